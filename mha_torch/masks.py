"""Masks in the shared convention.

A mask broadcasts (right-aligned, numpy rules) to ``(batch, heads, q_len, kv_len)``:

- bool: True = attend;
- integer: nonzero = attend (0/1 masks work as they are);
- floating: added to the logits (``-inf`` excludes a key).

Beware: ``torch.nn.MultiheadAttention``'s boolean masks mean the opposite (True = ignore).
Twin of ``mha_jax/masks.py``.
"""

from __future__ import annotations

import torch

from mha_torch import _checks

MASK_LAYOUT = "(batch, heads, q_len, kv_len)"


def padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``(batch, 1, 1, kv_len)`` from a ``(batch, kv_len)`` validity tensor.

    ``valid`` is bool or 0/1 integer; True/nonzero marks a real (not padded) key.
    """
    _checks.require_array("valid", valid)
    if valid.ndim != 2:
        raise ValueError(f"valid must have rank 2 (batch, kv_len), got shape {tuple(valid.shape)}")
    if _checks._dtype_kind(valid) not in ("bool", "int"):
        raise TypeError(f"valid must be bool or integer, got dtype {valid.dtype}")
    return (valid != 0)[:, None, None, :]


def causal_mask(q_len: int, kv_len: int | None = None, *, device=None) -> torch.Tensor:
    """Boolean mask ``(1, 1, q_len, kv_len)``: query i attends to keys 0..i.

    Aligned top-left, as ``is_causal`` in ``F.scaled_dot_product_attention`` and
    ``jax.nn.dot_product_attention``: with ``q_len > kv_len`` the last rows see every key.
    """
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()[None, None]


def _split_mask(mask, is_causal: bool, shape: tuple[int, int, int, int], device=None):
    """Turn ``mask`` and ``is_causal`` into (allowed, bias), either of which may be None.

    ``allowed`` is a boolean tensor (True = attend) and ``bias`` a floating tensor added to the
    logits; both broadcast to ``shape`` = (batch, heads, q_len, kv_len).
    """
    allowed = bias = None
    if mask is not None:
        _checks.require_array("mask", mask)
        _checks.check_broadcast("mask", mask.shape, shape, MASK_LAYOUT)
        kind = _checks._dtype_kind(mask)
        if kind == "bool":
            allowed = mask
        elif kind == "int":
            allowed = mask != 0
        elif kind == "float":
            bias = mask
        else:
            raise TypeError(
                f"mask must be bool, integer or real floating, got dtype {mask.dtype} "
                f"with shape {tuple(mask.shape)}"
            )
    if is_causal:
        causal = causal_mask(shape[2], shape[3], device=device)
        allowed = causal if allowed is None else allowed & causal
    return allowed, bias


def _unused_keys(allowed, bias, is_causal: bool, shape: tuple[int, int, int, int], kv_heads: int = 1, device=None):
    """bool ``(batch, kv_heads, kv_len)``: True where no query of the heads sharing a key/value
    head (with ``kv_heads=1``, of any head) may attend to the key; None when every key is used.

    ``allowed``/``bias`` are ``_split_mask``'s for ``shape`` = (batch, heads, q_len, kv_len);
    with ``is_causal``, keys past the last query are unused too. Zeroing those keys keeps
    whatever they hold (NaN in padding, say) out of outputs and every gradient: 0 * NaN is NaN
    in the weights-times-values product and in a projection's weight gradient.
    """
    batch, _, q_len, kv_len = shape
    excluded = []
    if allowed is not None:
        excluded.append(~allowed)
    if bias is not None:
        excluded.append(bias == -float("inf"))
    if is_causal and q_len < kv_len:
        excluded.append(torch.arange(kv_len, device=device) >= q_len)
    if not excluded:
        return None
    unused = None
    for ex in excluded:  # over queries, then over the query heads of each key/value head
        ex = ex.reshape((1,) * (4 - ex.ndim) + tuple(ex.shape)).all(dim=2)  # (batch?, heads?, kv_len?)
        if ex.shape[1] != 1:
            ex = ex.reshape(ex.shape[0], kv_heads, ex.shape[1] // kv_heads, ex.shape[2]).all(dim=2)
        unused = ex if unused is None else unused | ex
    return unused.expand(batch, kv_heads, kv_len)


def _zero_unused_inputs(inputs_k, inputs_v, mask, is_causal: bool, shape: tuple[int, int, int, int]):
    """The module's ``key``/``value`` inputs ``(batch, kv_len, features)`` with zeros at the
    keys that no query of any head may attend to, before they are projected."""
    unused = _unused_keys(*_split_mask(mask, False, shape), is_causal, shape, device=inputs_k.device)
    if unused is None:
        return inputs_k, inputs_v
    unused = unused[:, 0, :, None].to(inputs_k.device)
    return inputs_k.masked_fill(unused, 0), inputs_v.masked_fill(unused, 0)
