"""``flax.nnx`` multi-head attention, a drop-in for ``flax.nnx.MultiHeadAttention``.

Twin of ``mha_torch/module.py``. The constructor and the call take what flax's class takes, in
flax's order, with flax's meaning; the parameter tree is flax's: ``query``/``key``/``value`` with
``kernel (in, heads, head_dim)`` and ``bias (heads, head_dim)``, ``out`` with
``kernel (heads, head_dim, out)`` and ``bias (out,)``, and with ``normalize_qk`` the LayerNorm
scales ``query_ln``/``key_ln``. Built from the same ``nnx.Rngs`` it holds flax's parameters.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from mha_jax import _cache, _checks, masks
from mha_jax.attention import IMPLEMENTATIONS, _attention
from mha_spec import arguments, batch_axes, terms
from mha_spec.qk_norm import QKNorm

INPUT_LAYOUT = "(*batch, length, features)"
_NO_METADATA: Mapping[str, Any] = MappingProxyType({})


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query) attention with input and output projections.

    Args (flax's, in flax's positional order; then this module's additions):
      num_heads: query heads.
      in_features: feature size of ``inputs_q``.
      qkv_features: total query feature size ``num_heads * head_dim``; default ``in_features``.
      out_features: output feature size; default ``in_features``.
      num_kv_heads: key/value heads, dividing ``num_heads``; default ``num_heads``.
      in_kv_features: feature size of ``inputs_k`` and ``inputs_v``; default ``in_features``.
      dtype: computation dtype; default: promoted from inputs and parameters.
      param_dtype: parameter dtype.
      broadcast_dropout: one dropout mask ``(q_len, kv_len)`` shared by the batch and heads (flax's
        default) instead of one per batch row and head.
      dropout_rate: dropout on the attention weights.
      deterministic: default for the call's ``deterministic`` (``.eval()``/``nnx.view`` set it).
      precision: precision of every matrix product.
      kernel_init, bias_init: initialisers of the projections.
      out_kernel_init, out_bias_init: of the output projection; default ``kernel_init``/``bias_init``.
      use_bias: biases on the four projections.
      attention_fn: None (this package's attention, every mask form and implementation) or a
        function with the signature of ``flax.nnx.dot_product_attention``, called as flax calls it;
        positions, windows, segments and lengths then reach it as a boolean ``mask``.
      decode: autoregressive decoding with the key/value cache of ``init_cache`` (default False).
      normalize_qk: True: flax's LayerNorm (no bias) on each head's queries and keys
        (``query_ln``/``key_ln``, each ``scale``); a ``QKNorm`` for another norm (RMS, over the
        whole projection, ``1 + scale``, its epsilon).
      qkv_promote_dtype, out_promote_dtype, ln_promote_dtype: dtype promotion of the query/key/value
        projections, the output projection and the LayerNorms, as in flax.
      qkv_dot_general, out_dot_general, qkv_dot_general_cls, out_dot_general_cls: the projections'
        ``dot_general``, as in flax.
      rngs: ``nnx.Rngs`` for the parameters and, with ``dropout_rate > 0``, the dropout stream.
      keep_rngs: keep a dropout stream forked from ``rngs`` (else pass ``rngs`` to each call).
      kernel_metadata, out_kernel_metadata, bias_metadata, out_bias_metadata,
        query_ln_scale_metadata, key_ln_scale_metadata: parameter metadata (sharding), as in flax.
      implementation: attention implementation, see ``mha_jax.dot_product_attention``.
      scale: multiplies the logits; default ``1 / sqrt(head_dim)``.
      logit_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking (Gemma 2).
      use_sinks: a learned logit per query head, ``sinks`` ``(num_heads,)``, joins each row's
        softmax normaliser without a value (gpt-oss); initialised by ``sinks_init``.
      rotary: a ``RotaryEmbedding`` applied to queries and keys (after ``normalize_qk``) at their
        positions (``query_positions``/``key_positions``, default ``arange``; while decoding, the
        cache's positions).
      local_window_size: the call's default window (a sliding-window layer), see the call.
      attention_chunk_size: the layer's chunks of positions (Llama 4's chunked attention), see
        ``mha_jax.dot_product_attention``; also while decoding.
      use_out_bias: a bias on the output projection; default ``use_bias`` (Qwen2: biases on the
        query/key/value projections only).
      sequence_axis: a mesh axis over which the length is sharded: ring attention, see
        ``mha_jax.dot_product_attention`` (not while decoding, whose steps attend over the cache
        as without it).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: jax.lax.PrecisionLike = None,
        kernel_init: nnx.Initializer = nnx.initializers.lecun_normal(),
        out_kernel_init: nnx.Initializer | None = None,
        bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
        out_bias_init: nnx.Initializer | None = None,
        use_bias: bool = True,
        attention_fn: Callable[..., jax.Array] | None = None,
        decode: bool | None = None,
        normalize_qk: bool = False,
        qkv_promote_dtype: Callable = dtypes.promote_dtype,
        out_promote_dtype: Callable = dtypes.promote_dtype,
        ln_promote_dtype: Callable = dtypes.promote_dtype,
        qkv_dot_general: Callable | None = None,
        out_dot_general: Callable | None = None,
        qkv_dot_general_cls: Any = None,
        out_dot_general_cls: Any = None,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = _NO_METADATA,
        out_kernel_metadata: Mapping[str, Any] = _NO_METADATA,
        bias_metadata: Mapping[str, Any] = _NO_METADATA,
        out_bias_metadata: Mapping[str, Any] = _NO_METADATA,
        query_ln_scale_metadata: Mapping[str, Any] = _NO_METADATA,
        key_ln_scale_metadata: Mapping[str, Any] = _NO_METADATA,
        implementation: str | None = None,
        scale: float | None = None,
        logit_soft_cap: float | None = None,
        use_sinks: bool = False,
        sinks_init: nnx.Initializer = nnx.initializers.zeros_init(),
        rotary: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        use_out_bias: bool | None = None,
        sequence_axis: str | None = None,
        attention_chunk_size: int | None = None,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.in_features = in_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        for name in ("in_features", "in_kv_features", "out_features"):
            arguments.check_heads(1, 1, getattr(self, name), name)
        self.head_dim = arguments.check_heads(num_heads, self.num_kv_heads, self.qkv_features, "qkv_features")
        self.dropout_rate = arguments.check_dropout_rate("dropout_rate", dropout_rate)
        self.broadcast_dropout = broadcast_dropout
        self.deterministic = deterministic
        self.decode = decode
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.use_bias = use_bias
        self.normalize_qk = normalize_qk
        self.attention_fn = attention_fn
        self.implementation = arguments.check_implementation(implementation, IMPLEMENTATIONS)
        self.scale = arguments.check_scale(scale)
        self.logit_soft_cap = logit_soft_cap
        self.rotary = rotary
        self.local_window_size = arguments.check_window(local_window_size)
        self.attention_chunk_size = terms.check_chunk_size(attention_chunk_size)
        self.sequence_axis = _check_sequence_axis(sequence_axis)
        qk_norm = arguments.check_qk_norm(normalize_qk)

        common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

        def projection(in_features, out_features):
            return nnx.LinearGeneral(
                in_features, out_features, kernel_init=kernel_init, bias_init=bias_init,
                promote_dtype=qkv_promote_dtype, dot_general=qkv_dot_general, dot_general_cls=qkv_dot_general_cls,
                kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, **common,
            )

        # flax's order of construction, so that the same Rngs give the same parameters
        self.query = projection(in_features, (num_heads, self.head_dim))
        self.key = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.value = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        if qk_norm is not None and qk_norm == QKNorm(eps=qk_norm.eps):
            def layer_norm(metadata):
                return nnx.LayerNorm(
                    self.head_dim, use_bias=False, epsilon=qk_norm.eps, dtype=dtype, param_dtype=param_dtype,
                    promote_dtype=ln_promote_dtype, rngs=rngs, scale_metadata=metadata,
                )
            self.query_ln = layer_norm(query_ln_scale_metadata)
            self.key_ln = layer_norm(key_ln_scale_metadata)
        elif qk_norm is not None:
            self.query_ln = _Norm(qk_norm, num_heads, self.head_dim, param_dtype, query_ln_scale_metadata, rngs)
            self.key_ln = _Norm(qk_norm, self.num_kv_heads, self.head_dim, param_dtype, key_ln_scale_metadata, rngs)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = nnx.LinearGeneral(
            (num_heads, self.head_dim), self.out_features, axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
            promote_dtype=out_promote_dtype, dot_general=out_dot_general, dot_general_cls=out_dot_general_cls,
            kernel_metadata=out_kernel_metadata or kernel_metadata, bias_metadata=out_bias_metadata or bias_metadata,
            **dict(common, use_bias=use_bias if use_out_bias is None else use_out_bias),
        )
        self.sinks = nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype)) if use_sinks else nnx.data(None)
        self.rngs = rngs.dropout.fork() if keep_rngs and self.dropout_rate > 0 else None

    # No cache until init_cache (or nnx.update with a cache's state, ours or flax's): as in flax's
    # class, the instance has no such attributes, so that nnx.update can add them.
    cached_key = cached_value = cache_index = cache_overflow = None

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool = False,
        out_sharding=None,
        qkv_sharding=None,
        bias: jax.Array | None = None,
        query_positions: jax.Array | None = None,
        key_positions: jax.Array | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        query_segment_ids: jax.Array | None = None,
        key_segment_ids: jax.Array | None = None,
        key_value_seq_lengths: jax.Array | None = None,
        dropout_mask: jax.Array | None = None,
        return_weights: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attend from ``inputs_q`` to ``inputs_k``/``inputs_v``.

        Args (flax's, then this module's additions):
          inputs_q: ``(*batch, q_len, in_features)``; any number of batch axes, none included.
          inputs_k: ``(*batch, kv_len, in_kv_features)``; default ``inputs_q`` (self-attention).
          inputs_v: ``(*batch, kv_len, in_kv_features)``; default ``inputs_k``.
          mask: broadcasts to ``(*batch, num_heads, q_len, kv_len)``; any dtype, nonzero = attend.
          deterministic: no dropout when True; overrides the constructor's.
          rngs: dropout randomness; overrides the stream kept at construction.
          sow_weights: store the attention weights ``(*batch, num_heads, q_len, kv_len)``, before
            dropout, as ``nnx.Intermediate`` ``attention_weights`` (flax's name); any implementation.
          decode: append the inputs' keys and values to the cache and attend over everything
            cached (``init_cache`` first): any number of new tokens, at ``query_positions``
            ``(batch, n)`` (default: each row's ``cache_index + arange(n)``; ``-1`` marks padding,
            not cached). Masks and biases then span the cache: ``(*batch, heads, n, max_length)``.
          is_causal: key position <= query position.
          out_sharding, qkv_sharding: output sharding of the output and the q/k/v projections.
          bias: added to the logits, broadcasting to ``(*batch, num_heads, q_len, kv_len)``.
          query_positions, key_positions, local_window_size, query_segment_ids, key_segment_ids,
            key_value_seq_lengths: as in ``mha_jax.dot_product_attention``, with the batch axes of
            the inputs; in self-attention (``inputs_k`` not given, or ``inputs_q`` itself) the key
            positions and segment ids default to the query's.
          dropout_mask: explicit keep-mask broadcasting to ``(*batch, num_heads, q_len, kv_len)``;
            always applied, kept weights scaled by ``1 / (1 - dropout_rate)``.
          return_weights: also return the weights ``(*batch, num_heads, q_len, kv_len)``.

        Returns:
          ``(*batch, q_len, out_features)``, or ``(output, weights)``.
        """
        if self.decode if decode is None else decode:
            local_window_size = self.local_window_size if local_window_size is None else local_window_size
            return self._decode(
                inputs_q, inputs_k, inputs_v, mask=mask, bias=bias, is_causal=is_causal, query_positions=query_positions,
                local_window_size=local_window_size, rngs=rngs, deterministic=deterministic, sow_weights=sow_weights,
                return_weights=return_weights, out_sharding=out_sharding, qkv_sharding=qkv_sharding,
                forbidden=dict(key_positions=key_positions, query_segment_ids=query_segment_ids,
                               key_segment_ids=key_segment_ids, key_value_seq_lengths=key_value_seq_lengths,
                               dropout_mask=dropout_mask),
            )
        local_window_size = self.local_window_size if local_window_size is None else local_window_size
        batch_shape, (inputs_q, inputs_k, inputs_v), spec, dropout_mask = _prepare(
            inputs_q, inputs_k, inputs_v, self.num_heads, self.in_features, self.in_kv_features,
            mask=mask, bias=bias, dropout_mask=dropout_mask, is_causal=is_causal,
            query_positions=query_positions, key_positions=key_positions, local_window_size=local_window_size,
            query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
            key_value_seq_lengths=key_value_seq_lengths, attention_chunk_size=self.attention_chunk_size,
        )
        dropping = dropout_mask is None and self.dropout_rate > 0 and not arguments.resolve_deterministic(deterministic, self.deterministic)
        dropout_rng = _dropout_key(rngs if rngs is not None else self.rngs) if dropping else None

        # a length sharded for the ring: segments absent from the queries are not looked for
        inputs_k, inputs_v = masks._zero_unused_inputs(inputs_k, inputs_v, spec, segments=self.sequence_axis is None)
        query = self.query(inputs_q, out_sharding=qkv_sharding)
        key = self.key(inputs_k, out_sharding=qkv_sharding)
        value = self.value(inputs_v, out_sharding=qkv_sharding)
        if self.query_ln is not None:
            query, key = self.query_ln(query), self.key_ln(key)
        query, key = _rotate(self.rotary, query, key, *masks._positions(spec))
        out, weights, sown = _attend(
            self, query, key, value, spec, batch_shape, dropout_rng=dropout_rng, dropout_mask=dropout_mask,
            sow_weights=sow_weights, return_weights=return_weights, sinks=self._sinks(), sequence_axis=self.sequence_axis,
        )
        if sown is not None:
            self.sow(nnx.Intermediate, "attention_weights", sown)
        out = batch_axes.unflatten_batch(self.out(out, out_sharding=out_sharding), batch_shape)
        return (out, weights) if return_weights else out

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...]

    def init_cache(self, input_shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> None:
        """A key/value cache for ``decode=True``, as flax's: ``input_shape`` is
        ``(*batch, max_length, features)``; ``cached_key``/``cached_value`` are
        ``(*batch, max_length, num_kv_heads, head_dim)`` (key/value heads only), ``cache_index``
        holds each row's next position ``(*batch,)`` (flax: one for all rows, ``()``), and
        ``cache_overflow`` ``(*batch,)`` turns True when a step inside ``jit`` overwrote a position
        a query could still see (outside ``jit`` that step raises instead). A cache flax's class
        made, given by ``nnx.update`` (a scalar ``cache_index``, no flag), is taken as every row
        at that position; the next step leaves one index per row and the flag."""
        input_shape = tuple(input_shape)
        if len(input_shape) < 2 or not all(isinstance(n, int) and n >= 0 for n in input_shape) or input_shape[-2] < 1:
            raise ValueError(f"input_shape must be (*batch, max_length, features) with max_length >= 1, got {input_shape}")
        batch_shape, max_length = input_shape[:-2], input_shape[-2]
        shape = (*batch_shape, max_length, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.zeros(batch_shape, jnp.int32))
        self.cache_overflow = nnx.Cache(jnp.zeros(batch_shape, bool))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | tuple[int, ...] | None = None, max_length: int | None = None):
        """``nnx.view``'s hook: the modes flax's class answers (``deterministic``, ``decode``, and
        ``batch_size``/``max_length`` of a cache made when ``decode`` is set and none exists)."""
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if decode and self.cached_key is None:
                if batch_size is None or max_length is None:
                    raise TypeError("'batch_size' and 'max_length' must be provided when initializing cache.")
                batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
                self.init_cache((*batch, max_length, self.in_features), self.dtype or self.param_dtype)

    def _decode(self, inputs_q, inputs_k, inputs_v, *, mask, bias, is_causal, query_positions, local_window_size,
                rngs, deterministic, sow_weights, return_weights, out_sharding, qkv_sharding, forbidden):
        """One decoding step: append the new tokens' keys and values to the cache, attend over it."""
        if self.cached_key is None:
            raise ValueError("decode=True needs a cache: call init_cache(input_shape) or nnx.view(..., decode=True, batch_size=, max_length=) first")
        _, inputs_q, inputs_k, inputs_v = _self_attention(inputs_q, inputs_k, inputs_v)
        _check_inputs(inputs_q, inputs_k, inputs_v, self.in_features, self.in_kv_features)
        batch_shape, (inputs_q, inputs_k, inputs_v), terms = batch_axes.flatten_batch(
            (inputs_q, inputs_k, inputs_v), jnp.broadcast_to, mask=mask, bias=bias, query_positions=query_positions,
        )
        overflow = None if self.cache_overflow is None else self.cache_overflow[...]
        cache = _as_ours(self.cached_key[...], self.cached_value[...], self.cache_index[...], overflow, batch_shape)
        cache = _check_cache(cache, batch_shape, inputs_q.shape[0], inputs_k.shape[1], self.num_kv_heads, self.head_dim, forbidden)
        query = self.query(inputs_q, out_sharding=qkv_sharding)
        key = self.key(inputs_k, out_sharding=qkv_sharding)
        value = self.value(inputs_v, out_sharding=qkv_sharding)
        if self.query_ln is not None:
            query, key = self.query_ln(query), self.key_ln(key)
        pos = _cache.positions(cache.end, query.shape[1], terms["query_positions"])
        query, key = _rotate(self.rotary, query, key, pos, pos)
        cache, spec = _decode_step(cache, key, value, self.num_heads, mask=terms["mask"], bias=terms["bias"],
                                   is_causal=is_causal, query_positions=pos, local_window_size=local_window_size,
                                   attention_chunk_size=self.attention_chunk_size)
        self.cached_key[...], self.cached_value[...] = (x.reshape(self.cached_key.shape) for x in (cache.key, cache.value))
        self.cache_index.set_value(cache.end.reshape(batch_shape))  # flax's scalar index becomes one per row
        if self.cache_overflow is None:  # flax's cache has no flag: it is made here
            self.cache_overflow = nnx.Cache(cache.overflow.reshape(batch_shape))
        else:
            self.cache_overflow[...] = cache.overflow.reshape(batch_shape)
        dropping = self.dropout_rate > 0 and not arguments.resolve_deterministic(deterministic, self.deterministic)
        dropout_rng = _dropout_key(rngs if rngs is not None else self.rngs) if dropping else None
        out, weights, sown = _attend(
            self, query, cache.key.astype(query.dtype), cache.value.astype(query.dtype), spec, batch_shape,
            dropout_rng=dropout_rng, dropout_mask=None, sow_weights=sow_weights, return_weights=return_weights,
            zero_unused=False, sinks=self._sinks(),
        )
        if sown is not None:
            self.sow(nnx.Intermediate, "attention_weights", sown)
        out = batch_axes.unflatten_batch(self.out(out, out_sharding=out_sharding), batch_shape)
        return (out, weights) if return_weights else out


