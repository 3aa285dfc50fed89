"""Argument checks shared by the functional core and the module.

Twin of ``mha_jax/_checks.py``: the same checks, the same messages, so that a bad argument
fails alike in both frameworks. Every message names the argument and the shapes.
"""

from __future__ import annotations

import torch

from mha_spec import arguments

# The functional core's layout, named in messages.
QKV_LAYOUT = "(batch, heads, q_len, head_dim)"
KV_LAYOUT = "(batch, kv_heads, kv_len, head_dim)"


def _dtype_kind(x) -> str:
    """'float', 'complex', 'int', 'bool' or 'other' for a tensor's dtype."""
    dtype = x.dtype
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    if dtype == torch.bool:
        return "bool"
    try:
        torch.iinfo(dtype)
    except TypeError:
        return "other"
    return "int"


def _dtype_name(x) -> str:
    """A tensor's dtype as JAX and NumPy print it (``int32``, not ``torch.int32``), so that
    messages naming it read the same in both frameworks."""
    return str(x.dtype).removeprefix("torch.")


def require_array(name: str, x) -> None:
    """TypeError unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def require_float(name: str, x) -> None:
    """TypeError unless ``x`` is a real floating-point tensor."""
    require_array(name, x)
    if _dtype_kind(x) != "float":
        raise TypeError(
            f"{name} must be a real floating-point array, got dtype {_dtype_name(x)} "
            f"with shape {tuple(x.shape)}"
        )


def require_int(name: str, x) -> None:
    """TypeError unless ``x`` is an integer tensor."""
    require_array(name, x)
    if _dtype_kind(x) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {_dtype_name(x)} with shape {tuple(x.shape)}")


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
    batch, heads, q_len, head_dim = query.shape
    if key.shape != value.shape:
        raise ValueError(
            f"key and value must have the same shape {KV_LAYOUT}, "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    k_batch, kv_heads, kv_len, k_dim = key.shape
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
    """An integer tensor of shape ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    require_array(name, x)
    if _dtype_kind(x) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {_dtype_name(x)} with shape {tuple(x.shape)}")
    arguments.check_sequence_shape(name, x.shape, batch, length, length_name)


def check_lengths(name: str, lengths, batch: int, kv_len: int) -> None:
    """An integer ``(batch,)`` (or scalar) tensor of lengths in ``[0, kv_len]``; tensors are
    always concrete here, so the range is always checked (JAX skips it under ``jit``)."""
    require_array(name, lengths)
    if _dtype_kind(lengths) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {_dtype_name(lengths)} with shape {tuple(lengths.shape)}")
    arguments.check_lengths_shape(name, lengths.shape, batch)
    arguments.check_lengths_range(name, lengths.detach().cpu().numpy(), kv_len)
