"""Masks to and from the convention of ``torch.nn.MultiheadAttention``.

Its boolean masks mean the opposite of ours: True = ignore. Twin of
``mha_torch/_torch_mha_masks.py``; here the masks are JAX (or NumPy) arrays.

==========================================  ==========================  =============================
``torch.nn.MultiheadAttention``             shape                       ours (``mask_from_torch_mha``)
==========================================  ==========================  =============================
``attn_mask`` bool, True = ignore           ``(q_len, kv_len)``         ``~attn_mask``
``attn_mask`` bool, True = ignore           ``(batch*heads, q, kv)``    ``~attn_mask`` as ``(batch, heads, q, kv)``
``attn_mask`` float, added to the logits    either                      the same values, added
``key_padding_mask`` bool, True = padding   ``(batch, kv_len)``         ``~kpm[:, None, None, :]``
``key_padding_mask`` float, added           ``(batch, kv_len)``         ``kpm[:, None, None, :]``
both                                                                    bool: both allow; else the sum
==========================================  ==========================  =============================
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_jax.masks import MASK_LAYOUT


def mask_from_torch_mha(
    attn_mask: jax.Array | None = None,
    key_padding_mask: jax.Array | None = None,
    *,
    num_heads: int | None = None,
) -> jax.Array | None:
    """Our mask from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    Args:
      attn_mask: ``(q_len, kv_len)`` or ``(batch * num_heads, q_len, kv_len)``; bool (True =
        ignore) or float (added to the logits).
      key_padding_mask: ``(batch, kv_len)``; bool (True = padding) or float (added).
      num_heads: needed for a 3-d ``attn_mask``.

    Returns:
      ``None`` if both are None; a bool mask (True = attend) if neither is float; else a float
      mask (bool parts become 0 / -inf), broadcasting to ``(batch, num_heads, q_len, kv_len)``.
    """
    parts = []
    if attn_mask is not None:
        _checks.require_array("attn_mask", attn_mask)
        _check_kind("attn_mask", attn_mask)
        if attn_mask.ndim == 3:
            if not isinstance(num_heads, int) or num_heads < 1 or attn_mask.shape[0] % num_heads:
                raise ValueError(
                    f"a 3-d attn_mask (batch * num_heads, q_len, kv_len) needs num_heads dividing "
                    f"its first axis; got shape {tuple(attn_mask.shape)} and num_heads={num_heads!r}"
                )
            attn_mask = jnp.asarray(attn_mask).reshape(-1, num_heads, *attn_mask.shape[1:])
        elif attn_mask.ndim != 2:
            raise ValueError(
                "attn_mask must have rank 2 (q_len, kv_len) or 3 (batch * num_heads, q_len, kv_len), "
                f"got shape {tuple(attn_mask.shape)}"
            )
        parts.append(jnp.asarray(attn_mask))
    if key_padding_mask is not None:
        _checks.require_array("key_padding_mask", key_padding_mask)
        _check_kind("key_padding_mask", key_padding_mask)
        if key_padding_mask.ndim != 2:
            raise ValueError(
                f"key_padding_mask must have rank 2 (batch, kv_len), got shape {tuple(key_padding_mask.shape)}"
            )
        parts.append(jnp.asarray(key_padding_mask)[:, None, None, :])
    if not parts:
        return None
    if len(parts) == 2 and parts[1].shape[-1] != parts[0].shape[-1]:
        raise ValueError(
            f"attn_mask and key_padding_mask disagree on kv_len: shapes {tuple(attn_mask.shape)} "
            f"and {tuple(key_padding_mask.shape)}"
        )
    floats = [p for p in parts if p.dtype != jnp.bool_]
    if not floats:
        return ~parts[0] if len(parts) == 1 else ~parts[0] & ~parts[1]
    dtype = floats[0].dtype if len(floats) == 1 else jnp.promote_types(floats[0].dtype, floats[1].dtype)
    # A bool part as the additive form torch uses for it: 0 where allowed, -inf where ignored.
    as_float = [p.astype(dtype) if p.dtype != jnp.bool_ else jnp.where(p, -jnp.inf, 0.0).astype(dtype) for p in parts]
    return as_float[0] if len(as_float) == 1 else as_float[0] + as_float[1]


def mask_to_torch_mha(mask: jax.Array, shape: tuple[int, int, int, int]) -> jax.Array:
    """``torch.nn.MultiheadAttention``'s ``attn_mask`` from our mask.

    Args:
      mask: ours, broadcasting to ``shape``: bool (True = attend), integer (nonzero = attend)
        or float (added to the logits).
      shape: ``(batch, num_heads, q_len, kv_len)`` of the call it is for.

    Returns:
      ``(q_len, kv_len)`` when the mask is the same for every batch element and head, else
      ``(batch * num_heads, q_len, kv_len)``; bool (True = ignore) or, for a float mask, the
      same values.
    """
    _checks.require_array("mask", mask)
    _checks.check_broadcast("mask", mask.shape, shape, MASK_LAYOUT)
    kind = _checks._dtype_kind(mask)
    if kind not in ("bool", "int", "float"):
        raise TypeError(f"mask must be bool, integer or real floating, got dtype {mask.dtype} with shape {tuple(mask.shape)}")
    theirs = jnp.asarray(mask) if kind == "float" else jnp.asarray(mask) == 0
    batch, heads, q_len, kv_len = shape
    if all(n == 1 for n in mask.shape[:-2]):
        return jnp.broadcast_to(theirs.reshape(mask.shape[-2:] if mask.ndim >= 2 else (1, -1)), (q_len, kv_len))
    return jnp.broadcast_to(theirs, (batch, heads, q_len, kv_len)).reshape(batch * heads, q_len, kv_len)


def _check_kind(name: str, mask) -> None:
    """torch.nn.MultiheadAttention takes bool and float masks only (it rejects integers)."""
    if _checks._dtype_kind(mask) not in ("bool", "float"):
        raise TypeError(f"{name} must be bool or floating, got dtype {mask.dtype} with shape {tuple(mask.shape)}")
