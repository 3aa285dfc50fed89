"""Scaled dot-product attention, the functional core.

Twin of ``mha_jax/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``F.scaled_dot_product_attention``: query ``(batch, heads, q_len, head_dim)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mha_torch import _checks, _neutral, masks
from mha_torch.masks import MASK_LAYOUT

IMPLEMENTATIONS = ("math", "sdpa")


def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: torch.Tensor | None = None,
    key_segment_ids: torch.Tensor | None = None,
    key_value_seq_lengths: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    need_weights: bool = False,
    implementation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head scaled dot-product attention.

    Every masking term below combines with the others (logical and; the bias is added).

    Args:
      query: ``(batch, heads, q_len, head_dim)``.
      key, value: ``(batch, kv_heads, kv_len, head_dim)``; ``kv_heads`` divides ``heads``, and
        query head ``h`` reads key/value head ``h // (heads // kv_heads)``.
      mask: broadcasts to ``(batch, heads, q_len, kv_len)``; as in
        ``F.scaled_dot_product_attention``: bool True = attend, integer nonzero = attend,
        floating = added to the logits (with ``bias``). ``mha_jax``'s mask differs here: any
        dtype, nonzero = attend.
      bias: real floating, broadcasting to ``(batch, heads, q_len, kv_len)``; added to the
        scaled logits (``-inf`` excludes a key).
      is_causal: a query sees the keys at positions ``<=`` its own.
      query_positions, key_positions: integer ``(q_len,)``/``(kv_len,)`` or ``(batch, len)``;
        default ``arange``. With a chunk of queries at positions ``t..t+n-1`` over keys
        ``0..t+n-1``, ``is_causal`` is what decoding needs.
      local_window_size: ``w`` or ``(left, right)``: a query at position ``p`` sees keys at
        positions ``p - left .. p + right``.
      query_segment_ids, key_segment_ids: integer ``(batch, q_len)``/``(batch, kv_len)`` (or
        one row for every batch element), given together: a query sees keys of its own segment.
      key_value_seq_lengths: integer ``(batch,)``: keys at index ``>=`` the length are padding.
      scale: multiplies the logits; default ``1 / sqrt(head_dim)``.
      dropout_p: probability of dropping an attention weight; kept weights are scaled by
        ``1 / (1 - dropout_p)``. Without ``dropout_mask`` the mask is drawn from torch's RNG.
      dropout_mask: explicit keep-mask (True = keep) broadcasting to
        ``(batch, heads, q_len, kv_len)`` (``"math"`` only).
      need_weights: also return the attention weights actually applied to ``value``
        (``"math"`` only).
      implementation: ``"math"`` (the explicit formulation), ``"sdpa"``
        (``F.scaled_dot_product_attention``; causality alone at default positions goes to it
        as ``is_causal``, any other term as one materialised ``attn_mask``), or None:
        ``"sdpa"`` unless weights or an explicit dropout mask are asked for.

    Returns:
      ``(batch, heads, q_len, head_dim)`` in the input dtype, or ``(output, weights)`` with
      weights ``(batch, heads, q_len, kv_len)``. A query that may attend to no key gets an
      output row of 0 and weights 0. bfloat16/float16 inputs are computed in float32.
    """
    batch, q_len, heads, _, kv_len, _ = _checks.check_attention_inputs(query, key, value)
    spec = masks._parse(
        (batch, heads, q_len, kv_len), mask=mask, bias=bias, is_causal=is_causal,
        query_positions=query_positions, key_positions=key_positions,
        local_window_size=local_window_size, query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids, key_value_seq_lengths=key_value_seq_lengths,
        device=query.device,
    )
    return _attention(
        query, key, value, spec, scale=scale, dropout_p=dropout_p, dropout_mask=dropout_mask,
        need_weights=need_weights, implementation=implementation,
    )


