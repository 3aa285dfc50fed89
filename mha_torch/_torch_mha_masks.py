"""Masks to and from the convention of ``torch.nn.MultiheadAttention``.

Its boolean masks mean the opposite of ours: True = ignore. Its float masks are added to the
logits, which is our ``bias`` (our own ``mask`` is float-additive in ``mha_torch`` but
nonzero = attend in ``mha_jax``, so the pair below is what means the same in both). Twin of
``mha_jax/_torch_mha_masks.py``.

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
when nothing is additive, else float ``attn_mask`` (the bias, plus a float mask, ``-inf``
where a bool or integer mask forbids).
"""

from __future__ import annotations

import torch

from mha_spec import torch_mha
from mha_torch import _checks, masks


def mask_from_torch_mha(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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
      in either framework; ``(None, None)`` if both are None. New tensors are made on the
      inputs' device.
    """
    parts = []
    if attn_mask is not None:
        _checks.require_array("attn_mask", attn_mask)
        _check_kind("attn_mask", attn_mask)
        parts.append(attn_mask.reshape(torch_mha.torch_mha_attn_shape(attn_mask.shape, num_heads)))
    if key_padding_mask is not None:
        _checks.require_array("key_padding_mask", key_padding_mask)
        _check_kind("key_padding_mask", key_padding_mask)
        torch_mha.check_torch_mha_padding(None if attn_mask is None else attn_mask.shape, key_padding_mask.shape)
        parts.append(key_padding_mask[:, None, None, :])
    # Each part stays in its own kind: bool parts never become 0/-inf floats (nothing is made
    # on a default device, and a float "mask" would mean nonzero = attend in mha_jax).
    allowed = [~p for p in parts if p.dtype == torch.bool]
    added = [p for p in parts if p.dtype != torch.bool]
    mask = None if not allowed else allowed[0] if len(allowed) == 1 else allowed[0] & allowed[1]
    bias = None
    if added:
        dtype = added[0].dtype if len(added) == 1 else torch.promote_types(added[0].dtype, added[1].dtype)
        bias = added[0].to(dtype) if len(added) == 1 else added[0].to(dtype) + added[1].to(dtype)
    return mask, bias


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
    spec = masks._parse(shape, mask=mask, bias=bias, device=device)  # checked as the core checks them
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
    """torch.nn.MultiheadAttention takes bool and float masks only (it rejects integers)."""
    if _checks._dtype_kind(mask) not in ("bool", "float"):
        raise TypeError(f"{name} must be bool or floating, got dtype {_checks._dtype_name(mask)} with shape {tuple(mask.shape)}")
