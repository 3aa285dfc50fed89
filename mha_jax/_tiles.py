"""Query/key tile layout and the tile step (scores, online softmax, gradient) shared by every JAX kernel."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mha_spec import alibi as _alibi
from mha_spec.terms import BIAS_FLOOR, EMPTY_LSE, MASKED, NO_KEY, Terms, Where, conjoin


class Tokens(NamedTuple):
    """What a kernel reads per query or per key, by name (None: absent): positions and segment ids ``(batch|1,
    len)``, the keys' ``lengths`` ``(batch,)``, the ALiBi ``slopes`` laid out to broadcast over the kernel's scores."""

    query_positions: Any = None
    key_positions: Any = None
    query_segments: Any = None
    key_segments: Any = None
    lengths: Any = None
    slopes: Any = None


def _of_max(dtype, fraction: float):
    """``fraction`` x the largest finite value of ``dtype``, a NumPy scalar of it."""
    return np.asarray(fraction * float(jnp.finfo(dtype).max), jnp.dtype(dtype))[()]


def masked(dtype):
    """The score a masked entry gets (finite: no inf in any path)."""
    return _of_max(dtype, MASKED)


def has_key(row_max):
    """Whether a row whose running max is ``row_max`` has met a key (a score above every masked one)."""
    return row_max > _of_max(row_max.dtype, NO_KEY)


def empty_lse(dtype):
    """The lse an empty row keeps: finite, and so large that every weight recomputed from it is 0."""
    return _of_max(dtype, EMPTY_LSE)


def no_key_residual(dtype):
    """The residual of a query with no key: jax.nn's (``-0.7 x`` float32's largest, as float32 rounds it), or
    ``dtype``'s lowest finite value where that is higher (float16: jax.nn's overflows to -inf)."""
    value = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))
    return np.asarray(max(value, float(jnp.finfo(dtype).min)), jnp.promote_types(dtype, jnp.float32))[()]


def grouped(x, kv_heads: int):
    """A mask broadcasting to (b, heads, q, k) as 5-d (b|1, kv_heads|1, groups|1, q|1, k|1)."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, x.shape[2], x.shape[3])


def below_all(x):
    """bool: where ``x`` is ``-inf`` (read without an inf constant, which ``jax.debug_infs`` would catch)."""
    return ~jnp.isfinite(x) & (x < 0)


def floored_bias(bias, compute):
    """``bias`` (its dtype kept) with finite values below ``FLOOR`` x max of ``compute`` raised to it, ``-inf`` kept:
    every score a finite bias leaves stays above the masked ones' (a key excluded only by a mask or ``-inf``)."""
    if bias is None or float(jnp.finfo(bias.dtype).min) >= BIAS_FLOOR * float(jnp.finfo(compute).max):
        return bias
    floor = np.asarray(BIAS_FLOOR * float(jnp.finfo(compute).max), bias.dtype)
    return jnp.where(below_all(bias), bias, jnp.maximum(bias, floor))


def pad(x, axis, size, broadcast=False):
    """Zero-pad ``axis`` to ``size``; with ``broadcast``, an axis of 1 stays as it is."""
    if x is None or x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def query_rows(cfg, x):
    """``(b, h, g, q_len, *rest)`` -> query blocks ``(n_q, b, h, g*block_q, *rest)``."""
    b, h, g = x.shape[:3]
    x = pad(x, 3, cfg.n_q * cfg.block_q)
    x = x.reshape((b, h, g, cfg.n_q, cfg.block_q) + x.shape[4:])
    return jnp.moveaxis(x, 3, 0).reshape((cfg.n_q, b, h, g * cfg.block_q) + x.shape[5:])


def from_query_rows(cfg, x, b, h, g):
    """The inverse of ``query_rows``, with the padding of the last block dropped."""
    x = x.reshape((cfg.n_q, b, h, g, cfg.block_q) + x.shape[4:])
    x = jnp.moveaxis(x, 0, 3).reshape((b, h, g, cfg.n_q * cfg.block_q) + x.shape[5:])
    return x[:, :, :, : cfg.q_len]


def key_rows(cfg, x):
    """``(b, h, kv_len, d)`` -> key blocks ``(n_k, b, h, block_k, d)``."""
    b, h, _, d = x.shape
    x = pad(x, 2, cfg.n_k * cfg.block_k).reshape(b, h, cfg.n_k, cfg.block_k, d)
    return jnp.moveaxis(x, 2, 0)


def scores(s, shape, *, scale=None, soft_cap=None, bias=None, terms: Terms | None = None, q: Where | None = None,
           k: Where | None = None, masks=(), alibi=None):
    """(scores, tanh of the cap or None) of a tile's products ``s``: scaled, capped, plus ``bias`` and ALiBi,
    ``masked`` where ``terms`` (on ``q``, ``k``) or ``masks`` exclude; bias, slopes and masks broadcast to ``shape``."""
    if scale is not None:
        s = s * scale
    t = None
    if soft_cap is not None:
        t = jnp.tanh(s / soft_cap)
        s = soft_cap * t
    ok = None if not terms else terms.visible(q, k)
    for mask in masks:
        ok = conjoin(ok, mask)
    if bias is None and ok is None and alibi is None:
        return s, t
    flat = s.shape
    s = s.reshape(shape)
    if bias is not None:
        s = s + bias.astype(s.dtype)
    if alibi is not None:
        s = s + _alibi.bias(alibi, q.position, k.position).astype(s.dtype)
    if ok is not None:
        s = jnp.where(ok, s, masked(s.dtype))
    return s.reshape(flat), t


