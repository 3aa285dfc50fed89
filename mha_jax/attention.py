"""Scaled dot-product attention, the functional core.

Twin of ``mha_torch/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``jax.nn.dot_product_attention``: query ``(batch, q_len, heads, head_dim)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from mha_jax import _blockwise, _checks, _platform, _ring, _splash, _tiles, masks
from mha_jax.masks import MASK_LAYOUT
from mha_spec import arguments, batch_axes, docstrings


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What one implementation takes; the choice and its error messages are read from these."""

    name: str
    weights: bool = False  # return_weights (only a kernel that forms the weights)
    dropout: bool = True
    soft_cap: bool = True
    sinks: bool = True
    alibi: bool = True  # alibi_slopes (the ALiBi term read on positions)
    forward_mode: bool = False  # jax.jvp, jacfwd, derivatives of derivatives (custom-VJP kernels have none)
    dtypes: tuple[str, ...] = ()  # the query/key/value dtypes it takes; () for every floating dtype
    platform: str | None = None  # the platform it is compiled for; None for every platform
    interpret_elsewhere: bool = False  # on other platforms: Pallas interpret mode (else: an error when lowered)
    ring: bool = False  # runs under ``sequence_axis`` (the ring computes each step itself)
    value_head_dim: bool = True  # a value whose head dim differs from the query's and key's
    residual: bool = True  # return_residual (the logsumexp)
    # per platform where the program is lowered, the kernel it runs (``"flash"``); "default": elsewhere
    per_platform: tuple[tuple[str, str], ...] = ()


_KERNELS = {k.name: k for k in (
    _Kernel("xla", weights=True, forward_mode=True, ring=True),
    _Kernel("blockwise", ring=True),
    # jax.nn.dot_product_attention requires the value's shape to be the key's
    _Kernel("cudnn", dropout=False, soft_cap=False, sinks=False, dtypes=("bfloat16", "float16"), platform="cuda",
            value_head_dim=False),
    _Kernel("splash", dropout=False, alibi=False, platform="tpu", interpret_elsewhere=True,  # its kernel has no bias
            residual=False),
    _Kernel("flash", per_platform=(("cuda", "cudnn"), ("tpu", "splash"), ("default", "blockwise"))),
)}
IMPLEMENTATIONS = tuple(_KERNELS)
_PLATFORM_NAMES = {"cuda": "an NVIDIA GPU", "tpu": "a TPU"}
_AD_TRACERS = ("JVPTracer", "LinearizeTracer")


