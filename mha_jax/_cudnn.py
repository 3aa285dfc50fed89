"""cuDNN's fused attention (``implementation="cudnn"``) through ``jax.nn.dot_product_attention``, with our semantics."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mha_jax import _platform, _tiles, masks


def run(query, key, value, *, spec, scale, residual=False, **_):
    """(output ``(batch, q_len, heads, v_head_dim)``, None, lse ``(batch, q_len, heads)`` or None), lowered for CUDA."""
    def kernel(q, k, v, arrays):
        with _platform.cudnn_traced_anywhere():
            return _cudnn(q, k, v, dataclasses.replace(spec, **arrays), scale, residual)
    out = _platform.on("cuda", kernel, query, key, value, _platform.spec_arrays(spec))
    return (out[0], None, out[1]) if residual else (out, None, None)


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
        return out, jnp.where(has_key[..., 0], lse.astype(jnp.float32), _tiles.no_key_residual(jnp.float32))
    return out