@dataclasses.dataclass(frozen=True)
class _Cache:
    """A cache with one batch axis: ``key``/``value`` ``(batch, max_length, kv_heads, head_dim)``,
    ``end`` int32 ``(batch,)`` (next position), ``overflow`` bool ``(batch,)``."""

    key: jax.Array
    value: jax.Array
    end: jax.Array
    overflow: jax.Array


def _as_ours(key, value, index, overflow, batch_shape) -> _Cache:
    """A cache of ours, or one flax's class made (a scalar ``cache_index``: every row at that
    position; no ``cache_overflow``: nothing overwritten), as ours: ``index`` ``(*batch,)``."""
    index = jnp.asarray(index)
    index = jnp.broadcast_to(index, batch_shape) if index.ndim == 0 else index
    return _Cache(key, value, index, jnp.zeros(index.shape, bool) if overflow is None else overflow)


def _check_cache(cache: _Cache, batch_shape, batch: int, n: int, kv_heads: int, head_dim: int, forbidden) -> _Cache:
    """The cache against the step's inputs, its batch axes merged as the inputs' are."""
    given = [name for name, value in forbidden.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} cannot be given while decoding: the cache sets the keys' positions and lengths")
    expected = (*batch_shape, cache.key.shape[-3], kv_heads, head_dim)
    if tuple(cache.key.shape) != expected or tuple(cache.end.shape) != tuple(batch_shape):
        raise ValueError(
            f"the cache holds cached_key {tuple(cache.key.shape)} and cache_index {tuple(cache.end.shape)}, but the inputs "
            f"need (*batch, max_length, num_kv_heads, head_dim) = {expected} and (*batch,) = {tuple(batch_shape)}; "
            "call init_cache with the inputs' batch axes"
        )
    max_length = cache.key.shape[-3]
    if n > max_length:
        raise ValueError(f"a chunk of {n} tokens does not fit a cache of max_length {max_length}")
    flat = (batch,) + tuple(cache.key.shape[len(batch_shape):])
    return _Cache(cache.key.reshape(flat), cache.value.reshape(flat), cache.end.reshape(batch), cache.overflow.reshape(batch))


