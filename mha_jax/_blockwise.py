"""Blockwise (flash-style) attention in pure JAX: online softmax over key blocks, custom VJP from the saved lse.

Blocks are classed whole (unmasked), partial or empty (skipped). The backward works on ``S^T = K Q^T``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from mha_jax import _band, _mesh, _tiles, _tuning, masks
from mha_spec import terms as _terms
from mha_spec.terms import Terms, Where

_BLOCK_SCORES = 1 << 22  # the most scores of one block (batch x heads x rows x keys): 16 MiB of float32


@dataclass(frozen=True)
class Config:
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    causal: bool
    window: tuple[int, int] | None
    scale: float
    keep_scale: float
    dropout_rate: float
    precision: lax.PrecisionLike
    soft_cap: float | None = None
    band: tuple[int, int, int] | None = None  # (block, left, right): computed by ``_band``
    chunk_size: int | None = None
    backward_blocks: tuple[int, int] | None = None  # (block_q, block_k) of the backward; None: ``block_sizes``'

    @property
    def n_q(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.kv_len // self.block_k)


# The blocks' caps (query rows over all groups, keys) by (backward, causal): causal blocks waste less when finer.
_CAPS = {(False, False): (1024, 512), (False, True): (512, 256), (True, False): (512, 1024), (True, True): (512, 512)}


def block_sizes(q_len: int, kv_len: int, batch_heads: int = 8, groups: int = 1, causal: bool = False,
                backward: bool = False) -> tuple[int, int]:
    """(query, key) blocks: powers of two up to ``_CAPS``, halved (down to 64) until they fit ``_BLOCK_SCORES``;
    a symbolic size counts as a long length, or as 8 batch x heads."""
    cap_q, cap_k = _CAPS[backward, causal]
    cap_q = max(cap_q // groups, 8)
    q_len, kv_len = (n if isinstance(n, int) else cap for n, cap in ((q_len, cap_q), (kv_len, cap_k)))
    batch_heads = batch_heads if isinstance(batch_heads, int) else 8
    block_q, block_k = (min(cap, max(8, 1 << (n - 1).bit_length())) for n, cap in ((q_len, cap_q), (kv_len, cap_k)))
    while batch_heads * groups * block_q * block_k > _BLOCK_SCORES and max(block_q, block_k) > 64:
        if block_q * groups >= block_k:
            block_q //= 2
        else:
            block_k //= 2
    return block_q, block_k


def run(query, key, value, *, spec, scale, soft_cap, sinks, keep, rng, dropout_rate, keep_scale, precision, compute,
        residual=False):
    """(output ``(batch, q_len, heads, v_head_dim)``, None, lse ``(batch, q_len, heads)`` or None) of the public
    layout's inputs."""
    batch, heads, q_len, kv_len = spec.shape
    kv_heads, head_dim = key.shape[2], query.shape[3]
    groups = heads // kv_heads
    q = query.astype(compute).reshape(batch, q_len, kv_heads, groups, head_dim)
    k, v = key.astype(compute), value.astype(compute)
    causal = spec.is_causal or spec.window is not None
    blocks = _tuning.current().blocks or block_sizes(q_len, kv_len, batch * kv_heads, groups, causal)
    out = attention(
        q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), spec,
        allowed=_tiles.grouped(spec.allowed, kv_heads), bias=_tiles.grouped(spec.bias, kv_heads),
        keep=_tiles.grouped(keep, kv_heads), dropout_rng=rng, scale=scale, dropout_rate=dropout_rate,
        keep_scale=keep_scale, precision=precision, block_q=blocks[0], block_k=blocks[1], soft_cap=soft_cap,
        sinks=None if sinks is None else sinks.astype(compute).reshape(1, kv_heads, groups), residual=residual,
    )
    lse = None
    if residual:  # (batch, kv_heads, groups, q_len) -> (batch, q_len, heads)
        out, lse = out
        lse = _tiles.residual(lse, _tiles.no_key_residual(lse.dtype)).transpose(0, 3, 1, 2).reshape(query.shape[:3])
    return out.transpose(0, 3, 1, 2, 4).reshape(query.shape[:3] + value.shape[3:]), None, lse


