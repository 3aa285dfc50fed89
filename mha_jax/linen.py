"""``flax.linen`` multi-head attention, for models still written in linen.

Its parameter tree is that of ``flax.linen.MultiHeadDotProductAttention`` (and so of our nnx
module): ``query``/``key``/``value``/``out``, each ``kernel`` and ``bias``. Given the same
parameters it computes exactly what ``mha_jax.MultiHeadAttention`` computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from mha_jax import _checks, _neutral, masks
from mha_jax.attention import IMPLEMENTATIONS, _attention
from mha_jax.module import _check_inputs, _spec


class MultiHeadDotProductAttention(nn.Module):
    """Multi-head (grouped-query) attention; the input feature sizes are inferred.

    Attributes: as ``mha_jax.MultiHeadAttention``'s constructor arguments, less
    ``in_features``/``in_kv_features`` (read from the inputs) and ``rngs`` (linen's ``'params'``
    and ``'dropout'`` RNG collections).
    """

    num_heads: int
    qkv_features: int | None = None
    out_features: int | None = None
    num_kv_heads: int | None = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32
    precision: jax.lax.PrecisionLike = None
    implementation: str | None = None
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
    bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

    def __post_init__(self):
        # The other attributes wait for the inputs (feature sizes); this one needs none.
        _neutral.check_implementation(self.implementation, IMPLEMENTATIONS)
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        is_causal: bool = False,
        query_positions: jax.Array | None = None,
        key_positions: jax.Array | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        query_segment_ids: jax.Array | None = None,
        key_segment_ids: jax.Array | None = None,
        key_value_seq_lengths: jax.Array | None = None,
        deterministic: bool | None = None,
        dropout_rng: jax.Array | None = None,
        dropout_mask: jax.Array | None = None,
        return_weights: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Shapes as ``mha_jax.MultiHeadAttention.__call__``; ``dropout_rng`` defaults to
        ``self.make_rng('dropout')``."""
        self_attention = inputs_k is None or inputs_k is inputs_q
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        for name, x in (("inputs_q", inputs_q), ("inputs_k", inputs_k)):
            _checks.require_float(name, x)
            _checks.require_rank(name, x, 3, "(batch, length, features)")
        in_features, in_kv_features = inputs_q.shape[-1], inputs_k.shape[-1]
        _check_inputs(inputs_q, inputs_k, inputs_v, in_features, in_kv_features)
        qkv_features = in_features if self.qkv_features is None else self.qkv_features
        out_features = in_features if self.out_features is None else self.out_features
        num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
        head_dim = _neutral.check_heads(self.num_heads, num_kv_heads, qkv_features, "qkv_features")
        rate = _neutral.check_dropout_rate("dropout_rate", self.dropout_rate)

        def projection(out_features, name, axis=-1):
            return nn.DenseGeneral(
                out_features, axis=axis, use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, precision=self.precision,
                kernel_init=self.kernel_init, bias_init=self.bias_init, name=name,
            )

        spec = _spec(
            inputs_q, inputs_k, self.num_heads, self_attention, mask=mask, bias=bias,
            is_causal=is_causal, query_positions=query_positions, key_positions=key_positions,
            local_window_size=local_window_size, query_segment_ids=query_segment_ids,
            key_segment_ids=key_segment_ids, key_value_seq_lengths=key_value_seq_lengths,
        )
        inputs_k, inputs_v = masks._zero_unused_inputs(inputs_k, inputs_v, spec)
        query = projection((self.num_heads, head_dim), "query")(inputs_q)
        key = projection((num_kv_heads, head_dim), "key")(inputs_k)
        value = projection((num_kv_heads, head_dim), "value")(inputs_v)
        if dropout_mask is None and rate > 0 and not _neutral.resolve_deterministic(deterministic, self.deterministic):
            dropout_rng = self.make_rng("dropout") if dropout_rng is None else dropout_rng
        else:
            dropout_rng = None
        result = _attention(
            query, key, value, spec,
            dropout_rate=rate if dropout_rng is not None or dropout_mask is not None else 0.0,
            dropout_rng=dropout_rng, dropout_mask=dropout_mask,
            return_weights=return_weights, precision=self.precision,
            implementation=self.implementation,
        )
        out, weights = result if return_weights else (result, None)
        out = projection(out_features, "out", axis=(-2, -1))(out)
        return (out, weights) if return_weights else out