def _decode_step(cache: _Cache, key, value, num_heads: int, *, mask, bias, is_causal, query_positions,
                 local_window_size, attention_chunk_size=None):
    """Append ``key``/``value`` ``(batch, n, kv_heads, head_dim)`` to ``cache``; the updated cache
    and the spec of the new queries over its ``max_length`` slots."""
    batch, n, max_length = key.shape[0], key.shape[1], cache.key.shape[1]
    if cache.key.dtype != key.dtype:
        raise TypeError(
            f"cached_key has dtype {cache.key.dtype} but the keys are {key.dtype}: init_cache(input_shape, dtype={key.dtype})"
        )
    start = cache.end
    pos = _cache.positions(start, n, query_positions)
    end = _cache.advance(start, pos)
    window = arguments.check_window(local_window_size)
    bounds = terms.of(arguments.check_is_causal(is_causal), window, attention_chunk_size, False, False)
    overflow = terms.cache_overflows(start, end, max_length, bounds)
    if _checks._concrete(overflow) and bool(overflow.any()):
        row = int(jnp.argmax(overflow))
        raise ValueError(
            f"the cache overflows: row {row} would hold positions up to {int(end[row]) - 1} in max_length {max_length} "
            f"slots, overwriting positions its queries may still see (a window of left + chunk <= max_length makes it a rolling buffer)"
        )
    updated = _Cache(_cache.write(cache.key, key, pos), _cache.write(cache.value, value, pos), end, cache.overflow | overflow)
    held, lengths = _cache.slot_positions(end, max_length)
    spec = masks._parse(
        (batch, num_heads, n, max_length), mask=mask, bias=bias, is_causal=is_causal, query_positions=pos,
        key_positions=held, local_window_size=local_window_size, key_value_seq_lengths=lengths,
        attention_chunk_size=attention_chunk_size,
    )
    return updated, spec


