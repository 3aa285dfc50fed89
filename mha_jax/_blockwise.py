"""Blockwise (flash-style) attention in pure JAX: memory linear in length.

Queries are processed in blocks; for each, an online softmax runs over key blocks, so no
``(q_len, kv_len)`` matrix is ever formed. A custom VJP recomputes each block's scores in the
backward pass from the saved row log-sum-exp instead of storing them. Key blocks that a causal
mask empties entirely are never visited, in either pass.

Internal layout: query ``(batch, kv_heads, groups, q_len, head_dim)``, key/value
``(batch, kv_heads, kv_len, head_dim)``; masks keep their own (broadcast) shape
``(batch|1, kv_heads|1, groups|1, q_len|1, kv_len|1)`` and are sliced per block.
"""

from __future__ import annotations

import functools
import math
import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class _Config:
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    causal: bool
    scale: float
    keep_scale: float
    dropout_rate: float
    precision: lax.PrecisionLike

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.kv_len // self.block_k)


def _fit(n: int, cap: int) -> int:
    return min(cap, max(8, 1 << (n - 1).bit_length()))


def block_sizes(q_len: int, kv_len: int) -> tuple[int, int]:
    """Forward blocks: 512 queries x 256 keys, smaller for short inputs.

    Chosen by timing on a 2-core CPU (B=1, H=8, head_dim=64, length 4096, one run): 512x256
    was the fastest of 256x512, 512x512, 1024x512, 1024x1024, 128x4096, 1024x256, 512x128.
    """
    return _fit(q_len, 512), _fit(kv_len, 256)


def backward_block_sizes(q_len: int, kv_len: int) -> tuple[int, int]:
    """Backward blocks (when no drawn dropout mask ties them to the forward's): 256 x 512,
    the fastest of 256x512, 128x512, 256x256, 512x512, 1024x256, 4096x128 in the same kind of run."""
    return _fit(q_len, 256), _fit(kv_len, 512)


def attention(q, k, v, *, allowed, bias, keep, dropout_rng, causal, scale, dropout_rate,
              keep_scale, precision, block_q, block_k):
    """Attention output ``(batch, kv_heads, groups, q_len, head_dim)`` in ``q.dtype``.

    ``allowed``/``keep`` (bool) and ``bias`` (float) are None or 5-d in the internal layout.
    ``dropout_rng`` draws a keep-mask per block (a stream of its own, not the plain path's).
    """
    cfg = _Config(block_q, block_k, q.shape[3], k.shape[2], causal, scale, keep_scale,
                  dropout_rate, precision)
    return _flash(cfg, q, k, v, allowed, bias, keep, dropout_rng)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, allowed, bias, keep, rng):
    return _forward(cfg, q, k, v, allowed, bias, keep, rng)[0]


