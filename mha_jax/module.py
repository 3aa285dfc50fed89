"""``flax.nnx`` multi-head attention, a drop-in for ``flax.nnx.MultiHeadAttention`` (its arguments and parameter
tree, the same values from the same ``nnx.Rngs``); twin of ``mha_torch/module.py``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from typing_extensions import Unpack

from mha_jax import _layer, paged
from mha_jax import latent as mla
from mha_jax.attention import IMPLEMENTATIONS
from mha_spec import alibi, arguments, batch_axes, docstrings, query_terms
from mha_spec import latent as latent_spec
from mha_spec import paged as paged_spec
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale

_NO_METADATA: Mapping[str, Any] = MappingProxyType({})


@docstrings.fill
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
      broadcast_dropout: one dropout mask ``(q_len, kv_len)`` shared by the batch and heads (flax's default).
      dropout_rate: dropout on the attention weights.
      deterministic: default for the call's ``deterministic`` (``.eval()``/``nnx.view`` set it).
      precision: precision of every matrix product.
      kernel_init, bias_init: initialisers of the projections.
      out_kernel_init, out_bias_init: of the output projection; default ``kernel_init``/``bias_init``.
      use_bias: biases on the four projections.
      attention_fn: None (this package's attention) or a function with the signature of
        ``flax.nnx.dot_product_attention``, called as flax calls it (positions, windows, segments and lengths
        reach it as a boolean ``mask``).
      decode: autoregressive decoding with the key/value cache of ``init_cache`` (default False).
      normalize_qk: True: flax's LayerNorm (no bias) on each head's queries and keys (``query_ln``/``key_ln``,
        each ``scale``); a ``QKNorm`` for another norm (RMS, over the whole projection, ``1 + scale``, its epsilon).
      qkv_promote_dtype, out_promote_dtype, ln_promote_dtype: dtype promotion of the query/key/value
        projections, the output projection and the LayerNorms, as in flax.
      qkv_dot_general, out_dot_general, qkv_dot_general_cls, out_dot_general_cls: the projections'
        ``dot_general``, as in flax.
      rngs: ``nnx.Rngs`` for the parameters and, with ``dropout_rate > 0``, the dropout stream.
      keep_rngs: keep a dropout stream forked from ``rngs`` (else pass ``rngs`` to each call).
      kernel_metadata, out_kernel_metadata, bias_metadata, out_bias_metadata,
        query_ln_scale_metadata, key_ln_scale_metadata: parameter metadata (sharding), as in flax.
      implementation: attention implementation, see ``mha_jax.dot_product_attention``.
      use_sinks: a learned logit per query head, ``sinks`` ``(num_heads,)``, joins each row's softmax normaliser
        without a value (gpt-oss); initialised by ``sinks_init``.
      {module_terms}
      use_out_bias: a bias on the output projection; default ``use_bias`` (Qwen2: ``False``).
      sequence_axis: a mesh axis over which the length is sharded: ring attention, see
        ``mha_jax.dot_product_attention`` (not while decoding).
      latent: an ``mha_spec.latent.Latent``: multi-head latent attention (DeepSeek-V2/V3): keys and values of
        every head lifted from one low-rank latent per token, ``rotary`` on the rope part of each head,
        ``use_bias`` on the low-rank input projections only; ``num_kv_heads`` and ``qkv_features`` None, no
        ``normalize_qk``, ``inputs_v`` the keys' input; default scale ``1 / sqrt(qk_head_dim)``. The cache holds
        the latent entries, ``cached_key`` ``(*batch, max_length, 1, kv_lora_rank + qk_rope_head_dim)``.
      clip_qkv: a bound: ``query``, ``key`` and ``value`` (the projections, after ``query_ln``/``key_ln``)
        clamped to ``[-clip_qkv, clip_qkv]``, as OLMo, OLMoE, MPT and DBRX do; None: no clamp.
      query_scale: an ``mha_spec.query_terms.QueryScale``: the queries, once rotated, scaled by their
        positions (Llama 4's temperature tuning, Ministral 3's ``llama_4_scaling_beta``); None: no scale.
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
        alibi_slopes: Sequence[float] | None = None,
        latent: latent_spec.Latent | None = None,
        clip_qkv: float | None = None,
        query_scale: QueryScale | None = None,
        output_gate: str | None = None,
    ):
        self._set_sizes(num_heads, num_kv_heads, in_features, in_kv_features, qkv_features, out_features, latent)
        self.dropout_rate = arguments.check_dropout_rate("dropout_rate", dropout_rate)
        self.broadcast_dropout, self.deterministic, self.decode = broadcast_dropout, deterministic, decode
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.use_bias, self.normalize_qk, self.attention_fn = use_bias, normalize_qk, attention_fn
        self.implementation, self.scale, self.local_window_size, self.attention_chunk_size = arguments.check_options(
            implementation, IMPLEMENTATIONS, scale, local_window_size, attention_chunk_size)
        self.logit_soft_cap, self.rotary = logit_soft_cap, rotary
        self.sequence_axis = _layer.check_sequence_axis(sequence_axis)
        self.alibi_slopes = alibi.check_module_slopes(alibi_slopes, num_heads)
        self.clip_qkv, self.query_scale = query_terms.check_terms(clip_qkv, query_scale, self.latent)
        qk_norm = arguments.check_qk_norm(normalize_qk)

        common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)
        def projection(in_features, out_features, **options):
            return nnx.LinearGeneral(
                in_features, out_features, kernel_init=kernel_init, bias_init=bias_init,
                promote_dtype=qkv_promote_dtype, dot_general=qkv_dot_general, dot_general_cls=qkv_dot_general_cls,
                kernel_metadata=kernel_metadata, bias_metadata=bias_metadata, **dict(common, **options),
            )

        if self.latent is not None:
            self.scale = latent_spec.check_options(self.latent, qk_norm, rotary, self.scale)
            features = (in_features, self.in_kv_features)
            mla.make_projections(self, self.latent, features, num_heads, projection, param_dtype, rngs)
            self.query_ln = self.key_ln = nnx.data(None)
        else:  # flax's order of construction, so that the same Rngs give the same parameters
            self.query = projection(in_features, (num_heads, self.head_dim))
            self.key = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
            self.value = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
            self.query_ln, self.key_ln = _qk_norms(
                qk_norm, (num_heads, self.num_kv_heads), self.head_dim, dtype, param_dtype, ln_promote_dtype,
                (query_ln_scale_metadata, key_ln_scale_metadata), rngs)
        value_head_dim = self.head_dim if self.latent is None else self.latent.v_head_dim
        self.out = nnx.LinearGeneral(
            (num_heads, value_head_dim), self.out_features, axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init, bias_init=out_bias_init or bias_init,
            promote_dtype=out_promote_dtype, dot_general=out_dot_general, dot_general_cls=out_dot_general_cls,
            kernel_metadata=out_kernel_metadata or kernel_metadata, bias_metadata=out_bias_metadata or bias_metadata,
            **dict(common, use_bias=use_bias if use_out_bias is None else use_out_bias),
        )
        self.sinks = nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype)) if use_sinks else nnx.data(None)
        self.output_gate = query_terms.check_output_gate(output_gate, self.latent)
        self.gate = nnx.data(None) if output_gate is None else projection(
            in_features, query_terms.gate_features(output_gate, num_heads, self.head_dim), use_bias=False)
        self.rngs = rngs.dropout.fork() if keep_rngs and self.dropout_rate > 0 else None

    def _set_sizes(self, num_heads: int, num_kv_heads: int | None, in_features: int, in_kv_features: int | None,
                   qkv_features: int | None, out_features: int | None, latent: latent_spec.Latent | None) -> None:
        """The head counts, feature sizes and ``head_dim``, checked; with a ``latent``, ``qkv_features`` its query
        heads' width."""
        self.latent = None if latent is None else latent_spec.check_latent(
            latent, num_heads, num_kv_heads, qkv_features, ("num_kv_heads", "qkv_features"))
        if self.latent is not None:
            qkv_features = num_heads * self.latent.qk_head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.in_features = in_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        for name in ("in_features", "in_kv_features", "out_features"):
            arguments.check_heads(1, 1, getattr(self, name), name)
        self.head_dim = arguments.check_heads(num_heads, self.num_kv_heads, self.qkv_features, "qkv_features")

    # no cache until init_cache or nnx.update: as in flax's class, the instance has none, so that nnx.update adds it
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
        dropout_mask: jax.Array | None = None,
        return_weights: bool = False,
        **masking: Unpack[arguments.PositionMasking[jax.Array]],
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attend from ``inputs_q`` to ``inputs_k``/``inputs_v``.

        Args (flax's, then this module's additions):
          inputs_q: ``(*batch, q_len, in_features)``; any number of batch axes, none included.
          inputs_k: ``(*batch, kv_len, in_kv_features)``; default ``inputs_q`` (self-attention).
          inputs_v: ``(*batch, kv_len, in_kv_features)``; default ``inputs_k``.
          mask: broadcasts to ``(*batch, num_heads, q_len, kv_len)``; any dtype, nonzero = attend.
          deterministic: no dropout when True; overrides the constructor's.
          rngs: dropout randomness; overrides the stream kept at construction.
          sow_weights: store the attention weights ``(*batch, num_heads, q_len, kv_len)``, before dropout, as
            ``nnx.Intermediate`` ``attention_weights`` (flax's name); any implementation.
          decode: append the inputs' keys and values to the cache and attend over everything cached
            (``init_cache`` first): any number of new tokens, at ``query_positions`` ``(batch, n)`` (default: each
            row's ``cache_index + arange(n)``; ``-1`` marks padding, not cached). Masks and biases then span the
            cache: ``(*batch, heads, n, max_length)``.
          is_causal: key position <= query position.
          out_sharding, qkv_sharding: output sharding of the output and the q/k/v projections.
          bias: added to the logits, broadcasting to ``(*batch, num_heads, q_len, kv_len)``.
          dropout_mask: explicit keep-mask broadcasting to ``(*batch, num_heads, q_len, kv_len)``; always applied,
            kept weights scaled by ``1 / (1 - dropout_rate)``.
          return_weights: also return the weights ``(*batch, num_heads, q_len, kv_len)``.
          **masking: ``query_positions``, ``key_positions``, ``local_window_size``, ``query_segment_ids``,
            ``key_segment_ids`` and ``key_value_seq_lengths``, by name: as in ``mha_jax.dot_product_attention``,
            with the batch axes of the inputs; in self-attention (``inputs_k`` not given, or ``inputs_q``
            itself) the key positions and segment ids default to the query's.

        Returns:
          ``(*batch, q_len, out_features)``, or ``(output, weights)``.
        """
        masking = _layer.call_masking(self, "MultiHeadAttention.__call__", masking, mask=mask, bias=bias,
                                      is_causal=is_causal, dropout_mask=dropout_mask)
        if self.latent is not None:
            latent_spec.check_inputs(inputs_k, inputs_v, "inputs_v")
        decoding = self.decode if decode is None else decode
        if decoding and self.cached_key is None:
            raise ValueError("decode=True needs a cache: call init_cache(input_shape) or "
                             "nnx.view(..., decode=True, batch_size=, max_length=) first")
        call = _layer.prepare((inputs_q, inputs_k, inputs_v), masking, self.num_heads, (self.in_features,
                              self.in_kv_features), max_length=self.cached_key.shape[-3] if decoding else None,
                              sequence_axis=self.sequence_axis)
        batch_shape, (inputs_q, inputs_k, inputs_v), spec = call.batch_shape, call.inputs, call.spec
        if decoding:
            cache = self._read_cache(batch_shape, inputs_q.shape[0], inputs_k.shape[1])
        else:
            cache, dropout_rng = None, self._dropout_rng(rngs, deterministic, call.dropout_mask)
        if self.latent is not None:
            query, key, value = mla.project_query(self, inputs_q), mla.project_latent(self, inputs_k), None
        else:
            query = self.query(inputs_q, out_sharding=qkv_sharding)
            key = self.key(inputs_k, out_sharding=qkv_sharding)
            value = self.value(inputs_v, out_sharding=qkv_sharding)
        norms = _layer.norms_after_rotary(self.query_ln, self.key_ln)
        if self.query_ln is not None and norms is None:
            query, key = self.query_ln(query), self.key_ln(key)
        value = _layer.value_norm(self.query_ln, value)
        query, key, value = _layer.project_terms(self, query, key, value)
        if decoding:
            rotary = self.rotary if self.latent is None else mla.rope_part(self.rotary, self.latent)
            query, cache, spec = _layer.decode_step(cache, rotary, query, key, value, call, self.query_scale, norms)
            self._write_cache(cache, batch_shape)
            dropout_rng = self._dropout_rng(rngs, deterministic)
        query, key, value = _layer.attention_inputs(self, query, key, value, spec, cache, norms)
        out, weights, sown = _layer.attend(
            self, query, key, value, spec, batch_shape, dropout_rng=dropout_rng, dropout_mask=call.dropout_mask,
            sow_weights=sow_weights, return_weights=return_weights, zero_unused=not decoding,
            sinks=None if self.sinks is None else self.sinks[...],
            sequence_axis=None if decoding else self.sequence_axis,
        )
        if sown is not None:
            self.sow(nnx.Intermediate, "attention_weights", sown)
        if decoding and self.latent is not None:
            out = mla.lift_output(self, out)
        if self.gate is not None:  # (batch, len, heads[, head_dim]) gates of each head's output
            out = _layer.gated(out, self.gate(inputs_q), self.output_gate)
        out = batch_axes.unflatten_batch(self.out(out, out_sharding=out_sharding), batch_shape)
        return (out, weights) if return_weights else out

    @docstrings.fill
    def paged_step(self, inputs: jax.Array, cache: paged.PagedKVCache, *, max_q_len: int | None = None
                   ) -> tuple[jax.Array, paged.PagedKVCache]:
        """Self-attention of packed tokens over a paged cache: a serving step of many sequences at once.

        {paged_step}
        """
        pages = (1, self.latent.cache_dim) if self.latent is not None else (self.num_kv_heads, self.head_dim)
        paged_spec.check_layer_inputs(inputs.shape, self.in_features, cache.kv_pages.shape, *pages)
        x = inputs[None]  # one row of packed tokens
        if self.latent is not None:  # the cache's entries for keys, no values
            query, key, value, norms = mla.project_query(self, x), mla.project_latent(self, x), None, None
        else:
            query, key, value = self.query(x), self.key(x), self.value(x)
            norms = _layer.norms_after_rotary(self.query_ln, self.key_ln)
            if self.query_ln is not None and norms is None:
                query, key = self.query_ln(query), self.key_ln(key)
            value = _layer.value_norm(self.query_ln, value)
            query, key, value = _layer.project_terms(self, query, key, value)
        out, cache = _layer.paged_attend(self, query, key, value, norms, cache, max_q_len,
                                         None if self.sinks is None else self.sinks[...])
        if self.gate is not None:
            out = _layer.gated(out, self.gate(x), self.output_gate)
        return self.out(out)[0], cache

    def _read_cache(self, batch_shape: tuple[int, ...], batch: int, n: int) -> _layer.Cache:
        """The cache checked for a step of ``n`` new tokens, its batch axes merged into ``batch``."""
        overflow = None if self.cache_overflow is None else self.cache_overflow[...]
        value = None if self.cached_value is None else self.cached_value[...]
        kv_heads, head_dim = (1, self.latent.cache_dim) if self.latent else (self.num_kv_heads, self.head_dim)
        return _layer.check_cache(self.cached_key[...], value, self.cache_index[...], overflow, batch_shape, batch, n,
                                  kv_heads, head_dim)

    def _write_cache(self, cache: _layer.Cache, batch_shape: tuple[int, ...]) -> None:
        """Store a step's cache back with the inputs' batch axes (an index per row, and an overflow flag)."""
        self.cached_key[...] = cache.key.reshape(self.cached_key.shape)
        if cache.value is not None:
            self.cached_value[...] = cache.value.reshape(self.cached_value.shape)
        self.cache_index.set_value(cache.end.reshape(batch_shape))
        if self.cache_overflow is None:
            self.cache_overflow = nnx.Cache(cache.overflow.reshape(batch_shape))
        else:
            self.cache_overflow[...] = cache.overflow.reshape(batch_shape)

    def _dropout_rng(self, rngs, deterministic, dropout_mask=None) -> jax.Array | None:
        """The dropout key (the call's ``rngs``, else those kept), None without dropout."""
        if not _layer.dropping(self.dropout_rate, deterministic, self.deterministic, dropout_mask):
            return None
        rngs = rngs if rngs is not None else self.rngs
        if isinstance(rngs, nnx.Rngs):
            return rngs.dropout()
        if isinstance(rngs, nnx.RngStream):
            return rngs()
        if isinstance(rngs, jax.Array):
            return rngs
        raise ValueError("dropout is active (dropout_rate > 0, not deterministic) but no rngs were given: "
                         f"pass rngs to the constructor (keep_rngs=True) or the call, got {type(rngs).__name__}")

    def init_cache(self, input_shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32) -> None:
        """A key/value cache for ``decode=True``, as flax's: ``input_shape`` is ``(*batch, max_length, features)``;
        ``cached_key``/``cached_value`` ``(*batch, max_length, num_kv_heads, head_dim)``, ``cache_index`` each row's
        next position ``(*batch,)``, ``cache_overflow`` ``(*batch,)`` True once a step inside ``jit`` overwrote a
        position a query could still see (outside ``jit`` that step raises). Flax's cache (a scalar ``cache_index``)
        is also read."""
        input_shape = tuple(input_shape)
        if len(input_shape) < 2 or not all(isinstance(n, int) and n >= 0 for n in input_shape) or input_shape[-2] < 1:
            raise ValueError(
                f"input_shape must be (*batch, max_length, features) with max_length >= 1, got {input_shape}")
        batch_shape, max_length = input_shape[:-2], input_shape[-2]
        if self.latent is not None:  # the latent entries, one key head
            self.cached_key = nnx.Cache(jnp.zeros((*batch_shape, max_length, 1, self.latent.cache_dim), dtype))
        else:
            shape = (*batch_shape, max_length, self.num_kv_heads, self.head_dim)
            self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
            self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.zeros(batch_shape, jnp.int32))
        self.cache_overflow = nnx.Cache(jnp.zeros(batch_shape, bool))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | tuple[int, ...] | None = None, max_length: int | None = None):
        """``nnx.view``'s hook, as flax's: ``batch_size``/``max_length`` make a cache when ``decode`` is set and none
        exists."""
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if decode and self.cached_key is None:
                if batch_size is None or max_length is None:
                    raise TypeError("'batch_size' and 'max_length' must be provided when initializing cache.")
                batch = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
                self.init_cache((*batch, max_length, self.in_features), self.dtype or self.param_dtype)


def _qk_norms(qk_norm: QKNorm | None, heads: tuple[int, int], head_dim: int, dtype, param_dtype, promote_dtype,
              metadata: tuple[Mapping[str, Any], Mapping[str, Any]], rngs: nnx.Rngs) -> tuple:
    """``(query_ln, key_ln)`` for ``heads`` (query, key/value): flax's LayerNorm, else ``_Norm``, else None."""
    if qk_norm is None:
        return nnx.data(None), nnx.data(None)
    def norm(n_heads: int, scale_metadata: Mapping[str, Any]) -> nnx.Module:
        if qk_norm == QKNorm(eps=qk_norm.eps):
            return nnx.LayerNorm(head_dim, use_bias=False, epsilon=qk_norm.eps, dtype=dtype, param_dtype=param_dtype,
                                 promote_dtype=promote_dtype, rngs=rngs, scale_metadata=scale_metadata)
        return _Norm(qk_norm, n_heads, head_dim, param_dtype, scale_metadata, rngs)
    query_ln = norm(heads[0], metadata[0])  # the query's first, as in flax
    return query_ln, norm(heads[1], metadata[1])


class _Norm(nnx.Module):
    """A QK-norm other than flax's LayerNorm: ``scale`` ``(head_dim,)`` (shared) or ``(heads, head_dim)``."""

    def __init__(self, qk_norm: QKNorm, heads: int, head_dim: int, param_dtype, metadata, rngs: nnx.Rngs):
        self.qk_norm = qk_norm
        init = nnx.initializers.zeros_init() if qk_norm.offset else nnx.initializers.ones_init()
        shape = (head_dim,) if qk_norm.shared_scale else (heads, head_dim)
        self.scale = nnx.Param(init(rngs.params(), shape, param_dtype), **metadata) if qk_norm.weight \
            else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _layer.qk_norm(x, None if self.scale is None else self.scale[...], self.qk_norm)