def _prepare(inputs_q, inputs_k, inputs_v, num_heads: int, in_features: int | None, in_kv_features: int | None, *,
             is_causal, local_window_size, dropout_mask, attention_chunk_size=None, **terms):
    """The checked call of a Flax module: ``(batch_shape, inputs, spec, dropout_mask)``, the
    inputs and terms with their batch axes merged into one; feature sizes None are read from
    the inputs (linen)."""
    self_attention, inputs_q, inputs_k, inputs_v = _self_attention(inputs_q, inputs_k, inputs_v)
    if in_features is None:
        in_features, in_kv_features = (x.shape[-1] if getattr(x, "ndim", 0) >= 1 else 0 for x in (inputs_q, inputs_k))
    _check_inputs(inputs_q, inputs_k, inputs_v, in_features, in_kv_features)
    batch_shape, inputs, terms = batch_axes.flatten_batch(
        (inputs_q, inputs_k, inputs_v), jnp.broadcast_to, dropout_mask=dropout_mask, **terms
    )
    dropout_mask = terms.pop("dropout_mask")
    spec = _spec(inputs[0], inputs[1], num_heads, self_attention, is_causal=is_causal,
                 local_window_size=local_window_size, attention_chunk_size=attention_chunk_size, **terms)
    return batch_shape, inputs, spec, dropout_mask


