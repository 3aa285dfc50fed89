"""The explicit formulation (``implementation="math"``): every score formed, one softmax; the weights returned."""

from __future__ import annotations

import torch

from mha_torch import _tiles, masks


def run(q, k, v, spec: masks.Spec, *, scale, soft_cap, sinks, keep, keep_scale, dropout_p):
    """(out ``(b, heads, q, dv)``, weights ``(b, heads, q, k)``) of q ``(b, heads, q, d)``, k ``(b, kv_heads, k,
    d)``, v ``(b, kv_heads, k, dv)``; without ``keep``, a dropout mask drawn from torch's RNG."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    if keep is None and dropout_p > 0:
        keep = torch.rand(spec.shape, device=q.device) >= dropout_p
    logits = q.reshape(batch, kv_heads, groups, q_len, head_dim) @ k.unsqueeze(2).transpose(-1, -2)
    logits = _tiles.scores(logits.reshape(batch, heads, q_len, kv_len), scale=scale, soft_cap=soft_cap,
                           bias=masks.biases(spec), allowed=masks.dense(spec))
    weights = _tiles.softmax(logits, None if sinks is None else sinks.reshape(1, -1, 1, 1))
    if keep is not None:
        weights = torch.where(keep, weights * keep_scale, 0.0)
    out = weights.reshape(batch, kv_heads, groups, q_len, kv_len) @ v.unsqueeze(2)
    return out.reshape(batch, heads, q_len, v.shape[3]), weights
