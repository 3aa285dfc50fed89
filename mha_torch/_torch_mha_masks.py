"""Masks to and from the convention of ``torch.nn.MultiheadAttention``, read as the table of
``mha_spec.torch_mha`` says. Twin of ``mha_jax/_torch_mha_masks.py``; here they are tensors."""

from __future__ import annotations

import torch

from mha_spec import docstrings, torch_mha
from mha_torch import _checks, masks


@docstrings.fill
def mask_from_torch_mha(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    Args:
      {torch_mha_masks}

    Returns:
      {torch_mha_masks_returns}
      New tensors are made on the inputs' device.
    """
    parts = []
    if attn_mask is not None:
        _check_kind("attn_mask", attn_mask)
        parts.append(attn_mask.reshape(torch_mha.torch_mha_attn_shape(attn_mask.shape, num_heads)))
    if key_padding_mask is not None:
        _check_kind("key_padding_mask", key_padding_mask)
        torch_mha.check_torch_mha_padding(None if attn_mask is None else attn_mask.shape, key_padding_mask.shape)
        parts.append(key_padding_mask[:, None, None, :])
    return torch_mha.combine(parts)


def mask_to_torch_mha(
    mask: torch.Tensor | None,
    shape: tuple[int, int, int, int],
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``torch.nn.MultiheadAttention``'s ``attn_mask`` from our ``mask`` and ``bias``.

    Args:
      mask: ours, broadcasting to ``shape``, or None: bool (True = attend), integer (nonzero =
        attend) or float (added to the logits, as in ``mha_torch.dot_product_attention``).
      shape: ``(batch, num_heads, q_len, kv_len)`` of the call it is for.
      bias: real floating, broadcasting to ``shape``, added to the logits; or None.

    Returns:
      None when both are None; else ``(q_len, kv_len)`` when the result is the same for every
      batch element and head, or ``(batch * num_heads, q_len, kv_len)``: bool (True = ignore)
      when nothing is additive, else float (the additive terms summed, ``-inf`` where a bool
      or integer mask forbids).
    """
    device = next((x.device for x in (mask, bias) if isinstance(x, torch.Tensor)), None)
    spec = masks.parse(shape, mask=mask, bias=bias, device=device)  # checked as the core checks them
    if spec.bias is not None:  # the form torch uses for a bool mask beside a float one
        theirs = spec.bias if spec.allowed is None else torch.where(spec.allowed, spec.bias, float("-inf"))
    elif spec.allowed is not None:
        theirs = ~spec.allowed
    else:
        return None
    return _torch_mha_layout(theirs, shape)


def _torch_mha_layout(theirs: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``(q_len, kv_len)`` if ``theirs`` is one for every batch element and head, else
    ``(batch * num_heads, q_len, kv_len)``; a copy either way."""
    target = torch_mha.torch_mha_layout(theirs.shape, shape)
    theirs = theirs.reshape((1,) * (4 - theirs.ndim) + tuple(theirs.shape))
    if len(target) == 2:  # the same for every batch element and head
        return theirs[0, 0].expand(target).clone()
    return theirs.expand(tuple(shape)).reshape(target).clone()


def _check_kind(name: str, mask: torch.Tensor) -> None:
    _checks.require_array(name, mask)
    torch_mha.check_mask_kind(name, _checks.dtype_kind(mask), _checks.dtype_name(mask), mask.shape)
