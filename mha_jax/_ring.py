"""Ring attention: the length sharded over one mesh axis; key/value blocks go round with ``ppermute``.

Zig-zag layout: of ``2n`` chunks, device ``i`` holds chunks ``i`` and ``2n - 1 - i`` (balanced under causality).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P

from mha_jax import _mesh, _tiles, _tuning, masks
from mha_spec.terms import Terms, Where, conjoin


@dataclasses.dataclass(frozen=True)
class _Config:
    axis: str
    size: int
    scale: float
    soft_cap: float | None
    terms: Terms  # the structured terms, read from the tokens' positions, segments and lengths
    precision: Any
    batch_axes: tuple[str, ...] = ()  # Explicit mesh axes sharding the batch, manual in the ring too
    head_axes: tuple[str, ...] = ()  # and the (key/value) heads
    explicit: bool = False  # the sequence axis is Explicit: the ring's inputs are resharded to its specs
    auto: bool = True  # the mesh has Auto axes: a batch or heads axis may be sharded where the ring cannot see it
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # (batch, heads, q_len, kv_len), globally
    dropout_rate: float = 0.0  # of drawn dropout (a "seed" among the dense terms)
    keep_scale: float = 1.0  # of kept weights, drawn or given
    uniform: str = "float32"  # the dtype in which jax.random.bernoulli draws: float64 under jax_enable_x64
    tile: int = 512  # the largest tile of queries (and of keys) a step scores at once (``Tuning.ring_tile``)

    def spec(self, *dims):
        """A PartitionSpec naming the axes of ``dims``: "b" batch, "s" sequence, "h" heads, None."""
        axes = dict(b=self.batch_axes or None, s=self.axis, h=self.head_axes or None)
        return P(*(None if d is None else axes[d] for d in dims))


# The ring's terms beside the tokens, by name (None: absent): ``allowed``, ``bias``, ``keep`` 5-d ``(b|1, kv_heads|1,
# groups|1, q|1, k|1)``, their rows in zig-zag order on a device; the device, example and key/value head indices
# (inputs: XLA's SPMD partitioner rejects ``axis_index`` when partly manual); drawn dropout's threefry ``seed`` and,
# on a device, each row's counters ``hi``, ``lo``.
Dense = collections.namedtuple("Dense", "allowed bias keep device examples kv_heads seed hi lo", defaults=(None,) * 9)


def check(sequence_axis, q_len: int, kv_len: int, *, dropout_rng, return_weights: bool, implementation,
          takes_ring: bool, return_residual: bool = False) -> int:
    """The axis's size, after refusing by name what a ring cannot run on or take."""
    if not isinstance(sequence_axis, str):
        raise TypeError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}")
    def refused(why: str, error=ValueError):
        return error(f"sequence_axis={sequence_axis!r} {why}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise refused(f"needs a mesh: call under jax.set_mesh(mesh), with a mesh that has an axis {sequence_axis!r}")
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sequence_axis not in sizes:
        raise refused(f"is not an axis of the mesh, whose axes are {sizes}")
    if sequence_axis in getattr(mesh, "manual_axes", ()):
        raise refused("is already manual here (inside jax.shard_map over it): call the attention outside shard_map, "
                      "or leave that axis out of the shard_map's axis_names")
    n = sizes[sequence_axis]
    if n == 1:
        raise refused(f"has size 1 in the mesh {sizes}: a ring needs 2 devices or more; pass sequence_axis=None")
    for name, length in (("q_len", q_len), ("kv_len", kv_len)):
        if length % (2 * n):
            raise refused(f"of size {n} needs {name} to be a multiple of 2 x {n} = {2 * n} (each device holds a "
                          f"front and a back chunk), got {name}={length}")
    if dropout_rng is not None:
        dtype, shape = getattr(dropout_rng, "dtype", None), tuple(getattr(dropout_rng, "shape", ()))
        typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
        # one key: typed of shape (), or raw uint32 of rank 1 (jax.random.PRNGKey)
        if not ((typed and shape == ()) or (not typed and dtype == jnp.uint32 and len(shape) == 1)):
            raise refused(f"with dropout_rate > 0 needs dropout_rng to be one PRNG key (jax.random.key(seed)), got "
                          f"{type(dropout_rng).__name__} with shape {shape} and dtype {dtype}",
                          ValueError if typed or dtype == jnp.uint32 else TypeError)  # a key of another shape, or none
    if return_weights:
        raise refused("does not take return_weights=True (the ring never forms them)")
    if return_residual:
        raise refused("does not take return_residual=True; use sequence_axis=None")
    if not takes_ring:
        raise refused(f"does not take implementation={implementation!r}; use None, 'xla' or 'blockwise' (the ring "
                      "computes each step itself)")
    return n


def run(query, key, value, *, axis: str, size: int, spec: masks.Spec, scale, soft_cap, sinks, keep, rng, dropout_rate,
        keep_scale, precision, compute, residual=False):
    """(output ``(batch, q_len, heads, v_head_dim)``, None, None) of the public layout's inputs, over the ring."""
    batch, heads, q_len, _ = spec.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    out = attention(
        query.reshape(batch, q_len, kv_heads, groups, query.shape[3]), key, value, spec, axis=axis, size=size,
        scale=scale, soft_cap=soft_cap, precision=precision,
        sinks=None if sinks is None else sinks.astype(compute).reshape(kv_heads, groups),
        allowed=_tiles.grouped(spec.allowed, kv_heads), bias=_tiles.grouped(spec.bias, kv_heads),
        keep=_tiles.grouped(keep, kv_heads), dropout_rng=rng, dropout_rate=dropout_rate, keep_scale=keep_scale,
    )
    return out.reshape(batch, q_len, heads, value.shape[3]), None, None


def attention(q, k, v, spec: masks.Spec, *, axis: str, size: int, scale: float, soft_cap, sinks, precision,
              allowed=None, bias=None, keep=None, dropout_rng=None, dropout_rate: float = 0.0, keep_scale: float = 1.0):
    """q ``(b, q_len, kv_heads, groups, d)``, k, v ``(b, kv_len, kv_heads, d|dv)`` -> ``(b, q_len, kv_heads, groups,
    dv)``; ``sinks`` ``(kv_heads, groups)`` or None; ``allowed``, ``keep``, ``bias`` None or 5-d."""
    # the Explicit mesh axes sharding q's batch and heads: manual in the ring's ``shard_map`` too
    q_spec = tuple(getattr(getattr(jax.typeof(q), "sharding", None), "spec", ())) + (None,) * 5
    batch, heads = _mesh.axes_of(q_spec[0]), _mesh.axes_of(q_spec[2])
    if axis in batch + heads:
        raise ValueError(f"sequence_axis={axis!r} also shards the query's {'batch' if axis in batch else 'heads'}: "
                         "shard the length over it, and the batch and heads over other axes")
    mesh = jax.sharding.get_abstract_mesh()
    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Explicit
    drawn = keep is None and dropout_rng is not None
    cfg = _Config(axis, size, float(scale), soft_cap, spec.terms, precision, batch, heads,
                  explicit, bool(mesh.auto_axes), tuple(spec.shape), float(dropout_rate) if drawn else 0.0,
                  float(keep_scale), str(jnp.dtype(jax.dtypes.canonicalize_dtype(jnp.float64))),
                  _tuning.current().ring_tile)
    slopes = None if spec.alibi_slopes is None else spec.alibi_slopes.reshape(-1, *q.shape[2:4], 1, 1)
    tokens = _tiles.Tokens(spec.query_positions, spec.key_positions, spec.query_segment_ids, spec.key_segment_ids,
                           spec.lengths, slopes)
    dense = Dense(allowed=allowed, keep=keep, device=jnp.arange(size, dtype=jnp.int32))
    if drawn:  # the seed: the threefry key the bits are hashed with (drawn from a key of another kind)
        key = dropout_rng
        key = key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)
        threefry = str(jax.random.key_impl(key)) == "threefry2x32"
        dense = dense._replace(examples=jnp.arange(q.shape[0], dtype=jnp.uint32),
                               kv_heads=jnp.arange(k.shape[2], dtype=jnp.uint32),
                               seed=jax.random.key_data(key) if threefry else jax.random.bits(key, (2,), jnp.uint32))
    return _ring(cfg, q, k, v, sinks, bias, tokens, dense)