def attention(q, k, v, spec: masks.Spec, *, allowed, bias, keep, dropout_rng, scale, dropout_rate,
              keep_scale, precision, block_q, block_k, soft_cap=None, sinks=None, residual=False):
    """Output ``(batch, kv_heads, groups, q_len, v_head_dim)`` in ``q.dtype`` (``residual``: and its lse ``(batch,
    kv_heads, groups, q_len)``, ``_tiles.finish``'s); ``allowed``, ``keep``, ``bias``: None or 5-d; ``dropout_rng``
    draws a keep-mask per block; ``sinks``: ``(1, kv_heads, groups)`` or None."""
    if q.shape[3] == 0:  # no query: nothing to visit (and no block to slice one from)
        out = _tiles.accumulator(q, v.shape[-1])
        return (out, out[..., 0]) if residual else out
    plain = all(x is None for x in (allowed, bias, keep, dropout_rng, sinks, soft_cap))
    b, h, g = q.shape[:3]
    bands = _band.band(q.shape[3], k.shape[2], b * h, g, spec.terms) if plain and spec.default_positions else None
    cfg = Config(block_q, block_k, q.shape[3], k.shape[2], spec.is_causal, spec.window, scale, keep_scale,
                 dropout_rate, precision, soft_cap, bands, spec.chunk_size, _tuning.current().backward_blocks)
    _tuning.observe("blocks", (block_q, block_k))
    slopes = None if spec.alibi_slopes is None else spec.alibi_slopes.reshape(-1, h, g, 1, 1)  # (b|1, h, g, 1, 1)
    positions = masks.positions(spec) if "position" in spec.terms.reads or slopes is not None else (None, None)
    tokens = _tiles.Tokens(*positions, spec.query_segment_ids, spec.key_segment_ids, spec.lengths, slopes)
    args = (q, k, v, allowed, bias, keep, sinks, dropout_rng, tokens)
    explicit = tuple(getattr(jax.sharding.get_abstract_mesh(), "explicit_axes", ()))
    if not explicit:
        out, lse = _run(cfg, *args)
        return (out, lse) if residual else out
    # Only batch and heads sharded, no drawn dropout: each device runs its own share; else the axes go automatic.
    out_spec = jax.typeof(q).sharding.spec
    batch, heads = _mesh.names(out_spec[0]), _mesh.names(out_spec[1])
    if dropout_rng is None and (batch or heads) and not any(_mesh.names(e) for e in out_spec[2:]):
        n, kv_heads = q.shape[:2]
        def place(x, has_heads):  # the batch (where not broadcast) and the key/value heads split
            entries = [batch if x.shape[0] == n else None] + [None] * (x.ndim - 1)
            if has_heads and x.shape[1] == kv_heads:
                entries[1] = heads
            return P(*(e or None for e in entries))
        specs = (*(None if x is None else place(x, True) for x in args[:7]), None,
                 jax.tree.map(lambda x: place(x, False), tokens)._replace(
                     slopes=None if slopes is None else place(slopes, True)))
        placed = P(batch or None, heads or None)
        out, lse = _mesh.per_device(functools.partial(_run, cfg), args, specs, (placed, placed))
        out, lse = ((x if jax.typeof(x).sharding.spec == want else jax.sharding.reshard(x, want))
                    for x, want in ((out, out_spec), (lse, P(*out_spec[:4]))))
        return (out, lse) if residual else out
    out, lse = jax.sharding.auto_axes(functools.partial(_run, cfg), axes=explicit,
                                      out_sharding=(out_spec, P(*out_spec[:4])))(*args)
    return (out, lse) if residual else out


def _run(cfg, q, k, v, allowed, bias, keep, sinks, rng, tokens):
    # varying over every manual axis any input varies over: the loops' carries start from them, and each
    # gradient then has its input's type
    leaves = jax.tree.leaves(((q, k, v, bias, sinks), (allowed, keep, rng, tokens)))
    axes = frozenset().union(*(_mesh.vma(x) for x in leaves))
    def vary(x):
        missing = tuple(sorted(axes - _mesh.vma(x)))
        return _mesh.to_varying(x, missing) if missing else x
    q, k, v, bias, sinks = (None if x is None else vary(x) for x in (q, k, v, bias, sinks))
    if cfg.band is not None:
        block, left, right = cfg.band
        return _band.attention(q, k, v, tokens, _conjunction(cfg, tokens), block=block, left=left, right=right,
                               scale=cfg.scale, precision=cfg.precision)
    return _flash(cfg, q, k, v, allowed, bias, keep, sinks, rng, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, allowed, bias, keep, sinks, rng, tokens):
    """(output, lse); the lse has no gradient (its cotangent is not read)."""
    return _forward(cfg, q, k, v, allowed, bias, keep, sinks, rng, tokens)[0]


