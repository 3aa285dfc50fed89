"""Scaled dot-product attention, the functional core.

Twin of ``mha_jax/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``F.scaled_dot_product_attention``: query ``(batch, heads, q_len, head_dim)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mha_torch import _checks
from mha_torch.masks import MASK_LAYOUT, _split_mask, _unused_keys, causal_mask


IMPLEMENTATIONS = ("math", "sdpa")


def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    return_weights: bool = False,
    implementation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head scaled dot-product attention.

    Args:
      query: ``(batch, heads, q_len, head_dim)``.
      key, value: ``(batch, kv_heads, kv_len, head_dim)``; ``kv_heads`` divides ``heads``, and
        query head ``h`` reads key/value head ``h // (heads // kv_heads)``.
      mask: broadcasts to ``(batch, heads, q_len, kv_len)``; bool True = attend, integer
        nonzero = attend, floating = added to the logits.
      is_causal: query ``i`` attends to keys ``0..i`` (top-left aligned); combines with ``mask``.
      scale: multiplies the logits; default ``1 / sqrt(head_dim)``.
      dropout_p: probability of dropping an attention weight; kept weights are scaled by
        ``1 / (1 - dropout_p)``. Without ``dropout_mask`` the mask is drawn from torch's RNG.
      dropout_mask: explicit keep-mask (True = keep) broadcasting to
        ``(batch, heads, q_len, kv_len)`` (``"math"`` only).
      return_weights: also return the attention weights actually applied to ``value``
        (``"math"`` only).
      implementation: ``"math"`` (the explicit formulation), ``"sdpa"``
        (``F.scaled_dot_product_attention``, memory linear in length), or None: ``"sdpa"``
        unless weights or an explicit dropout mask are asked for.

    Returns:
      ``(batch, heads, q_len, head_dim)`` in the input dtype, or ``(output, weights)`` with
      weights ``(batch, heads, q_len, kv_len)``. A query that may attend to no key gets an
      output row of 0 and weights 0. bfloat16/float16 inputs are computed in float32.
    """
    batch, q_len, heads, head_dim, kv_len, kv_heads = _checks.check_attention_inputs(
        query, key, value
    )
    is_causal, scale = _checks.check_is_causal(is_causal), _checks.check_scale(scale)
    shape = (batch, heads, q_len, kv_len)
    allowed, bias = _split_mask(mask, False, shape)  # causality is each implementation's own
    keep, keep_scale = _dropout_keep(dropout_p, dropout_mask, shape)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if kv_len == 0:  # no key to attend to: zeros, as for a fully masked row (kept in the graph)
        groups = heads // kv_heads
        empty = query.reshape(batch, kv_heads, groups, q_len, head_dim) @ key.unsqueeze(2).transpose(-1, -2)
        out = (empty @ value.unsqueeze(2)).reshape(query.shape)
        return (out, empty.reshape(shape)) if return_weights else out
    implementation = _choose(implementation, return_weights, keep is not None)

    dtype = query.dtype
    compute = torch.promote_types(dtype, torch.float32)
    groups = heads // kv_heads
    unused = _unused_keys(allowed, bias, is_causal, shape, kv_heads, device=key.device)
    if unused is not None:  # per key/value head, in the key layout (batch, kv_heads, kv_len, 1)
        unused = unused[..., None]
        key, value = key.masked_fill(unused, 0), value.masked_fill(unused, 0)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    if implementation == "math":
        if is_causal:
            causal = causal_mask(q_len, kv_len, device=query.device)
            allowed = causal if allowed is None else allowed & causal
        if keep is None and dropout_p > 0:
            keep = torch.rand(shape, device=query.device) >= dropout_p
        out, weights = _math(q, k, v, allowed, bias, keep, keep_scale, scale)
    else:
        out = _sdpa(q, k, v, allowed, bias, is_causal, scale, dropout_p)
        weights = None
    out = out.to(dtype)
    if return_weights:
        return out, weights.to(dtype)
    return out


def _choose(implementation, return_weights, explicit_dropout) -> str:
    if implementation is None:
        return "math" if return_weights or explicit_dropout else "sdpa"
    _checks.check_implementation(implementation, IMPLEMENTATIONS)
    if implementation == "sdpa" and (return_weights or explicit_dropout):
        raise ValueError("return_weights=True and dropout_mask need implementation='math', got 'sdpa'")
    return implementation


def _math(q, k, v, allowed, bias, keep, keep_scale, scale):
    """The explicit formulation: q ``(b, heads, q, d)``, k/v ``(b, kv_heads, k, d)``."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    logits = q.reshape(batch, kv_heads, groups, q_len, head_dim) @ k.unsqueeze(2).transpose(-1, -2)
    logits = logits.reshape(batch, heads, q_len, kv_len) * scale
    weights = _masked_softmax(logits, allowed, bias)
    if keep is not None:
        weights = torch.where(keep, weights * keep_scale, 0.0)
    out = weights.reshape(batch, kv_heads, groups, q_len, kv_len) @ v.unsqueeze(2)
    return out.reshape(batch, heads, q_len, head_dim), weights


def _sdpa(q, k, v, allowed, bias, is_causal, scale, dropout_p):
    """``F.scaled_dot_product_attention`` with our mask semantics folded into one ``attn_mask``."""
    attn_mask = allowed
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if allowed is not None:
            attn_mask = attn_mask.masked_fill(~allowed, -math.inf)
    if attn_mask is not None and attn_mask.ndim < 4:  # SDPA wants at least (q_len, kv_len)
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    if is_causal and attn_mask is not None:  # SDPA takes one or the other
        causal = causal_mask(q.shape[2], k.shape[2], device=q.device)
        attn_mask = attn_mask & causal if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~causal, -math.inf)
        is_causal = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _masked_softmax(
    logits: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """Softmax over the last axis that gives 0 (not NaN, not uniform) on rows with no allowed key."""
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    # The row maximum only shifts the exponent; softmax does not depend on it, so no gradient.
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
    exp = torch.exp(logits - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    return exp / torch.where(total == 0.0, 1.0, total)


def _dropout_keep(rate, dropout_mask, shape):
    """(explicit keep-mask or None, scale of kept weights)."""
    rate = _checks.check_dropout_rate("dropout_p", rate)
    if dropout_mask is not None:
        _checks.require_array("dropout_mask", dropout_mask)
        _checks.check_broadcast("dropout_mask", dropout_mask.shape, shape, MASK_LAYOUT)
        if _checks._dtype_kind(dropout_mask) not in ("bool", "int"):
            raise TypeError(
                f"dropout_mask must be bool (True = keep) or 0/1 integer, got dtype "
                f"{dropout_mask.dtype} with shape {tuple(dropout_mask.shape)}"
            )
        return dropout_mask != 0, 1.0 / (1.0 - rate)
    return None, 1.0 / (1.0 - rate)  # without a mask, each implementation draws its own