def _self_attention(inputs_q, inputs_k, inputs_v):
    """flax's defaults for absent key and value inputs; True when keys are the queries."""
    if inputs_k is None and inputs_v is not None:
        raise ValueError(
            "`inputs_k` cannot be None if `inputs_v` is not None. To use one array for both, pass it "
            "as inputs_k and leave inputs_v as None"
        )
    self_attention = inputs_k is None or inputs_k is inputs_q
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    return self_attention, inputs_q, inputs_k, inputs_v


def _attend(module, query, key, value, spec: masks._Spec, batch_shape, *, dropout_rng, dropout_mask,
            sow_weights: bool, return_weights: bool, attention_fn_kwargs: Mapping[str, Any] = _NO_METADATA,
            zero_unused: bool = True, sinks: jax.Array | None = None, sequence_axis: str | None = None):
    """Attention of projected ``(batch, len, heads, head_dim)`` inputs with flax's dropout, for
    the nnx and linen modules (``module`` gives the attributes): ``(out, weights, sown)``, the
    weights asked for by ``return_weights`` and those to sow (before dropout, as flax sows them),
    each None unless asked for, with the inputs' batch axes. ``sinks``: the module's ``(num_heads,)``
    sink logits, if it has them; ``sequence_axis``: the ring's mesh axis, or None."""
    rate = module.dropout_rate
    if module.attention_fn is None and _checks._dtype_kind(query) == "complex":
        return _attend_complex(module, query, key, value, spec, batch_shape, dropout_rng=dropout_rng, dropout_mask=dropout_mask,
                               sow_weights=sow_weights, return_weights=return_weights, sinks=sinks, sequence_axis=sequence_axis,
                               attention_fn_kwargs=attention_fn_kwargs)
    if module.attention_fn is not None and sequence_axis is not None:
        raise ValueError("sequence_axis reaches only this package's attention: leave attention_fn None to use it")
    if module.attention_fn is not None:
        if return_weights:
            raise ValueError("return_weights=True needs attention_fn=None; with an attention_fn use sow_weights=True")
        given = list(_logit_terms(module, sinks))
        if given:
            raise ValueError(f"{', '.join(given)} reach only this package's attention: leave attention_fn None to use them")
        out = _call_attention_fn(module, query, key, value, spec, batch_shape, dropout_rng, sow_weights, attention_fn_kwargs)
        return out, None, None
    if dropout_rng is not None:
        shape = (1, 1) + spec.shape[2:] if module.broadcast_dropout else spec.shape
        dropout_mask = jax.random.bernoulli(dropout_rng, 1.0 - rate, shape)
    dropped = dropout_mask is not None
    # weights come from "xla", the implementation that forms them; sown ones are formed on the side
    # when another implementation computes the output or dropout changes the applied weights
    want = return_weights or sow_weights and not dropped and module.implementation in (None, "xla")
    logits = _logit_terms(module, sinks)
    result = _attention(
        query, key, value, spec, dropout_rate=rate if dropped else 0.0, dropout_mask=dropout_mask,
        return_weights=want, precision=module.precision,
        implementation="xla" if want and module.implementation is None else module.implementation, zero_unused=zero_unused,
        sequence_axis=sequence_axis, **logits,
    )
    out, weights = result if want else (result, None)
    sown = None
    # linen's force_fp32_for_softmax: flax sows a narrower dtype's weights as the float32 softmax gave them
    wide = attention_fn_kwargs.get("force_fp32_for_softmax") and jnp.finfo(query.dtype).bits < 32
    if sow_weights:  # flax sows the weights before dropout
        sown = weights if weights is not None and not dropped and not wide else _attention(
            *(x.astype(jnp.float32) if wide else x for x in (query, key, value)), spec, return_weights=True,
            precision=module.precision, implementation="xla", **logits,
        )[1]
        sown = batch_axes.unflatten_batch(sown, batch_shape)
    return out, None if weights is None or not return_weights else batch_axes.unflatten_batch(weights, batch_shape), sown


