"""Steps the nnx (``module.py``) and linen (``linen.py``) modules share, on inputs with merged batch axes."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax import _cache, _checks, _dispatch, masks, paged
from mha_jax import latent as mla
from mha_jax.attention import spec_attention
from mha_spec import arguments, batch_axes, kv_cache, query_terms
from mha_spec import paged as paged_spec
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale
from mha_spec.rotary import rotate_at


@dataclasses.dataclass(frozen=True)
class Cache:
    """``key``/``value`` ``(batch, max_length, kv_heads, head_dim)`` (``value`` None: latent), ``end``, ``overflow``."""

    key: jax.Array
    value: jax.Array | None
    end: jax.Array
    overflow: jax.Array


def _check_inputs(inputs_q, inputs_k, inputs_v, in_features: int | None, in_kv_features: int | None):
    """``(self_attention, inputs_q, inputs_k, inputs_v)``, defaulted as flax's and checked."""
    self_attention, inputs_q, inputs_k, inputs_v = arguments.default_inputs(
        inputs_q, inputs_k, inputs_v, ("inputs_q", "inputs_k", "inputs_v"), "array")
    if in_features is None:
        in_features, in_kv_features = (x.shape[-1] if getattr(x, "ndim", 0) >= 1 else 0 for x in (inputs_q, inputs_k))
    for name, x, features, feat_name in (
        ("inputs_q", inputs_q, in_features, "in_features"),
        ("inputs_k", inputs_k, in_kv_features, "in_kv_features"),
        ("inputs_v", inputs_v, in_kv_features, "in_kv_features"),
    ):
        _checks.require_array(name, x)
        if _checks.dtype_kind(x) != "complex":  # complex ones as flax's classes take them: see _complex_attention_fn
            _checks.require_float(name, x)
        arguments.check_input_features(name, x.shape, features, feat_name)
    arguments.check_inputs_agree(("inputs_q", "inputs_k", "inputs_v"), (inputs_q.shape, inputs_k.shape, inputs_v.shape),
                                 (inputs_q.dtype, inputs_k.dtype, inputs_v.dtype))
    return self_attention, inputs_q, inputs_k, inputs_v


def prepare(inputs: tuple, masking: Mapping, num_heads: int, features: tuple[int | None, int | None], *,
            max_length: int | None = None, sequence_axis: str | None = None) -> batch_axes.Call:
    """The checked call (``batch_axes.merged_call``); ``features`` None: read from the inputs (linen)."""
    self_attention, *inputs = _check_inputs(*inputs, *features)
    # a ring's sharded length: segments absent from the queries are not looked for
    zero_unused = functools.partial(masks.zero_unused_inputs, segments=sequence_axis is None)
    return batch_axes.merged_call(tuple(inputs), self_attention, masking, jnp.broadcast_to, masks.parse, zero_unused,
                                  num_heads, max_length)


def check_cache(key, value, index, overflow, batch_shape, batch: int, n: int, kv_heads: int, head_dim: int) -> Cache:
    """A module's cache checked against the step, batch axes merged; ``index`` may be a scalar and ``overflow`` None
    (flax's cache)."""
    index = jnp.asarray(index)
    index = jnp.broadcast_to(index, batch_shape) if index.ndim == 0 else index
    overflow = jnp.zeros(index.shape, bool) if overflow is None else overflow
    kv_cache.check_cache(("cached_key", "cache_index"), "call init_cache with the inputs' batch axes", key.shape,
                         index.shape, batch_shape, kv_heads, head_dim, n)
    flat = (batch,) + tuple(key.shape[len(batch_shape):])
    value = None if value is None else value.reshape(flat)  # None: a latent cache, keys alone
    return Cache(key.reshape(flat), value, index.reshape(batch), overflow.reshape(batch))