def _axes(transposed):
    """(query axis, key axis) of ``(b, h, g, block_q, block_k)``, or transposed ``(b, h, block_k, g, block_q)``."""
    return (4, 2) if transposed else (3, 4)


def _tile(cfg, x, i, j, transposed):
    """Block (i, j) of a padded mask, bias or keep-mask or None (its broadcast axes left whole)."""
    for axis, index, size in zip(_axes(transposed), (i, j), (cfg.block_q, cfg.block_k)):
        if x is not None and x.shape[axis] != 1:
            x = lax.dynamic_slice_in_dim(x, index * size, size, axis)
    return x


def _pad_masks(cfg, arrays):
    return [_tiles.pad(_tiles.pad(m, 3, cfg.n_q * cfg.block_q, True), 4, cfg.n_k * cfg.block_k, True) for m in arrays]


def _scores(cfg, s, i, j, allowed, tokens: _tiles.Tokens, bias, block5, transposed, partial):
    """(scores, tanh of the cap) of block (i, j) from products ``s`` (``_axes`` layout); a partial block is masked
    by the terms, the mask and (forward only: ``_tiles.backward`` clamps) the key padding."""
    bias = _tile(cfg, bias, i, j, transposed)
    slopes = tokens.slopes if tokens.slopes is None or not transposed else jnp.moveaxis(tokens.slopes, 4, 2)
    if not partial and slopes is None:
        return _tiles.scores(s, block5, soft_cap=cfg.soft_cap, bias=bias)
    q_axis, k_axis = _axes(transposed)
    shape = [1] * 5
    shape[q_axis], shape[k_axis] = cfg.block_q, cfg.block_k
    cols = j * cfg.block_k + lax.broadcasted_iota(jnp.int32, shape, k_axis)
    padding = cols < cfg.kv_len if cfg.kv_len % cfg.block_k and not transposed else None
    def along(x, axis, index, size):  # block ``index`` of a padded (b|1, len) term, laid along ``axis``
        if x is None:
            return None
        layout = [x.shape[0], 1, 1, 1, 1]
        layout[axis] = size
        return lax.dynamic_slice_in_dim(x, index * size, size, 1).reshape(layout)
    t = tokens
    q = Where(along(t.query_positions, q_axis, i, cfg.block_q), along(t.query_segments, q_axis, i, cfg.block_q))
    k = Where(along(t.key_positions, k_axis, j, cfg.block_k), along(t.key_segments, k_axis, j, cfg.block_k), cols,
              None if t.lengths is None else t.lengths.reshape(-1, 1, 1, 1, 1))
    conditions = _conjunction(cfg, tokens) if partial else None
    dense = (padding, _tile(cfg, allowed, i, j, transposed)) if partial else ()
    return _tiles.scores(s, block5, soft_cap=cfg.soft_cap, bias=bias, terms=conditions, q=q, k=k, masks=dense,
                         alibi=slopes)


def _edge_padded(x, n, block):
    """A ``(b|1, len)`` term padded to ``n`` whole blocks, its last entry repeated (None for None)."""
    return None if x is None else jnp.pad(x, ((0, 0), (0, n * block - x.shape[1])), mode="edge")


def _ranges(x, block, n):
    """(min, max) over each block of a ``(b|1, len)`` term: ``(b|1, n)`` each (None for None)."""
    if x is None:
        return None
    x = _edge_padded(x, n, block).reshape(x.shape[0], n, block)
    return x.min(axis=2), x.max(axis=2)


def _pad_tokens(cfg, t: _tiles.Tokens) -> _tiles.Tokens:
    """Positions and segment ids padded to whole blocks (``_edge_padded``); lengths and slopes as they are."""
    return t._replace(query_positions=_edge_padded(t.query_positions, cfg.n_q, cfg.block_q),
                      key_positions=_edge_padded(t.key_positions, cfg.n_k, cfg.block_k),
                      query_segments=_edge_padded(t.query_segments, cfg.n_q, cfg.block_q),
                      key_segments=_edge_padded(t.key_segments, cfg.n_k, cfg.block_k))


