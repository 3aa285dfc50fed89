"""Masks to and from the convention of ``torch.nn.MultiheadAttention`` (``mha_spec.torch_mha``), over JAX (or
NumPy) arrays. Twin of ``mha_torch/_torch_mha_masks.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks, masks
from mha_spec import docstrings, torch_mha


@docstrings.fill
def mask_from_torch_mha(attn_mask: jax.Array | None = None, key_padding_mask: jax.Array | None = None, *,
                        num_heads: int | None = None) -> tuple[jax.Array | None, jax.Array | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``
    (JAX arrays, from NumPy ones too).

    Args:
      {torch_mha_masks}

    Returns:
      {torch_mha_masks_returns}
    """
    return torch_mha.from_torch_mha(attn_mask, key_padding_mask, num_heads, _checks.CHECKS, jnp.asarray)


def mask_to_torch_mha(mask: jax.Array | None, shape: tuple[int, int, int, int], *,
                      bias: jax.Array | None = None) -> jax.Array | None:
    """``torch.nn.MultiheadAttention``'s ``attn_mask`` from our ``mask`` and ``bias``.

    Args:
      mask: ours, broadcasting to ``shape``, or None: any dtype, nonzero = attend (as in
        ``mha_jax.dot_product_attention``).
      shape: ``(batch, num_heads, q_len, kv_len)`` of the call it is for.
      bias: real floating, broadcasting to ``shape``, added to the logits; or None.

    Returns:
      None when both are None; else ``(q_len, kv_len)`` when the result is the same for every
      batch element and head, or ``(batch * num_heads, q_len, kv_len)``: bool (True = ignore)
      without a bias, else float (the bias, ``-inf`` where the mask forbids).
    """
    spec = masks.parse(shape, mask=mask, bias=bias)  # checked as the core checks them
    return torch_mha.to_torch_mha(spec, shape, jnp.where, jnp.broadcast_to)