def decode_step(cache: Cache, rotary, query, key, value, call: batch_axes.Call, query_scale: QueryScale | None = None,
                norms=None):
    """Rotate ``query`` and ``key`` ``(batch, n, heads, head_dim)`` at the new positions (then ``norms``; ``query``
    then scaled by ``query_scale``), append ``key``/``value``: ``(query, cache, spec)``, ``spec`` over the new queries
    and the cache's slots."""
    start = cache.end
    pos = _cache.positions(start, query.shape[1], call.query_positions)
    query, key = rotate(rotary, query, key, pos, pos, norms)
    query = scale_queries(query_scale, query, pos)
    max_length = cache.key.shape[1]
    kv_cache.check_dtype(str(cache.key.dtype), str(key.dtype), "cached_key",
                         f"init_cache(input_shape, dtype={key.dtype})")
    end = _cache.advance(start, pos)
    overflow = kv_cache.check_step(start, end, max_length, call.spec.terms,
                                   lambda x: np.asarray(x) if _checks.concrete(x) else None)
    written = (_cache.write(cache.key, key, pos), None if value is None else _cache.write(cache.value, value, pos))
    updated = Cache(*written, end, cache.overflow | overflow)
    return query, updated, masks.over_cache(call.spec, pos, *_cache.slot_positions(end, max_length))


def attention_inputs(module, query, key, value, spec: masks.Spec, cache: Cache | None, norms=None):
    """The attended queries, keys and values: over ``cache`` while decoding, else rotated at ``spec``'s positions
    (then ``norms``)."""
    if cache is not None and module.latent is not None:
        return mla.absorb_query(module, query), *mla.cached_keys(cache.key, module.latent, query.dtype)
    if cache is not None:
        return query, cache.key.astype(query.dtype), cache.value.astype(query.dtype)
    if module.latent is not None:
        return mla.attention_inputs(module, query, key, spec)
    query_positions, key_positions = masks.positions(spec)
    query, key = rotate(module.rotary, query, key, query_positions, key_positions, norms)
    return scale_queries(module.query_scale, query, query_positions), key, value


def rotate(rotary, query, key, query_positions, key_positions, norms=None):
    """``rotate_at``, then ``norms`` (the query's and the key's QK-norm with ``after_rotary``, or None)."""
    query, key = rotate_at(rotary, query, key, query_positions, key_positions)
    return (query, key) if norms is None else (norms[0](query), norms[1](key))


def value_norm(query_ln, value):
    """``value`` ``(..., heads, head_dim)`` normed as ``query_ln``'s ``QKNorm.of_values`` says (unchanged without)."""
    norm = getattr(getattr(query_ln, "qk_norm", None), "of_values", None)
    return value if norm is None else qk_norm(value, None, norm)


def norms_after_rotary(query_ln, key_ln) -> tuple | None:
    """``(query_ln, key_ln)`` when their ``QKNorm`` is applied after the rotary embedding, else None."""
    return (query_ln, key_ln) if getattr(getattr(query_ln, "qk_norm", None), "after_rotary", False) else None


def scale_queries(query_scale: QueryScale | None, query: jax.Array, positions: jax.Array) -> jax.Array:
    """``query`` ``(batch, len, heads, head_dim)`` times ``query_scale``'s factor at ``positions``
    ``(batch|1, len)``."""
    if query_scale is None:
        return query
    compute = jnp.promote_types(query.dtype, jnp.float32)
    factor = query_scale.factor(jnp.asarray(positions).astype(compute), jnp.floor, jnp.log1p)
    return query * factor[:, :, None, None].astype(query.dtype)


def gated(out: jax.Array, raw: jax.Array, output_gate: str) -> jax.Array:
    """Each head's output ``(batch, len, heads, head_dim)`` times its gate, the sigmoid (or softplus) of the gate
    projection ``raw`` ``(batch, len, heads[, head_dim])``; the softplus in float32 or wider, as transformers'."""
    if query_terms.gate_softplus(output_gate):
        gate = jax.nn.softplus(raw.astype(jnp.promote_types(raw.dtype, jnp.float32))).astype(out.dtype)
    else:
        gate = jax.nn.sigmoid(raw)
    return out * (gate[..., None] if output_gate.startswith("head") else gate)