def _conjunction(cfg, tokens: _tiles.Tokens) -> Terms:
    """The structured terms of ``cfg`` and of the ``tokens`` given (segments, lengths)."""
    return _terms.of(cfg.causal, cfg.window, cfg.chunk_size, tokens.query_segments is not None,
                     tokens.lengths is not None)


def classes(cfg, allowed, tokens: _tiles.Tokens, padding):
    """(whole, live) bool ``(n_q, n_k)``: live where some score may be visible, whole where all are (no mask
    needed); with ``padding`` the last key block's padding counts as masked."""
    t = tokens
    q_pos, k_pos = _ranges(t.query_positions, cfg.block_q, cfg.n_q), _ranges(t.key_positions, cfg.block_k, cfg.n_k)
    q_ids, k_ids = _ranges(t.query_segments, cfg.block_q, cfg.n_q), _ranges(t.key_segments, cfg.block_k, cfg.n_k)
    start = jnp.arange(cfg.n_k)[None, None, :] * cfg.block_k  # each key block's first index
    length = None if t.lengths is None else t.lengths[:, None, None]
    def at(ranges, end, axis):  # the blocks' lows (end 0) or highs (1), laid as (b|1, n_q, n_k)
        return None if ranges is None else jnp.expand_dims(ranges[end], axis)
    queries = (Where(at(q_pos, e, 2), at(q_ids, e, 2)) for e in (0, 1))
    keys = (Where(at(k_pos, e, 1), at(k_ids, e, 1), start + e * (cfg.block_k - 1), length) for e in (0, 1))
    block = _conjunction(cfg, tokens).block(*queries, *keys)
    whole = live = jnp.ones((1, cfg.n_q, cfg.n_k), bool)  # (b|1, n_q, n_k)
    if block[0] is not None:
        whole, live = whole & block[0], live & block[1]
    whole, live = whole.all(axis=0), live.any(axis=0)
    if allowed is not None:
        some, every = _mask_blocks(cfg, allowed)
        whole, live = whole & every, live & some
    if padding and cfg.kv_len % cfg.block_k:
        whole = whole.at[:, -1].set(False)
    return whole & live, live


def _mask_blocks(cfg, allowed):
    """(any, all) of a boolean 5-d mask over each block and every batch element and head."""
    some, every = allowed.any(axis=(0, 1, 2)), allowed.all(axis=(0, 1, 2))
    def blocks(x, fill, reduce):
        if x.shape[0] != 1:
            x = jnp.pad(x, ((0, cfg.n_q * cfg.block_q - x.shape[0]), (0, 0)), constant_values=fill)
            x = reduce(x.reshape(cfg.n_q, cfg.block_q, x.shape[1]), axis=1)
        if x.shape[1] != 1:
            x = jnp.pad(x, ((0, 0), (0, cfg.n_k * cfg.block_k - x.shape[1])), constant_values=fill)
            x = reduce(x.reshape(x.shape[0], cfg.n_k, cfg.block_k), axis=2)
        return x
    return blocks(some, False, jnp.any), blocks(every, True, jnp.all)


def schedule(whole, live):
    """Per row: (block order whole, partial, empty; number of whole blocks; of live blocks)."""
    rank = jnp.where(whole, 0, jnp.where(live, 1, 2))
    order = jnp.argsort(rank, axis=1, stable=True).astype(jnp.int32)
    return order, whole.sum(axis=1, dtype=jnp.int32), live.sum(axis=1, dtype=jnp.int32)


def _keep(cfg, keep, rng, i, j, b, h, g, transposed):
    """Block (i, j)'s keep-mask or None: a tile of ``keep``, or drawn from ``rng`` in the forward's layout."""
    if keep is not None:
        return _tile(cfg, keep, i, j, transposed)
    if rng is None:
        return None
    key = jax.random.fold_in(jax.random.fold_in(rng, i), j)
    drawn = jax.random.bernoulli(key, 1.0 - cfg.dropout_rate, (b, h, g, cfg.block_q, cfg.block_k))
    return jnp.moveaxis(drawn, 4, 2) if transposed else drawn