def _attend_complex(module, query, key, value, spec, batch_shape, *, dropout_rng, dropout_mask, sow_weights,
                    return_weights, sinks, sequence_axis, attention_fn_kwargs):
    """``_attend`` of complex inputs, which flax's classes take: flax's own
    ``dot_product_attention`` (linen's or nnx's, as the module's class), called as flax calls
    it; this package's additions to the attention need real inputs."""
    given = [name for name, value in dict(
        **_logit_terms(module, sinks), implementation=module.implementation, sequence_axis=sequence_axis,
        dropout_mask=dropout_mask, return_weights=return_weights or None,
    ).items() if value is not None]
    if given:
        raise ValueError(
            f"complex inputs are attended by flax's dot_product_attention, which takes no {', '.join(given)}: "
            f"pass real floating-point inputs to use {'them' if len(given) > 1 else 'it'}"
        )
    flax_fn = nnx.dot_product_attention if isinstance(module, nnx.Module) else _linen_attention()
    out = _call_attention_fn(module, query, key, value, spec, batch_shape, dropout_rng, sow_weights, attention_fn_kwargs,
                             attention_fn=flax_fn)
    return out, None, None


def _linen_attention():
    from flax.linen import dot_product_attention  # linen is imported only where a linen module needs it

    return dot_product_attention


