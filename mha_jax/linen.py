"""``flax.linen`` multi-head attention, a drop-in for ``flax.linen.MultiHeadDotProductAttention``; its parameter
tree is flax's, and it computes what ``mha_jax.MultiHeadAttention`` computes."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen import combine_masks, make_attention_mask, make_causal_mask
from typing_extensions import Unpack

from mha_jax import _layer, paged
from mha_jax import latent as mla
from mha_jax.attention import IMPLEMENTATIONS
from mha_spec import alibi, arguments, batch_axes, docstrings, query_terms
from mha_spec import latent as latent_spec
from mha_spec import paged as paged_spec
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale

# flax's mask helpers are exported beside the classes, as flax exports them
__all__ = ["MultiHeadAttention", "MultiHeadDotProductAttention", "SelfAttention", "combine_masks",
           "make_attention_mask", "make_causal_mask"]


class MultiHeadDotProductAttention(nn.Module):
    """Multi-head (grouped-query) attention; the input feature sizes are inferred.

    Attributes: flax's (``num_heads``, ``dtype``, ``param_dtype``, ``qkv_features``, ``out_features``,
    ``broadcast_dropout``, ``dropout_rate``, ``deterministic``, ``precision``, ``kernel_init``, ``out_kernel_init``,
    ``bias_init``, ``out_bias_init``, ``use_bias``, ``attention_fn``, ``decode``, ``normalize_qk``,
    ``force_fp32_for_softmax``, the ``*_dot_general`` and einsum factories), as in
    ``flax.linen.MultiHeadDotProductAttention``; ``attention_fn=None`` is this package's attention (softmax in
    float32 or wider); plus ``num_kv_heads``, ``implementation``, a ``QKNorm`` as ``normalize_qk``, ``scale``,
    ``logit_soft_cap``, ``use_sinks``/``sinks_init``, ``rotary``, ``local_window_size``, ``use_out_bias``,
    ``sequence_axis``, ``alibi_slopes`` (a tuple), ``latent``, ``clip_qkv``, ``query_scale`` and ``output_gate`` as in
    ``mha_jax.MultiHeadAttention``.
    Randomness: linen's ``'params'`` and ``'dropout'`` RNG collections.
    """

    num_heads: int
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: jax.lax.PrecisionLike = None
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    out_kernel_init: nn.initializers.Initializer | None = None
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()
    out_bias_init: nn.initializers.Initializer | None = None
    use_bias: bool = True
    attention_fn: Callable[..., jax.Array] | None = None
    decode: bool = False
    normalize_qk: bool | QKNorm = False
    force_fp32_for_softmax: bool = False
    qkv_dot_general: Callable | None = None
    out_dot_general: Callable | None = None
    qkv_dot_general_cls: Any = None
    out_dot_general_cls: Any = None
    qk_attn_weights_einsum_cls: Callable[..., Callable[..., jax.Array]] | None = None
    attn_weights_value_einsum_cls: Callable[..., Callable[..., jax.Array]] | None = None
    num_kv_heads: int | None = None
    implementation: str | None = None
    scale: float | None = None
    logit_soft_cap: float | None = None
    use_sinks: bool = False
    sinks_init: nn.initializers.Initializer = nn.initializers.zeros_init()
    rotary: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    local_window_size: int | tuple[int, int] | None = None
    use_out_bias: bool | None = None
    sequence_axis: str | None = None
    attention_chunk_size: int | None = None
    alibi_slopes: tuple[float, ...] | None = None
    latent: latent_spec.Latent | None = None
    clip_qkv: float | None = None
    query_scale: QueryScale | None = None
    output_gate: str | None = None

    def __post_init__(self):
        arguments.check_options(self.implementation, IMPLEMENTATIONS, self.scale, self.local_window_size,
                                self.attention_chunk_size)
        arguments.check_qk_norm(self.normalize_qk)
        _layer.check_sequence_axis(self.sequence_axis)
        object.__setattr__(self, "alibi_slopes", alibi.check_module_slopes(self.alibi_slopes, self.num_heads))
        object.__setattr__(self, "clip_qkv", query_terms.check_terms(self.clip_qkv, self.query_scale, self.latent)[0])
        query_terms.check_output_gate(self.output_gate, self.latent)
        if self.latent is not None:
            latent_spec.check_latent(self.latent, self.num_heads, self.num_kv_heads, self.qkv_features,
                                     ("num_kv_heads", "qkv_features"))
            object.__setattr__(self, "scale", latent_spec.check_options(
                self.latent, arguments.check_qk_norm(self.normalize_qk), self.rotary, self.scale))
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        inputs_kv: jax.Array | None = None,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        dropout_rng: jax.Array | None = None,
        sow_weights: bool = False,
        bias: jax.Array | None = None,
        is_causal: bool = False,
        dropout_mask: jax.Array | None = None,
        return_weights: bool = False,
        _paged: tuple[Any, int | None] | None = None,
        **masking: Unpack[arguments.PositionMasking[jax.Array]],
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Shapes and arguments as ``mha_jax.MultiHeadAttention.__call__``; ``inputs_kv`` (deprecated) and
        ``dropout_rng`` (default ``self.make_rng('dropout')``) as in flax; ``sow_weights`` sows
        ``attention_weights`` into ``'intermediates'``. With ``decode=True`` the first call (``init`` on
        ``(*batch, max_length, features)`` inputs) makes flax's ``'cache'`` collection; later calls decode."""
        if _paged is not None:  # paged_step's: one compact method makes every submodule
            return self._paged(inputs_q, *_paged)
        if inputs_kv is not None:
            inputs_k = inputs_v = _inputs_kv(inputs_k, inputs_v, inputs_kv)
        if self.latent is not None:
            latent_spec.check_inputs(inputs_k, inputs_v, "inputs_v")
        decoding = self.decode and self.has_variable("cache", "cached_key")  # flax: the first call makes the cache
        masking = _layer.call_masking(self, "MultiHeadDotProductAttention.__call__", masking, mask=mask, bias=bias,
                                      is_causal=is_causal, dropout_mask=dropout_mask)
        max_length = self.get_variable("cache", "cached_key").shape[-3] if decoding else None
        call = _layer.prepare((inputs_q, inputs_k, inputs_v), masking, self.num_heads, (None, None),
                              max_length=max_length, sequence_axis=self.sequence_axis)
        batch_shape, (inputs_q, inputs_k, inputs_v), spec = call.batch_shape, call.inputs, call.spec
        out_features = self.out_features or inputs_q.shape[-1]
        parts = None if self.latent is None else _LatentParts(self)
        if parts is not None:  # the cache's entries for keys, no values
            query, key = mla.project_query(parts, inputs_q), mla.project_latent(parts, inputs_k)
            value = norms = None
        else:
            query, key, value, norms = self._project(inputs_q, inputs_k, inputs_v)
        rate = arguments.check_dropout_rate("dropout_rate", self.dropout_rate)
        query, cache, spec = self._cached(query, key, value, call, decoding, norms) if self.decode else (
            query, None, spec)
        query, key, value = _layer.attention_inputs(self if parts is None else parts, query, key, value, spec, cache,
                                                    norms)
        dropping = _layer.dropping(rate, deterministic, self.deterministic, call.dropout_mask)
        dropout_rng = (self.make_rng("dropout") if dropout_rng is None else dropout_rng) if dropping else None
        out, weights, sown = _layer.attend(
            self, query, key, value, spec, batch_shape, dropout_rng=dropout_rng, dropout_mask=call.dropout_mask,
            sow_weights=sow_weights, return_weights=return_weights, attention_fn_kwargs=self._einsums(),
            zero_unused=not decoding, sequence_axis=None if decoding else self.sequence_axis,
            sinks=self._sinks(),
        )
        if sown is not None:
            self.sow("intermediates", "attention_weights", sown)
        if parts is not None and decoding:
            out = mla.lift_output(parts, out)
        out = batch_axes.unflatten_batch(self._output(out, inputs_q, out_features), batch_shape)
        return (out, weights) if return_weights else out

    @docstrings.fill
    def paged_step(self, inputs: jax.Array, cache: paged.PagedKVCache, *, max_q_len: int | None = None
                   ) -> tuple[jax.Array, paged.PagedKVCache]:
        """Self-attention of packed tokens over a paged cache: a serving step of many sequences at once
        (``module.apply(variables, inputs, cache, method="paged_step")``, or from a parent's method).

        {paged_step}
        """
        return self(inputs, _paged=(cache, max_q_len))

    def _paged(self, inputs: jax.Array, cache: paged.PagedKVCache, max_q_len: int | None):
        """``paged_step``, inside ``__call__`` (its submodules are the same)."""
        params = self.variables.get("params", {})
        kernel = params.get("query" if "query" in params else "kv_a_proj_with_mqa", {}).get("kernel")
        features = inputs.shape[-1] if kernel is None else kernel.shape[0]
        kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        pages = (1, self.latent.cache_dim) if self.latent is not None else (kv_heads, arguments.check_heads(
            self.num_heads, kv_heads, self.qkv_features or features, "qkv_features"))
        paged_spec.check_layer_inputs(inputs.shape, features, cache.kv_pages.shape, *pages)
        x = inputs[None]  # one row of packed tokens
        parts = None if self.latent is None else _LatentParts(self)
        if parts is not None:  # the cache's entries for keys, no values
            query, key, value, norms = mla.project_query(parts, x), mla.project_latent(parts, x), None, None
            if parts.kv_b_proj.kernel is None:  # init: kv_b_proj's kernel made to be read
                parts.kv_b_proj(key[..., 0, :self.latent.kv_lora_rank])
                parts.kv_b_proj.kernel = self.variables["params"]["kv_b_proj"]["kernel"]
        else:
            query, key, value, norms = self._project(x, x, x)
        out, cache = _layer.paged_attend(self if parts is None else parts, query, key, value, norms, cache, max_q_len,
                                         self._sinks())
        return self._output(out, x, self.out_features or inputs.shape[-1])[0], cache

    def _sinks(self) -> jax.Array | None:
        return self.param("sinks", self.sinks_init, (self.num_heads,), self.param_dtype) if self.use_sinks else None

    def _output(self, out: jax.Array, inputs_q: jax.Array, out_features: int) -> jax.Array:
        """Each head's output ``(batch, len, heads, head_dim)`` gated (``output_gate``) and projected by ``out``."""
        if self.output_gate is not None:  # (batch, len, heads[, head_dim]) gates of each head's output
            out = _layer.gated(out, _projection(self, query_terms.gate_features(
                self.output_gate, self.num_heads, out.shape[-1]), "gate", use_bias=False)(inputs_q), self.output_gate)
        return nn.DenseGeneral(
            out_features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init, dtype=self.dtype,
            bias_init=self.out_bias_init or self.bias_init, param_dtype=self.param_dtype, precision=self.precision,
            use_bias=self.use_bias if self.use_out_bias is None else self.use_out_bias, name="out",
            dot_general=self.out_dot_general, dot_general_cls=self.out_dot_general_cls,
        )(out)

    def _project(self, inputs_q: jax.Array, inputs_k: jax.Array, inputs_v: jax.Array):
        """QK-normed projections ``(batch, len, heads, head_dim)``, made in flax's order, and the QK-norms to apply
        after the rotary embedding (``_layer.norms_after_rotary``)."""
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        head_dim = arguments.check_heads(self.num_heads, num_kv_heads, qkv_features, "qkv_features")
        query = _projection(self, (self.num_heads, head_dim), "query")(inputs_q)
        key = _projection(self, (num_kv_heads, head_dim), "key")(inputs_k)
        value = _projection(self, (num_kv_heads, head_dim), "value")(inputs_v)
        qk_norm = arguments.check_qk_norm(self.normalize_qk)
        if qk_norm is not None and qk_norm == QKNorm(eps=qk_norm.eps):
            norm = functools.partial(nn.LayerNorm, use_bias=False, epsilon=qk_norm.eps, dtype=self.dtype,
                                     param_dtype=self.param_dtype)
            query, key = norm(name="query_ln")(query), norm(name="key_ln")(key)
        elif qk_norm is not None:
            norms = _LinenNorm(qk_norm, self.param_dtype, name="query_ln"), _LinenNorm(qk_norm, self.param_dtype,
                                                                                        name="key_ln")
            if not qk_norm.after_rotary:
                query, key = norms[0](query), norms[1](key)
            value = _layer.value_norm(norms[0], value)
            return (*_layer.project_terms(self, query, key, value), _layer.norms_after_rotary(*norms))
        return (*_layer.project_terms(self, query, key, value), None)

    def _cached(self, query, key, value, call: batch_axes.Call, decoding: bool, norms=None):
        """flax's ``'cache'`` collection, made by the first call (cache None); later calls append to it:
        ``(query, cache, spec)``; ``value`` None: a latent cache."""
        batch_shape = call.batch_shape
        kv_shape = (*batch_shape, *key.shape[1:])
        cached_key = self.variable("cache", "cached_key", jnp.zeros, kv_shape, key.dtype)
        cached_value = None if value is None else self.variable("cache", "cached_value", jnp.zeros, kv_shape,
                                                                value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.zeros(batch_shape, jnp.int32))
        overflow = self.variable("cache", "cache_overflow", lambda: jnp.zeros(batch_shape, bool))
        if not decoding:
            return query, None, call.spec
        cache = _layer.check_cache(cached_key.value, None if value is None else cached_value.value, index.value,
                                   overflow.value, batch_shape, *key.shape)
        rotary = self.rotary if value is not None else mla.rope_part(self.rotary, self.latent)
        query, cache, spec = _layer.decode_step(cache, rotary, query, key, value, call, self.query_scale, norms)
        cached_key.value = cache.key.reshape(cached_key.value.shape)
        if value is not None:
            cached_value.value = cache.value.reshape(cached_value.value.shape)
        index.value, overflow.value = cache.end.reshape(batch_shape), cache.overflow.reshape(batch_shape)
        return query, cache, spec

    def _einsums(self) -> dict:
        """linen's extra ``attention_fn`` arguments (quantised einsums, fp32 softmax)."""
        qk, wv = self.qk_attn_weights_einsum_cls, self.attn_weights_value_einsum_cls
        einsums = dict(qk_attn_weights_einsum=qk() if qk else None, attn_weights_value_einsum=wv() if wv else None)
        if self.attention_fn is None and any(v is not None for v in einsums.values()):
            raise ValueError("qk_attn_weights_einsum_cls and attn_weights_value_einsum_cls reach only an attention_fn; "
                             "pass one (flax.linen.dot_product_attention, say) to use them")
        return dict(einsums, force_fp32_for_softmax=self.force_fp32_for_softmax)


