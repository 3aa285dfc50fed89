"""Masks, biases and positions parsed into ``mha_spec.terms.Spec``; ``mask`` in SDPA's convention (bool/integer
nonzero = attend, floating added to the logits, unlike ``mha_jax``'s). Twin of ``mha_jax/masks.py``."""

from __future__ import annotations

import dataclasses
import functools

import torch

from mha_spec import arguments, docstrings, torch_mha
from mha_spec.terms import Spec
from mha_torch import _checks

MASK_LAYOUT = "(batch, heads, q_len, kv_len)"


def padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``(batch, 1, 1, kv_len)`` from ``valid`` ``(batch, kv_len)``: bool or 0/1, True = a real key."""
    _checks.require_array("valid", valid)
    arguments.check_padding_valid(valid.shape, _checks.dtype_kind(valid), _checks.dtype_name(valid))
    return (valid != 0)[:, None, None, :]


def causal_mask(q_len: int, kv_len: int | None = None, *, device=None) -> torch.Tensor:
    """Boolean mask ``(1, 1, q_len, kv_len)``: query i attends to keys 0..i (aligned top-left, as ``is_causal``)."""
    kv_len = arguments.check_mask_sizes(q_len, kv_len)
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()[None, None]


def parse(shape: tuple[int, int, int, int], *, mask=None, bias=None, device=None, mask_name="mask", **terms) -> Spec:
    """Check every masking argument of a call with ``shape`` = (batch, heads, q_len, kv_len); ``terms``: the others
    of ``batch_axes.Masking``, by name (``ArrayChecks.position_terms``). The tensors kept are moved to ``device``
    (the query's); ``mask_name``: what messages call ``mask``."""
    allowed = additive = None
    if mask is not None:
        _checks.require_array(mask_name, mask)
        arguments.check_broadcast(mask_name, mask.shape, shape, MASK_LAYOUT)
        kind = _checks.dtype_kind(mask)
        if kind not in ("bool", "int", "float"):
            raise TypeError(f"{mask_name} must be bool, integer or real floating (bool/integer: nonzero = attend; "
                            f"floating: added to the logits), got dtype {_checks.dtype_name(mask)} with shape "
                            f"{tuple(mask.shape)}")
        mask = mask.to(device)
        if kind == "float":  # SDPA's convention: an additive term, like bias
            additive = mask
        else:
            allowed = mask if kind == "bool" else mask != 0
    if bias is not None:
        _checks.require_float("bias", bias)
        arguments.check_broadcast("bias", bias.shape, shape, MASK_LAYOUT)
        bias = bias.to(device)
        if additive is not None:  # both broadcast to shape, so their sum does too
            dtype = torch.promote_types(additive.dtype, bias.dtype)  # not left to a 0-d operand
            bias = additive.to(dtype) + bias.to(dtype)
    else:
        bias = additive
    fields = _checks.CHECKS.position_terms(shape, _index(device), lambda x: x.detach().to(device), **terms)
    return Spec(shape, allowed, bias, **fields, device=device)


def over_cache(spec: Spec, query_positions, key_positions, lengths) -> Spec:
    """``spec`` over a decoding cache's slots, with the step's positions ``(batch, n)``, the slots' positions
    ``(batch, max_length)`` and the written slots' count ``(batch,)``."""
    batch, _, q_len, kv_len = spec.shape
    checks, index = _checks.CHECKS, _index(spec.device)
    return dataclasses.replace(
        spec, query_positions=checks.sequence("query_positions", query_positions, batch, q_len, "q_len", index),
        key_positions=checks.sequence("key_positions", key_positions, batch, kv_len, "kv_len", index),
        lengths=checks.lengths("key_value_seq_lengths", lengths, batch, kv_len, "kv_len", index))


def _index(device):
    """Integers as int64 on ``device``."""
    return lambda x: x.to(device=device, dtype=torch.int64)


def positions(spec: Spec):
    """(query positions ``(batch|1, q_len)``, key positions ``(batch|1, kv_len)``), arange by default."""
    return spec.positions(functools.partial(torch.arange, device=spec.device))


def biases(spec: Spec):
    """float broadcasting to ``(batch, heads, q_len, kv_len)``: the bias plus the ALiBi term, or None."""
    return spec.biases(functools.partial(torch.arange, device=spec.device))


def dense(spec: Spec):
    """bool ``(batch|1, heads|1, q_len, kv_len)``: every term but the bias, or None if none restricts."""
    return spec.dense(functools.partial(torch.arange, device=spec.device))


@docstrings.fill
def unused_keys(spec: Spec, kv_heads: int = 1):
    """Keys no query may see.

    {unused_keys}
    """
    arange = functools.partial(torch.arange, device=spec.device)
    unused = spec.excluded_keys(kv_heads, arange, _extremes, _present)
    return None if unused is None else unused.expand(spec.shape[0], kv_heads, spec.shape[3])


def _extremes(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return positions.amin(dim=1, keepdim=True), positions.amax(dim=1, keepdim=True)


def _present(query_ids, key_ids):
    """bool ``(batch|1, kv_len)``: whether each key's segment id occurs among the queries'."""
    batch = max(query_ids.shape[0], key_ids.shape[0])
    ordered = torch.sort(query_ids, dim=1).values.expand(batch, query_ids.shape[1]).contiguous()
    key_ids = key_ids.expand(batch, key_ids.shape[1]).contiguous()
    index = torch.searchsorted(ordered, key_ids)  # batched along the first axis
    found = torch.gather(ordered, 1, index.clamp(max=ordered.shape[1] - 1))
    return found == key_ids


def zero_unused_inputs(inputs_k, inputs_v, spec: Spec):
    """``inputs_k``/``inputs_v`` ``(batch, kv_len, features)`` zeroed at the keys no query may attend to."""
    unused = unused_keys(spec)
    if unused is None:
        return inputs_k, inputs_v
    unused = unused[:, 0, :, None]
    return inputs_k.masked_fill(unused, 0), inputs_v.masked_fill(unused, 0)


# --- torch.nn.MultiheadAttention's masks (mha_spec.torch_mha) ---


@docstrings.fill
def mask_from_torch_mha(attn_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None, *,
                        num_heads: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    {from_torch_mha}
      New tensors are made on the inputs' device.
    """
    return torch_mha.from_torch_mha(attn_mask, key_padding_mask, num_heads, _checks.CHECKS, lambda x: x)


@docstrings.fill
def mask_to_torch_mha(mask: torch.Tensor | None, shape: tuple[int, int, int, int], *,
                      bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``torch.nn.MultiheadAttention``'s ``attn_mask`` from our ``mask`` and ``bias``.

    Args:
      mask: ours, broadcasting to ``shape``, or None: bool (True = attend), integer (nonzero =
        attend) or float (added to the logits).
      {to_torch_mha_shape}

    Returns:
      {to_torch_mha_returns}
      when nothing is additive, else float (the additive terms summed, ``-inf`` where a bool
      or integer mask forbids).
    """
    device = next((x.device for x in (mask, bias) if isinstance(x, torch.Tensor)), None)
    spec = parse(shape, mask=mask, bias=bias, device=device)  # checked as the core checks them
    return torch_mha.to_torch_mha(spec, shape, torch.where, lambda x, to: x.expand(to).clone())
