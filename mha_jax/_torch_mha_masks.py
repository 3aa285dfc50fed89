"""Masks to and from the convention of ``torch.nn.MultiheadAttention``, read as the table of
``mha_spec.torch_mha`` says. Twin of ``mha_torch/_torch_mha_masks.py``; here they are JAX (or NumPy) arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks, masks
from mha_spec import docstrings, torch_mha


@docstrings.fill
def mask_from_torch_mha(
    attn_mask: jax.Array | None = None,
    key_padding_mask: jax.Array | None = None,
    *,
    num_heads: int | None = None,
) -> tuple[jax.Array | None, jax.Array | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    Args:
      {torch_mha_masks}

    Returns:
      {torch_mha_masks_returns}
    """
    parts = []
    if attn_mask is not None:
        _check_kind("attn_mask", attn_mask)
        parts.append(jnp.asarray(attn_mask).reshape(torch_mha.torch_mha_attn_shape(attn_mask.shape, num_heads)))
    if key_padding_mask is not None:
        _check_kind("key_padding_mask", key_padding_mask)
        torch_mha.check_torch_mha_padding(None if attn_mask is None else attn_mask.shape, key_padding_mask.shape)
        parts.append(jnp.asarray(key_padding_mask)[:, None, None, :])
    return torch_mha.combine(parts)


def mask_to_torch_mha(
    mask: jax.Array | None,
    shape: tuple[int, int, int, int],
    *,
    bias: jax.Array | None = None,
) -> jax.Array | None:
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
    if spec.bias is not None:  # the form torch uses for a bool mask beside a float one
        theirs = spec.bias if spec.allowed is None else \
            jnp.where(spec.allowed, spec.bias, -jnp.inf).astype(spec.bias.dtype)
    elif spec.allowed is not None:
        theirs = ~spec.allowed
    else:
        return None
    return _torch_mha_layout(theirs, shape)


def _torch_mha_layout(theirs: jax.Array, shape: tuple[int, int, int, int]) -> jax.Array:
    """``(q_len, kv_len)`` if ``theirs`` is one for every batch element and head, else
    ``(batch * num_heads, q_len, kv_len)``."""
    target = torch_mha.torch_mha_layout(theirs.shape, shape)
    theirs = theirs.reshape((1,) * (4 - theirs.ndim) + tuple(theirs.shape))
    if len(target) == 2:  # the same for every batch element and head
        return jnp.broadcast_to(theirs[0, 0], target)
    return jnp.broadcast_to(theirs, tuple(shape)).reshape(target)


def _check_kind(name: str, mask) -> None:
    _checks.require_array(name, mask)
    torch_mha.check_mask_kind(name, _checks.dtype_kind(mask), mask.dtype, mask.shape)