def paged_attend(module, query: jax.Array, key: jax.Array, value: jax.Array, norms, cache: paged.PagedKVCache,
                 max_q_len: int | None, sinks: jax.Array | None) -> tuple[jax.Array, paged.PagedKVCache]:
    """A paged step of a layer's projections ``(1, total_q, heads, head_dim)`` (one row of packed tokens): rotated
    and scaled at the tokens' positions in ``cache``, keys and values written, then ``paged.ragged_attention`` with
    the layer's terms: ``(out (1, total_q, heads, head_dim), cache)``. With a latent (``value`` None), ``key``
    holds the latent entries ``(1, total_q, 1, cache_dim)``, written as the key and the value of one head; the
    queries absorbed, the outputs' first ``kv_lora_rank`` lifted to the value heads."""
    latent = module.latent
    positions = paged_spec.token_positions(paged_spec.step_arrays(cache), jnp.arange(query.shape[1]), jnp)[2][None]
    rotary = module.rotary if latent is None else mla.rope_part(module.rotary, latent)
    query, key = rotate(rotary, query, key, positions, positions, norms)
    query = scale_queries(module.query_scale, query, positions)
    if latent is not None:
        query, value = mla.absorb_query(module, query), key
    cache = paged.write(cache, key[0], value[0])
    out = paged.ragged_attention(
        query[0], cache, max_q_len=max_q_len, local_window_size=module.local_window_size,
        attention_chunk_size=module.attention_chunk_size, scale=module.scale, logit_soft_cap=module.logit_soft_cap,
        alibi_slopes=None if module.alibi_slopes is None else jnp.asarray(module.alibi_slopes), sinks=sinks)[None]
    return (out if latent is None else mla.lift_output(module, out[..., :latent.kv_lora_rank])), cache


def project_terms(module, query: jax.Array, key: jax.Array, value: jax.Array):
    """The projections clamped to ``[-clip_qkv, clip_qkv]`` (after the QK-norm), unchanged without ``clip_qkv``."""
    if module.clip_qkv is None:
        return query, key, value
    return tuple(jnp.clip(x, -module.clip_qkv, module.clip_qkv) for x in (query, key, value))


def attend(module, query, key, value, spec: masks.Spec, batch_shape, *, dropout_rng, dropout_mask,
            sow_weights: bool, return_weights: bool, attention_fn_kwargs: Mapping = MappingProxyType({}),
            zero_unused: bool = True, sinks: jax.Array | None = None, sequence_axis: str | None = None):
    """Attention of ``(batch, len, heads, head_dim)`` inputs with flax's dropout: ``(out, weights, sown)``, each of
    the weights None unless asked for."""
    rate, attention_fn = module.dropout_rate, module.attention_fn
    if attention_fn is None and _checks.dtype_kind(query) == "complex":
        attention_fn = _complex_attention_fn(module, sinks, sequence_axis=sequence_axis, dropout_mask=dropout_mask,
                                             return_weights=return_weights or None)
    elif attention_fn is not None:
        if sequence_axis is not None:
            raise ValueError("sequence_axis reaches only this package's attention: leave attention_fn None to use it")
        if return_weights:
            raise ValueError("return_weights=True needs attention_fn=None; with an attention_fn use sow_weights=True")
        given = list(_logit_terms(module, sinks))
        if given:
            raise ValueError(
                f"{', '.join(given)} reach only this package's attention: leave attention_fn None to use them"
            )
    if attention_fn is not None:
        out = _call_attention_fn(module, attention_fn, query, key, value, spec, batch_shape, dropout_rng, sow_weights,
                                 attention_fn_kwargs)
        return out, None, None
    if dropout_rng is not None:
        shape = (1, 1) + spec.shape[2:] if module.broadcast_dropout else spec.shape
        dropout_mask = jax.random.bernoulli(dropout_rng, 1.0 - rate, shape)
    dropped = dropout_mask is not None
    # weights come from "xla"; sown ones are formed on the side when another implementation or dropout is used
    want = return_weights or sow_weights and not dropped and _dispatch.record(module.implementation).weights
    logits = _logit_terms(module, sinks)
    result = spec_attention(
        query, key, value, spec, dropout_rate=rate if dropped else 0.0, dropout_mask=dropout_mask,
        return_weights=want, precision=module.precision, implementation=module.implementation,
        zero_unused=zero_unused, sequence_axis=sequence_axis, **logits,
    )
    out, weights = result if want else (result, None)
    sown = None
    # force_fp32_for_softmax: flax sows a narrower dtype's weights from the float32 softmax
    wide = attention_fn_kwargs.get("force_fp32_for_softmax") and jnp.finfo(query.dtype).bits < 32
    if sow_weights:  # flax sows the weights before dropout
        sown = weights if weights is not None and not dropped and not wide else spec_attention(
            *(x.astype(jnp.float32) if wide else x for x in (query, key, value)), spec, return_weights=True,
            precision=module.precision, **logits,  # the default forms the weights
        )[1]
        sown = batch_axes.unflatten_batch(sown, batch_shape)
    weights = None if weights is None or not return_weights else batch_axes.unflatten_batch(weights, batch_shape)
    return out, weights, sown


