"""Sliding-window attention over default positions: one band of ``block + left + right`` keys per query block."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mha_jax import _tiles, _tuning
from mha_spec.terms import Causal, Terms, Where, Window

_BAND_SCORES = 1 << 22  # the most scores of one band (batch x heads x rows x keys), as ``_blockwise``'s


@dataclass(frozen=True)
class _Band:
    block_q: int  # as ``_blockwise.Config``'s, for ``_tiles.query_rows``
    q_len: int
    kv_len: int
    left: int
    right: int
    scale: float
    precision: lax.PrecisionLike
    terms: Terms = Terms()

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def width(self) -> int:
        return self.block_q + self.left + self.right


def band(q_len: int, kv_len: int, batch_heads: int, groups: int, terms: Terms) -> tuple[int, int, int] | None:
    """(block, left, right) for a window among shift-invariant ``terms`` whose band fits ``_BAND_SCORES``, else
    None; causality makes ``right`` 0, a side wider than the keys is cut to them."""
    window = [t for t in terms if isinstance(t, Window)]
    if not window or not all(t.shift_invariant for t in terms) or q_len == 0 or kv_len == 0:
        return None
    left, right = window[0].left, window[0].right
    left, right = min(left, q_len), min(0 if Causal() in terms.members else right, kv_len)
    block = min(_tuning.current().band_block, max(8, 1 << (q_len - 1).bit_length()))
    if batch_heads * groups * block * (block + left + right) > _BAND_SCORES:
        return None
    return block, left, right


def attention(q, k, v, tokens: _tiles.Tokens, conditions: Terms, *, block, left, right, scale, precision):
    """(output ``(batch, kv_heads, groups, q_len, v_head_dim)`` in ``q.dtype``, its lse ``(batch, kv_heads, groups,
    q_len)``, without gradient); ``conditions`` read ``tokens`` (positions: default ones, relative to each band)."""
    cfg = _Band(block, q.shape[3], k.shape[2], left, right, scale, precision, conditions)
    _tuning.observe("band", cfg)
    return _band(cfg, q, k, v, tokens._replace(query_positions=None, key_positions=None))


def _padded_keys(cfg, x, axis):
    """Keys padded (``left`` zeros before) or cut so that band ``i`` is ``[i * block, i * block + width)``."""
    size = cfg.n_q * cfg.block_q + cfg.left + cfg.right
    x = lax.slice_in_dim(x, 0, min(x.shape[axis], size - cfg.left), axis=axis)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (cfg.left, size - cfg.left - x.shape[axis])
    return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _band(cfg, q, k, v, tokens):
    return _forward(cfg, q, k, v, tokens)[0]


def _scores(cfg, q_i, k_band, i, g, tokens: _tiles.Tokens, transposed=False):
    """Band ``i``'s scores ``(b, h, g * block, width)``, masked where not visible; ``transposed``: ``(b, h, width, g *
    block)``."""
    b, h = q_i.shape[:2]
    rows = np.arange(cfg.block_q).reshape(1, 1, 1, -1, 1)  # positions relative to the band's first query
    cols = np.arange(cfg.width).reshape(1, 1, 1, 1, -1) - cfg.left
    key = i * cfg.block_q + jnp.asarray(cols, jnp.int32)  # the key's index
    qs, ks, lengths, slopes = tokens.query_segments, tokens.key_segments, tokens.lengths, tokens.slopes
    q_ids = None if qs is None else \
        lax.dynamic_slice_in_dim(qs, i * cfg.block_q, cfg.block_q, 1)[:, None, None, :, None]
    k_ids = None if ks is None else lax.dynamic_slice_in_dim(ks, i * cfg.block_q, cfg.width, 1)[:, None, None, None, :]
    visible = cfg.terms.visible(Where(rows, q_ids),
                                Where(cols, k_ids, key, None if lengths is None else lengths.reshape(-1, 1, 1, 1, 1)))
    visible = visible & (key >= 0) & (key < cfg.kv_len)  # (b|1, 1, 1|g, block, width)
    scale = jnp.asarray(cfg.scale, q_i.dtype)
    if transposed:
        s = jnp.einsum("bhkd,bhmd->bhkm", k_band, q_i, precision=cfg.precision)
        shape, visible = (b, h, cfg.width, g, cfg.block_q), jnp.moveaxis(visible, 4, 2)
        rows, cols = np.moveaxis(rows, 4, 2), np.moveaxis(cols, 4, 2)
        slopes = None if slopes is None else jnp.moveaxis(slopes, 4, 2)
    else:
        s = jnp.einsum("bhmd,bhkd->bhmk", q_i, k_band, precision=cfg.precision)
        shape = (b, h, g, cfg.block_q, cfg.width)
    return _tiles.scores(s, shape, scale=scale, masks=(visible,), alibi=slopes, q=Where(rows), k=Where(cols))[0]


def _queries(cfg, x):
    """``(b, h, g, q_len, ...)`` -> ``(b, n * block, h, g, ...)``, zero-padded to whole blocks."""
    return _tiles.pad(jnp.moveaxis(x, 3, 1), 1, cfg.n_q * cfg.block_q)


def _block_rows(cfg, x, i):
    """Query block ``i`` of ``_queries``' layout as rows ``(b, h, g * block, ...)``."""
    b, _, h, g = x.shape[:4]
    x = jnp.moveaxis(lax.dynamic_slice_in_dim(x, i * cfg.block_q, cfg.block_q, 1), 1, 3)
    return x.reshape((b, h, g * cfg.block_q) + x.shape[4:])


