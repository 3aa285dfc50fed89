"""Argument checks shared by the functional core and the modules.

Twin of ``mha_torch/_checks.py``: the same checks, the same messages, so that a bad
argument fails alike in both frameworks. Every message names the argument and the shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mha_spec import arguments

# The functional core's layout, named in messages.
QKV_LAYOUT = "(batch, q_len, heads, head_dim)"
KV_LAYOUT = "(batch, kv_len, kv_heads, head_dim)"


def _dtype_kind(x) -> str:
    """'float', 'complex', 'int', 'bool' or 'other' for an array's dtype."""
    dtype = np.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    if jnp.issubdtype(dtype, jnp.bool_):
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    return "other"


def require_array(name: str, x) -> None:
    """TypeError unless ``x`` has a shape and a dtype."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def require_float(name: str, x) -> None:
    """TypeError unless ``x`` is a real floating-point array."""
    require_array(name, x)
    if _dtype_kind(x) != "float":
        raise TypeError(
            f"{name} must be a real floating-point array, got dtype {x.dtype} "
            f"with shape {tuple(x.shape)}"
        )


def require_int(name: str, x) -> None:
    """TypeError unless ``x`` is an integer array."""
    require_array(name, x)
    if _dtype_kind(x) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype} with shape {tuple(x.shape)}")


def require_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_attention_inputs(query, key, value) -> tuple[int, int, int, int, int, int]:
    """Check the functional core's inputs; return (batch, q_len, heads, head_dim, kv_len, kv_heads)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        require_float(name, x)
    require_rank("query", query, 4, QKV_LAYOUT)
    require_rank("key", key, 4, KV_LAYOUT)
    require_rank("value", value, 4, KV_LAYOUT)
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    batch, q_len, heads, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape {KV_LAYOUT}, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    k_batch, kv_len, kv_heads, k_dim = key.shape
    if k_batch != batch or k_dim != head_dim:
        raise ValueError(
            f"key/value {tuple(key.shape)} must match query {tuple(query.shape)} "
            f"in batch and head_dim"
        )
    if head_dim == 0:
        raise ValueError(
            f"query, key and value need head_dim >= 1, got query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"key/value heads ({kv_heads}) must divide query heads ({heads}); "
            f"query {tuple(query.shape)}, key {tuple(key.shape)}"
        )
    return batch, q_len, heads, head_dim, kv_len, kv_heads


def check_sequence(name: str, x, batch: int, length: int, length_name: str) -> None:
    """An integer array of shape ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    require_array(name, x)
    if _dtype_kind(x) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype} with shape {tuple(x.shape)}")
    arguments.check_sequence_shape(name, x.shape, batch, length, length_name)


def check_lengths(name: str, lengths, batch: int, kv_len: int) -> None:
    """An integer ``(batch,)`` (or scalar) array of lengths in ``[0, kv_len]``; the range is
    checked where the values are known (not under ``jit``)."""
    require_array(name, lengths)
    if _dtype_kind(lengths) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {lengths.dtype} with shape {tuple(lengths.shape)}")
    arguments.check_lengths_shape(name, lengths.shape, batch)
    if _concrete(lengths):
        arguments.check_lengths_range(name, np.asarray(lengths), kv_len)


def _concrete(x) -> bool:
    """Whether ``x``'s values are known here (not a tracer inside ``jit`` or ``grad``)."""
    return not isinstance(x, jax.core.Tracer)