def _check_sequence_axis(sequence_axis):
    if sequence_axis is not None and not isinstance(sequence_axis, str):
        raise TypeError(f"sequence_axis must be a mesh axis name (str) or None, got {sequence_axis!r}")
    return sequence_axis


def _logit_terms(module, sinks) -> dict:
    """What a module adds to the logits and their softmax, those it has of ``scale``,
    ``logit_soft_cap`` and ``sinks`` (an array ``(num_heads,)`` or None)."""
    terms = dict(scale=module.scale, logit_soft_cap=module.logit_soft_cap, sinks=sinks)
    return {name: value for name, value in terms.items() if value is not None}


def _rotate(rotary, query, key, query_positions, key_positions):
    """Queries ``(batch, q_len, heads, head_dim)`` and keys rotated at their positions
    ``(batch|1, len)`` by ``rotary`` (nothing without one)."""
    if rotary is None:
        return query, key

    def rows(positions, batch):  # one row of positions serves every batch row
        return positions[0] if positions.ndim == 2 and positions.shape[0] == 1 and batch != 1 else positions

    return rotary(query, rows(query_positions, query.shape[0])), rotary(key, rows(key_positions, key.shape[0]))


class _Norm(nnx.Module):
    """A QK-norm other than flax's LayerNorm: ``scale`` ``(head_dim,)`` shared by the heads,
    else ``(heads, head_dim)`` (each head's own, or the whole projection's, in the kernel's layout)."""

    def __init__(self, qk_norm: QKNorm, heads: int, head_dim: int, param_dtype, metadata, rngs: nnx.Rngs):
        self.qk_norm = qk_norm
        init = nnx.initializers.zeros_init() if qk_norm.offset else nnx.initializers.ones_init()
        shape = (head_dim,) if qk_norm.shared_scale else (heads, head_dim)
        self.scale = nnx.Param(init(rngs.params(), shape, param_dtype), **metadata)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _qk_norm(x, self.scale[...], self.qk_norm)


def _qk_norm(x: jax.Array, scale: jax.Array, qk_norm: QKNorm) -> jax.Array:
    """``x`` ``(..., heads, head_dim)`` normalised over its last axis (per head) or its last two,
    in float32 or wider, times ``offset + scale``; in ``x``'s dtype."""
    axes = (-1,) if qk_norm.per_head else (-2, -1)
    compute = jnp.promote_types(x.dtype, jnp.float32)
    y = x.astype(compute)
    if qk_norm.kind == "layer":
        y = y - y.mean(axis=axes, keepdims=True)
    y = y * jax.lax.rsqrt((y * y).mean(axis=axes, keepdims=True) + qk_norm.eps)
    return (y * (qk_norm.offset + scale.astype(compute))).astype(x.dtype)


