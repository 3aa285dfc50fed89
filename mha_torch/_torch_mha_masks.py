"""Masks to and from the convention of ``torch.nn.MultiheadAttention`` (``mha_spec.torch_mha``), over
tensors. Twin of ``mha_jax/_torch_mha_masks.py``."""

from __future__ import annotations

import torch

from mha_spec import docstrings, torch_mha
from mha_torch import _checks, masks


@docstrings.fill
def mask_from_torch_mha(attn_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None, *,
                        num_heads: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    Args:
      {torch_mha_masks}

    Returns:
      {torch_mha_masks_returns}
      New tensors are made on the inputs' device.
    """
    return torch_mha.from_torch_mha(attn_mask, key_padding_mask, num_heads, _checks.CHECKS, lambda x: x)


def mask_to_torch_mha(mask: torch.Tensor | None, shape: tuple[int, int, int, int], *,
                      bias: torch.Tensor | None = None) -> torch.Tensor | None:
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
    return torch_mha.to_torch_mha(spec, shape, torch.where, lambda x, to: x.expand(to).clone())
