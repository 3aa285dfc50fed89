"""Argument checks shared by the functional core and the module.

Twin of ``mha_jax/_checks.py``: the same checks, the same messages, so that a bad argument
fails alike in both frameworks. Every message names the argument and the shapes.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

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


def require_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}")


def check_heads(num_heads: int, num_kv_heads: int, features: int, features_name: str) -> int:
    """Validate head counts against a feature size; return head_dim."""
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    if not isinstance(features, int) or isinstance(features, bool) or features < 1:
        raise ValueError(f"{features_name} must be a positive integer, got {features!r}")
    if features % num_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must divide {features_name} ({features})"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})"
        )
    return features // num_heads


def check_broadcast(name: str, shape: Sequence[int], target: Sequence[int], target_names: str) -> None:
    """ValueError unless ``shape`` broadcasts to ``target`` (right-aligned, numpy rules)."""
    shape, target = tuple(shape), tuple(target)
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(shape[::-1], target[::-1])
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to {target_names} = {target}"
        )


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


def check_dropout_rate(name: str, rate: float) -> float:
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number in [0, 1), got {rate!r}") from None
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate}")
    return rate


def check_scale(scale) -> float | None:
    """None, or a finite real number."""
    if scale is None:
        return None
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_is_causal(is_causal) -> bool:
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return bool(is_causal)


def check_implementation(implementation, known: tuple[str, ...]) -> str | None:
    """None (the default choice) or one of ``known``."""
    if implementation is not None and implementation not in known:
        raise ValueError(f"implementation must be one of {known} or None, got {implementation!r}")
    return implementation


def check_window(window) -> tuple[int, int] | None:
    """None, an integer ``w`` (the window ``(w, w)``) or ``(left, right)``, each >= 0."""
    if window is None:
        return None
    pair = (window, window) if isinstance(window, (int, np.integer)) and not isinstance(window, bool) else window
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
        isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in pair
    )):
        raise TypeError(f"local_window_size must be an integer or a pair (left, right) of integers, got {window!r}")
    if min(pair) < 0:
        raise ValueError(f"local_window_size must be >= 0 on both sides, got {window!r}")
    return int(pair[0]), int(pair[1])


def check_sequence(name: str, x, batch: int, length: int, length_name: str) -> None:
    """An integer tensor of shape ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    require_array(name, x)
    if _dtype_kind(x) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {_dtype_name(x)} with shape {tuple(x.shape)}")
    shape = tuple(x.shape)
    if not (shape == (length,) or (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == length)):
        raise ValueError(
            f"{name} must have shape ({length_name},) = ({length},) or (batch, {length_name}) = "
            f"({batch}, {length}), got {shape}"
        )


def check_lengths(name: str, lengths, batch: int, kv_len: int) -> None:
    """An integer ``(batch,)`` (or scalar) tensor of lengths in ``[0, kv_len]``; tensors are
    always concrete here, so the range is always checked (JAX skips it under ``jit``)."""
    require_array(name, lengths)
    if _dtype_kind(lengths) != "int":
        raise TypeError(f"{name} must be an integer array, got dtype {_dtype_name(lengths)} with shape {tuple(lengths.shape)}")
    if tuple(lengths.shape) not in ((), (1,), (batch,)):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
    values = lengths.detach().cpu().numpy()
    if values.size and (values.min() < 0 or values.max() > kv_len):
        raise ValueError(f"{name} must lie in [0, kv_len] = [0, {kv_len}], got {values.tolist()}")
