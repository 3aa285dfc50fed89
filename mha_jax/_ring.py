"""Ring attention: the query/key/value length sharded over one mesh axis (``sequence_axis``).

Each of the axis's ``n`` devices holds a block of queries and a block of keys and values. The
key/value blocks (with the per-key terms given as arrays: key positions, key segment ids) go
round the ring with ``jax.lax.ppermute``, ``n - 1`` steps; each device combines its partial
results with the log-sum-exp trick (online softmax), as the blockwise kernel does over blocks.
The backward pass is a second ring: the key/value blocks travel with the gradients of their
keys and values, which after ``n`` steps are home again; the gradient of a device's queries
stays on it. Nothing is gathered.

Zig-zag layout: the length is cut into ``2n`` chunks and device ``i`` works on chunks ``i`` and
``2n - 1 - i``, one from the front and one from the back, so that under causality every
device has as many visible (query, key) pairs as another. The inputs are sharded contiguously
(device ``i`` holds chunks ``2i`` and ``2i + 1``, as ``P(None, sequence_axis)`` places them)
and the output comes back so: the reordering is two ``ppermute`` of half a block per array on
the way in and on the way out, outside the ring. Positions are the chunks' own (``arange`` in
the user's order, or the given ones moved with their chunks), so the masks mean what they mean
on one device.

Each step goes over its blocks in tiles of at most ``TILE`` queries x ``TILE`` keys, scored in
float32 or wider; a tile that causality or the window leave empty for every example is skipped
(under causality, with the zig-zag layout, half of each step's tiles but the first step's).
Keys and values travel in the inputs' dtype, their gradients in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mha_jax import masks


@dataclasses.dataclass(frozen=True)
class _Config:
    axis: str
    size: int
    scale: float
    soft_cap: float | None
    is_causal: bool
    window: tuple[int, int] | None
    precision: Any
    batch_axes: tuple[str, ...] = ()  # Explicit mesh axes sharding the batch, manual in the ring too
    head_axes: tuple[str, ...] = ()  # and the (key/value) heads
    explicit: bool = False  # the sequence axis is Explicit: the ring's inputs are resharded to its specs

    def spec(self, *dims):
        """A PartitionSpec naming the axes of ``dims``: "b" batch, "s" sequence, "h" heads, None."""
        axes = dict(b=self.batch_axes or None, s=self.axis, h=self.head_axes or None)
        return P(*(None if d is None else axes[d] for d in dims))


def check(sequence_axis, q_len: int, kv_len: int, spec: masks._Spec, *, dropout: bool, return_weights: bool,
          implementation) -> int:
    """The axis's size, after refusing what a ring does not take, by name and size."""
    if not isinstance(sequence_axis, str):
        raise TypeError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            f"sequence_axis={sequence_axis!r} needs a mesh: call under jax.set_mesh(mesh), with a mesh that has "
            f"an axis {sequence_axis!r}"
        )
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sequence_axis not in sizes:
        raise ValueError(f"sequence_axis={sequence_axis!r} is not an axis of the mesh, whose axes are {sizes}")
    if sequence_axis in getattr(mesh, "manual_axes", ()):
        raise ValueError(
            f"sequence_axis={sequence_axis!r} is already manual here (inside jax.shard_map over it): call the "
            "attention outside shard_map, or leave that axis out of the shard_map's axis_names"
        )
    n = sizes[sequence_axis]
    if n == 1:
        raise ValueError(
            f"sequence_axis={sequence_axis!r} has size 1 in the mesh {sizes}: a ring needs 2 devices or more; "
            "pass sequence_axis=None"
        )
    for name, length in (("q_len", q_len), ("kv_len", kv_len)):
        if length % (2 * n):
            raise ValueError(
                f"sequence_axis={sequence_axis!r} of size {n} needs {name} to be a multiple of 2 x {n} = {2 * n} "
                f"(each device holds a front and a back chunk), got {name}={length}"
            )
    for name, given in (("mask", spec.allowed), ("bias", spec.bias)):
        if given is not None:
            raise ValueError(
                f"sequence_axis={sequence_axis!r} does not take a dense {name} (given with shape "
                f"{tuple(given.shape)}); express it as is_causal, local_window_size, query_positions/key_positions, "
                "query_segment_ids/key_segment_ids or key_value_seq_lengths"
            )
    if dropout:
        raise ValueError(f"sequence_axis={sequence_axis!r} does not take dropout (dropout_rate > 0 or dropout_mask)")
    if return_weights:
        raise ValueError(f"sequence_axis={sequence_axis!r} does not take return_weights=True (the ring never forms them)")
    if implementation == "cudnn":
        raise ValueError(
            f"sequence_axis={sequence_axis!r} does not take implementation='cudnn'; use None, 'xla' or 'blockwise' "
            "(the ring computes each step itself)"
        )
    return n