def _projection(module: MultiHeadDotProductAttention, features, name: str, use_bias: bool | None = None):
    """An input projection ``(batch, len, in) -> (batch, len, *features)`` of ``module``'s options."""
    return nn.DenseGeneral(
        features, axis=-1, dtype=module.dtype, param_dtype=module.param_dtype, kernel_init=module.kernel_init,
        bias_init=module.bias_init, use_bias=module.use_bias if use_bias is None else use_bias,
        precision=module.precision, dot_general=module.qkv_dot_general, dot_general_cls=module.qkv_dot_general_cls,
        name=name,
    )


def _inputs_kv(inputs_k: jax.Array | None, inputs_v: jax.Array | None, inputs_kv: jax.Array) -> jax.Array:
    """flax's deprecated ``inputs_kv``, with flax's texts."""
    if inputs_k is not None or inputs_v is not None:
        raise ValueError("If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None. Pass inputs_k "
                         "and inputs_v (inputs_kv is deprecated in flax)")
    warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v instead.",
                  DeprecationWarning, stacklevel=3)
    return inputs_kv


class _LinenNorm(nn.Module):
    """A QK-norm other than flax's LayerNorm, as the nnx module's ``_Norm``."""

    qk_norm: QKNorm
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros_init() if self.qk_norm.offset else nn.initializers.ones_init()
        shape = x.shape[-1:] if self.qk_norm.shared_scale else x.shape[-2:]
        scale = self.param("scale", init, shape, self.param_dtype) if self.qk_norm.weight else None
        return _layer.qk_norm(x, scale, self.qk_norm)