def softmax(s, sinks=None):
    """(softmax over the last axis of scores ``s`` from ``scores``, 0 on rows with no key; its lse, ``no_key_residual``
    on those rows); ``sinks`` broadcasting to ``s`` without its last axis (kept as 1): each row's extra logit."""
    row_max = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        row_max = jnp.maximum(row_max, sinks)
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(has_key(row_max), row_max, 0.0)  # no key: exp(masked) is 0
    exp = jnp.exp(s - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks - row_max)
    lse = jnp.where(total > 0.0, row_max + jnp.log(jnp.where(total > 0.0, total, 1.0)), no_key_residual(total.dtype))
    return exp / jnp.where(total == 0.0, 1.0, total), lse[..., 0]


def dropped(x, keep, keep_scale, shape):
    """Tile ``x`` with its entries kept by ``keep`` (broadcasting to ``shape``) times ``keep_scale``, the others 0."""
    return jnp.where(keep, x.reshape(shape) * keep_scale, 0.0).reshape(x.shape)


def init(acc, sinks=None):
    """(running max, sum, ``acc``) before any tile (max ``masked``); a sink starts a row at max = sink, sum = 1."""
    zeros = jnp.zeros_like(acc[..., 0])
    if sinks is None:
        return jnp.full_like(zeros, masked(zeros.dtype)), zeros, acc
    return jnp.maximum(zeros + sinks, masked(zeros.dtype)), zeros + (~below_all(sinks)).astype(zeros.dtype), acc


def accumulator(rows, dim: int):
    """Zeros ``(..., rows, dim)`` with the dtype (and varying manual axes) of query rows ``(..., rows, d)``."""
    return jnp.broadcast_to(jnp.zeros_like(rows[..., :1]), rows.shape[:-1] + (dim,))


def forward(state, s, mix, keep=None, keep_scale=1.0, shape=None):
    """The state after tile scores ``s``; ``mix(p)`` is ``p V``; ``keep`` drops weights after the sum."""
    m, norm, acc = state
    m_new = jnp.maximum(m, s.max(axis=-1))
    shift = jnp.where(has_key(m_new), m_new, 0.0)  # no key yet: exp(masked) is 0
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    norm = alpha * norm + p.sum(axis=-1)
    if keep is not None:
        p = dropped(p, keep, keep_scale, shape)
    return m_new, norm, alpha[..., None] * acc + mix(p)


def finish(state):
    """(output ``(..., rows, d)``, lse ``(..., rows)``); an empty row gets 0 and lse ``empty_lse`` (zero weights
    later)."""
    m, norm, acc = state
    out = acc / jnp.where(norm == 0.0, 1.0, norm)[..., None]
    log_norm = jnp.log(jnp.where(norm > 0.0, norm, 1.0))
    return out, jnp.where(norm > 0.0, m + log_norm, empty_lse(m.dtype))


def residual(lse, no_key):
    """An lse of ``finish`` as ``return_residual`` gives it: an empty row's ``no_key``."""
    return jnp.where(lse == empty_lse(lse.dtype), no_key, lse)


def backward(s, lse, delta, dp, tanh=None, keep=None, keep_scale=1.0, shape=None):
    """(weights used, bias gradient, gradient before the cap) of a tile from ``s``, ``lse``, ``delta`` and ``dp = dO
    V^T``. The clamp bounds scores left unmasked (zero-padded keys), whose weights count for nothing."""
    p = jnp.exp(jnp.minimum(s - lse, 0.0))
    p_used = p
    if keep is not None:
        p_used, dp = dropped(p, keep, keep_scale, shape), dropped(dp, keep, keep_scale, shape)
    ds = p * (dp - delta)
    return p_used, ds, ds if tanh is None else ds * (1.0 - tanh * tanh)


def bias_tile(shape, offsets: dict):
    """(start, size) of a bias-gradient tile: ``offsets`` maps axis -> (start, size); an axis of 1 stays whole."""
    start, size = [jnp.int32(0)] * len(shape), list(shape)
    for axis, (offset, n) in offsets.items():
        if shape[axis] != 1:
            start[axis], size[axis] = jnp.asarray(offset, jnp.int32), n
    return start, size


def bias_share(ds, shape):
    """A tile's score gradient ``ds`` summed over the axes on which a bias of ``shape`` broadcasts."""
    return ds.sum(axis=tuple(a for a in range(ds.ndim) if shape[a] == 1 and ds.shape[a] != 1), keepdims=True)


def sink_gradient(sinks, lse, delta):
    """``(heads, groups)``: the sinks' gradient, summed over batch and rows of ``lse``, ``delta``."""
    return -jnp.sum(jnp.exp(sinks - lse) * delta, axis=(0, 3))