@docstrings.fill
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    query_positions: jax.Array | None = None,
    key_positions: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_mask: jax.Array | None = None,
    return_weights: bool = False,
    precision: jax.lax.PrecisionLike = None,
    sequence_axis: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head scaled dot-product attention, a drop-in for ``jax.nn.dot_product_attention``.

    Its arguments in its order and with its meaning (``docs/drop-in.md`` lists the differences), then this
    package's terms, keywords only. Every masking term combines with the others (logical and; the bias is added).

    Args:
      query: ``(batch, q_len, heads, head_dim)``, or ``(q_len, heads, head_dim)``: one example (key, value,
        output and residual then without the batch axis too; masks and biases broadcast to
        ``(1, heads, q_len, kv_len)``, lengths have shape ``(1,)`` or ``()``).
      key: ``(batch, kv_len, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``, and query head
        ``h`` reads key/value head ``h // (heads // kv_heads)``.
      value: ``(batch, kv_len, kv_heads, v_head_dim)``, ``v_head_dim`` may differ from ``head_dim``
        (as in multi-head latent attention); the output has it.
      bias: real floating, broadcasting to ``(batch, heads, q_len, kv_len)``; added to the
        scaled logits (``-inf`` excludes a key; a finite value below ``-0.1 x`` the compute dtype's largest
        counts as that value, so that only a mask or ``-inf`` excludes).
      mask: broadcasts to ``(batch, heads, q_len, kv_len)``; bool (as jax.nn's), or any dtype with
        nonzero = attend (as in flax: its ``make_attention_mask``/``make_causal_mask`` float32 0/1 masks
        work as they are).
      {masking_terms}
      query_seq_lengths: integer ``(batch,)``: queries at index ``>=`` the length are padding: their
        output (and weights) 0, their residual that of a row with no key, no gradient through them.
      {logit_terms}
      implementation: ``"xla"`` (the plain formulation), ``"blockwise"`` (online softmax over blocks, memory
        linear in length, empty blocks skipped), ``"cudnn"`` (NVIDIA GPUs, through ``jax.nn.dot_product_attention``;
        bfloat16/float16; no ``logit_soft_cap``, ``sinks`` or dropout), ``"splash"`` (JAX's Pallas TPU kernel; no
        ``mask``, ``bias``, ``alibi_slopes``, dropout, ``return_residual`` or position arrays with causality/windows;
        float32 at most; off a TPU, slow Pallas interpret mode), ``"flash"`` (``"cudnn"`` on an NVIDIA GPU,
        ``"splash"`` on a TPU, else or where that kernel cannot express the call ``"blockwise"``), or None:
        ``"xla"``. The platform is the one the program is lowered for, not the host's. Every implementation but
        ``"xla"`` has first-order reverse-mode derivatives only.
      return_residual: also return the logsumexp of each query's scores (natural log; the scaled, capped,
        biased logits, with the sink's): ``(batch, q_len, heads)`` in the input dtype, without gradient,
        as ``jax.nn``'s; a query with no key gets ``-0.7 x`` float32's largest value (jax.nn's; float16: its
        lowest finite). Not with ``return_weights``, ``"splash"`` or ``sequence_axis``.
      dropout_rate: probability of dropping an attention weight; kept weights are scaled by
        ``1 / (1 - dropout_rate)``.
      dropout_rng: PRNG key drawing the dropout mask when ``dropout_rate > 0`` (each implementation
        draws its own).
      dropout_mask: explicit keep-mask (True = keep) broadcasting to
        ``(batch, heads, q_len, kv_len)``; when given it is used instead of ``dropout_rng``.
      return_weights: also return the attention weights actually applied to ``value``
        (``"xla"`` only: the other implementations never form them); with ``sinks`` the
        sink's share is not among them.
      precision: passed to the matrix products.
      sequence_axis: a mesh axis (of ``jax.set_mesh``'s mesh) sharding the query and key/value lengths as
        ``P(None, sequence_axis)``: ring attention (key/value blocks passed round in a zig-zag order). Both lengths
        must be multiples of twice the axis's size. No ``return_weights``; first-order reverse-mode derivatives only.
    Returns:
      ``(batch, q_len, heads, v_head_dim)`` in the input dtype; with ``return_weights``, ``(output, weights)``,
      weights ``(batch, heads, q_len, kv_len)``; with ``return_residual``, ``(output, residual)``. A query that
      may attend to no key gets an output row of 0 and weights 0 (jax.nn: the mean of the values). No inf or NaN
      is formed inside (``jax.debug_infs``, ``jax.debug_nans``) but from a user's ``-inf``. bfloat16/float16 inputs
      are computed in float32, float64 in float64 (jax.nn: its softmax in float32).
    """
    unbatched = _checks.check_unbatched(query, key, value)
    if unbatched:  # one example: a batch axis of 1, dropped again from the results
        query, key, value = (jnp.asarray(x)[None] for x in (query, key, value))
    batch, q_len, heads, _, kv_len, _ = _checks.check_attention_inputs(query, key, value)
    spec = masks.parse((batch, heads, q_len, kv_len), **batch_axes.masking(locals()))
    result = spec_attention(
        query, key, value, spec, scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, dropout_mask=dropout_mask, return_weights=return_weights, precision=precision,
        implementation=implementation, sequence_axis=sequence_axis, return_residual=return_residual,
    )
    if unbatched:
        return tuple(x[0] for x in result) if isinstance(result, tuple) else result[0]
    return result


def spec_attention(query, key, value, spec: masks.Spec, *, scale=None, logit_soft_cap=None, sinks=None,
                   dropout_rate=0.0, dropout_rng=None, dropout_mask=None, return_weights=False, precision=None,
                   implementation=None, zero_unused=True, sequence_axis=None, return_residual=False):
    """``dot_product_attention`` on checked inputs and a parsed ``spec`` (the modules' entry).
    ``zero_unused=False`` skips zeroing the keys no query sees (a decoding cache's slots are finite)."""
    batch, heads, q_len, kv_len = shape = spec.shape
    kv_heads, head_dim, v_dim = key.shape[2], query.shape[3], value.shape[3]
    scale = arguments.check_scale(scale)
    soft_cap = arguments.check_logit_soft_cap(logit_soft_cap)
    if sinks is not None:
        _checks.require_float("sinks", sinks)
        arguments.check_sinks_shape(sinks.shape, heads)
    if return_residual and return_weights:
        raise ValueError("return_weights=True and return_residual=True cannot both be given; ask for one")
    keep, rng, keep_scale = _dropout_keep(dropout_rate, dropout_rng, dropout_mask, shape)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    ring = None if sequence_axis is None else _ring.check(
        sequence_axis, q_len, kv_len, dropout_rng=rng, return_weights=return_weights, implementation=implementation,
        return_residual=return_residual,
    )
    dtype = query.dtype
    compute = jnp.promote_types(dtype, jnp.float32)
    rows = masks.query_rows(spec)  # (batch, 1, q_len, 1) or None
    rows = None if rows is None else rows[:, 0, :, :, None]  # (batch, q_len, 1, 1): as the query
    if rows is not None:  # padding queries hold zeros: whatever they held (NaN) reaches nothing
        query = jnp.where(rows, query, 0)
    if kv_len == 0:
        return _no_keys(query, key, value, sinks, shape, return_weights, return_residual)
    kernel = _choose(
        implementation, return_weights, keep is not None or rng is not None, query.dtype,
        soft_cap is not None, sinks is not None, v_dim != head_dim, spec.alibi_slopes is not None, return_residual,
    )
    if not kernel.forward_mode:
        _check_derivatives(kernel.name, query, key, value, spec.bias, sinks)
    if ring is not None and not kernel.ring:
        raise ValueError(
            f"sequence_axis={sequence_axis!r} does not take implementation={kernel.name!r}; use None, 'xla' or "
            "'blockwise' (the ring computes each step itself)"
        )
    _check_head_sharding(query, heads, kv_heads)
    groups = heads // kv_heads
    if spec.alibi_slopes is not None:  # the ALiBi term in the compute dtype, on every path
        spec = dataclasses.replace(spec, alibi_slopes=spec.alibi_slopes.astype(compute))
    if spec.bias is not None:  # its finite values above every masked score (no inf: see _tiles)
        spec = dataclasses.replace(spec, bias=_tiles.floored_bias(spec.bias, compute))
    if ring is not None:  # zeroes its own padding (and masked) keys, block by block
        out = _ring.attention(
            query.reshape(batch, q_len, kv_heads, groups, head_dim), key, value, spec,
            axis=sequence_axis, size=ring, scale=scale, soft_cap=soft_cap,
            sinks=None if sinks is None else sinks.astype(compute).reshape(kv_heads, groups), precision=precision,
            allowed=_grouped(spec.allowed, kv_heads), bias=_grouped(spec.bias, kv_heads),
            keep=_grouped(keep, kv_heads), dropout_rng=rng, dropout_rate=dropout_rate, keep_scale=keep_scale,
        )
        return _query_rows(out.reshape(batch, q_len, heads, v_dim).astype(dtype), rows)
    unused = masks.unused_keys(spec, kv_heads) if zero_unused else None
    if unused is not None:  # per key/value head, in the key layout (batch, kv_len, kv_heads, 1)
        unused = unused.transpose(0, 2, 1)[..., None]
        key, value = jnp.where(unused, 0, key), jnp.where(unused, 0, value)
    call = dict(spec=spec, scale=scale, soft_cap=soft_cap, sinks=sinks, keep=keep, rng=rng, dropout_rate=dropout_rate,
                keep_scale=keep_scale, precision=precision, compute=compute)
    if kernel.name == "xla":
        out, weights, lse = _run_xla(query, key, value, **call)
    else:
        out, weights = _per_platform(kernel, query, key, value, dict(call, residual=return_residual)), None
        out, lse = out if return_residual else (out, None)
    out = _query_rows(out.reshape(batch, q_len, heads, v_dim).astype(dtype), rows)
    if return_weights:
        return out, weights.reshape(shape).astype(dtype)
    if return_residual:
        lse = jax.lax.stop_gradient(lse.reshape(batch, q_len, heads))
        no_key = _no_key_residual(dtype)
        lse = lse if rows is None else jnp.where(rows[..., 0], lse, no_key)
        return out, jnp.maximum(lse, no_key).astype(dtype)
    return out


def _query_rows(out, rows):
    """``out`` ``(batch, q_len, heads, d)`` with the padding queries' rows 0 (``rows`` None: every row kept)."""
    return out if rows is None else jnp.where(rows, out, 0)


def _no_key_residual(dtype):
    """The residual of a query with no key: jax.nn's (``-0.7 x`` float32's largest, as float32 rounds it), or
    ``dtype``'s lowest finite value where that is higher (float16: jax.nn's overflows to -inf)."""
    value = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))
    return np.asarray(max(value, float(jnp.finfo(dtype).min)), jnp.promote_types(dtype, jnp.float32))[()]


def _no_keys(query, key, value, sinks, shape, return_weights, return_residual=False):
    """Zeros ``(batch, q_len, heads, v_head_dim)`` (and weights ``(batch, heads, q_len, 0)``, or the residual of
    queries with no key), kept in the graph."""
    batch, heads, q_len, _ = shape
    kv_heads, head_dim, groups = key.shape[2], query.shape[3], heads // key.shape[2]
    empty = jnp.einsum("bqhgd,bkhd->bhgqk", query.reshape(batch, q_len, kv_heads, groups, head_dim), key)
    if sinks is not None:
        empty = empty + sinks.reshape(1, kv_heads, groups, 1, 1).astype(empty.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", empty, value).reshape(batch, q_len, heads, value.shape[3])
    if return_residual:
        return out, jnp.full(out.shape[:3], _no_key_residual(out.dtype), out.dtype)
    return (out, empty.reshape(shape)) if return_weights else out


def _check_head_sharding(query, heads, kv_heads):
    """Refuse query heads sharded over Explicit axes whose size does not divide ``kv_heads``."""
    sharding = getattr(jax.typeof(query), "sharding", None)
    axes = (tuple(getattr(sharding, "spec", ())) + (None,) * 3)[2]
    if axes is None:
        return
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    if kv_heads % shards:
        raise ValueError(
            f"query's {heads} heads are sharded over mesh axes {axes} ({shards} shards), which does not divide "
            f"its {kv_heads} key/value heads: each group of {heads // kv_heads} query heads must stay with its "
            f"key/value head; shard the heads over axes of a size that divides {kv_heads}, or not at all"
        )


def _choose(implementation, return_weights, dropout, dtype, soft_cap=False, sinks=False, value_dim=False,
            alibi=False, residual=False) -> _Kernel:
    """The record of the implementation asked for, after the checks that hold on every platform."""
    if implementation is None:
        return _KERNELS["xla"]
    arguments.check_implementation(implementation, IMPLEMENTATIONS)
    kernel = _KERNELS[implementation]
    if return_weights and not kernel.weights:
        raise ValueError(f"return_weights=True needs implementation='xla', got {implementation!r}")
    if kernel.per_platform:  # what a platform's kernel cannot take is decided where it is lowered
        return kernel
    if kernel.platform is not None and not kernel.interpret_elsewhere:
        dropout = dtype = None  # refused on its platform, after the platform itself (see ``_branch``)
    refused = _refusal(kernel, dropout, dtype, soft_cap, sinks, value_dim, alibi, residual)
    if refused is not None:
        error, message = refused
        raise error(message)
    return kernel


def _refusal(kernel: _Kernel, dropout, dtype, soft_cap, sinks, value_dim=False, alibi=False,
             residual=False) -> tuple[type, str] | None:
    """(exception type, message) when ``kernel`` cannot take a call of these options, else None."""
    name = kernel.name
    if residual and not kernel.residual:
        return ValueError, f"implementation={name!r} does not take return_residual=True; use 'xla' or 'blockwise'"
    if value_dim and not kernel.value_head_dim:
        return ValueError, (f"implementation={name!r} does not take a value head dim apart from the key's "
                            "(value's last axis must be key's); use 'xla' or 'blockwise'")
    asked = (("logit_soft_cap", soft_cap, kernel.soft_cap), ("sinks", sinks, kernel.sinks),
             ("alibi_slopes", alibi, kernel.alibi))
    missing = [n for n, given, takes in asked if given and not takes]
    if missing:
        return ValueError, f"implementation={name!r} does not take {' and '.join(missing)}; use 'xla' or 'blockwise'"
    if dropout and not kernel.dropout:
        return ValueError, f"implementation={name!r} does not take dropout here; use 'blockwise' or 'xla'"
    if kernel.dtypes and dtype is not None and jnp.dtype(dtype).name not in kernel.dtypes:
        return TypeError, f"implementation={name!r} needs {' or '.join(kernel.dtypes)} query/key/value, got {dtype}"
    return None


def _per_platform(kernel: _Kernel, query, key, value, call):
    """Output ``(batch, q_len, heads, v_head_dim)`` in the compute dtype, from the lowering platform's kernel."""
    pairs = kernel.per_platform or ((kernel.platform or "default", kernel.name),)
    if kernel.interpret_elsewhere:
        pairs += (("default", kernel.name),)
    value_dim = value.shape[-1] != key.shape[-1]
    names = {platform: _resolve(kernel.name, name, query.dtype, call, value_dim) for platform, name in pairs}
    if set(names.values()) == {"blockwise"}:  # one kernel everywhere (it places its own blocks on a mesh)
        return _run_blockwise(query, key, value, **call)
    sharded = _sharded_axes(query, key)
    if sharded is not None:  # Pallas and cuDNN kernels are not partitioned: one call per device
        return _per_device(kernel, names, query, key, value, call, *sharded)
    return _dispatch(kernel, names, query, key, value, call)


def _dispatch(kernel: _Kernel, names: dict, query, key, value, call):
    branches = {platform: _branch(platform, name, call) for platform, name in names.items()}
    if "default" not in branches:  # elsewhere, a clear error when (and only when) lowered
        branches["default"] = _unavailable(
            f"implementation={kernel.name!r} needs {_PLATFORM_NAMES[kernel.platform]}; the program is being "
            "lowered for {platform!r}", residual=call["residual"],
        )
    default = branches.pop("default")
    return jax.lax.platform_dependent(query, key, value, default=default, **branches)


def _sharded_axes(query, key):
    """(batch axes, heads axes) where Explicit mesh axes shard the query's batch or heads, else None."""
    if not tuple(getattr(jax.sharding.get_abstract_mesh(), "explicit_axes", ())):
        return None
    q_spec, k_spec = (tuple(jax.typeof(x).sharding.spec) + (None,) * 4 for x in (query, key))
    if not (q_spec[0] or q_spec[2]):
        return None
    if q_spec[1] or q_spec[3] or k_spec[1] or k_spec[3]:
        raise ValueError(
            f"this implementation runs on each device's whole sequences: the query is sharded as {q_spec[:4]} and the "
            f"key as {k_spec[:4]}; shard the batch and heads only (sequence_axis shards the lengths)"
        )
    return q_spec[0], q_spec[2]


def _per_device(kernel: _Kernel, names, query, key, value, call, batch, heads):
    """``_dispatch`` inside ``jax.shard_map`` over the mesh's Explicit axes (per device: its examples and heads)."""
    spec, b = call["spec"], call["spec"].shape[0]
    arrays = _platform.spec_arrays(spec)
    specs = {n: None if x is None else P(batch if x.shape[0] == b else None, *(None,) * (x.ndim - 1))
             for n, x in arrays.items()}
    for n in ("allowed", "bias"):  # (batch|1, heads|1, q, k): heads too
        if arrays[n] is not None:
            arrays[n] = x = arrays[n].reshape((1,) * (4 - arrays[n].ndim) + arrays[n].shape)
            specs[n] = P(batch if x.shape[0] == b else None, heads if x.shape[1] > 1 else None, None, None)
    if arrays["alibi_slopes"] is not None:  # (batch|1, heads): heads too
        specs["alibi_slopes"] = P(batch if arrays["alibi_slopes"].shape[0] == b else None, heads)
    layout, sinks = P(batch, None, heads, None), call["sinks"]
    out_specs = (layout, P(batch, None, heads)) if call["residual"] else layout

    def local(q, k, v, arrays, sinks):
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        here = dict(call, spec=dataclasses.replace(spec, shape=shape, **arrays), sinks=sinks)
        return _dispatch(kernel, names, q, k, v, here)
    specs = (layout, layout, layout, specs, None if sinks is None else P(heads))
    return _blockwise.per_device(local, (query, key, value, arrays, sinks), specs, out_specs, check_vma=False)


def _resolve(asked: str, name: str, dtype, call, value_dim=False):
    """The kernel name to run for ``asked`` on ``name``'s platform, or a refusal ``(exception type, message)``."""
    spec = call["spec"]
    refused = _refusal(_KERNELS[name], call["rng"] is not None or call["keep"] is not None, dtype,
                       call["soft_cap"] is not None, call["sinks"] is not None, value_dim,
                       spec.alibi_slopes is not None, call["residual"])
    if asked != name:  # "flash": the platform's kernel where it takes the call
        if refused is not None or (name == "splash" and _splash.refusal(spec, dropout=False) is not None):
            return "blockwise"
        return name
    if refused is not None:
        return refused
    if name == "splash":
        why = _splash.refusal(spec, dropout=call["rng"] is not None or call["keep"] is not None)
        if why is not None:
            raise ValueError(f"implementation='splash' does not take {why}; use 'xla' or 'blockwise'")
    return name


def _branch(platform: str, name, call):
    """The function run on ``platform``: ``name``'s kernel, or a refusal when lowered."""
    if isinstance(name, tuple):
        return _unavailable(name[1].replace("{", "{{").replace("}", "}}"), name[0], call["residual"])
    run = {"blockwise": _run_blockwise, "cudnn": _run_cudnn}.get(name)
    run = run or functools.partial(_run_splash, interpret=platform != "tpu")  # Pallas interpret mode off a TPU
    return lambda q, k, v: jax.tree.map(lambda x: x.astype(call["compute"]), run(q, k, v, **call))


def _run_xla(query, key, value, *, spec, scale, soft_cap, sinks, keep, rng, dropout_rate, keep_scale, precision,
             compute):
    """(output, weights, lse ``(batch, q_len, heads)``): the weights' softmax read once for all three."""
    batch, heads, q_len, _ = spec.shape
    q = query.astype(compute).reshape(batch, q_len, key.shape[2], heads // key.shape[2], query.shape[3])
    if rng is not None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, spec.shape)
    out, weights, lse = _xla(q, key.astype(compute), value.astype(compute), masks.dense(spec), masks.biases(spec), keep,
                             keep_scale, scale, precision, soft_cap, None if sinks is None else sinks.astype(compute))
    return out, weights, lse.transpose(0, 2, 1)  # (batch, q_len, heads)


def _run_blockwise(query, key, value, *, spec, scale, soft_cap, sinks, keep, rng, dropout_rate, keep_scale, precision,
                   compute, residual=False):
    batch, heads, q_len, kv_len = spec.shape
    kv_heads, head_dim = key.shape[2], query.shape[3]
    groups = heads // kv_heads
    q = query.astype(compute).reshape(batch, q_len, kv_heads, groups, head_dim)
    k, v = key.astype(compute), value.astype(compute)
    causal = spec.is_causal or spec.window is not None
    block_q, block_k = _blockwise.block_sizes(q_len, kv_len, batch * kv_heads, groups, causal)
    out = _blockwise.attention(
        q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), spec,
        allowed=_grouped(spec.allowed, kv_heads), bias=_grouped(spec.bias, kv_heads), keep=_grouped(keep, kv_heads),
        dropout_rng=rng, scale=scale, dropout_rate=dropout_rate, keep_scale=keep_scale, precision=precision,
        block_q=block_q, block_k=block_k, soft_cap=soft_cap,
        sinks=None if sinks is None else sinks.astype(compute).reshape(1, kv_heads, groups), residual=residual,
    )
    if residual:  # (batch, kv_heads, groups, q_len) -> (batch, q_len, heads)
        out, lse = out
        lse = _tiles.residual(lse, _no_key_residual(lse.dtype)).transpose(0, 3, 1, 2).reshape(query.shape[:3])
    out = out.transpose(0, 3, 1, 2, 4).reshape(query.shape[:3] + value.shape[3:])
    return (out, lse) if residual else out


def _run_cudnn(query, key, value, *, spec, scale, residual=False, **_):
    def kernel(q, k, v, arrays):
        with _platform.cudnn_traced_anywhere():
            return _cudnn(q, k, v, dataclasses.replace(spec, **arrays), scale, residual)
    return _platform.on("cuda", kernel, query, key, value, _platform.spec_arrays(spec))


def _run_splash(query, key, value, *, spec, scale, soft_cap, sinks, interpret, **_):
    return _splash.attention(query, key, value, spec, scale=scale, soft_cap=soft_cap, sinks=sinks, interpret=interpret)


# Stands for a kernel off its platform: traces as the identity, fails with its message only when lowered.
_unavailable_p = Primitive("mha_kernel_unavailable")
_unavailable_p.def_abstract_eval(lambda x, **_: x)
ad.defjvp(_unavailable_p, lambda t, x, **_: t)
batching.primitive_batchers[_unavailable_p] = lambda args, dims, **kw: (_unavailable_p.bind(*args, **kw), dims[0])
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _refuse_lowering(ctx, x, *, message, error):
    platforms = getattr(ctx.module_context, "platforms", None) or ("this platform",)
    raise _ERRORS[error](message.format(platform=platforms[0] if len(platforms) == 1 else platforms))


def _refuse_running(x, *, message, error):  # run eagerly (outside jit), on the default backend's devices
    raise _ERRORS[error](message.format(platform=jax.default_backend()))


mlir.register_lowering(_unavailable_p, _refuse_lowering)
_unavailable_p.def_impl(_refuse_running)


def _unavailable(message: str, error: type = ValueError, residual: bool = False):
    """A branch that fails with ``message`` (``{platform}`` filled in) where it is lowered."""
    def branch(query, key, value):
        compute = jnp.promote_types(query.dtype, jnp.float32)
        # stands for the output (batch, q_len, heads, v_head_dim), as the kernel's branch gives it
        out = jnp.broadcast_to(query[..., :1], query.shape[:3] + value.shape[3:]).astype(compute)
        out = _unavailable_p.bind(out, message=message, error=error.__name__)
        return (out, out[..., 0]) if residual else out
    return branch


def _check_derivatives(implementation: str, *arrays) -> None:
    """Refuse forward mode or a second derivative of a custom-VJP kernel (seen on the traced inputs)."""
    for x in arrays:
        kinds = []
        while isinstance(x, jax.core.Tracer):
            kinds.append(type(x).__name__)
            x = getattr(x, "primal", getattr(x, "val", None))
        if "JVPTracer" in kinds or sum(kind in _AD_TRACERS for kind in kinds) > 1:
            raise NotImplementedError(
                f"implementation={implementation!r} has first-order reverse-mode derivatives only "
                "(jax.grad, jax.vjp); forward mode (jax.jvp, jacfwd, hessian) and derivatives of "
                "derivatives need implementation='xla'"
            )


def _xla(q, k, v, allowed, bias, keep, keep_scale, scale, precision, soft_cap=None, sinks=None):
    """(out, weights, lse ``(b, heads, q)``) of q ``(b, q, kv_heads, groups, d)``, k ``(b, k, kv_heads, d)``,
    v ``(b, k, kv_heads, dv)``."""
    batch, q_len, kv_heads, groups, _ = q.shape
    shape = (batch, kv_heads * groups, q_len, k.shape[1])
    logits = _scores(q, k, precision).reshape(shape) * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    weights, lse = _masked_softmax(logits, allowed, bias, sinks)
    if keep is not None:
        weights = jnp.where(keep, weights * keep_scale, 0.0)
    out = _mix(weights.reshape(batch, kv_heads, groups, q_len, k.shape[1]), v, precision)
    return out, weights, lse


# Few query rows over many keys: one product over every head's keys reads the cache in place (no head-major copy).
_ROWS_OVER_HEADS = 1024
_MANY_KEYS = 128


def _over_all_heads(x, q_len, kv_len, groups: int, kv_heads: int) -> bool:
    if not (isinstance(q_len, int) and isinstance(kv_len, int)):  # symbolic (jax.export): per head
        return False
    # per head on an Explicit mesh, whose sharding each reshape merging heads into rows would have to state
    if any(axis is not None for axis in getattr(jax.typeof(x).sharding, "spec", ())):
        return False
    return kv_len >= _MANY_KEYS and q_len * groups * kv_heads * kv_heads <= _ROWS_OVER_HEADS


def own_blocks(x, axis1: int, axis2: int):
    """The diagonal of two kv_heads axes, moved to ``axis1``."""
    return jnp.moveaxis(jnp.diagonal(x, axis1=axis1, axis2=axis2), -1, axis1)


def _scores(q, k, precision):
    """Logits ``(b, kv_heads, groups, q, k)`` of q ``(b, q, kv_heads, groups, d)`` against k ``(b, k, kv_heads, d)``."""
    batch, q_len, kv_heads, groups, head_dim = q.shape
    kv_len = k.shape[1]
    rows = q.transpose(0, 2, 3, 1, 4)  # each key/value head's queries as rows
    if not _over_all_heads(k, q_len, kv_len, groups, kv_heads):
        logits = jnp.einsum("bhmd,bhkd->bhmk", rows.reshape(batch, kv_heads, groups * q_len, head_dim),
                            k.transpose(0, 2, 1, 3), precision=precision)
        return logits.reshape(batch, kv_heads, groups, q_len, kv_len)
    every = jnp.einsum("bmd,bcd->bmc", rows.reshape(batch, -1, head_dim), k.reshape(batch, kv_len * kv_heads, head_dim),
                       precision=precision)
    return own_blocks(every.reshape(batch, kv_heads, groups, q_len, kv_len, kv_heads), 1, 5)


def _mix(weights, v, precision):
    """Outputs ``(b, q, kv_heads, groups, dv)`` of weights ``(b, kv_heads, groups, q, k)`` over v ``(b, k, h, dv)``."""
    batch, kv_heads, groups, q_len, kv_len = weights.shape
    if not _over_all_heads(v, q_len, kv_len, groups, kv_heads):
        out = jnp.einsum("bhmk,bhkd->bhmd", weights.reshape(batch, kv_heads, groups * q_len, kv_len),
                         v.transpose(0, 2, 1, 3), precision=precision)
        out = out.reshape(batch, kv_heads, groups, q_len, -1)
    else:
        every = jnp.einsum("bmk,bkc->bmc", weights.reshape(batch, -1, kv_len), v.reshape(batch, kv_len, -1),
                           precision=precision)
        out = own_blocks(every.reshape(batch, kv_heads, groups, q_len, kv_heads, v.shape[-1]), 1, 4)
    return out.transpose(0, 3, 1, 2, 4)


def _cudnn(query, key, value, spec: masks.Spec, scale, residual=False):
    """cuDNN's attention with our semantics: float32 ``(batch, q_len, heads, v_head_dim)``, fully masked rows 0
    (``residual``: and the lse ``(batch, q_len, heads)``). Other terms than default-position causality and
    lengths go into its mask (jax #32357)."""
    batch, heads, q_len, kv_len = shape = spec.shape
    native_causal = spec.is_causal and spec.default_positions
    allowed = masks.dense(dataclasses.replace(spec, is_causal=spec.is_causal and not native_causal, lengths=None,
                                              query_lengths=None))
    bias = masks.biases(spec)  # with the ALiBi term, a dense bias
    out = jax.nn.dot_product_attention(
        query, key, value,
        bias=None if bias is None else jnp.broadcast_to(bias, shape).astype(query.dtype),
        mask=None if allowed is None else jnp.broadcast_to(allowed, shape), scale=scale,
        is_causal=native_causal, key_value_seq_lengths=spec.lengths, query_seq_lengths=spec.query_lengths,
        implementation="cudnn", return_residual=residual,
    )
    out, lse = out if residual else (out, None)
    live = [x for x in (masks.dense(spec), None if spec.bias is None else ~_tiles.below_all(spec.bias))
            if x is not None]
    live = functools.reduce(jnp.logical_and, live, jnp.ones(shape, bool))
    has_key = live.any(axis=-1).transpose(0, 2, 1)[..., None]  # (b, q, heads, 1)
    out = jnp.where(has_key, out.astype(jnp.float32), 0.0)
    if residual:
        return out, jnp.where(has_key[..., 0], lse.astype(jnp.float32), _no_key_residual(jnp.float32))
    return out


def _grouped(x, kv_heads):
    """A mask broadcasting to (b, heads, q, k) as 5-d (b|1, kv_heads|1, groups|1, q|1, k|1)."""
    if x is None:
        return None
    x = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, x.shape[2], x.shape[3])


def _masked_softmax(logits: jax.Array, allowed: jax.Array | None, bias: jax.Array | None,
                    sinks=None) -> tuple[jax.Array, jax.Array]:
    """(softmax over the last axis of ``(batch, heads, q_len, kv_len)``, 0 on rows with no key; its lse ``(batch,
    heads, q_len)``, ``_no_key_residual`` on those rows); sinks ``(heads,)``. Masked scores are finite
    (``_tiles.masked``): no inf is formed, whatever is masked."""
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if allowed is not None:
        logits = jnp.where(allowed, logits, _tiles.masked(logits.dtype))
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jax.lax.stop_gradient(row_max)
    row_max = jnp.where(_tiles.has_key(row_max), row_max, 0.0)  # no key: exp(masked) is 0
    exp = jnp.exp(logits - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sink - row_max)
    lse = jnp.where(total > 0.0, row_max + jnp.log(jnp.where(total > 0.0, total, 1.0)), _no_key_residual(total.dtype))
    return exp / jnp.where(total == 0.0, 1.0, total), lse[..., 0]


def _dropout_keep(rate, rng, dropout_mask, shape):
    """(bool keep-mask or None, PRNG key to draw one or None, scale of kept weights)."""
    rate = arguments.check_dropout_rate("dropout_rate", rate)
    if dropout_mask is not None:
        _checks.check_dropout_mask(dropout_mask, shape, MASK_LAYOUT)
        return jnp.asarray(dropout_mask) != 0, None, 1.0 / (1.0 - rate)
    if rate == 0.0:
        return None, None, 1.0
    if rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng or dropout_mask")
    return None, rng, 1.0 / (1.0 - rate)  # each implementation draws its own mask from the key