def _in_caller_layout(cfg, x):
    """One block's rows ``(b, h, g * block, d)`` -> ``(b, block, h, g, d)``, the caller's layout."""
    b, h, _, d = x.shape
    return jnp.moveaxis(x.reshape(b, h, -1, cfg.block_q, d), 3, 1)


def _unblocked(cfg, x):
    """The blocks ``(n, b, block, h, g, d)`` -> ``(b, h, g, q_len, d)``, through the caller's layout."""
    n, b = x.shape[:2]
    x = jnp.moveaxis(x, 0, 1).reshape((b, n * cfg.block_q) + x.shape[3:])
    return jnp.moveaxis(x[:, : cfg.q_len], 1, 3)


def _forward(cfg, q, k, v, tokens: _tiles.Tokens):
    g = q.shape[2]
    q_ids, k_ids = tokens.query_segments, tokens.key_segments
    if q_ids is not None:  # query ids padded to whole blocks, key ids laid as the keys
        q_ids = jnp.pad(q_ids, ((0, 0), (0, cfg.n_q * cfg.block_q - q_ids.shape[1])), constant_values=-1)
        tokens = tokens._replace(query_segments=q_ids, key_segments=_padded_keys(cfg, k_ids, 1))
    qs = _queries(cfg, q)  # (b, padded, h, g, d)
    kp, vp = _padded_keys(cfg, k, 2), _padded_keys(cfg, v, 2)  # (b, h, padded, d)
    def block(i):
        start = i * cfg.block_q
        q_i = _block_rows(cfg, qs, i)
        s = _scores(cfg, q_i, lax.dynamic_slice_in_dim(kp, start, cfg.width, 2), i, g, tokens)
        v_band = lax.dynamic_slice_in_dim(vp, start, cfg.width, 2)
        def mix(p):
            return jnp.einsum("bhmk,bhkd->bhmd", p, v_band, precision=cfg.precision)
        acc = _tiles.accumulator(q_i, v.shape[-1])
        out, lse = _tiles.finish(_tiles.forward(_tiles.init(acc), s, mix))  # one tile: the band
        return _in_caller_layout(cfg, out), lse
    out, lse = lax.map(block, jnp.arange(cfg.n_q))
    out = _unblocked(cfg, out)
    return (out, _tiles.from_query_rows(cfg, lse, *q.shape[:3])), (q, k, v, tokens, out, lse)


def _backward(cfg, residuals, cotangents):
    q, k, v, tokens, out, lse = residuals  # lse: (n, b, h, rows)
    d_out = cotangents[0]  # the lse's is not read: it has no gradient
    g = q.shape[2]
    delta = _tiles.query_rows(cfg, jnp.sum(d_out * out, axis=-1))  # rowsum(dO * O) = rowsum(dP * P)
    qs, dos = _queries(cfg, q), _queries(cfg, d_out)
    kp, vp = _padded_keys(cfg, k, 2), _padded_keys(cfg, v, 2)  # (b, h, padded, d)
    kt = jnp.swapaxes(kp, 2, 3)  # (b, h, d, padded): dQ^T = K^T dS^T as stored
    # On transposed scores S^T, as ``_blockwise``'s backward: every product takes its operands as stored.
    def block(carry, args):
        dk, dv = carry
        i, lse_i, delta_i = args
        start = i * cfg.block_q
        q_i, do_i = _block_rows(cfg, qs, i), _block_rows(cfg, dos, i)
        v_band = lax.dynamic_slice_in_dim(vp, start, cfg.width, 2)
        st = _scores(cfg, q_i, lax.dynamic_slice_in_dim(kp, start, cfg.width, 2), i, g, tokens, transposed=True)
        dpt = jnp.einsum("bhkd,bhmd->bhkm", v_band, do_i, precision=cfg.precision)
        pt, _, dst = _tiles.backward(st, lse_i[:, :, None, :], delta_i[:, :, None, :], dpt)
        dst = dst * jnp.asarray(cfg.scale, pt.dtype)  # of the unscaled products
        kt_band = lax.dynamic_slice_in_dim(kt, start, cfg.width, 3)
        dqt_i = jnp.einsum("bhdk,bhkm->bhdm", kt_band, dst, precision=cfg.precision)
        dk_band = jnp.einsum("bhkm,bhmd->bhkd", dst, q_i, precision=cfg.precision)
        dv_band = jnp.einsum("bhkm,bhmd->bhkd", pt, do_i, precision=cfg.precision)
        dk = lax.dynamic_update_slice_in_dim(dk, lax.dynamic_slice_in_dim(dk, start, cfg.width, 2) + dk_band, start, 2)
        dv = lax.dynamic_update_slice_in_dim(dv, lax.dynamic_slice_in_dim(dv, start, cfg.width, 2) + dv_band, start, 2)
        return (dk, dv), _in_caller_layout(cfg, jnp.swapaxes(dqt_i, 2, 3))
    (dk, dv), dq = lax.scan(block, (jnp.zeros_like(kp), jnp.zeros_like(vp)), (jnp.arange(cfg.n_q), lse, delta))
    dq = _unblocked(cfg, dq)
    def keys(x):  # the padded keys' gradient -> the keys'
        x = lax.slice_in_dim(x, cfg.left, min(x.shape[2], cfg.left + cfg.kv_len), axis=2)
        return jnp.pad(x, ((0, 0), (0, 0), (0, cfg.kv_len - x.shape[2]), (0, 0)))
    return dq, keys(dk), keys(dv), None


_band.defvjp(_forward, _backward)
