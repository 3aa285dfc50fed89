"""Scaled dot-product attention, the functional core.

Twin of ``mha_torch/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``jax.nn.dot_product_attention``: query ``(batch, q_len, heads, head_dim)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_jax.masks import MASK_LAYOUT, _split_mask


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_mask: jax.Array | None = None,
    return_weights: bool = False,
    precision: jax.lax.PrecisionLike = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head scaled dot-product attention.

    Args:
      query: ``(batch, q_len, heads, head_dim)``.
      key, value: ``(batch, kv_len, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``, and
        query head ``h`` reads key/value head ``h // (heads // kv_heads)``.
      mask: broadcasts to ``(batch, heads, q_len, kv_len)``; bool True = attend, integer
        nonzero = attend, floating = added to the logits.
      is_causal: query ``i`` attends to keys ``0..i`` (top-left aligned); combines with ``mask``.
      scale: multiplies the logits; default ``1 / sqrt(head_dim)``.
      dropout_rate: probability of dropping an attention weight; kept weights are scaled by
        ``1 / (1 - dropout_rate)``.
      dropout_rng: PRNG key drawing the dropout mask when ``dropout_rate > 0``.
      dropout_mask: explicit keep-mask (True = keep) broadcasting to
        ``(batch, heads, q_len, kv_len)``; when given it is used instead of ``dropout_rng``.
      return_weights: also return the attention weights actually applied to ``value``.
      precision: passed to the matrix products.

    Returns:
      ``(batch, q_len, heads, head_dim)`` in the input dtype, or ``(output, weights)`` with
      weights ``(batch, heads, q_len, kv_len)``. A query that may attend to no key gets an
      output row of 0 and weights 0. bfloat16/float16 inputs are computed in float32.
    """
    batch, q_len, heads, head_dim, kv_len, kv_heads = _checks.check_attention_inputs(
        query, key, value
    )
    shape = (batch, heads, q_len, kv_len)
    allowed, bias = _split_mask(mask, is_causal, shape)
    keep, keep_scale = _dropout_keep(dropout_rate, dropout_rng, dropout_mask, shape)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    dtype = query.dtype
    compute = jnp.promote_types(dtype, jnp.float32)
    groups = heads // kv_heads
    key, value = _zero_unused_keys(key, value, allowed, bias, groups)
    q = query.astype(compute).reshape(batch, q_len, kv_heads, groups, head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, key.astype(compute), precision=precision)
    logits = logits.reshape(shape) * scale
    weights = _masked_softmax(logits, allowed, bias)
    if keep is not None:
        weights = jnp.where(keep, weights * keep_scale, 0.0)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd",
        weights.reshape(batch, kv_heads, groups, q_len, kv_len),
        value.astype(compute),
        precision=precision,
    )
    out = out.reshape(batch, q_len, heads, head_dim).astype(dtype)
    if return_weights:
        return out, weights.astype(dtype)
    return out


def _masked_softmax(logits: jax.Array, allowed: jax.Array | None, bias: jax.Array | None) -> jax.Array:
    """Softmax over the last axis that gives 0 (not NaN, not uniform) on rows with no allowed key."""
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    # The row maximum only shifts the exponent; softmax does not depend on it, so no gradient.
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    exp = jnp.exp(logits - row_max)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    return exp / jnp.where(total == 0.0, 1.0, total)


def _zero_unused_keys(key, value, allowed, bias, groups):
    """Zero the keys and values that no query may attend to (padding, say).

    Whatever they hold, NaN or Inf included, then cannot reach the output (0 * NaN is NaN in the
    weights-times-values product) nor the gradients of the other positions.
    """
    excluded = []
    if allowed is not None:
        excluded.append(jnp.logical_not(allowed))
    if bias is not None:
        excluded.append(bias == -jnp.inf)
    if not excluded:
        return key, value
    batch, kv_len, kv_heads, _ = key.shape
    unused = None
    for ex in excluded:  # reduce over queries, then over the query heads of each group
        ex = ex.reshape((1,) * (4 - ex.ndim) + ex.shape).all(axis=2)  # (batch?, heads?, kv_len?)
        if ex.shape[1] != 1:
            ex = ex.reshape(ex.shape[0], kv_heads, groups, ex.shape[2]).all(axis=2)
        unused = ex if unused is None else unused | ex
    unused = jnp.broadcast_to(unused, (batch, kv_heads, kv_len)).transpose(0, 2, 1)[..., None]
    return jnp.where(unused, 0, key), jnp.where(unused, 0, value)


def _dropout_keep(rate, rng, dropout_mask, shape):
    """(keep-mask or None, scale of kept weights)."""
    rate = _checks.check_dropout_rate("dropout_rate", rate)
    if dropout_mask is not None:
        _checks.require_array("dropout_mask", dropout_mask)
        _checks.check_broadcast("dropout_mask", dropout_mask.shape, shape, MASK_LAYOUT)
        if _checks._dtype_kind(dropout_mask) not in ("bool", "int"):
            raise TypeError(
                f"dropout_mask must be bool (True = keep) or 0/1 integer, got dtype "
                f"{dropout_mask.dtype} with shape {tuple(dropout_mask.shape)}"
            )
        return jnp.asarray(dropout_mask) != 0, 1.0 / (1.0 - rate)
    if rate == 0.0:
        return None, 1.0
    if rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng or dropout_mask")
    return jax.random.bernoulli(rng, 1.0 - rate, shape), 1.0 / (1.0 - rate)