def _pad(x, axis, size, broadcast=False):
    """Zero-pad ``axis`` to ``size``; with ``broadcast``, an axis of 1 (a mask broadcast along
    it) stays as it is."""
    if x is None or x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _block(x, axis, index, size):
    """Block ``index`` of ``x`` along ``axis``, or ``x`` itself where that axis is broadcast."""
    if x is None or x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _scores(cfg, q_i, k_j, i, j, allowed, bias, keep, rng):
    """Scaled, masked scores ``(b, h, g, bq, bk)`` of query block i and key block j, and the
    dropout keep-mask of that block (or None)."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j, precision=cfg.precision) * cfg.scale
    if bias is not None:
        s = s + _block(_block(bias, 3, i, cfg.block_q), 4, j, cfg.block_k).astype(s.dtype)
    # Each mask term is added only where it can exclude something: elementwise passes over the
    # block are what this kernel spends its time on, beside the two matrix products.
    ok = None
    if cfg.kv_len % cfg.block_k:  # the padding of the last key block
        cols = j * cfg.block_k + lax.broadcasted_iota(jnp.int32, (1, cfg.block_k), 1)
        ok = cols < cfg.kv_len
    if cfg.causal:
        rows = i * cfg.block_q + lax.broadcasted_iota(jnp.int32, (cfg.block_q, cfg.block_k), 0)
        cols = j * cfg.block_k + lax.broadcasted_iota(jnp.int32, (cfg.block_q, cfg.block_k), 1)
        ok = _and(ok, cols <= rows)
    if allowed is not None:
        ok = _and(ok, _block(_block(allowed, 3, i, cfg.block_q), 4, j, cfg.block_k))
    if ok is not None:
        s = jnp.where(ok, s, -jnp.inf)
    block_keep = None
    if keep is not None:
        block_keep = _block(_block(keep, 3, i, cfg.block_q), 4, j, cfg.block_k)
    elif rng is not None:
        key = jax.random.fold_in(jax.random.fold_in(rng, i), j)
        block_keep = jax.random.bernoulli(key, 1.0 - cfg.dropout_rate, s.shape)
    return s, block_keep


def _and(a, b):
    return b if a is None else a & b


def _key_blocks(cfg, i):
    """Key blocks that query block i can see: all, or (causal) those up to its last query."""
    if not cfg.causal:
        return cfg.n_k
    last_query = jnp.minimum((i + 1) * cfg.block_q, cfg.q_len) - 1
    return jnp.minimum(last_query // cfg.block_k + 1, cfg.n_k)


def _prepare(cfg, q, k, v, masks):
    """Pad q/k/v and masks to whole blocks; split q and k/v into blocks along the length."""
    b, h, g, _, d = q.shape
    qp = _pad(q, 3, cfg.n_q * cfg.block_q).reshape(b, h, g, cfg.n_q, cfg.block_q, d)
    kp = _pad(k, 2, cfg.n_k * cfg.block_k).reshape(b, h, cfg.n_k, cfg.block_k, d)
    vp = _pad(v, 2, cfg.n_k * cfg.block_k).reshape(b, h, cfg.n_k, cfg.block_k, d)
    masks = [_pad(_pad(m, 3, cfg.n_q * cfg.block_q, True), 4, cfg.n_k * cfg.block_k, True) for m in masks]
    return jnp.moveaxis(qp, 3, 0), jnp.moveaxis(kp, 2, 0), jnp.moveaxis(vp, 2, 0), masks


def _forward(cfg, q, k, v, allowed, bias, keep, rng):
    compute = q.dtype
    q_blocks, k_blocks, v_blocks, (allowed_p, bias_p, keep_p) = _prepare(cfg, q, k, v, (allowed, bias, keep))
    b, h, g, _, d = q.shape

    def query_block(args):
        i, q_i = args

        def key_step(j, carry):
            m, l, acc = carry
            s, block_keep = _scores(cfg, q_i, k_blocks[j], i, j, allowed_p, bias_p, keep_p, rng)
            m_new = jnp.maximum(m, s.max(axis=-1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(m - shift)
            l = alpha * l + p.sum(axis=-1)
            if block_keep is not None:
                p = jnp.where(block_keep, p * cfg.keep_scale, 0.0)
            pv = jnp.einsum("bhgqk,bhkd->bhgqd", p, v_blocks[j], precision=cfg.precision)
            return m_new, l, alpha[..., None] * acc + pv

        shape = (b, h, g, cfg.block_q)
        init = (jnp.full(shape, -jnp.inf, compute), jnp.zeros(shape, compute),
                jnp.zeros(shape + (d,), compute))
        m, l, acc = lax.fori_loop(0, _key_blocks(cfg, i), key_step, init)
        out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
        # A row with no allowed key keeps lse = +inf, so that exp(s - lse) = 0 when recomputed.
        lse = jnp.where(l > 0.0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(l > 0.0, l, 1.0)), jnp.inf)
        return out, lse

    out, lse = lax.map(query_block, (jnp.arange(cfg.n_q), q_blocks))
    out = jnp.moveaxis(out, 0, 3).reshape(b, h, g, cfg.n_q * cfg.block_q, d)[:, :, :, : cfg.q_len]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, h, g, cfg.n_q * cfg.block_q)[..., : cfg.q_len]
    return out, (q, k, v, allowed, bias, keep, rng, out, lse)


def _flash_fwd(cfg, q, k, v, allowed, bias, keep, rng):
    return _forward(cfg, q, k, v, allowed, bias, keep, rng)


def _flash_bwd(cfg, residuals, d_out):
    q, k, v, allowed, bias, keep, rng, out, lse = residuals
    if rng is None:  # a drawn dropout mask is tied to the forward's blocks; otherwise re-block
        cfg = dataclasses.replace(cfg, **dict(zip(("block_q", "block_k"), backward_block_sizes(cfg.q_len, cfg.kv_len))))
    b, h, g, _, d = q.shape
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O) = rowsum(dP * P), dropout included

    def rows(x):  # (b, h, g, q_len, ...) -> blocks of queries, (n_q, b, h, g, block_q, ...)
        x = _pad(x, 3, cfg.n_q * cfg.block_q)
        return jnp.moveaxis(x.reshape(x.shape[:3] + (cfg.n_q, cfg.block_q) + x.shape[4:]), 3, 0)

    do_blocks, delta_blocks, lse = rows(d_out), rows(delta), rows(lse)
    q_blocks, k_blocks, v_blocks, (allowed_p, bias_p, keep_p) = _prepare(cfg, q, k, v, (allowed, bias, keep))
    d_bias0 = None if bias is None else jnp.zeros(bias_p.shape, q.dtype)

    def key_block(carry, args):
        dq, d_bias = carry
        j, k_j, v_j = args

        def query_step(i, inner):
            dq, dk_j, dv_j, d_bias = inner
            q_i = q_blocks[i]
            s, block_keep = _scores(cfg, q_i, k_j, i, j, allowed_p, bias_p, keep_p, rng)
            p = jnp.exp(s - lse[i][..., None])
            do_i = do_blocks[i]
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j, precision=cfg.precision)
            if block_keep is not None:
                p_used = jnp.where(block_keep, p * cfg.keep_scale, 0.0)
                dp = jnp.where(block_keep, dp * cfg.keep_scale, 0.0)
            else:
                p_used = p
            dv_j = dv_j + jnp.einsum("bhgqk,bhgqd->bhkd", p_used, do_i, precision=cfg.precision)
            ds = p * (dp - delta_blocks[i][..., None])
            if d_bias is not None:
                d_bias = _add_block(d_bias, ds, i, j, cfg)
            ds = ds * cfg.scale
            dk_j = dk_j + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i, precision=cfg.precision)
            dq_i = jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_j, precision=cfg.precision)
            dq = lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)
            return dq, dk_j, dv_j, d_bias

        first = (j * cfg.block_k) // cfg.block_q if cfg.causal else 0  # earlier queries see none of block j
        zeros = jnp.zeros((b, h, cfg.block_k, d), q.dtype)
        dq, dk_j, dv_j, d_bias = lax.fori_loop(first, cfg.n_q, query_step, (dq, zeros, zeros, d_bias))
        return (dq, d_bias), (dk_j, dv_j)

    dq0 = jnp.zeros_like(q_blocks)
    (dq, d_bias), (dk, dv) = lax.scan(key_block, (dq0, d_bias0), (jnp.arange(cfg.n_k), k_blocks, v_blocks))
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape[:3] + (cfg.n_q * cfg.block_q, d))[:, :, :, : cfg.q_len]
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, h, cfg.n_k * cfg.block_k, d)[:, :, : cfg.kv_len]
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, h, cfg.n_k * cfg.block_k, d)[:, :, : cfg.kv_len]
    if d_bias is not None:
        d_bias = d_bias[..., : bias.shape[3], : bias.shape[4]].astype(bias.dtype)
    return dq, dk, dv, None, d_bias, None, None


def _add_block(d_bias, ds, i, j, cfg):
    """Add a block's score gradient into the bias gradient, summed over the bias's broadcast axes."""
    axes = tuple(a for a in range(5) if d_bias.shape[a] == 1 and ds.shape[a] != 1)
    ds = ds.sum(axis=axes, keepdims=True).astype(d_bias.dtype)
    start = [0, 0, 0, 0, 0]
    if d_bias.shape[3] != 1:
        start[3] = i * cfg.block_q
    if d_bias.shape[4] != 1:
        start[4] = j * cfg.block_k
    current = lax.dynamic_slice(d_bias, start, ds.shape)
    return lax.dynamic_update_slice(d_bias, current + ds, start)


_flash.defvjp(_flash_fwd, _flash_bwd)
