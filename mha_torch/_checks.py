"""Argument checks shared by the functional core and the module.

Twin of ``mha_jax/_checks.py``: the same checks, the same messages, so that a bad argument
fails alike in both frameworks. Every message names the argument and the shapes.
"""

from __future__ import annotations

import torch

from mha_spec import arguments


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
    arguments.check_kind(name, _dtype_kind(x), "float", _dtype_name(x), x.shape)


def require_int(name: str, x) -> None:
    """TypeError unless ``x`` is an integer tensor."""
    require_array(name, x)
    arguments.check_kind(name, _dtype_kind(x), "int", _dtype_name(x), x.shape)


def check_attention_inputs(query, key, value) -> tuple[int, int, int, int, int, int]:
    """Check the functional core's inputs; return (batch, q_len, heads, head_dim, kv_len, kv_heads)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        require_float(name, x)
    return arguments.check_attention_shapes(query.shape, key.shape, value.shape, (query.dtype, key.dtype, value.dtype),
                                            heads_first=True)


def check_sequence(name: str, x, batch: int, length: int, length_name: str) -> None:
    """An integer tensor of shape ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    require_int(name, x)
    arguments.check_sequence_shape(name, x.shape, batch, length, length_name)


def check_lengths(name: str, lengths, batch: int, kv_len: int) -> None:
    """An integer ``(batch,)`` (or scalar) tensor of lengths in ``[0, kv_len]``; tensors are
    always concrete here, so the range is always checked (JAX skips it under ``jit``)."""
    require_int(name, lengths)
    arguments.check_lengths_shape(name, lengths.shape, batch)
    arguments.check_lengths_range(name, lengths.detach().cpu().numpy(), kv_len)
