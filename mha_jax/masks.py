"""Masks, biases and positions parsed into ``mha_spec.terms.Spec``; ``mask`` in flax's convention (any dtype,
nonzero = attend). Twin of ``mha_torch/masks.py``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mha_jax import _checks, _tiles
from mha_spec import arguments, docstrings, torch_mha
from mha_spec.terms import Spec

MASK_LAYOUT = "(batch, heads, q_len, kv_len)"


def padding_mask(valid) -> jnp.ndarray:
    """Boolean mask ``(batch, 1, 1, kv_len)`` from ``valid`` ``(batch, kv_len)``: bool or 0/1, True = a real key."""
    _checks.require_array("valid", valid)
    arguments.check_padding_valid(valid.shape, _checks.dtype_kind(valid), valid.dtype)
    return (jnp.asarray(valid) != 0)[:, None, None, :]


def causal_mask(q_len: int, kv_len: int | None = None) -> jnp.ndarray:
    """Boolean mask ``(1, 1, q_len, kv_len)``: query i attends to keys 0..i (aligned top-left, as ``is_causal``)."""
    kv_len = arguments.check_mask_sizes(q_len, kv_len)
    return jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))[None, None]


def parse(shape: tuple[int, int, int, int], *, mask=None, bias=None, query_seq_lengths=None, **terms) -> Spec:
    """Check every masking argument of a call with ``shape`` = (batch, heads, q_len, kv_len); ``terms``: the others
    of ``batch_axes.Masking``, by name (``ArrayChecks.position_terms``)."""
    batch, _, q_len, _ = shape
    allowed = None
    if mask is not None:
        _checks.require_array("mask", mask)
        arguments.check_broadcast("mask", mask.shape, shape, MASK_LAYOUT)
        if _checks.dtype_kind(mask) not in ("bool", "int", "float"):
            raise TypeError(f"mask must be bool, integer or real floating (nonzero = attend), got dtype "
                            f"{mask.dtype} with shape {tuple(mask.shape)}")
        allowed = jnp.asarray(mask) if mask.dtype == jnp.bool_ else jnp.asarray(mask) != 0
    if bias is not None:
        _checks.require_float("bias", bias)
        arguments.check_broadcast("bias", bias.shape, shape, MASK_LAYOUT)
        bias = jnp.asarray(bias)
    fields = _checks.CHECKS.position_terms(shape, _index, _constant, **terms)
    query_lengths = _checks.CHECKS.lengths("query_seq_lengths", query_seq_lengths, batch, q_len, "q_len", _index)
    return Spec(shape, allowed, bias, **fields, query_lengths=query_lengths)


def over_cache(spec: Spec, query_positions, key_positions, lengths) -> Spec:
    """``spec`` over a decoding cache's slots, with the step's positions ``(batch, n)``, the slots' positions
    ``(batch, max_length)`` and the written slots' count ``(batch,)``."""
    batch, _, q_len, kv_len = spec.shape
    checks = _checks.CHECKS
    return dataclasses.replace(
        spec, query_positions=checks.sequence("query_positions", query_positions, batch, q_len, "q_len", _index),
        key_positions=checks.sequence("key_positions", key_positions, batch, kv_len, "kv_len", _index),
        lengths=checks.lengths("key_value_seq_lengths", lengths, batch, kv_len, "kv_len", _index))


def _index(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _constant(x) -> jax.Array:
    return jax.lax.stop_gradient(jnp.asarray(x))


def _arange(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def positions(spec: Spec):
    """(query positions ``(batch|1, q_len)``, key positions ``(batch|1, kv_len)``), arange by default."""
    return spec.positions(_arange)


def query_rows(spec: Spec):
    """bool ``(batch, 1, q_len, 1)``: the queries within ``query_lengths``, or None (every query)."""
    return spec.query_rows(_arange)


def biases(spec: Spec):
    """float broadcasting to ``(batch, heads, q_len, kv_len)``: the bias plus the ALiBi term, or None."""
    return spec.biases(_arange)


def dense(spec: Spec):
    """bool ``(batch|1, heads|1, q_len, kv_len)``: every term but the bias, or None if none restricts."""
    return spec.dense(_arange)


@docstrings.fill
def unused_keys(spec: Spec, kv_heads: int = 1, segments: bool = True):
    """Keys no query may see.

    {unused_keys}

    ``segments=False`` leaves the segments' term out (for a length sharded over a mesh axis).
    """
    unused = spec.excluded_keys(kv_heads, _arange, _extremes, _present if segments else None, _tiles.below_all)
    return None if unused is None else jnp.broadcast_to(unused, (spec.shape[0], kv_heads, spec.shape[3]))


def _extremes(positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    return positions.min(axis=1, keepdims=True), positions.max(axis=1, keepdims=True)


def _present(query_ids, key_ids):
    """bool ``(batch|1, kv_len)``: whether each key's segment id occurs among the queries'."""
    batch = max(query_ids.shape[0], key_ids.shape[0])
    ordered = jnp.broadcast_to(jnp.sort(query_ids, axis=1), (batch, query_ids.shape[1]))
    key_ids = jnp.broadcast_to(key_ids, (batch, key_ids.shape[1]))
    # "sort": the default's loop, under vmap, fails on a batch sharded over an Explicit mesh axis
    index = jax.vmap(lambda a, v: jnp.searchsorted(a, v, method="sort"))(ordered, key_ids)
    found = jnp.take_along_axis(ordered, jnp.minimum(index, ordered.shape[1] - 1), axis=1)
    return found == key_ids


def zero_unused_inputs(inputs_k, inputs_v, spec: Spec, segments: bool = True):
    """``inputs_k``/``inputs_v`` ``(batch, kv_len, features)`` zeroed at the keys no query may attend to."""
    unused = unused_keys(spec, segments=segments)
    if unused is None:
        return inputs_k, inputs_v
    unused = unused[:, 0, :, None]
    return jnp.where(unused, 0, inputs_k), jnp.where(unused, 0, inputs_v)


# --- torch.nn.MultiheadAttention's masks (mha_spec.torch_mha) ---


@docstrings.fill
def mask_from_torch_mha(attn_mask: jax.Array | None = None, key_padding_mask: jax.Array | None = None, *,
                        num_heads: int | None = None) -> tuple[jax.Array | None, jax.Array | None]:
    """Our ``(mask, bias)`` from ``torch.nn.MultiheadAttention``'s ``attn_mask`` and ``key_padding_mask``.

    {from_torch_mha}
    """
    return torch_mha.from_torch_mha(attn_mask, key_padding_mask, num_heads, _checks.CHECKS, jnp.asarray)


@docstrings.fill
def mask_to_torch_mha(mask: jax.Array | None, shape: tuple[int, int, int, int], *,
                      bias: jax.Array | None = None) -> jax.Array | None:
    """``torch.nn.MultiheadAttention``'s ``attn_mask`` from our ``mask`` and ``bias``.

    Args:
      mask: ours, broadcasting to ``shape``, or None: any dtype, nonzero = attend.
      {to_torch_mha_shape}

    Returns:
      {to_torch_mha_returns}
      without a bias, else float (the bias, ``-inf`` where the mask forbids).
    """
    spec = parse(shape, mask=mask, bias=bias)  # checked as the core checks them
    return torch_mha.to_torch_mha(spec, shape, jnp.where, jnp.broadcast_to)
