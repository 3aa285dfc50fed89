"""Argument checks shared by the functional core and the modules.

Twin of ``mha_torch/_checks.py``: the same checks, the same messages, so that a bad
argument fails alike in both frameworks. Every message names the argument and the shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mha_spec import arguments


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
    arguments.check_kind(name, _dtype_kind(x), "float", x.dtype, x.shape)


def require_int(name: str, x) -> None:
    """TypeError unless ``x`` is an integer array."""
    require_array(name, x)
    arguments.check_kind(name, _dtype_kind(x), "int", x.dtype, x.shape)


def check_attention_inputs(query, key, value) -> tuple[int, int, int, int, int, int]:
    """Check the functional core's inputs; return (batch, q_len, heads, head_dim, kv_len, kv_heads)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        require_float(name, x)
    return arguments.check_attention_shapes(query.shape, key.shape, value.shape, (query.dtype, key.dtype, value.dtype),
                                            heads_first=False)


def check_sequence(name: str, x, batch: int, length: int, length_name: str) -> None:
    """An integer array of shape ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    require_int(name, x)
    arguments.check_sequence_shape(name, x.shape, batch, length, length_name)


def check_lengths(name: str, lengths, batch: int, kv_len: int) -> None:
    """An integer ``(batch,)`` (or scalar) array of lengths in ``[0, kv_len]``; the range is
    checked where the values are known (not under ``jit``)."""
    require_int(name, lengths)
    arguments.check_lengths_shape(name, lengths.shape, batch)
    if _concrete(lengths):
        arguments.check_lengths_range(name, np.asarray(lengths), kv_len)


def _concrete(x) -> bool:
    """Whether ``x``'s values are known here (not a tracer inside ``jit`` or ``grad``)."""
    return not isinstance(x, jax.core.Tracer)