def _to_zigzag(x, cfg: _Config, me, dim: int = 1):
    """Contiguous chunks ``2i, 2i + 1`` on device ``i`` (``me``) -> chunks ``i, 2n - 1 - i``."""
    n, axis = cfg.size, cfg.axis
    home = lambda chunk: chunk if chunk < n else 2 * n - 1 - chunk  # noqa: E731
    first, second = jnp.split(x, 2, axis=dim)
    even = jax.lax.ppermute(first, axis, [(i, home(2 * i)) for i in range(n)])
    odd = jax.lax.ppermute(second, axis, [(i, home(2 * i + 1)) for i in range(n)])
    me_even = me % 2 == 0  # chunk i is even when i is
    return jnp.concatenate([jnp.where(me_even, even, odd), jnp.where(me_even, odd, even)], axis=dim)


def _from_zigzag(x, cfg: _Config, me, dim: int = 1):
    """The inverse of ``_to_zigzag``."""
    n, axis = cfg.size, cfg.axis
    front, back = jnp.split(x, 2, axis=dim)
    me_even = me % 2 == 0
    even, odd = jnp.where(me_even, front, back), jnp.where(me_even, back, front)
    chunk = lambda e, parity: e if e % 2 == parity else 2 * n - 1 - e  # noqa: E731
    first = jax.lax.ppermute(even, axis, [(e, chunk(e, 0) // 2) for e in range(n)])
    second = jax.lax.ppermute(odd, axis, [(e, chunk(e, 1) // 2) for e in range(n)])
    return jnp.concatenate([first, second], axis=dim)


def _index(device, n: int, chunk: int):
    """int32 ``(1, 2 * chunk)``: the indices, in the user's order, of a device's zig-zag block."""
    r = jnp.arange(chunk, dtype=jnp.int32)
    return jnp.concatenate([device * chunk + r, (2 * n - 1 - device) * chunk + r])[None]


def _next(x, cfg: _Config):
    """Each device's block to the next device of the ring."""
    return jax.lax.ppermute(x, cfg.axis, [(i, (i + 1) % cfg.size) for i in range(cfg.size)])


def _dense_rows(local: Dense, start, size: int) -> Dense:
    """The terms of ``size`` rows from ``start`` (a broadcast query axis as it is)."""
    return local._replace(**{name: _rows(x, start, size, 3) for name, x in local._asdict().items()
                             if name in ("allowed", "bias", "keep", "hi", "lo") and x is not None and x.shape[3] > 1})


def _key_tile(cfg: _Config, k, v, kt: Where, rows: Dense, start, size: int, dtype):
    """(keys, values in ``dtype``, their terms, (mask, bias, keep)) of the ``size`` keys from ``start``."""
    kj, vj = (_rows(x, start, size, 1).astype(dtype) for x in (k, v))
    ktj = _sliced(kt, start, size)
    keys = ktj.index[0]  # int32 (size,), consecutive global indices
    cols = lambda x: x if x is None or x.shape[4] == 1 else _rows(x, keys[0], keys.shape[0], 4)  # noqa: E731
    mask, bias, keep = cols(rows.allowed), cols(rows.bias), cols(rows.keep)
    if rows.seed is not None:
        keep = _drawn(cfg, rows.seed, rows.hi, rows.lo, keys)
    return kj, vj, ktj, (mask, bias, keep)


def _mul64(x, c: int):
    """(hi, lo) uint32 of ``x * c mod 2**64``: ``x`` uint32, ``c`` a Python int (no uint64 needed)."""
    u = np.uint32
    c &= (1 << 64) - 1
    xl, xh = x & u(0xFFFF), x >> u(16)
    cl, ch = u(c & 0xFFFF), u((c >> 16) & 0xFFFF)
    ll, lh, hl, hh = xl * cl, xl * ch, xh * cl, xh * ch
    lo1 = ll + (lh << u(16))
    lo = lo1 + (hl << u(16))
    carry = (lo1 < ll).astype(jnp.uint32) + (lo < lo1).astype(jnp.uint32)
    return hh + (lh >> u(16)) + (hl >> u(16)) + carry + x * u(c >> 32), lo


def _add64(a, b):
    lo = a[1] + b[1]
    return a[0] + b[0] + (lo < a[1]).astype(jnp.uint32), lo


def _counters(cfg: _Config, examples, kv_heads, groups: int, q_index):
    """(hi, lo) uint32 ``(b, kv_heads, groups, q_block)``: each row's flat index in ``cfg.shape`` at key 0."""
    _, heads, q_len, kv_len = cfg.shape
    u32 = jnp.uint32
    head = (kv_heads[:, None] * u32(groups) + jnp.arange(groups, dtype=u32))[None, :, :, None]
    query = q_index.astype(u32)[None, None, None, :]
    hi, lo = functools.reduce(_add64, (_mul64(examples[:, None, None, None], heads * q_len * kv_len),
                                       _mul64(head, q_len * kv_len), _mul64(query, kv_len)))
    shape = (examples.shape[0], kv_heads.shape[0], groups, q_index.shape[0])
    return jnp.broadcast_to(hi, shape), jnp.broadcast_to(lo, shape)


def _drawn(cfg: _Config, seed, hi, lo, keys):
    """bool ``(b, kv_heads, groups, q_tile, k_tile)``: a tile's keep bits, as
    ``jax.random.bernoulli(key, 1 - rate, cfg.shape)`` draws them."""
    keys = keys.astype(jnp.uint32)
    lo = lo[..., None] + keys
    hi = hi[..., None] + (lo < keys).astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(seed[0], seed[1], hi, lo)
    if cfg.uniform == "float64":
        bits = (b1.astype(jnp.uint64) << np.uint64(32)) | b2.astype(jnp.uint64)
        width, mantissa, kind = 64, 52, np.uint64
    else:
        bits, width, mantissa, kind = b1 ^ b2, 32, 23, np.uint32
    p = float(np.asarray(1.0 - cfg.dropout_rate, cfg.uniform))  # as bernoulli rounds it
    # uniform = (bits >> (width - mantissa)) * 2**-mantissa < p <=> that integer < ceil(p * 2**mantissa)
    return (bits >> kind(width - mantissa)) < kind(math.ceil(p * 2.0**mantissa))


def _tile(chunk: int, most: int) -> int:
    """The largest divisor of ``chunk`` up to ``most``: tiles never straddle two chunks."""
    return max(t for t in range(1, min(chunk, most) + 1) if chunk % t == 0)


_rows = jax.lax.dynamic_slice_in_dim  # (x, start, size, axis)
_put = jax.lax.dynamic_update_slice_in_dim  # (x, update, start, axis)


def _sliced(w: Where, start, size: int) -> Where:
    """The ``size`` queries (or keys) of ``w`` from ``start``."""
    return jax.tree.map(lambda x: _rows(x, start, size, 1), w)


def _scores(cfg: _Config, q, k, v, qt: Where, kt: Where, tokens: _tiles.Tokens, mask, bias):
    """(scores ``(b, kv_heads, groups, q_tile, k_tile)``, tanh or None, keys, values with the unseen zeroed) of
    ``q`` ``(b, q_tile, kv_heads, groups, d)`` and ``k`` ``(b, k_tile, kv_heads, d)``."""
    seen = conjoin(mask, None if bias is None else ~_tiles.below_all(bias))
    if seen is not None:  # keys that the mask or a -inf bias hides from every query of the tile: zeros
        seen = seen.any(axis=(2, 3)).transpose(0, 2, 1)[..., None]  # (b|1, k_tile|1, kv_heads|1, 1), as k
        k, v = jnp.where(seen, k, 0), jnp.where(seen, v, 0)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=cfg.precision)
    qw = jax.tree.map(lambda x: x[:, None, None, :, None], qt)
    kw = jax.tree.map(lambda x: x[:, None, None, None, :], kt)._replace(
        length=None if tokens.lengths is None else tokens.lengths[:, None, None, None, None])
    s, tanh = _tiles.scores(s, s.shape, scale=cfg.scale, soft_cap=cfg.soft_cap, bias=bias, terms=cfg.terms, q=qw,
                            k=kw, masks=(mask,), alibi=tokens.slopes)
    return s, tanh, k, v


def _if_visible(cfg: _Config, qt: Where, kt: Where, mask, update, state):
    """``update(state)``, skipped where the positional terms or the (wholly seen) dense mask leave the tile empty."""
    may, qp, kp = None, qt.position, kt.position
    positional = cfg.terms.only({"position"})
    if positional and qp.shape[0] == 1 and kp.shape[0] == 1:
        may = positional.block(Where(qp.min()), Where(qp.max()), Where(kp.min()), Where(kp.max()))[1]
    if mask is not None and (not cfg.auto or (mask.shape[0] == 1 or cfg.batch_axes)
                             and (mask.shape[1] == 1 or cfg.head_axes)):
        may = conjoin(may, mask.any())
    return update(state) if may is None else jax.lax.cond(may, update, lambda state: state, state)


def _key_terms(cfg: _Config, kt: Where, source, chunk: int) -> Where:
    """The per-key terms of the block that came from device ``source``."""
    index = _index(source, cfg.size, chunk)
    return kt._replace(index=index, position=index if kt.position is None else kt.position)


def _forward_step(cfg: _Config, q, k, v, qt: Where, kt: Where, tokens: _tiles.Tokens, dense: Dense, state):
    """The online softmax ``state`` of ``q`` ``(b, q_block, kv_heads, groups, d)`` after one key/value block."""
    tq, tk = _tile(q.shape[1] // 2, cfg.tile), _tile(k.shape[1] // 2, cfg.tile)
    def q_tile(i, state):
        r = i * tq
        qi, qti, rows = _rows(q, r, tq, 1), _sliced(qt, r, tq), _dense_rows(dense, r, tq)
        def k_tile(j, tile_state):
            kj, vj, ktj, (mask, bias, keep) = _key_tile(cfg, k, v, kt, rows, j * tk, tk, q.dtype)
            def update(tile_state):
                s, _, _, vz = _scores(cfg, qi, kj, vj, qti, ktj, tokens, mask, bias)
                def mix(p):
                    return jnp.einsum("bhgqk,bkhd->bhgqd", p, vz, precision=cfg.precision)
                return _tiles.forward(tile_state, s, mix, keep, cfg.keep_scale, s.shape)
            return _if_visible(cfg, qti, ktj, mask, update, tile_state)
        tile_state = tuple(_rows(x, r, tq, 3) for x in state)
        tile_state = jax.lax.fori_loop(0, k.shape[1] // tk, k_tile, tile_state)
        return tuple(_put(x, t, r, 3) for x, t in zip(state, tile_state))
    return jax.lax.fori_loop(0, q.shape[1] // tq, q_tile, state)


def _backward_step(cfg: _Config, q, k, v, dout, lse, delta, qt: Where, kt: Where, tokens: _tiles.Tokens, dense: Dense,
                   grads):
    """``grads`` (dq, dk, dv, d_bias or None) plus one key/value block's share, by tiles."""
    tq, tk = _tile(q.shape[1] // 2, cfg.tile), _tile(k.shape[1] // 2, cfg.tile)
    def q_tile(i, grads):
        r = i * tq
        qi, qti, rows = _rows(q, r, tq, 1), _sliced(qt, r, tq), _dense_rows(dense, r, tq)
        douti, lsei, deltai = _rows(dout, r, tq, 3), _rows(lse, r, tq, 3), _rows(delta, r, tq, 3)
        def k_tile(j, grads):
            dqi, dk, dv, d_bias = grads
            c = j * tk
            kj, vj, ktj, (mask, bias, keep) = _key_tile(cfg, k, v, kt, rows, c, tk, q.dtype)
            def update(tile_grads):
                dqi, dkj, dvj, d_bias_t = tile_grads
                s, t, kz, vz = _scores(cfg, qi, kj, vj, qti, ktj, tokens, mask, bias)
                dp = jnp.einsum("bhgqd,bkhd->bhgqk", douti, vz, precision=cfg.precision)
                p_used, ds_bias, ds = _tiles.backward(s, lsei[..., None], deltai[..., None], dp, t, keep,
                                                      cfg.keep_scale, s.shape)
                dvj = dvj + jnp.einsum("bhgqk,bhgqd->bkhd", p_used, douti, precision=cfg.precision)
                if d_bias_t is not None:
                    d_bias_t = d_bias_t + _tiles.bias_share(ds_bias, d_bias_t.shape)
                ds = ds * cfg.scale
                dqi = dqi + jnp.einsum("bhgqk,bkhd->bhgqd", ds, kz, precision=cfg.precision)
                dkj = dkj + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qi, precision=cfg.precision)
                return dqi, dkj, dvj, d_bias_t
            tile = None if d_bias is None else _tiles.bias_tile(d_bias.shape, {3: (r, tq), 4: (ktj.index[0, 0], tk)})
            d_bias_t = None if tile is None else jax.lax.dynamic_slice(d_bias, *tile)
            tile_grads = _if_visible(cfg, qti, ktj, mask, update,
                                     (dqi, _rows(dk, c, tk, 1), _rows(dv, c, tk, 1), d_bias_t))
            if tile is not None:
                d_bias = jax.lax.dynamic_update_slice(d_bias, tile_grads[3], tile[0])
            return tile_grads[0], _put(dk, tile_grads[1], c, 1), _put(dv, tile_grads[2], c, 1), d_bias
        dq, dk, dv, d_bias = grads
        dqi, dk, dv, d_bias = jax.lax.fori_loop(0, k.shape[1] // tk, k_tile, (_rows(dq, r, tq, 3), dk, dv, d_bias))
        return _put(dq, dqi, r, 3), dk, dv, d_bias
    return jax.lax.fori_loop(0, q.shape[1] // tq, q_tile, grads)


def _on_device(cfg: _Config, q, k, bias, tokens: _tiles.Tokens, dense: Dense):
    """(ring size, device index, key chunk, query terms, travelling key terms, dense terms, the tokens' lengths and
    slopes)."""
    n, me = cfg.size, dense.device[0]  # (an input, not axis_index: see Dense)
    chunk_q = q.shape[1] // 2
    zig = jax.tree.map(lambda x: _to_zigzag(x, cfg, me), tokens._replace(lengths=None, slopes=None))
    qt = Where(_index(me, n, chunk_q) if zig.query_positions is None else zig.query_positions, zig.query_segments)
    kt = Where(zig.key_positions, zig.key_segments)
    # the dense terms, rows in zig-zag order; for drawn dropout its rows' counters
    local = dense._replace(bias=bias)
    local = local._replace(**{name: _to_zigzag(x, cfg, me, dim=3) for name, x in zip(local._fields, local)
                              if name in ("allowed", "bias", "keep") and x is not None and x.shape[3] > 1})
    if local.seed is not None:
        q_index = _index(me, n, chunk_q)[0]
        local = local._replace(**dict(zip(("hi", "lo"), _counters(cfg, dense.examples, dense.kv_heads, q.shape[3],
                                                                  q_index))))
    return n, me, k.shape[1] // 2, qt, kt, local, _tiles.Tokens(lengths=tokens.lengths, slopes=tokens.slopes)


def _around(cfg: _Config, step, carry, blocks: tuple, moved=None):
    """``carry`` after ``step(s, carry, *blocks)`` for each ring step, ``blocks`` sent on meanwhile, then ``moved``."""
    def ring_step(s, loop):
        carry, blocks = loop
        sent = _next(blocks, cfg)
        carry = step(s, carry, *blocks)
        return (carry if moved is None else moved(carry)), sent
    carry, last = jax.lax.fori_loop(0, cfg.size - 1, ring_step, (carry, blocks))
    return step(cfg.size - 1, carry, *last)


def _forward_body(cfg: _Config, q, k, v, sinks, bias, tokens, dense):
    """One device's forward: blocks travel in the inputs' dtype, tiles are computed in float32 or wider."""
    n, me, chunk_k, qt, kt, local, per_call = _on_device(cfg, q, k, bias, tokens, dense)
    q, k, v = (_to_zigzag(x, cfg, me) for x in (q, k, v))
    if per_call.lengths is not None:  # padding keys hold zeros: whatever they held (NaN) reaches nothing
        pad = (_index(me, n, chunk_k) >= per_call.lengths[:, None])[:, :, None, None]
        k, v = jnp.where(pad, 0, k), jnp.where(pad, 0, v)
    qc = q.astype(jnp.promote_types(q.dtype, jnp.float32))
    acc = _tiles.accumulator(qc.transpose(0, 2, 3, 1, 4), v.shape[-1])  # (b, kv_heads, groups, q_block, dv)
    def step(s, state, k, v, kt):
        return _forward_step(cfg, qc, k, v, qt, _key_terms(cfg, kt, (me - s) % n, chunk_k), per_call, local, state)
    state = _tiles.init(acc, None if sinks is None else sinks[None, :, :, None])
    out, lse = _tiles.finish(_around(cfg, step, state, (k, v, kt)))
    result = _from_zigzag(out.transpose(0, 3, 1, 2, 4).astype(q.dtype), cfg, me)
    return result, (q, k, v, out, lse)


def _backward_body(cfg: _Config, shared: tuple, q, k, v, out, lse, sinks, bias, tokens, dense, dout):
    """``shared``: the manual axes the bias is not split over (its gradient is summed over them)."""
    n, me, chunk_k, qt, kt, local, per_call = _on_device(cfg, q, k, bias, tokens, dense)
    qc = q.astype(out.dtype)
    dout = _to_zigzag(dout, cfg, me).astype(out.dtype).transpose(0, 2, 3, 1, 4)  # (b, kv_heads, groups, q_block, d)
    delta = jnp.sum(dout * out, axis=-1)  # rowsum(dO * O) = rowsum(dP * P), dropout included
    d_bias = None
    if bias is not None:  # varying over every manual axis, as what the loops add to it is
        d_bias = _mesh.to_varying(jnp.zeros(local.bias.shape, out.dtype), tuple(sorted(_manual(cfg))))
    def step(s, grads, k, v, kt):
        kt = _key_terms(cfg, kt, (me - s) % n, chunk_k)
        return _backward_step(cfg, qc, k, v, dout, lse, delta, qt, kt, per_call, local, grads)
    def moved(grads):  # a block's key and value gradients travel with it
        return grads[0], *_next(grads[1:3], cfg), grads[3]
    zeros = (jnp.zeros_like(qc.transpose(0, 2, 3, 1, 4)), *(jnp.zeros_like(x, dtype=out.dtype) for x in (k, v)))
    dq, dk, dv, d_bias = _around(cfg, step, (*zeros, d_bias), (k, v, kt), moved)
    dk, dv = _next((dk, dv), cfg)  # home: block i's gradients on device i
    dsinks = None
    if sinks is not None:
        dsinks = jax.lax.psum(_tiles.sink_gradient(sinks[None, :, :, None], lse, delta), (cfg.axis, *cfg.batch_axes))
    if d_bias is not None:  # rows home; summed over the devices that share the bias
        if bias.shape[3] > 1:
            d_bias = _from_zigzag(d_bias, cfg, me, dim=3)
        d_bias = (jax.lax.psum(d_bias, shared) if shared else d_bias).astype(bias.dtype)
    dq = _from_zigzag(dq.transpose(0, 3, 1, 2, 4).astype(q.dtype), cfg, me)
    return dq, _from_zigzag(dk.astype(k.dtype), cfg, me), _from_zigzag(dv.astype(v.dtype), cfg, me), dsinks, d_bias


def _in_specs(cfg: _Config, bias, tokens: _tiles.Tokens, dense: Dense):
    """The rings' specs: (length blocks, per-query rows, heads, the bias's, (the tokens', the dense terms'))."""
    tokens_specs = jax.tree.map(lambda x: cfg.spec("b" if x.shape[0] > 1 else None, "s"), tokens)._replace(
        lengths=None if tokens.lengths is None else cfg.spec("b"),
        slopes=None if tokens.slopes is None else _dense_spec(cfg, tokens.slopes))
    dense_specs = Dense(*(None if x is None else _dense_spec(cfg, x, name) for name, x in zip(Dense._fields, dense)))
    return (cfg.spec("b", "s", "h"), cfg.spec("b", "h", None, "s"), cfg.spec("h"), _dense_spec(cfg, bias),
            (tokens_specs, dense_specs))


# The dense terms that are indices, by the axes that split them (the seed: none, replicated).
_INDEX_AXES = dict(device=("s",), examples=("b",), kv_heads=("h",), seed=())


def _dense_spec(cfg: _Config, x, name: str = "bias"):
    """A dense term's spec: rows over the sequence axis, examples and heads as the query's; the seed replicated."""
    if name in _INDEX_AXES:
        return cfg.spec(*_INDEX_AXES[name])
    if x is None:
        return P()
    b, h, _, rows, _ = x.shape
    return cfg.spec("b" if b > 1 else None, "h" if h > 1 else None, None, "s" if rows > 1 else None, None)


def _manual(cfg: _Config):
    return {cfg.axis, *cfg.batch_axes, *cfg.head_axes}


def _mapped(cfg: _Config, body, args: tuple, in_specs: tuple, out_specs):
    """``body(*args)`` in ``jax.shard_map`` over the ring's axes (on an Explicit axis, resharded to ``in_specs``)."""
    if cfg.explicit:
        args = jax.tree.map(lambda x, spec: None if x is None else jax.reshard(x, spec), args, in_specs,
                            is_leaf=lambda x: x is None)
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names=_manual(cfg), check_vma=True)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Config, q, k, v, sinks, bias, tokens, dense):
    return _ring_fwd(cfg, q, k, v, sinks, bias, tokens, dense)[0]


def _ring_fwd(cfg: _Config, q, k, v, sinks, bias, tokens, dense):
    seq, per_query, heads, bias_spec, terms_specs = _in_specs(cfg, bias, tokens, dense)
    in_specs = (seq, seq, seq, heads, bias_spec, *terms_specs)
    out, residuals = _mapped(cfg, functools.partial(_forward_body, cfg), (q, k, v, sinks, bias, tokens, dense),
                             in_specs, (seq, (seq, seq, seq, per_query, per_query)))
    return out, (residuals, sinks, bias, tokens, dense)


def _ring_bwd(cfg: _Config, saved, dout):
    residuals, sinks, bias, tokens, dense = saved
    seq, per_query, heads, bias_spec, terms_specs = _in_specs(cfg, bias, tokens, dense)
    in_specs = (seq, seq, seq, per_query, per_query, heads, bias_spec, *terms_specs, seq)
    shared = tuple(sorted(_manual(cfg) - {a for entry in bias_spec for a in _mesh.axes_of(entry)}))
    dq, dk, dv, dsinks, d_bias = _mapped(cfg, functools.partial(_backward_body, cfg, shared),
                                         (*residuals, sinks, bias, tokens, dense, dout), in_specs,
                                         (seq, seq, seq, heads, bias_spec))
    if cfg.explicit and bias is not None:  # a cotangent has its primal's type: a bias not split over the ring too
        d_bias = jax.reshard(d_bias, jax.typeof(bias).sharding.spec)
    return dq, dk, dv, dsinks, d_bias, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
