"""Key/value cache arithmetic for decoding (``mha_spec.kv_cache``) over JAX arrays; twin of ``mha_torch/_cache.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_spec import kv_cache


def positions(end: jax.Array, n: int, query_positions) -> jax.Array:
    """int32 ``(batch, n)``: the new tokens' positions, default ``end + arange(n)`` (``-1``: padding)."""
    if query_positions is None:
        return end[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    _checks.require_array("query_positions", query_positions)
    kv_cache.check_step_positions(query_positions.shape, _checks.dtype_kind(query_positions), query_positions.dtype,
                                  end.shape[0], n)
    return jnp.broadcast_to(jnp.asarray(query_positions, jnp.int32), (end.shape[0], n))


def write(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """``cache`` ``(batch, max_length, ...)`` with ``new`` ``(batch, n, ...)`` at ``pos % max_length``, ``pos >= 0``."""
    batch, max_length, kv_heads, head_dim = cache.shape
    slots = jnp.where(pos >= 0, pos % max_length, max_length)  # out of range: dropped
    # one more slot, always dropped: XLA:CPU would turn a one-slot scatter into a copying dynamic-update-slice
    slots = jnp.pad(slots, ((0, 0), (0, 1)), constant_values=max_length)
    new = jnp.pad(new.astype(cache.dtype), ((0, 0), (0, 1), (0, 0), (0, 0)))
    # an Explicit mesh cannot infer a scatter's sharding
    return cache.at[jnp.arange(batch)[:, None], slots].set(new, mode="drop", out_sharding=jax.typeof(cache).sharding)


def advance(end: jax.Array, pos: jax.Array) -> jax.Array:
    """Each row's new end: one past the last position written."""
    return kv_cache.advance(end, pos.max(axis=1), jnp.maximum)


def slot_positions(end: jax.Array, max_length: int) -> tuple[jax.Array, jax.Array]:
    """``mha_spec.kv_cache.slot_positions``."""
    return kv_cache.slot_positions(end, max_length, jnp.arange(max_length, dtype=jnp.int32)[None], jnp.minimum)
