"""``F.scaled_dot_product_attention`` (``implementation="sdpa"``) with our semantics."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mha_spec import terms
from mha_torch import masks

# PyTorch's own, held from import: a program that puts ``dot_product_attention`` in its place as
# ``F.scaled_dot_product_attention`` still reaches PyTorch's here, not itself again.
_torch_sdpa = F.scaled_dot_product_attention


def run(q, k, v, spec: masks.Spec, *, scale, sinks, dropout_p, **_):
    """(out ``(b, heads, q, dv)``, None): ``_sdpa``'s."""
    return _sdpa(q, k, v, spec, scale, dropout_p, sinks), None


def _sdpa(q, k, v, spec: masks.Spec, scale, dropout_p, sinks=None):
    """``F.scaled_dot_product_attention`` with our semantics: default-position causality alone as its
    ``is_causal``, anything else as one ``attn_mask``; ``sinks`` ``(heads,)`` as ``_with_sink_key``."""
    native_causal = (
        spec.terms.members == (terms.Causal(),) and spec.default_positions
        and spec.allowed is None and spec.bias is None and spec.alibi_slopes is None and sinks is None
    )
    attn_mask, bias = None, masks.biases(spec)
    if not native_causal:
        attn_mask = masks.dense(spec)
        if bias is not None:
            attn_mask = bias.to(q.dtype) if attn_mask is None else torch.where(attn_mask, bias.to(q.dtype), -math.inf)
    if attn_mask is not None and attn_mask.ndim < 4:  # SDPA wants at least (q_len, kv_len)
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    if sinks is not None:
        q, k, v, attn_mask = _with_sink_key(q, k, v, attn_mask, sinks)
    batch, heads, q_len, head_dim = q.shape
    groups = heads // k.shape[1]
    if groups > 1 and attn_mask is None and not native_causal and dropout_p == 0:
        # a group's query heads as rows of one head: each key/value head read once (enable_gqa: once per query head)
        out = _torch_sdpa(q.reshape(batch, k.shape[1], groups * q_len, head_dim), k, v, scale=scale)
        return out.view(batch, heads, q_len, v.shape[3])
    return _torch_sdpa(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=native_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _with_sink_key(q, k, v, attn_mask, sinks):
    """(q, k, v, attn_mask) with one more key and value of zeros and a float mask ``(batch|1, heads, q_len,
    kv_len + 1)`` whose last column is ``sinks``: that key's score is the sink logit exactly."""
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len, head_dim = k.shape[1], k.shape[2], k.shape[3]
    k = torch.cat([k, k.new_zeros(batch, kv_heads, 1, head_dim)], dim=2)
    v = torch.cat([v, v.new_zeros(batch, kv_heads, 1, v.shape[3])], dim=2)
    if attn_mask is None:
        attn_mask = q.new_zeros(1, 1, 1, 1)
    elif attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, q.new_zeros(()), -math.inf)
    lead = attn_mask.shape[0]
    attn_mask = attn_mask.expand(lead, heads, q_len, kv_len)
    sink = sinks.reshape(1, heads, 1, 1).expand(lead, heads, q_len, 1)
    return q, k, v, torch.cat([attn_mask, sink], dim=-1)
