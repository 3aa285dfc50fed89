"""Tiles of queries and keys: their layout, and the one step of attention over a tile.

A query block holds ``block_q`` rows of every query head of a key/value head's group, so one product
serves the group; the last block is zero-padded. The tile step of every kernel (``_blockwise``,
``_band``, the ring): ``scores`` turns a tile's products ``Q K^T`` into scores with every term;
``init``, ``forward`` and ``finish`` carry the online softmax over tiles; ``backward`` is the gradient
through one tile. Shapes are a tile's scores ``(..., rows, keys)``, flat as the kernel's product gives them.
"""

from __future__ import annotations

import jax.numpy as jnp

from mha_spec import alibi as _alibi
from mha_spec.terms import Terms, Where, conjoin


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


# --- the tile step ------------------------------------------------------------------------------

def scores(s, shape, *, scale=None, soft_cap=None, bias=None, terms: Terms | None = None, q: Where | None = None,
           k: Where | None = None, masks=(), alibi=None):
    """(scores, tanh of the cap or None) of one tile from its products ``s``: times ``scale`` (None:
    folded into the queries), capped as ``cap * tanh(s / cap)``, plus ``bias`` and the ALiBi term of
    the slopes ``alibi`` on the positions of ``q`` and ``k`` (``mha_spec.alibi.bias``: it reads them
    relative to each other, so a tile's positions may be relative to a block), and -inf where the
    ``terms`` (read on the tile's queries ``q`` and keys ``k``) or a bool of ``masks`` exclude.
    ``bias``, the slopes and the masks broadcast to ``shape``, the scores as the kernel lays them out."""
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
        s = jnp.where(ok, s, -jnp.inf)
    return s.reshape(flat), t


def dropped(x, keep, keep_scale, shape):
    """Tile ``x`` with its entries kept by ``keep`` (broadcasting to ``shape``) times ``keep_scale``, the others 0."""
    return jnp.where(keep, x.reshape(shape) * keep_scale, 0.0).reshape(x.shape)


def init(acc, sinks=None):
    """The online softmax's state before any tile: (running maximum, sum, weighted values ``acc``,
    zeros ``(..., rows, d)``). A sink (broadcasting to the rows, or None) starts a row at maximum =
    sink, sum = 1."""
    zeros = jnp.zeros_like(acc[..., 0])
    if sinks is None:
        return jnp.full_like(zeros, -jnp.inf), zeros, acc
    return zeros + sinks, zeros + (sinks > -jnp.inf).astype(zeros.dtype), acc


def accumulator(rows, dim: int):
    """Zeros ``(..., rows, dim)`` of ``rows``' dtype (and, inside ``jax.shard_map``, the manual axes it
    varies over), from query rows ``(..., rows, d)``: the weighted values' sum, in the value's head dim."""
    return jnp.broadcast_to(jnp.zeros_like(rows[..., :1]), rows.shape[:-1] + (dim,))


def forward(state, s, mix, keep=None, keep_scale=1.0, shape=None):
    """The state after one tile of scores ``s``: ``mix(p)`` is the weights ``p`` times the tile's
    values ``(..., rows, d)``; ``keep`` drops weights after the sum (``dropped``)."""
    m, norm, acc = state
    m_new = jnp.maximum(m, s.max(axis=-1))
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - shift[..., None])
    alpha = jnp.exp(m - shift)
    norm = alpha * norm + p.sum(axis=-1)
    if keep is not None:
        p = dropped(p, keep, keep_scale, shape)
    return m_new, norm, alpha[..., None] * acc + mix(p)


def finish(state):
    """(output ``(..., rows, d)``, row log-sum-exp ``(..., rows)``); a row with no allowed key gets
    output 0 and log-sum-exp +inf, so that its weights recomputed in the backward are 0."""
    m, norm, acc = state
    out = acc / jnp.where(norm == 0.0, 1.0, norm)[..., None]
    log_norm = jnp.log(jnp.where(norm > 0.0, norm, 1.0))
    return out, jnp.where(norm > 0.0, jnp.where(jnp.isfinite(m), m, 0.0) + log_norm, jnp.inf)


def backward(s, lse, delta, dp, tanh=None, keep=None, keep_scale=1.0, shape=None):
    """(weights used ``P`` (dropout applied), gradient of the capped and biased scores (the bias's),
    gradient of the scores before the cap) of one tile, from its scores ``s``, the rows' ``lse``
    and ``delta = rowsum(dO * O)`` broadcasting against ``s``, and ``dp = dO V^T``. The clamp
    bounds scores the kernel left unmasked (zero-padded keys), whose weights count for nothing."""
    p = jnp.exp(jnp.minimum(s - lse, 0.0))
    p_used = p
    if keep is not None:
        p_used, dp = dropped(p, keep, keep_scale, shape), dropped(dp, keep, keep_scale, shape)
    ds = p * (dp - delta)
    return p_used, ds, ds if tanh is None else ds * (1.0 - tanh * tanh)


def bias_tile(shape, offsets: dict):
    """(start, size) of a tile of a bias gradient of ``shape``: ``offsets`` maps an axis to the tile's
    (start, size) along it; an axis of 1 (broadcast) stays whole."""
    start, size = [jnp.int32(0)] * len(shape), list(shape)
    for axis, (offset, n) in offsets.items():
        if shape[axis] != 1:
            start[axis], size[axis] = jnp.asarray(offset, jnp.int32), n
    return start, size


def bias_share(ds, shape):
    """A tile's score gradient ``ds`` summed over the axes on which a bias of ``shape`` broadcasts."""
    return ds.sum(axis=tuple(a for a in range(ds.ndim) if shape[a] == 1 and ds.shape[a] != 1), keepdims=True)


def sink_gradient(sinks, lse, delta):
    """``(heads, groups)``: each sink's gradient, its weight ``exp(sink - lse)`` times its score
    gradient ``-delta``, summed over the batch and rows of ``lse`` and ``delta`` ``(b, h, g, rows)``."""
    return -jnp.sum(jnp.exp(sinks - lse) * delta, axis=(0, 3))
