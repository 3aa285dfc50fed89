"""Key/value cache arithmetic for decoding: where new tokens go and what each slot holds.

Twin of ``mha_torch/_cache.py``. A cache of ``max_length`` slots per row holds the token at
position ``p`` in slot ``p % max_length``; each row keeps its own end (one past its last
position written). Slot ``s`` of a row whose end is ``e`` then holds position
``s + max_length * floor((e - 1 - s) / max_length)``, a negative one if never written. While
``e <= max_length`` nothing is overwritten; past it the oldest positions are, which is right only
when every query's window starts after them (a rolling buffer for sliding-window attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks


def positions(end: jax.Array, n: int, query_positions) -> jax.Array:
    """int32 ``(batch, n)``: the new tokens' positions; default ``end + arange(n)``, else the
    given ones (``-1`` marks a padding token, which is not written)."""
    if query_positions is None:
        return end[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    _checks.require_array("query_positions", query_positions)
    if _checks.dtype_kind(query_positions) != "int":
        raise TypeError(f"query_positions must be integer, got dtype {query_positions.dtype}")
    if tuple(query_positions.shape) not in ((n,), (end.shape[0], n)):
        raise ValueError(
            f"query_positions must have shape (batch, n) = {(end.shape[0], n)} or (n,) = ({n},) "
            f"while decoding, got {tuple(query_positions.shape)}"
        )
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
    return jnp.maximum(end, pos.max(axis=1) + 1)


def slot_positions(end: jax.Array, max_length: int) -> tuple[jax.Array, jax.Array]:
    """(int32 ``(batch, max_length)`` positions each slot holds, int32 ``(batch,)`` count of
    written slots): the key positions and lengths the attention reads."""
    slots = jnp.arange(max_length, dtype=jnp.int32)[None]
    held = slots + max_length * jnp.floor_divide(end[:, None] - 1 - slots, max_length)
    return held, jnp.minimum(end, max_length)
