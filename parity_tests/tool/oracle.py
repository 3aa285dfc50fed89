"""An independent float64 NumPy oracle: multi-head attention forward and its hand-written gradient.

It shares no code with ``mha_jax`` or ``mha_torch``: it reads masks by the documented semantics
itself, and computes the backward pass from the textbook formulas, so that both frameworks are
checked against ground truth and not only against each other. Parameters use ``mha_torch``'s
state-dict names and shapes; arrays are float64 throughout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Params = dict[str, np.ndarray]


@dataclass
class Attention:
    """Everything one attention call is told about which keys each query sees, as NumPy.

    ``mask``: bool/integer nonzero = attend, floating = added (PyTorch's convention; each
    framework's harness passes it in its own). ``bias``: added. Positions ``(batch|1, len)``
    default to ``arange``; ``window`` is ``(left, right)``; ``lengths`` ``(batch,)``;
    ``chunk_size``: a query sees the keys of its own chunk of that many positions.
    ``soft_cap``: the scaled logits become ``soft_cap * tanh(logits / soft_cap)`` before the
    bias and masks. ``sinks`` ``(heads,)``: one more logit per query head in each row's
    normaliser, attached to no value.
    """

    mask: np.ndarray | None = None
    is_causal: bool = False
    keep: np.ndarray | None = None
    dropout_rate: float = 0.0
    scale: float | None = None
    bias: np.ndarray | None = None
    query_positions: np.ndarray | None = None
    key_positions: np.ndarray | None = None
    window: tuple[int, int] | None = None
    query_segment_ids: np.ndarray | None = None
    key_segment_ids: np.ndarray | None = None
    lengths: np.ndarray | None = None
    soft_cap: float | None = None
    sinks: np.ndarray | None = None
    chunk_size: int | None = None


@dataclass
class Cache:
    """What ``attention_grads`` reads of a forward pass (all float64, ``(B, H, Q, K)`` unless said)."""

    q: np.ndarray
    k_rep: np.ndarray  # keys and values repeated to the query heads, (B, H, K, D)
    v_rep: np.ndarray
    probs: np.ndarray  # softmax before dropout
    drop: np.ndarray  # 0 or 1 / (1 - rate) per weight
    weights: np.ndarray  # probs * drop
    scale: float
    groups: int
    tanh: np.ndarray | None  # tanh(scaled logits / soft_cap), None without a cap
    sink_probs: np.ndarray | None  # (B, H, Q, 1): the sink's share of each row, None without sinks


def allowed_and_bias(att: Attention, shape: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(allowed bool, additive bias float64), both of ``shape`` = (batch, heads, q_len, kv_len).

    Every term is read here, query by query and key by key, from its documented meaning."""
    batch, heads, q_len, kv_len = shape
    allowed = np.ones(shape, dtype=bool)
    bias = np.zeros(shape)
    if att.mask is not None:
        mask = np.asarray(att.mask)
        if mask.dtype.kind in "biu":
            allowed = allowed & np.broadcast_to(mask != 0, shape)
        else:
            bias = bias + np.broadcast_to(mask.astype(np.float64), shape)
    if att.bias is not None:
        bias = bias + np.broadcast_to(np.asarray(att.bias, np.float64), shape)
    qp = np.broadcast_to(np.arange(q_len) if att.query_positions is None else att.query_positions, (batch, q_len))
    kp = np.broadcast_to(np.arange(kv_len) if att.key_positions is None else att.key_positions, (batch, kv_len))
    seen = np.ones((batch, q_len, kv_len), dtype=bool)
    for b in range(batch):
        for i in range(q_len):
            for j in range(kv_len):
                if att.is_causal and kp[b, j] > qp[b, i]:
                    seen[b, i, j] = False
                if att.window is not None and not qp[b, i] - att.window[0] <= kp[b, j] <= qp[b, i] + att.window[1]:
                    seen[b, i, j] = False
                if att.query_segment_ids is not None:
                    qs = np.broadcast_to(att.query_segment_ids, (batch, q_len))
                    ks = np.broadcast_to(att.key_segment_ids, (batch, kv_len))
                    seen[b, i, j] &= bool(qs[b, i] == ks[b, j])
                if att.lengths is not None and j >= att.lengths[b]:
                    seen[b, i, j] = False
                if att.chunk_size is not None and _chunk(qp[b, i], att.chunk_size) != _chunk(kp[b, j], att.chunk_size):
                    seen[b, i, j] = False
    return allowed & seen[:, None], bias


def _chunk(position, size: int) -> int:
    """The chunk of ``size`` positions a position falls in: the ``c`` with
    ``c * size <= position < (c + 1) * size`` (chunk -1 holds positions -size .. -1)."""
    return math.floor(float(position) / size)


def attention(q, k, v, att: Attention):
    """Forward of the core in torch layout: q ``(B, H, Q, D)``, k/v ``(B, Hk, K, D)``.

    Returns (out ``(B, H, Q, D)``, applied weights ``(B, H, Q, K)``, ``Cache`` for ``attention_grads``).
    """
    batch, heads, q_len, head_dim = q.shape
    groups = heads // k.shape[1]
    k_rep, v_rep = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scale = 1.0 / np.sqrt(head_dim) if att.scale is None else att.scale
    shape = (batch, heads, q_len, k.shape[2])
    allowed, bias = allowed_and_bias(att, shape)

    logits = np.einsum("bhqd,bhkd->bhqk", q, k_rep) * scale
    tanh = None
    if att.soft_cap is not None:
        tanh = np.tanh(logits / att.soft_cap)
        logits = att.soft_cap * tanh
    logits = np.where(allowed, logits + bias, -np.inf)
    live = np.isfinite(logits)
    has_key = live.any(axis=-1, keepdims=True)
    row_max = np.where(has_key, np.where(live, logits, -np.inf).max(axis=-1, keepdims=True), 0.0)
    sink = None
    if att.sinks is not None:  # the sink is one more finite logit in every row
        sink = np.broadcast_to(np.asarray(att.sinks, np.float64).reshape(1, heads, 1, 1), (batch, heads, q_len, 1))
        row_max = np.where(has_key, np.maximum(row_max, sink), sink)
    exp = np.where(live, np.exp(np.where(live, logits, 0.0) - row_max), 0.0)
    total = exp.sum(axis=-1, keepdims=True)
    sink_probs = None
    if sink is not None:
        sink_exp = np.exp(sink - row_max)
        total = total + sink_exp
        sink_probs = sink_exp / total
    probs = exp / np.where(total > 0.0, total, 1.0)

    drop = np.ones(shape)
    if att.keep is not None:
        drop = np.broadcast_to(np.asarray(att.keep) != 0, shape) / (1.0 - att.dropout_rate)
    weights = probs * drop
    out = np.einsum("bhqk,bhkd->bhqd", weights, v_rep)
    return out, weights, Cache(q, k_rep, v_rep, probs, drop, weights, scale, groups, tanh, sink_probs)


def attention_grads(cache: Cache, d_out) -> dict[str, Any]:
    """Every gradient of ``attention`` for the cotangent ``d_out``: ``query``, ``key``,
    ``value``; ``logits`` ``(B, H, Q, K)``, that of the capped logits plus bias (an additive
    bias's gradient before summing over its broadcast axes); ``sinks`` ``(H,)`` or None."""
    c = cache
    d_weights = np.einsum("bhqd,bhkd->bhqk", d_out, c.v_rep)
    dv_rep = np.einsum("bhqk,bhqd->bhkd", c.weights, d_out)
    d_probs = d_weights * c.drop
    # softmax backward: dS = P * (dP - rowsum(dP * P)); the sink's own dP is 0 (it has no value)
    row = (d_probs * c.probs).sum(axis=-1, keepdims=True)
    d_logits = c.probs * (d_probs - row)
    d_sinks = None if c.sink_probs is None else -(c.sink_probs * row).sum(axis=(0, 2, 3))
    d_raw = d_logits if c.tanh is None else d_logits * (1.0 - c.tanh**2)  # d(cap tanh(x / cap)) / dx
    d_scaled = d_raw * c.scale
    dq = np.einsum("bhqk,bhkd->bhqd", d_scaled, c.k_rep)
    dk_rep = np.einsum("bhqk,bhqd->bhkd", d_scaled, c.q)

    def fold(x):  # sum the query heads of each group back onto their key/value head
        b, h, n, d = x.shape
        return x.reshape(b, h // c.groups, c.groups, n, d).sum(axis=2)

    return {"query": dq, "key": fold(dk_rep), "value": fold(dv_rep), "logits": d_logits, "sinks": d_sinks}


def attention_grad(cache: Cache, d_out):
    """Gradients (dq, dk, dv) of ``attention`` for the cotangent ``d_out``."""
    grads = attention_grads(cache, d_out)
    return grads["query"], grads["key"], grads["value"]


def _split_heads(x, heads):
    b, n, f = x.shape
    return x.reshape(b, n, heads, f // heads).transpose(0, 2, 1, 3)


def _merge_heads(x):
    b, h, n, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def _linear(params: Params, name: str, x):
    y = x @ params[f"{name}.weight"].T
    return y + params[f"{name}.bias"] if f"{name}.bias" in params else y


NORM_EPS = 1e-6  # flax's LayerNorm epsilon, that of normalize_qk


def _layer_norm(x, weight):
    """LayerNorm without bias over the last axis: ``(output, normalised x, 1 / std)``."""
    centred = x - x.mean(axis=-1, keepdims=True)
    inv_std = 1.0 / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + NORM_EPS)
    normalised = centred * inv_std
    return normalised * weight, normalised, inv_std


def _layer_norm_grad(dy, weight, normalised, inv_std):
    """(d input, d weight) of ``_layer_norm``, by the textbook formula."""
    d_norm = dy * weight
    dx = inv_std * (d_norm - d_norm.mean(axis=-1, keepdims=True)
                    - normalised * (d_norm * normalised).mean(axis=-1, keepdims=True))
    return dx, (dy * normalised).reshape(-1, dy.shape[-1]).sum(axis=0)


def _rms_norm(x, weight):
    """RMSNorm over the last axis: ``(output, normalised x, 1 / rms)``."""
    inv_rms = 1.0 / np.sqrt((x**2).mean(axis=-1, keepdims=True) + NORM_EPS)
    normalised = x * inv_rms
    return normalised * weight, normalised, inv_rms


def _rms_norm_grad(dy, weight, normalised, inv_rms):
    """(d input, d weight) of ``_rms_norm``."""
    d_norm = dy * weight
    dx = inv_rms * (d_norm - normalised * (d_norm * normalised).mean(axis=-1, keepdims=True))
    return dx, (dy * normalised).reshape(-1, dy.shape[-1]).sum(axis=0)


def _angles(positions, length: int, batch: int, inv_freq):
    """cos and sin ``(B, 1, len, half)`` of each position times each frequency."""
    positions = np.broadcast_to(np.arange(length) if positions is None else positions, (batch, length))
    angles = positions[..., None].astype(np.float64) * np.asarray(inv_freq, np.float64)
    return np.cos(angles)[:, None], np.sin(angles)[:, None]


def _rotate(x, cos, sin, inverse: bool = False):
    """Rotate-half rotary embedding over the whole head: pairs ``(i, i + head_dim / 2)``; the
    inverse rotation (the transpose) is the gradient's."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    sin = -sin if inverse else sin
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mha(params: Params, xq, xk, xv, att: Attention, *, num_heads: int, num_kv_heads: int, d_out=None,
        qk_norm: str = "layer", inv_freq=None):
    """Module forward and, given a cotangent ``d_out``, every gradient.

    With ``q_norm.weight``/``k_norm.weight`` in ``params``, each head's queries and keys go
    through a norm (epsilon 1e-6) before attending: ``qk_norm="layer"``, a LayerNorm without bias
    (flax's ``normalize_qk``), or ``"rms"``. ``inv_freq`` ``(head_dim / 2,)``: queries and keys
    (after the norm) are rotated, rotate-half, at ``att``'s positions (default ``arange``).
    ``sinks`` in ``params``: each head's sink logit. Returns a dict: ``out`` ``(B, Q, out)``,
    ``weights`` ``(B, H, Q, K)`` and, with ``d_out``, ``grads``: ``inputs_q``/``inputs_k``/
    ``inputs_v`` and each parameter by state-dict name.
    """
    q = _split_heads(_linear(params, "q_proj", xq), num_heads)
    k = _split_heads(_linear(params, "k_proj", xk), num_kv_heads)
    v = _split_heads(_linear(params, "v_proj", xv), num_kv_heads)
    norm, norm_grad = (_rms_norm, _rms_norm_grad) if qk_norm == "rms" else (_layer_norm, _layer_norm_grad)
    normalize_qk = "q_norm.weight" in params
    if normalize_qk:
        q, q_norm, q_inv = norm(q, params["q_norm.weight"])
        k, k_norm, k_inv = norm(k, params["k_norm.weight"])
    if inv_freq is not None:
        q_rot = _angles(att.query_positions, q.shape[2], q.shape[0], inv_freq)
        k_rot = _angles(att.key_positions, k.shape[2], k.shape[0], inv_freq)
        q, k = _rotate(q, *q_rot), _rotate(k, *k_rot)
    if "sinks" in params:
        att = dataclasses.replace(att, sinks=params["sinks"])
    core, weights, cache = attention(q, k, v, att)
    merged = _merge_heads(core)
    out = _linear(params, "out_proj", merged)
    result = {"out": out, "weights": weights}
    if d_out is None:
        return result

    grads: dict[str, np.ndarray] = {}

    def linear_grad(name, x, dy):
        grads[f"{name}.weight"] = np.einsum("bno,bni->oi", dy, x)
        if f"{name}.bias" in params:
            grads[f"{name}.bias"] = dy.sum(axis=(0, 1))
        return dy @ params[f"{name}.weight"]

    d_core = _split_heads(linear_grad("out_proj", merged, d_out), num_heads)
    core_grads = attention_grads(cache, d_core)
    dq, dk, dv = core_grads["query"], core_grads["key"], core_grads["value"]
    if "sinks" in params:
        grads["sinks"] = core_grads["sinks"]
    if inv_freq is not None:
        dq, dk = _rotate(dq, *q_rot, inverse=True), _rotate(dk, *k_rot, inverse=True)
    if normalize_qk:
        dq, grads["q_norm.weight"] = norm_grad(dq, params["q_norm.weight"], q_norm, q_inv)
        dk, grads["k_norm.weight"] = norm_grad(dk, params["k_norm.weight"], k_norm, k_inv)
    grads["inputs_q"] = linear_grad("q_proj", xq, _merge_heads(dq))
    grads["inputs_k"] = linear_grad("k_proj", xk, _merge_heads(dk))
    grads["inputs_v"] = linear_grad("v_proj", xv, _merge_heads(dv))
    result["grads"] = grads
    return result
