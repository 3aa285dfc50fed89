"""Masks to and from the convention of ``torch.nn.MultiheadAttention``.

Its boolean masks mean the opposite of ours: True = ignore. Its float masks are added to the
logits, which is our ``bias`` (our own ``mask`` is nonzero = attend in ``mha_jax`` but
float-additive in ``mha_torch``, so the pair below is what means the same in both). Twin of
``mha_torch/_torch_mha_masks.py``; here the masks are JAX (or NumPy) arrays.

==========================================  ==========================  ==============================================
``torch.nn.MultiheadAttention``             shape                       ours: ``(mask, bias) = mask_from_torch_mha(...)``
==========================================  ==========================  ==============================================
``attn_mask`` bool, True = ignore           ``(q_len, kv_len)``         ``mask = ~attn_mask``
``attn_mask`` bool, True = ignore           ``(batch*heads, q, kv)``    ``mask = ~attn_mask`` as ``(batch, heads, q, kv)``
``attn_mask`` float, added to the logits    either                      ``bias =`` the same values
``key_padding_mask`` bool, True = padding   ``(batch, kv_len)``         ``mask = ~kpm[:, None, None, :]``
``key_padding_mask`` float, added           ``(batch, kv_len)``         ``bias = kpm[:, None, None, :]``
both                                                                    ``mask``: both allow; ``bias``: the sum
==========================================  ==========================  ==============================================

``mask_to_torch_mha(mask, shape, bias=...)`` goes back: bool ``attn_mask`` (True = ignore)
without a bias, else float ``attn_mask`` (the bias, ``-inf`` where the mask forbids).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks, masks
from mha_spec import torch_mha


def mask_from_torch_mha(
    attn_mask: jax.Array | None = None,
    key_padding_mask: jax.Array | None = None,
    *,
    num_heads: int | None = None,
) -> tuple[jax.Array | None, jax.Array | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    Args:
      attn_mask: ``(q_len, kv_len)`` or ``(batch * num_heads, q_len, kv_len)``; bool (True =
        ignore) or float (added to the logits).
      key_padding_mask: ``(batch, kv_len)``; bool (True = padding) or float (added).
      num_heads: needed for a 3-d ``attn_mask``.

    Returns:
      ``(mask, bias)``, each broadcasting to ``(batch, num_heads, q_len, kv_len)`` or None:
      ``mask`` bool (True = attend) from the bool parts (both must allow), ``bias`` float from
      the float parts (their sum, in the promoted dtype). Pass them as ``mask=`` and ``bias=``
      in either framework; ``(None, None)`` if both are None.
    """
    parts = []
    if attn_mask is not None:
        _checks.require_array("attn_mask", attn_mask)
        _check_kind("attn_mask", attn_mask)
        parts.append(jnp.asarray(attn_mask).reshape(torch_mha.torch_mha_attn_shape(attn_mask.shape, num_heads)))
    if key_padding_mask is not None:
        _checks.require_array("key_padding_mask", key_padding_mask)
        _check_kind("key_padding_mask", key_padding_mask)
        torch_mha.check_torch_mha_padding(None if attn_mask is None else attn_mask.shape, key_padding_mask.shape)
        parts.append(jnp.asarray(key_padding_mask)[:, None, None, :])
    # Each part stays in its own kind: a float 0/-inf "mask" would read as nonzero = attend here.
    allowed = [~p for p in parts if p.dtype == jnp.bool_]
    added = [p for p in parts if p.dtype != jnp.bool_]
    mask = None if not allowed else allowed[0] if len(allowed) == 1 else allowed[0] & allowed[1]
    bias = None
    if added:
        dtype = added[0].dtype if len(added) == 1 else jnp.promote_types(added[0].dtype, added[1].dtype)
        bias = added[0].astype(dtype) if len(added) == 1 else added[0].astype(dtype) + added[1].astype(dtype)
    return mask, bias


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
    spec = masks._parse(shape, mask=mask, bias=bias)  # checked as the core checks them
    if spec.bias is not None:  # the form torch uses for a bool mask beside a float one
        theirs = spec.bias if spec.allowed is None else jnp.where(spec.allowed, spec.bias, -jnp.inf).astype(spec.bias.dtype)
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
    """torch.nn.MultiheadAttention takes bool and float masks only (it rejects integers)."""
    if _checks._dtype_kind(mask) not in ("bool", "float"):
        raise TypeError(f"{name} must be bool or floating, got dtype {mask.dtype} with shape {tuple(mask.shape)}")
