"""The TPU kernel: JAX's splash attention (Pallas), with our masking terms.

Causality, windows and chunks are its static masks; segment ids, key lengths and block padding its segment ids.
Off a TPU it runs in Pallas interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from mha_jax import _platform, _tiles, masks
from mha_spec.terms import Where

_LANES = 128  # the kernel's blocks are whole multiples of the TPU's 128 lanes
BLOCKS = (512, 256, 128)

INTERNALS = {module: names for module, names in _platform.INTERNALS.items() if module.startswith(splash.__name__)}


def jax_internals() -> dict:
    """The names of ``INTERNALS`` from jax's splash modules; an ImportError naming what moved."""
    return {name: getattr(_platform.jax_internal(m), name) for m, names in INTERNALS.items() for name in names}


def refusal(spec: masks.Spec, *, dropout: bool) -> str | None:
    """Why the kernel cannot express this call (naming the argument), or None."""
    if not all(isinstance(n, int) for n in spec.shape[2:]):
        return "a symbolic length (jax.export.symbolic_shape: its block tables are built for known lengths)"
    if spec.allowed is not None:
        return "a dense mask (use is_causal, local_window_size, segment ids or key_value_seq_lengths)"
    if spec.bias is not None:
        return "bias"
    if dropout:
        return "dropout"
    if (spec.is_causal or spec.window is not None) and not spec.default_positions:
        return "query_positions/key_positions with is_causal or local_window_size (only default positions)"
    if spec.chunk_size is not None and (not spec.is_causal or spec.window is not None):  # positions: refused above
        return "attention_chunk_size without is_causal or with local_window_size (its chunks are causal ones)"
    return None


def run(query, key, value, *, spec, scale, soft_cap, sinks, interpret, **_):
    """(output, None, None): ``attention``'s, as the dispatch's runners give theirs."""
    out = attention(query, key, value, spec, scale=scale, soft_cap=soft_cap, sinks=sinks, interpret=interpret)
    return out, None, None


def block_size(length: int) -> int:
    """The largest of 512, 256, 128 that divides ``length`` (a multiple of 128)."""
    return next(b for b in BLOCKS if length % b == 0)


def padded(length: int) -> int:
    return -(-max(length, 1) // _LANES) * _LANES


def attention(query, key, value, spec: masks.Spec, *, scale: float, soft_cap=None, sinks=None, interpret=False):
    """float32 ``(batch, q_len, heads, v_head_dim)`` of query, key, value in the public layout; sinks ``(heads,)``."""
    batch, heads, q_len, kv_len = spec.shape
    if jnp.dtype(query.dtype).itemsize > 4:  # the kernel computes in float32 at most
        query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
    q_pad, kv_pad = padded(q_len), padded(kv_len)
    built = kernel(heads, q_pad, kv_pad, spec.is_causal, spec.window, spec.chunk_size, soft_cap, interpret)
    q = _tiles.pad((query * jnp.asarray(scale, query.dtype)).transpose(0, 2, 1, 3), 2, q_pad)
    k, v = (_tiles.pad(x.transpose(0, 2, 1, 3), 2, kv_pad) for x in (key, value))
    q_ids, kv_ids = _segment_ids(spec, q_pad, kv_pad)
    sinks = None if sinks is None else sinks.astype(jnp.float32)

    def one(q, k, v, q_ids, kv_ids, sinks):  # one example; the ids None where not needed
        ids = None if q_ids is None else splash.SegmentIds(q_ids, kv_ids)
        return built(q, k, v, segment_ids=ids, sinks=sinks)
    batched = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None))
    out = _platform.on(None if interpret else "tpu", batched, q, k, v, q_ids, kv_ids, sinks, x32=True)
    out = out[:, :, :q_len].astype(jnp.float32).transpose(0, 2, 1, 3)
    return jnp.where(has_key(spec), out, 0.0)


@functools.lru_cache(maxsize=64)
def kernel(heads, q_len, kv_len, causal, window, chunk, soft_cap, interpret):
    """The kernel for one mask structure and padded size (cached: its block tables are NumPy work)."""
    internal = jax_internals()
    if chunk is not None:  # causal within each chunk of positions (Llama 4's)
        one = internal["ChunkedCausalMask"]((q_len, kv_len), chunk_size=chunk)
    elif window is not None:
        left, right = window
        one = splash.LocalMask((q_len, kv_len), window_size=(left, 0 if causal else right), offset=0)
    elif causal:
        one = splash.CausalMask((q_len, kv_len))
    else:
        one = splash.FullMask((q_len, kv_len))
    bq, bk = block_size(q_len), block_size(kv_len)
    sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                              block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    # ``make_splash_mha`` with NumPy block tables, so that it can be built inside a trace
    mask = splash.MultiHeadMask([one] * heads)
    shards = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1)
    fwd, function = internal["process_mask"](mask, (bq, bk), **shards)
    dq, _ = internal["process_mask"](mask, (bq, bk), **shards)
    dkv, _ = internal["process_mask_dkv"](mask, (bq, bk), shrink_grid=True, **shards)
    return internal["SplashAttentionKernel"](
        fwd, dq, dkv, block_sizes=sizes, is_mqa=False, save_residuals=False, mask_value=internal["DEFAULT_MASK_VALUE"],
        attn_logits_soft_cap=soft_cap, residual_checkpoint_name=None, mask_function=function, interpret=interpret,
    )


