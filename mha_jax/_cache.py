"""Key/value cache arithmetic for decoding (``mha_spec.kv_cache``) over JAX arrays.

Twin of ``mha_torch/_cache.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_spec import kv_cache


def positions(end: jax.Array, n: int, query_positions) -> jax.Array:
    """int32 ``(batch, n)``: the new tokens' positions; default ``end + arange(n)``, else the
    given ones (``-1`` marks a padding token, which is not written)."""
    if query_positions is None:
        return end[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    _checks.require_array("query_positions", query_positions)
    kv_cache.check_step_positions(query_positions.shape, _checks.dtype_kind(query_positions), query_positions.dtype,
                                  end.shape[0], n)
    return jnp.broadcast_to(jnp.asarray(query_positions, jnp.int32), (end.shape[0], n))


def write(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """``cache`` ``(batch, max_length, kv_heads, head_dim)`` with ``new`` ``(batch, n, kv_heads,
    head_dim)`` at slots ``pos % max_length``; padding tokens (``pos < 0``) are dropped."""
    batch, max_length, kv_heads, head_dim = cache.shape
    slots = jnp.where(pos >= 0, pos % max_length, max_length)  # out of range: dropped
    # One more slot, always dropped: XLA:CPU turns a one-slot scatter (one batch row, one token)
    # into a dynamic-update-slice, which it fuses apart for each reader, copying the cache each time.
    slots = jnp.pad(slots, ((0, 0), (0, 1)), constant_values=max_length)
    new = jnp.pad(new.astype(cache.dtype), ((0, 0), (0, 1), (0, 0), (0, 0)))
    # the cache's own sharding, which an Explicit mesh (jax.make_mesh's) cannot infer for a scatter
    return cache.at[jnp.arange(batch)[:, None], slots].set(new, mode="drop", out_sharding=jax.typeof(cache).sharding)


def advance(end: jax.Array, pos: jax.Array) -> jax.Array:
    """Each row's new end: one past the last position written."""
    return kv_cache.advance(end, pos.max(axis=1), jnp.maximum)


def slot_positions(end: jax.Array, max_length: int) -> tuple[jax.Array, jax.Array]:
    """(positions each slot holds, count of written slots): ``mha_spec.kv_cache.slot_positions``."""
    return kv_cache.slot_positions(end, max_length, jnp.arange(max_length, dtype=jnp.int32)[None], jnp.minimum)