class _LinenRMSNorm(nn.Module):
    """The latent's RMSNorm (``mha_jax.latent.RMSNorm``)."""

    latent: latent_spec.Latent
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones_init(), x.shape[-1:], self.param_dtype)
        return mla.rms_norm(self.latent, x, scale)


class _LatentParts:
    """A linen module's latent projections under the nnx module's names and its terms, for ``mha_jax.latent``'s
    functions and ``_layer.paged_attend``."""

    def __init__(self, module: MultiHeadDotProductAttention):
        latent = module.latent
        for name in ("latent", "rotary", "precision", "query_scale", "local_window_size", "attention_chunk_size",
                     "scale", "logit_soft_cap", "alibi_slopes"):
            setattr(self, name, getattr(module, name))
        queries = (module.num_heads, latent.qk_head_dim)
        if latent.q_lora_rank is None:
            self.query = _projection(module, queries, "query", use_bias=False)
        else:
            self.q_a_proj = _projection(module, latent.q_lora_rank, "q_a_proj")
            self.q_a_layernorm = _LinenRMSNorm(latent, module.param_dtype, name="q_a_layernorm")
            self.q_b_proj = _projection(module, queries, "q_b_proj", use_bias=False)
        self.kv_a_proj_with_mqa = _projection(module, latent.cache_dim, "kv_a_proj_with_mqa")
        self.kv_a_layernorm = _LinenRMSNorm(latent, module.param_dtype, name="kv_a_layernorm")
        # the decoding step reads kv_b_proj's kernel without calling it (None before init)
        kernel = module.variables.get("params", {}).get("kv_b_proj", {}).get("kernel")
        kv_b_proj = _projection(module, (module.num_heads, latent.kv_b_features), "kv_b_proj", use_bias=False)
        self.kv_b_proj = _WithKernel(kv_b_proj, kernel)


class _WithKernel:
    """A linen projection and its ``kernel`` (as an nnx projection shows it)."""

    def __init__(self, layer: nn.Module, kernel: jax.Array | None):
        self.layer, self.kernel = layer, kernel

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layer(x)


class MultiHeadAttention(MultiHeadDotProductAttention):
    """``MultiHeadDotProductAttention`` under flax's alias (layers named ``MultiHeadAttention_{i}``)."""


class SelfAttention(MultiHeadDotProductAttention):
    """Self-attention, as flax's deprecated ``SelfAttention``: ``inputs_q`` and ``mask`` positional."""

    @nn.compact
    def __call__(self, inputs_q: jax.Array, mask: jax.Array | None = None, deterministic: bool | None = None,
                 dropout_rng: jax.Array | None = None, sow_weights: bool = False, **kwargs):
        warnings.warn("SelfAttention is deprecated in flax: call MultiHeadDotProductAttention with inputs_q",
                      DeprecationWarning, stacklevel=2)
        return super().__call__(inputs_q, mask=mask, deterministic=deterministic, dropout_rng=dropout_rng,
                                sow_weights=sow_weights, **kwargs)
