"""``flax.nnx`` multi-head attention.

Twin of ``mha_torch/module.py``. The parameter tree is that of ``flax.nnx.MultiHeadAttention``:
``query``/``key``/``value`` with ``kernel (in, heads, head_dim)`` and ``bias (heads, head_dim)``,
``out`` with ``kernel (heads, head_dim, out)`` and ``bias (out,)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mha_jax import _checks, _neutral, masks
from mha_jax.attention import IMPLEMENTATIONS, _attention

INPUT_LAYOUT = "(batch, length, features)"


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query) attention with input and output projections.

    Args:
      num_heads: query heads.
      in_features: feature size of ``inputs_q``.
      qkv_features: total query feature size ``num_heads * head_dim``; default ``in_features``.
      out_features: output feature size; default ``in_features``.
      num_kv_heads: key/value heads, dividing ``num_heads``; default ``num_heads``.
      in_kv_features: feature size of ``inputs_k`` and ``inputs_v``; default ``in_features``.
      use_bias: biases on the four projections.
      dropout_rate: dropout on the attention weights.
      deterministic: default for the call's ``deterministic`` (``nnx.Module.eval()`` sets it).
      dtype: computation dtype; default: promoted from inputs and parameters.
      param_dtype: parameter dtype.
      precision: precision of every matrix product.
      implementation: attention implementation, see ``mha_jax.dot_product_attention``.
      kernel_init, bias_init: initialisers, as in flax.
      rngs: ``nnx.Rngs`` for the parameters and, with ``dropout_rate > 0``, the dropout stream.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        *,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        precision: jax.lax.PrecisionLike = None,
        implementation: str | None = None,
        kernel_init: nnx.Initializer = nnx.initializers.lecun_normal(),
        bias_init: nnx.Initializer = nnx.initializers.zeros_init(),
        rngs: nnx.Rngs,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.in_features = in_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        for name in ("in_features", "in_kv_features", "out_features"):
            _neutral.check_heads(1, 1, getattr(self, name), name)
        self.head_dim = _neutral.check_heads(
            num_heads, self.num_kv_heads, self.qkv_features, "qkv_features"
        )
        self.dropout_rate = _neutral.check_dropout_rate("dropout_rate", dropout_rate)
        self.deterministic = deterministic
        self.precision = precision
        self.implementation = _neutral.check_implementation(implementation, IMPLEMENTATIONS)

        def projection(in_features, out_features, axis=-1):
            return nnx.LinearGeneral(
                in_features, out_features, axis=axis, use_bias=use_bias, dtype=dtype,
                param_dtype=param_dtype, precision=precision, kernel_init=kernel_init,
                bias_init=bias_init, rngs=rngs,
            )

        self.query = projection(in_features, (num_heads, self.head_dim))
        self.key = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.value = projection(self.in_kv_features, (self.num_kv_heads, self.head_dim))
        self.out = projection((num_heads, self.head_dim), self.out_features, axis=(-2, -1))
        self.rngs = rngs.dropout.fork() if self.dropout_rate > 0 else None

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
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        dropout_mask: jax.Array | None = None,
        return_weights: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attend from ``inputs_q`` to ``inputs_k``/``inputs_v``.

        Args:
          inputs_q: ``(batch, q_len, in_features)``.
          inputs_k: ``(batch, kv_len, in_kv_features)``; default ``inputs_q`` (self-attention).
          inputs_v: ``(batch, kv_len, in_kv_features)``; default ``inputs_k``.
          mask: broadcasts to ``(batch, num_heads, q_len, kv_len)``; any dtype, nonzero = attend.
          bias: added to the logits, broadcasting to ``(batch, num_heads, q_len, kv_len)``.
          is_causal, query_positions, key_positions, local_window_size, query_segment_ids,
            key_segment_ids, key_value_seq_lengths: as in ``mha_jax.dot_product_attention``;
            in self-attention (``inputs_k`` not given, or ``inputs_q`` itself) the key
            positions and segment ids default to the query's.
          deterministic: no dropout when True; overrides the constructor's.
          rngs: dropout randomness; overrides the stream forked at construction.
          dropout_mask: explicit keep-mask ``(batch, num_heads, q_len, kv_len)``; always applied,
            kept weights scaled by ``1 / (1 - dropout_rate)``.
          return_weights: also return the weights ``(batch, num_heads, q_len, kv_len)``.

        Returns:
          ``(batch, q_len, out_features)``, or ``(output, weights)``.
        """
        self_attention = inputs_k is None or inputs_k is inputs_q
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        _check_inputs(inputs_q, inputs_k, inputs_v, self.in_features, self.in_kv_features)
        dropout_rng = None
        if dropout_mask is None and self.dropout_rate > 0 and not _neutral.resolve_deterministic(deterministic, self.deterministic):
            dropout_rng = _dropout_key(rngs if rngs is not None else self.rngs)

        spec = _spec(
            inputs_q, inputs_k, self.num_heads, self_attention, mask=mask, bias=bias,
            is_causal=is_causal, query_positions=query_positions, key_positions=key_positions,
            local_window_size=local_window_size, query_segment_ids=query_segment_ids,
            key_segment_ids=key_segment_ids, key_value_seq_lengths=key_value_seq_lengths,
        )
        inputs_k, inputs_v = masks._zero_unused_inputs(inputs_k, inputs_v, spec)
        query = self.query(inputs_q)
        key = self.key(inputs_k)
        value = self.value(inputs_v)
        result = _attention(
            query, key, value, spec,
            dropout_rate=self.dropout_rate if dropout_rng is not None or dropout_mask is not None else 0.0,
            dropout_rng=dropout_rng, dropout_mask=dropout_mask,
            return_weights=return_weights, precision=self.precision,
            implementation=self.implementation,
        )
        out, weights = result if return_weights else (result, None)
        out = self.out(out)
        return (out, weights) if return_weights else out



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
    """Ranks, dtypes and feature sizes of the module's inputs, with messages naming each."""
    for name, x, features, feat_name in (
        ("inputs_q", inputs_q, in_features, "in_features"),
        ("inputs_k", inputs_k, in_kv_features, "in_kv_features"),
        ("inputs_v", inputs_v, in_kv_features, "in_kv_features"),
    ):
        _checks.require_float(name, x)
        _checks.require_rank(name, x, 3, INPUT_LAYOUT)
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
    if not inputs_q.shape[0] == inputs_k.shape[0] == inputs_v.shape[0]:
        raise ValueError(
            f"inputs_q, inputs_k and inputs_v must share the batch size, got shapes "
            f"{tuple(inputs_q.shape)}, {tuple(inputs_k.shape)}, {tuple(inputs_v.shape)}"
        )
    if inputs_k.shape[1] != inputs_v.shape[1]:
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
        f"pass rngs to the constructor or the call, got {type(rngs).__name__}"
    )