def attention(q, k, v, spec: masks._Spec, *, axis: str, size: int, scale: float, soft_cap, sinks, precision):
    """q ``(b, q_len, kv_heads, groups, d)``, k/v ``(b, kv_len, kv_heads, d)``, in their dtype (what
    travels); ``sinks`` ``(kv_heads, groups)`` in float32 or wider, or None. Returns q's shape and
    dtype."""
    batch_axes, head_axes = _explicit_axes(q, axis)
    mesh = jax.sharding.get_abstract_mesh()
    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Explicit
    cfg = _Config(axis, size, float(scale), soft_cap, spec.is_causal, spec.window, precision, batch_axes, head_axes,
                  explicit)
    terms = dict(qp=spec.query_positions, kp=spec.key_positions, qs=spec.query_segment_ids,
                 ks=spec.key_segment_ids, lengths=spec.lengths)
    terms = {name: x for name, x in terms.items() if x is not None}
    return _ring(cfg, q, k, v, sinks, terms)


def _explicit_axes(q, axis: str):
    """The Explicit mesh axes over which q ``(b, len, kv_heads, groups, d)`` shards its batch and its
    heads: the ring's ``shard_map`` takes them as manual too, so that each device keeps its own
    examples and heads (left out, they would be gathered). Auto axes stay with the compiler."""
    spec = tuple(getattr(getattr(jax.typeof(q), "sharding", None), "spec", ())) + (None,) * 5
    as_tuple = lambda x: () if x is None else (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    batch, heads = as_tuple(spec[0]), as_tuple(spec[2])
    if axis in batch + heads:
        raise ValueError(
            f"sequence_axis={axis!r} also shards the query's {'batch' if axis in batch else 'heads'}: "
            "shard the length over it, and the batch and heads over other axes"
        )
    return batch, heads


# --- the zig-zag layout ---------------------------------------------------------------------------

def _to_zigzag(x, cfg: _Config, dim: int = 1):
    """Contiguous chunks ``2i, 2i + 1`` on device ``i`` -> chunks ``i, 2n - 1 - i``."""
    n, axis = cfg.size, cfg.axis
    home = lambda chunk: chunk if chunk < n else 2 * n - 1 - chunk  # noqa: E731
    first, second = jnp.split(x, 2, axis=dim)
    even = jax.lax.ppermute(first, axis, [(i, home(2 * i)) for i in range(n)])
    odd = jax.lax.ppermute(second, axis, [(i, home(2 * i + 1)) for i in range(n)])
    me_even = jax.lax.axis_index(axis) % 2 == 0  # chunk i is even when i is
    return jnp.concatenate([jnp.where(me_even, even, odd), jnp.where(me_even, odd, even)], axis=dim)


def _from_zigzag(x, cfg: _Config, dim: int = 1):
    """The inverse of ``_to_zigzag``."""
    n, axis = cfg.size, cfg.axis
    front, back = jnp.split(x, 2, axis=dim)
    me_even = jax.lax.axis_index(axis) % 2 == 0
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


# --- one step: a query block against a key/value block, tile by tile ---------------------------

TILE = 512  # the largest tile of queries (and of keys) a step scores at once


def _tile(chunk: int) -> int:
    """The largest divisor of ``chunk`` up to ``TILE``: tiles never straddle two chunks."""
    return max(t for t in range(1, min(chunk, TILE) + 1) if chunk % t == 0)


def _rows(x, start, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _put(x, update, start, axis: int):
    return jax.lax.dynamic_update_slice_in_dim(x, update, start, axis)


def _sliced(terms: dict, start, size: int) -> dict:
    return {name: None if x is None else _rows(x, start, size, 1) for name, x in terms.items()}


def _allowed(cfg: _Config, qt: dict, kt: dict, lengths):
    """bool ``(b|1, 1, 1, q_tile, k_tile)`` or None. ``qt``: ``qp``, ``qs``; ``kt``: ``kp``,
    ``ks``, ``index`` (key indices in the user's order), each ``(b|1, tile)``."""
    q5 = lambda x: None if x is None else x[:, None, None, :, None]  # noqa: E731
    k5 = lambda x: None if x is None else x[:, None, None, None, :]  # noqa: E731
    return masks._visible(
        cfg.is_causal, cfg.window, q5(qt["qp"]), k5(kt["kp"]), q5(qt.get("qs")), k5(kt.get("ks")),
        k5(kt["index"]), None if lengths is None else lengths[:, None, None, None, None],
    )


def _may_see(cfg: _Config, qp, kp):
    """A scalar bool, False when causality or the window leave a tile empty for every example,
    read from the tile's extreme positions; None (always computed) where the positions differ
    between examples (deciding over a batch sharded elsewhere would need a reduction)."""
    if not (cfg.is_causal or cfg.window is not None) or qp.shape[0] != 1 or kp.shape[0] != 1:
        return None
    q_lo, q_hi, k_lo, k_hi = qp.min(), qp.max(), kp.min(), kp.max()
    ok = k_lo <= q_hi if cfg.is_causal else jnp.bool_(True)
    if cfg.window is not None:
        left, right = cfg.window
        ok = ok & (k_lo <= q_hi + right) & (k_hi >= q_lo - left)
    return ok


def _if_visible(cfg: _Config, qt: dict, kt: dict, update, state):
    may = _may_see(cfg, qt["qp"], kt["kp"])
    return update(state) if may is None else jax.lax.cond(may, update, lambda state: state, state)


def _logits(cfg: _Config, q, k):
    """(scaled and capped logits ``(b, kv_heads, groups, q_tile, k_tile)``, tanh of the cap or None)."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, precision=cfg.precision) * cfg.scale
    if cfg.soft_cap is None:
        return s, None
    t = jnp.tanh(s / cfg.soft_cap)
    return cfg.soft_cap * t, t


def _key_terms(cfg: _Config, kt: dict, source, chunk: int):
    """The per-key terms of the block that came from device ``source``."""
    index = _index(source, cfg.size, chunk)
    return dict(kt, index=index, kp=kt.get("kp", index))


def _forward_step(cfg: _Config, q, k, v, qt: dict, kt: dict, lengths, state):
    """Online softmax of the query block ``q`` ``(b, q_block, kv_heads, groups, d)`` over one
    key/value block: ``state`` = (running max, sum ``(b, kv_heads, groups, q_block)``, weighted
    values ``(..., d)``), tile by tile."""
    tq, tk = _tile(q.shape[1] // 2), _tile(k.shape[1] // 2)

    def q_tile(i, state):
        r = i * tq
        qi, qti = _rows(q, r, tq, 1), _sliced(qt, r, tq)

        def k_tile(j, tile_state):
            c = j * tk
            kj, vj = (_rows(x, c, tk, 1).astype(q.dtype) for x in (k, v))
            ktj = _sliced(kt, c, tk)

            def update(tile_state):
                m, l, acc = tile_state  # noqa: E741
                logits, _ = _logits(cfg, qi, kj)
                allowed = _allowed(cfg, qti, ktj, lengths)
                if allowed is not None:
                    logits = jnp.where(allowed, logits, -jnp.inf)
                m_new = jnp.maximum(m, logits.max(axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(logits - m_safe[..., None])
                correction = jnp.exp(m - m_safe)
                acc = acc * correction[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p, vj, precision=cfg.precision)
                return m_new, l * correction + p.sum(axis=-1), acc

            return _if_visible(cfg, qti, ktj, update, tile_state)

        tile_state = tuple(_rows(x, r, tq, 3) for x in state)
        tile_state = jax.lax.fori_loop(0, k.shape[1] // tk, k_tile, tile_state)
        return tuple(_put(x, t, r, 3) for x, t in zip(state, tile_state))

    return jax.lax.fori_loop(0, q.shape[1] // tq, q_tile, state)


def _backward_step(cfg: _Config, q, k, v, dout, lse, delta, qt: dict, kt: dict, lengths, grads):
    """The gradients ``grads`` = (dq ``(b, kv_heads, groups, q_block, d)``, dk, dv
    ``(b, kv_block, kv_heads, d)``) plus one key/value block's share, tile by tile."""
    tq, tk = _tile(q.shape[1] // 2), _tile(k.shape[1] // 2)

    def q_tile(i, grads):
        r = i * tq
        qi, qti = _rows(q, r, tq, 1), _sliced(qt, r, tq)
        douti, lsei, deltai = _rows(dout, r, tq, 3), _rows(lse, r, tq, 3), _rows(delta, r, tq, 3)

        def k_tile(j, grads):
            dqi, dk, dv = grads
            c = j * tk
            kj, vj = (_rows(x, c, tk, 1).astype(q.dtype) for x in (k, v))
            ktj = _sliced(kt, c, tk)

            def update(tile_grads):
                dqi, dkj, dvj = tile_grads
                logits, t = _logits(cfg, qi, kj)
                p = jnp.exp(logits - lsei[..., None])
                allowed = _allowed(cfg, qti, ktj, lengths)
                if allowed is not None:
                    p = jnp.where(allowed, p, 0.0)
                dvj = dvj + jnp.einsum("bhgqk,bhgqd->bkhd", p, douti, precision=cfg.precision)
                ds = p * (jnp.einsum("bhgqd,bkhd->bhgqk", douti, vj, precision=cfg.precision) - deltai[..., None])
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds * cfg.scale
                dqi = dqi + jnp.einsum("bhgqk,bkhd->bhgqd", ds, kj, precision=cfg.precision)
                dkj = dkj + jnp.einsum("bhgqk,bqhgd->bkhd", ds, qi, precision=cfg.precision)
                return dqi, dkj, dvj

            tile_grads = _if_visible(cfg, qti, ktj, update, (dqi, _rows(dk, c, tk, 1), _rows(dv, c, tk, 1)))
            return tile_grads[0], _put(dk, tile_grads[1], c, 1), _put(dv, tile_grads[2], c, 1)

        dq, dk, dv = grads
        dqi, dk, dv = jax.lax.fori_loop(0, k.shape[1] // tk, k_tile, (_rows(dq, r, tq, 3), dk, dv))
        return _put(dq, dqi, r, 3), dk, dv

    return jax.lax.fori_loop(0, q.shape[1] // tq, q_tile, grads)


# --- forward and backward rings ------------------------------------------------------------------

def _local_terms(cfg: _Config, terms: dict, chunk_q: int):
    """Zig-zag query terms and travelling key terms, on one device."""
    zig = {name: _to_zigzag(x, cfg) for name, x in terms.items() if name != "lengths"}
    me = jax.lax.axis_index(cfg.axis)
    qt = dict(qp=zig.get("qp", _index(me, cfg.size, chunk_q)), qs=zig.get("qs"))
    kt = {name: zig[name] for name in ("kp", "ks") if name in zig}
    return qt, kt


def _forward_body(cfg: _Config, q, k, v, sinks, terms):
    """On one device: its blocks (contiguous), in the inputs' dtype; the keys and values travel
    in it, each tile is computed in float32 or wider."""
    n, me = cfg.size, jax.lax.axis_index(cfg.axis)
    chunk_q, chunk_k = q.shape[1] // 2, k.shape[1] // 2
    q, k, v = (_to_zigzag(x, cfg) for x in (q, k, v))
    qt, kt = _local_terms(cfg, terms, chunk_q)
    lengths = terms.get("lengths")
    if lengths is not None:  # padding keys hold zeros: whatever they held (NaN) reaches nothing
        pad = (_index(me, n, chunk_k) >= lengths[:, None])[:, :, None, None]
        k, v = jnp.where(pad, 0, k), jnp.where(pad, 0, v)
    qc = q.astype(jnp.promote_types(q.dtype, jnp.float32))
    acc = jnp.zeros_like(qc.transpose(0, 2, 3, 1, 4))  # (b, kv_heads, groups, q_block, d), as q is placed
    l = jnp.zeros_like(acc[..., 0])  # noqa: E741
    m = jnp.full_like(l, -jnp.inf)

    def step(s, state, k, v, kt):
        return _forward_step(cfg, qc, k, v, qt, _key_terms(cfg, kt, (me - s) % n, chunk_k), lengths, state)

    def ring_step(s, carry):
        state, k, v, kt = carry
        sent = _next((k, v, kt), cfg)  # on its way while this block is used
        return step(s, state, k, v, kt), *sent

    state, k_last, v_last, kt_last = jax.lax.fori_loop(0, n - 1, ring_step, ((m, l, acc), k, v, kt))
    m, l, acc = step(n - 1, state, k_last, v_last, kt_last)  # noqa: E741
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    if sinks is not None:
        sink = sinks[None, :, :, None]
        m_all = jnp.maximum(m, sink)
        correction = jnp.exp(m - m_all)
        l, acc = l * correction + jnp.exp(sink - m_all), acc * correction[..., None]  # noqa: E741
        m_safe = m_all
    out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
    lse = jnp.where(l == 0.0, 0.0, m_safe + jnp.log(jnp.where(l == 0.0, 1.0, l)))
    result = _from_zigzag(out.transpose(0, 3, 1, 2, 4).astype(q.dtype), cfg)
    return result, (q, k, v, out, lse)


def _backward_body(cfg: _Config, q, k, v, out, lse, sinks, terms, dout):
    n, me = cfg.size, jax.lax.axis_index(cfg.axis)
    chunk_q, chunk_k = q.shape[1] // 2, k.shape[1] // 2
    qt, kt = _local_terms(cfg, terms, chunk_q)
    lengths = terms.get("lengths")
    qc = q.astype(out.dtype)
    dout = _to_zigzag(dout, cfg).astype(out.dtype).transpose(0, 2, 3, 1, 4)  # (b, kv_heads, groups, q_block, d)
    delta = jnp.sum(dout * out, axis=-1)
    dq = jnp.zeros_like(dout)

    def step(s, grads, k, v, kt):
        kt = _key_terms(cfg, kt, (me - s) % n, chunk_k)
        return _backward_step(cfg, qc, k, v, dout, lse, delta, qt, kt, lengths, grads)

    def ring_step(s, carry):
        (dq, dk, dv), k, v, kt = carry
        sent = _next((k, v, kt), cfg)
        dq, dk, dv = step(s, (dq, dk, dv), k, v, kt)
        return (dq, *_next((dk, dv), cfg)), *sent  # the block's gradients travel with it

    zeros = jnp.zeros_like(k, dtype=out.dtype)
    grads, k_last, v_last, kt_last = jax.lax.fori_loop(0, n - 1, ring_step, ((dq, zeros, zeros), k, v, kt))
    dq, dk, dv = step(n - 1, grads, k_last, v_last, kt_last)
    dk, dv = _next((dk, dv), cfg)  # home: block i's gradients on device i
    dsinks = None
    if sinks is not None:  # d lse / d sink = the sink's weight; its gradient is -weight * delta
        weight = jnp.exp(sinks[None, :, :, None] - lse)
        dsinks = jax.lax.psum(-jnp.sum(weight * delta, axis=(0, 3)), (cfg.axis, *cfg.batch_axes))
    dq = _from_zigzag(dq.transpose(0, 3, 1, 2, 4).astype(q.dtype), cfg)
    return dq, _from_zigzag(dk.astype(k.dtype), cfg), _from_zigzag(dv.astype(v.dtype), cfg), dsinks


def _specs(cfg: _Config, terms: dict):
    """The terms' specs: ``(b|1, len)`` arrays and ``lengths`` ``(b,)``."""
    return {
        name: cfg.spec("b") if name == "lengths" else cfg.spec("b" if x.shape[0] > 1 else None, "s")
        for name, x in terms.items()
    }


def _manual(cfg: _Config):
    return {cfg.axis, *cfg.batch_axes, *cfg.head_axes}


def _placed(cfg: _Config, args, specs):
    """On an Explicit sequence axis, ``args`` resharded to ``specs`` (a length not yet split over the
    axis is split: each device keeps its slice); on an Auto one, as they are."""
    if not cfg.explicit:
        return args
    return jax.tree.map(lambda x, spec: None if x is None else jax.reshard(x, spec), args, specs,
                        is_leaf=lambda x: x is None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Config, q, k, v, sinks, terms):
    return _ring_fwd(cfg, q, k, v, sinks, terms)[0]


def _ring_fwd(cfg: _Config, q, k, v, sinks, terms):
    seq, per_query, heads = cfg.spec("b", "s", "h"), cfg.spec("b", "h", None, "s"), cfg.spec("h")
    in_specs = (seq, seq, seq, heads, _specs(cfg, terms))
    f = jax.shard_map(
        functools.partial(_forward_body, cfg), in_specs=in_specs,
        out_specs=(seq, (seq, seq, seq, per_query, per_query)), axis_names=_manual(cfg), check_vma=True,
    )
    out, residuals = f(*_placed(cfg, (q, k, v, sinks, terms), in_specs))
    return out, (residuals, sinks, terms)


def _ring_bwd(cfg: _Config, saved, dout):
    residuals, sinks, terms = saved
    seq, per_query, heads = cfg.spec("b", "s", "h"), cfg.spec("b", "h", None, "s"), cfg.spec("h")
    in_specs = (seq, seq, seq, per_query, per_query, heads, _specs(cfg, terms), seq)
    f = jax.shard_map(
        functools.partial(_backward_body, cfg), in_specs=in_specs,
        out_specs=(seq, seq, seq, heads), axis_names=_manual(cfg), check_vma=True,
    )
    dq, dk, dv, dsinks = f(*_placed(cfg, (*residuals, sinks, terms, dout), in_specs))
    return dq, dk, dv, dsinks, None


_ring.defvjp(_ring_fwd, _ring_bwd)