def _forward(cfg, q, k, v, allowed, bias, keep, sinks, rng, tokens):
    b, h, g, _, d = q.shape
    q_blocks = _tiles.query_rows(cfg, q * jnp.asarray(cfg.scale, q.dtype))  # (n_q, b, h, rows, d)
    kt_blocks = jnp.swapaxes(_tiles.key_rows(cfg, k), 3, 4)  # (n_k, b, h, d, block_k)
    v_blocks = _tiles.key_rows(cfg, v)
    allowed_p, bias_p, keep_p = _pad_masks(cfg, (allowed, bias, keep))
    tokens_p = _pad_tokens(cfg, tokens)
    order, n_whole, n_live = schedule(*classes(cfg, allowed, tokens, padding=True))
    block5 = (b, h, g, cfg.block_q, cfg.block_k)
    # (1, h, g * block_q): each query head's sink along the rows of a query block
    sink_rows = None if sinks is None else jnp.repeat(sinks, cfg.block_q, axis=2)
    def query_block(args):
        i, q_i, order_i, whole_i, live_i = args
        def key_step(t, state, partial):
            j = order_i[t]
            s = jnp.einsum("bhmd,bhdk->bhmk", q_i, kt_blocks[j], precision=cfg.precision)
            s = _scores(cfg, s, i, j, allowed_p, tokens_p, bias_p, block5, False, partial)[0]
            def mix(p):
                return jnp.einsum("bhmk,bhkd->bhmd", p, v_blocks[j], precision=cfg.precision)
            block_keep = _keep(cfg, keep_p, rng, i, j, b, h, g, False)
            return _tiles.forward(state, s, mix, block_keep, cfg.keep_scale, block5)
        state = lax.fori_loop(0, whole_i, functools.partial(key_step, partial=False),
                              _tiles.init(_tiles.accumulator(q_i, v.shape[-1]), sink_rows))
        return _tiles.finish(lax.fori_loop(whole_i, live_i, functools.partial(key_step, partial=True), state))
    out, lse = lax.map(query_block, (jnp.arange(cfg.n_q), q_blocks, order, n_whole, n_live))
    out, lse = _tiles.from_query_rows(cfg, out, b, h, g), _tiles.from_query_rows(cfg, lse, b, h, g)
    return (out, lse), (q, k, v, allowed, bias, keep, sinks, rng, tokens, out, lse)


# The backward's query blocks ``(n_q, b, h, rows, ...)``, padded transposed masks and padded tokens.
_Transposed = collections.namedtuple("_Transposed", "qs qst do dot lse delta allowed bias keep tokens")


def _flash_bwd(cfg, residuals, cotangents):
    q, k, v, allowed, bias, keep, sinks, rng, tokens, out, lse = residuals
    d_out = cotangents[0]  # the lse's is not read: it has no gradient
    b, h, g, _, d = q.shape
    if rng is None:  # a drawn dropout mask is tied to the forward's blocks; otherwise re-block
        causal = cfg.causal or cfg.window is not None
        sizes = cfg.backward_blocks or block_sizes(cfg.q_len, cfg.kv_len, b * h, g, causal, backward=True)
        cfg = dataclasses.replace(cfg, block_q=sizes[0], block_k=sizes[1])
    delta = jnp.sum(d_out * out, axis=-1)  # rowsum(dO * O) = rowsum(dP * P), dropout included
    qs_blocks, do_blocks = _tiles.query_rows(cfg, q * jnp.asarray(cfg.scale, q.dtype)), _tiles.query_rows(cfg, d_out)
    masks_t = (None if m is None else jnp.moveaxis(m, 4, 2) for m in _pad_masks(cfg, (allowed, bias, keep)))
    blocks = _Transposed(qs_blocks, jnp.swapaxes(qs_blocks, 3, 4), do_blocks, jnp.swapaxes(do_blocks, 3, 4),
                         _tiles.query_rows(cfg, lse), _tiles.query_rows(cfg, delta), *masks_t, _pad_tokens(cfg, tokens))
    k_blocks, v_blocks = _tiles.key_rows(cfg, k), _tiles.key_rows(cfg, v)  # (n_k, b, h, block_k, d)
    whole, live = classes(cfg, allowed, tokens, padding=False)
    order, n_whole, n_live = schedule(whole.T, live.T)  # per key block, over query blocks
    def key_block(carry, args):
        dqt, d_bias = carry
        j, k_j, v_j, kt_j, order_j, whole_j, live_j = args
        def query_step(t, grads, partial):
            return _backward_tile(cfg, blocks, rng, order_j[t], j, (k_j, v_j, kt_j), grads, partial)
        grads = (dqt, jnp.zeros_like(k_j), jnp.zeros_like(v_j), d_bias)
        grads = lax.fori_loop(0, whole_j, functools.partial(query_step, partial=False), grads)
        dqt, dk_j, dv_j, d_bias = lax.fori_loop(whole_j, live_j, functools.partial(query_step, partial=True), grads)
        return (dqt, d_bias), (dk_j, dv_j)
    d_bias0 = None if bias is None else jnp.zeros_like(blocks.bias, q.dtype)
    xs = (jnp.arange(cfg.n_k), k_blocks, v_blocks, jnp.swapaxes(k_blocks, 3, 4), order, n_whole, n_live)
    (dqt, d_bias), (dk, dv) = lax.scan(key_block, (jnp.zeros_like(blocks.qst), d_bias0), xs)
    dq = _tiles.from_query_rows(cfg, jnp.swapaxes(dqt, 3, 4) * jnp.asarray(cfg.scale, q.dtype), b, h, g)
    def keys(x):  # (n_k, b, h, block_k, d) -> (b, h, kv_len, d), d the key's or the value's
        return jnp.moveaxis(x, 0, 2).reshape(b, h, cfg.n_k * cfg.block_k, x.shape[-1])[:, :, : cfg.kv_len]
    if d_bias is not None:
        d_bias = jnp.moveaxis(d_bias, 2, 4)[..., : bias.shape[3], : bias.shape[4]].astype(bias.dtype)
    d_sinks = None
    if sinks is not None:
        d_sinks = _tiles.sink_gradient(sinks[..., None], lse, delta).reshape(sinks.shape).astype(sinks.dtype)
    return dq, keys(dk), keys(dv), None, d_bias, None, d_sinks, None, None