def _attention(query, key, value, spec: masks._Spec, *, scale=None, dropout_p=0.0, dropout_mask=None,
               need_weights=False, implementation=None, zero_unused=True):
    """``dot_product_attention`` on checked inputs and a parsed ``spec`` (the module's entry).
    ``zero_unused=False`` skips zeroing the keys no query sees: a decoding cache's slots hold
    finite values (zeros or earlier tokens), and zeroing would copy the whole cache every step."""
    batch, heads, q_len, kv_len = shape = spec.shape
    kv_heads, head_dim = key.shape[1], query.shape[3]
    scale = _neutral.check_scale(scale)
    keep, keep_scale = _dropout_keep(dropout_p, dropout_mask, shape)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if kv_len == 0:  # no key to attend to: zeros, as for a fully masked row (kept in the graph)
        groups = heads // kv_heads
        empty = query.reshape(batch, kv_heads, groups, q_len, head_dim) @ key.unsqueeze(2).transpose(-1, -2)
        out = (empty @ value.unsqueeze(2)).reshape(query.shape)
        return (out, empty.reshape(shape)) if need_weights else out
    implementation = _choose(implementation, need_weights, keep is not None)

    dtype = query.dtype
    compute = torch.promote_types(dtype, torch.float32)
    unused = masks._unused_keys(spec, kv_heads) if zero_unused else None
    if unused is not None:  # per key/value head, in the key layout (batch, kv_heads, kv_len, 1)
        unused = unused[..., None]
        key, value = key.masked_fill(unused, 0), value.masked_fill(unused, 0)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    if implementation == "math":
        if keep is None and dropout_p > 0:
            keep = torch.rand(shape, device=query.device) >= dropout_p
        out, weights = _math(q, k, v, masks._dense(spec), spec.bias, keep, keep_scale, scale)
    else:
        out = _sdpa(q, k, v, spec, scale, dropout_p)
        weights = None
    out = out.to(dtype)
    if need_weights:
        return out, weights.to(dtype)
    return out


def _choose(implementation, need_weights, explicit_dropout) -> str:
    if implementation is None:
        return "math" if need_weights or explicit_dropout else "sdpa"
    _neutral.check_implementation(implementation, IMPLEMENTATIONS)
    if implementation == "sdpa" and (need_weights or explicit_dropout):
        raise ValueError("need_weights=True and dropout_mask need implementation='math', got 'sdpa'")
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


def _sdpa(q, k, v, spec: masks._Spec, scale, dropout_p):
    """``F.scaled_dot_product_attention`` with our semantics: causality alone at default
    positions as its ``is_causal`` (top-left, as ours there), anything else materialised into
    one ``attn_mask``: bool, or float with ``-inf`` where not allowed when there is a bias.

    SDPA gives a row with no allowed key an output of 0 and gradients of 0, as ours (checked
    with torch 2.13 on CPU, float64/float32/bfloat16, bool and float masks), so those rows
    need no fixing here.
    """
    native_causal = (
        spec.is_causal and spec.default_positions and spec.window is None and spec.query_segment_ids is None
        and spec.lengths is None and spec.allowed is None and spec.bias is None
    )
    attn_mask = None
    if not native_causal:
        attn_mask = masks._dense(spec)
        if spec.bias is not None:
            attn_mask = spec.bias.to(q.dtype) if attn_mask is None else torch.where(
                attn_mask, spec.bias.to(q.dtype), -math.inf
            )
    if attn_mask is not None and attn_mask.ndim < 4:  # SDPA wants at least (q_len, kv_len)
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=native_causal, scale=scale,
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
    rate = _neutral.check_dropout_rate("dropout_p", rate)
    if dropout_mask is not None:
        _checks.require_array("dropout_mask", dropout_mask)
        _neutral.check_broadcast("dropout_mask", dropout_mask.shape, shape, MASK_LAYOUT)
        if _checks._dtype_kind(dropout_mask) not in ("bool", "int"):
            raise TypeError(
                f"dropout_mask must be bool (True = keep) or 0/1 integer, got dtype "
                f"{_checks._dtype_name(dropout_mask)} with shape {tuple(dropout_mask.shape)}"
            )
        return dropout_mask != 0, 1.0 / (1.0 - rate)
    return None, 1.0 / (1.0 - rate)  # without a mask, each implementation draws its own