def _complex_attention_fn(module, sinks, **options) -> Callable[..., jax.Array]:
    """flax's ``dot_product_attention`` for complex inputs; refuses this package's additions."""
    given = [name for name, value in dict(
        **_logit_terms(module, sinks), implementation=module.implementation, **options).items() if value is not None]
    if given:
        raise ValueError(
            f"complex inputs are attended by flax's dot_product_attention, which takes no {', '.join(given)}: "
            f"pass real floating-point inputs to use {'them' if len(given) > 1 else 'it'}"
        )
    if isinstance(module, nnx.Module):
        return nnx.dot_product_attention
    from flax.linen import dot_product_attention  # linen is imported only where a linen module needs it
    return dot_product_attention


def call_masking(module, call: str, masking: Mapping, **given) -> dict:
    """A call's masking arguments (``batch_axes.call_masking``): ``**masking`` and the call's own, ``given`` by
    name."""
    slopes = None if module.alibi_slopes is None else jnp.asarray(module.alibi_slopes)
    return batch_axes.call_masking(module.local_window_size, module.attention_chunk_size, slopes,
                                   arguments.position_masking(call, masking), **given)


def check_sequence_axis(sequence_axis):
    if sequence_axis is not None and not isinstance(sequence_axis, str):
        raise TypeError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}")
    return sequence_axis


def _logit_terms(module, sinks) -> dict:
    """Those of ``scale``, ``logit_soft_cap`` and ``sinks`` that are set, by name."""
    terms = dict(scale=module.scale, logit_soft_cap=module.logit_soft_cap, sinks=sinks)
    return {name: value for name, value in terms.items() if value is not None}


def qk_norm(x: jax.Array, scale: jax.Array, qk_norm: QKNorm) -> jax.Array:
    """``x`` ``(..., heads, head_dim)`` as ``qk_norm`` normalises it, in float32 or wider; in ``x``'s dtype."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    scale = 1.0 if scale is None else scale.astype(compute)  # None: a weightless norm
    y = qk_norm.normalize(x.astype(compute), scale, _mean, jax.lax.rsqrt)
    return y.astype(x.dtype)


def _mean(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return x.mean(axis=axes, keepdims=True)


def _call_attention_fn(module, attention_fn, query, key, value, spec, batch_shape, dropout_rng, sow_weights, extra):
    """A flax-style ``attention_fn`` called as flax calls it; the spec reaches it as a boolean mask."""
    parameters = inspect.signature(attention_fn).parameters
    # flax passes is_causal from nnx's class, never from linen's, unless the function names it
    passes_causal = isinstance(module, nnx.Module) or "is_causal" in parameters
    native_causal = spec.is_causal and spec.default_positions and passes_causal
    allowed = masks.dense(dataclasses.replace(spec, is_causal=spec.is_causal and not native_causal))

    def logits_shaped(x):  # masks of fewer than 4 axes broadcast from the right as they are
        return x if x is None or x.ndim < 4 else batch_axes.unflatten_batch(x, batch_shape)

    kwargs = dict(
        mask=logits_shaped(allowed), bias=logits_shaped(masks.biases(spec)), dropout_rng=dropout_rng,
        dropout_rate=module.dropout_rate, broadcast_dropout=module.broadcast_dropout,
        deterministic=dropout_rng is None, dtype=module.dtype, precision=module.precision,
        module=module if sow_weights else None, **extra,
    )
    if passes_causal:
        kwargs["is_causal"] = native_causal
    if kwargs["bias"] is None:  # neither flax class passes bias: not to a function taking **kwargs either
        del kwargs["bias"]
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        dropped = [name for name, value in kwargs.items() if name not in parameters and value not in (None, False)]
        if dropped:
            raise TypeError(
                f"attention_fn {getattr(attention_fn, '__name__', attention_fn)!r} takes no "
                f"{', '.join(dropped)}, which this call needs"
            )
        kwargs = {name: value for name, value in kwargs.items() if name in parameters}
    q, k, v = (batch_axes.unflatten_batch(x, batch_shape) for x in (query, key, value))
    out = attention_fn(q, k, v, **kwargs)
    return out.reshape(query.shape[:2] + out.shape[-2:])


def dropping(rate: float, deterministic: bool | None, default: bool | None, dropout_mask=None) -> bool:
    """Whether a call draws dropout: a rate, no mask given, and not deterministic (the call's, else ``default``)."""
    return dropout_mask is None and rate > 0 and not arguments.resolve_deterministic(deterministic, default)