def _segment_ids(spec: masks.Spec, q_pad: int, kv_pad: int):
    """int32 ``(batch, q_pad)``, ``(batch, kv_pad)`` segment ids (lengths, padding: an id no query has), or Nones."""
    batch, _, q_len, kv_len = spec.shape
    padding = kv_pad != kv_len
    if spec.query_segment_ids is None and spec.lengths is None and not padding:
        return None, None
    if spec.query_segment_ids is None:
        qs, ks = jnp.zeros((1, q_len), jnp.int32), jnp.zeros((1, kv_len), jnp.int32)
    else:
        qs, ks = spec.query_segment_ids, spec.key_segment_ids
    # an id below every query's (or above, should the smallest be int32's least)
    low, high = qs.min(), qs.max()
    none = jnp.where(low > jnp.iinfo(jnp.int32).min, low - 1, high + 1)
    qs, ks = jnp.broadcast_to(qs, (batch, q_len)), jnp.broadcast_to(ks, (batch, kv_len))
    if spec.lengths is not None:
        ks = jnp.where(jnp.arange(kv_len)[None] < spec.lengths[:, None], ks, none)
    qs = jnp.pad(qs, ((0, 0), (0, q_pad - q_len)), mode="edge")
    ks = jnp.pad(ks, ((0, 0), (0, kv_pad - kv_len)), constant_values=none)
    return qs, ks


def has_key(spec: masks.Spec):
    """bool ``(batch, q_len, 1, 1)``: whether each query may attend to some key, found by bisection on the
    range ``[lo, hi]`` its positional terms leave it (and its segment's keys in it), without ``(q_len, kv_len)``."""
    batch, _, q_len, kv_len = spec.shape
    ranged = spec.terms.only({"position", "index", "length"})
    query = Where(jnp.arange(q_len, dtype=jnp.int32)[None])
    lengths = None if spec.lengths is None else spec.lengths[:, None]
    last = kv_len - 1

    def live(first, final):  # keys first..final, at positions equal to their indices
        keys = (Where(x, index=x, length=lengths) for x in (first, final))
        return ranged.block(query, query, *keys)[1]
    lo, hi = jnp.zeros((1, q_len), jnp.int32), jnp.full((1, q_len), last, jnp.int32)
    if ranged:
        first, end = jnp.zeros((1, q_len), jnp.int32), jnp.full((1, q_len), kv_len, jnp.int32)
        lo = _least(lambda k: live(jnp.zeros_like(k), k), first, end, kv_len)
        hi = last - _least(lambda k: live(last - k, jnp.full_like(k, last)), first, end, kv_len)
    ok = lo <= hi
    if spec.query_segment_ids is not None:
        n = max(x.shape[0] for x in (spec.query_segment_ids, spec.key_segment_ids, lo, hi))
        rows = (jnp.broadcast_to(x, (n, x.shape[1])) for x in (spec.query_segment_ids, spec.key_segment_ids, lo, hi))
        ok = ok & jax.vmap(_segment_in_range)(*rows)
    return jnp.broadcast_to(ok, (batch, q_len))[:, :, None, None]


def _least(holds, first, end, n: int):
    """By bisection, the least ``k`` in ``[first, end)`` (at most ``n`` long) where ``holds(k)``, else ``end``."""
    for _ in range(max(n, 1).bit_length()):
        mid = (first + end) // 2
        yes, active = holds(mid), first < end
        first, end = jnp.where(active & ~yes, mid + 1, first), jnp.where(active & yes, mid, end)
    return first


def _segment_in_range(qs, ks, lo, hi):
    """bool ``(q_len,)``: whether a key of each query's segment ``qs`` has its index in ``[lo, hi]``."""
    order = jnp.argsort(ks, stable=True).astype(jnp.int32)  # by segment, indices ascending within each
    ids, last = ks[order], ks.shape[0] - 1
    start, end = jnp.searchsorted(ids, qs, side="left"), jnp.searchsorted(ids, qs, side="right")
    first = _least(lambda mid: order[jnp.minimum(mid, last)] >= lo, start, end, ks.shape[0])  # index >= lo
    return (first < end) & (order[jnp.minimum(first, last)] <= hi)