def _call_attention_fn(module, query, key, value, spec, batch_shape, dropout_rng, sow_weights, extra, attention_fn=None):
    """A user's flax-style ``attention_fn`` (default ``module.attention_fn``), called with flax's
    arguments on the inputs' batch axes; what the spec holds beyond a native causal flag reaches
    it as a boolean mask."""
    attention_fn = module.attention_fn if attention_fn is None else attention_fn
    parameters = inspect.signature(attention_fn).parameters
    # is_causal as flax passes it: always from nnx's class, never from linen's (whose function has
    # none: a linen attention_fn taking **kwargs may forward them to it), unless the function names it
    passes_causal = isinstance(module, nnx.Module) or "is_causal" in parameters
    native_causal = spec.is_causal and spec.default_positions and passes_causal
    allowed = masks._dense(dataclasses.replace(spec, is_causal=spec.is_causal and not native_causal))

    def logits_shaped(x):  # masks of fewer than 4 axes broadcast from the right as they are
        return x if x is None or x.ndim < 4 else batch_axes.unflatten_batch(x, batch_shape)

    kwargs = dict(
        mask=logits_shaped(allowed), bias=logits_shaped(spec.bias), dropout_rng=dropout_rng,
        dropout_rate=module.dropout_rate, broadcast_dropout=module.broadcast_dropout,
        deterministic=dropout_rng is None, dtype=module.dtype, precision=module.precision,
        module=module if sow_weights else None, **extra,
    )
    if passes_causal:
        kwargs["is_causal"] = native_causal
    if spec.bias is None:  # neither flax class passes bias: not to a function taking **kwargs either
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


def _spec(inputs_q, inputs_k, num_heads: int, self_attention: bool, *, key_positions=None,
          key_segment_ids=None, query_positions=None, query_segment_ids=None, **terms) -> masks._Spec:
    """The call's masking, parsed once for ``(batch, num_heads, q_len, kv_len)``; in
    self-attention the key positions and segment ids default to the query's."""
    if self_attention:
        key_positions = query_positions if key_positions is None else key_positions
        key_segment_ids = query_segment_ids if key_segment_ids is None else key_segment_ids
    shape = (inputs_q.shape[0], num_heads, inputs_q.shape[1], inputs_k.shape[1])
    return masks._parse(
        shape, query_positions=query_positions, key_positions=key_positions,
        query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids, **terms,
    )


def _check_inputs(inputs_q, inputs_k, inputs_v, in_features: int, in_kv_features: int) -> None:
    """Ranks, dtypes, batch axes and feature sizes of the module's inputs, naming each."""
    for name, x, features, feat_name in (
        ("inputs_q", inputs_q, in_features, "in_features"),
        ("inputs_k", inputs_k, in_kv_features, "in_kv_features"),
        ("inputs_v", inputs_v, in_kv_features, "in_kv_features"),
    ):
        _checks.require_array(name, x)
        if _checks._dtype_kind(x) != "complex":  # complex ones as flax's classes take them: see _attend_complex
            _checks.require_float(name, x)
        if x.ndim < 2:
            raise ValueError(f"{name} must have rank 2 or more {INPUT_LAYOUT}, got shape {tuple(x.shape)}")
        if x.shape[-1] != features:
            raise ValueError(
                f"{name} has {x.shape[-1]} features (shape {tuple(x.shape)}), "
                f"but the module's {feat_name} is {features}"
            )
    if not inputs_q.dtype == inputs_k.dtype == inputs_v.dtype:
        raise TypeError(
            f"inputs_q, inputs_k and inputs_v must share one dtype, got "
            f"{inputs_q.dtype}, {inputs_k.dtype}, {inputs_v.dtype}"
        )
    if not inputs_q.shape[:-2] == inputs_k.shape[:-2] == inputs_v.shape[:-2]:
        raise ValueError(
            f"inputs_q, inputs_k and inputs_v must share the batch axes, got shapes "
            f"{tuple(inputs_q.shape)}, {tuple(inputs_k.shape)}, {tuple(inputs_v.shape)}"
        )
    if inputs_k.shape[-2] != inputs_v.shape[-2]:
        raise ValueError(
            f"inputs_k and inputs_v must share kv_len, got shapes "
            f"{tuple(inputs_k.shape)} and {tuple(inputs_v.shape)}"
        )


def _dropout_key(rngs) -> jax.Array:
    if isinstance(rngs, nnx.Rngs):
        return rngs.dropout()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    if isinstance(rngs, jax.Array):
        return rngs
    raise ValueError(
        "dropout is active (dropout_rate > 0, not deterministic) but no rngs were given: "
        f"pass rngs to the constructor (keep_rngs=True) or the call, got {type(rngs).__name__}"
    )