def _backward_tile(cfg, blocks: _Transposed, rng, i, j, key_block, grads, partial):
    """``grads`` (dQ^T, dK_j, dV_j, transposed d_bias or None) plus block (i, j)'s share; ``key_block``: K, V, K^T."""
    dqt, dk_j, dv_j, d_bias = grads
    k_j, v_j, kt_j = key_block
    b, h, block_k = k_j.shape[:3]
    g = blocks.qs.shape[3] // cfg.block_q
    block5_t = (b, h, block_k, g, cfg.block_q)
    st = jnp.einsum("bhkd,bhdm->bhkm", k_j, blocks.qst[i], precision=cfg.precision)
    st, tanh_t = _scores(cfg, st, i, j, blocks.allowed, blocks.tokens, blocks.bias, block5_t, True, partial)
    dpt = jnp.einsum("bhkd,bhdm->bhkm", v_j, blocks.dot[i], precision=cfg.precision)
    block_keep = _keep(cfg, blocks.keep, rng, i, j, b, h, g, True)
    pt_used, ds_bias, dst = _tiles.backward(st, blocks.lse[i][:, :, None, :], blocks.delta[i][:, :, None, :], dpt,
                                            tanh_t, block_keep, cfg.keep_scale, block5_t)
    dv_j = dv_j + jnp.einsum("bhkm,bhmd->bhkd", pt_used, blocks.do[i], precision=cfg.precision)
    if d_bias is not None:  # the transposed bias's
        q_axis, k_axis = _axes(True)
        tile = {q_axis: (i * cfg.block_q, cfg.block_q), k_axis: (j * cfg.block_k, cfg.block_k)}
        start, size = _tiles.bias_tile(d_bias.shape, tile)
        share = _tiles.bias_share(ds_bias.reshape(block5_t), d_bias.shape).astype(d_bias.dtype)
        d_bias = lax.dynamic_update_slice(d_bias, lax.dynamic_slice(d_bias, start, size) + share, start)
    dk_j = dk_j + jnp.einsum("bhkm,bhmd->bhkd", dst, blocks.qs[i], precision=cfg.precision)
    dqt_i = jnp.einsum("bhdk,bhkm->bhdm", kt_j, dst, precision=cfg.precision)
    return lax.dynamic_update_index_in_dim(dqt, dqt[i] + dqt_i, i, 0), dk_j, dv_j, d_bias


_flash.defvjp(_forward, _flash_bwd)  # the forward's residuals are what the backward reads
