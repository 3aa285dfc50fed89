"""Argument checks that read no array library: head counts, broadcasting, rates, scales,
logit soft-caps, windows, sequence, length, position and sink shapes. Every message names the
argument and the shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from mha_spec.qk_norm import QKNorm


def _require_counts(num_heads: int, num_kv_heads: int) -> None:
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")


def check_head_counts(num_heads: int, num_kv_heads: int) -> None:
    """Both counts positive integers, the key/value heads dividing the query heads."""
    _require_counts(num_heads, num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})"
        )


def check_heads(num_heads: int, num_kv_heads: int, features: int, features_name: str) -> int:
    """Validate head counts against a feature size; return head_dim."""
    _require_counts(num_heads, num_kv_heads)
    if not isinstance(features, (int, np.integer)) or isinstance(features, bool) or features < 1:
        raise ValueError(f"{features_name} must be a positive integer, got {features!r}")
    if features % num_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must divide {features_name} ({features})"
        )
    check_head_counts(num_heads, num_kv_heads)
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


def check_dropout_rate(name: str, rate: float) -> float:
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number in [0, 1), got {rate!r}") from None
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate}")
    return rate


def resolve_deterministic(call: bool | None, default: bool | None) -> bool:
    """The call's ``deterministic``, else the module's; an error when dropout needs one and neither is set."""
    for value in (call, default):
        if value is not None:
            return bool(value)
    raise ValueError(
        "dropout_rate > 0 needs deterministic=True or False, in the constructor or the call "
        "(nnx: module.eval() / module.train())"
    )


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


def check_logit_soft_cap(cap) -> float | None:
    """None, or a positive finite real number (a Python or NumPy scalar: it is static under ``jit``)."""
    if cap is None:
        return None
    if isinstance(cap, (bool, np.bool_, str, bytes)):  # float() would read True or '50'
        raise TypeError(f"logit_soft_cap must be a positive finite number, got {cap!r}")
    try:
        value = float(cap)
    except (TypeError, ValueError):
        raise TypeError(f"logit_soft_cap must be a positive finite number, got {cap!r}") from None
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"logit_soft_cap must be a positive finite number, got {value}")
    return value


def check_sinks_shape(shape: Sequence[int], heads: int) -> None:
    """ValueError unless ``shape`` is ``(heads,)``: one sink logit per query head."""
    if tuple(shape) != (heads,):
        raise ValueError(
            f"sinks must have shape (heads,) = ({heads},), one logit per query head, got {tuple(shape)}"
        )


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


def check_qk_norm(normalize_qk) -> QKNorm | None:
    """``normalize_qk`` as a ``QKNorm``: False/None -> None, True -> flax's (LayerNorm per head,
    eps 1e-6), a ``QKNorm`` as it is."""
    if normalize_qk is None or normalize_qk is False:
        return None
    if normalize_qk is True:
        return QKNorm()
    if isinstance(normalize_qk, QKNorm):
        return normalize_qk
    raise TypeError(f"normalize_qk must be a bool or a QKNorm, got {type(normalize_qk).__name__}")


def check_sequence_shape(name: str, shape: Sequence[int], batch: int, length: int, length_name: str) -> None:
    """ValueError unless ``shape`` is ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    shape = tuple(shape)
    if not (shape == (length,) or (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == length)):
        raise ValueError(
            f"{name} must have shape ({length_name},) = ({length},) or (batch, {length_name}) = "
            f"({batch}, {length}), got {shape}"
        )


def check_lengths_shape(name: str, shape: Sequence[int], batch: int) -> None:
    """ValueError unless ``shape`` is ``()``, ``(1,)`` or ``(batch,)``."""
    if tuple(shape) not in ((), (1,), (batch,)):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(shape)}")


def check_lengths_range(name: str, values: np.ndarray, kv_len: int) -> None:
    """ValueError unless every length lies in ``[0, kv_len]``."""
    if values.size and (values.min() < 0 or values.max() > kv_len):
        raise ValueError(f"{name} must lie in [0, kv_len] = [0, {kv_len}], got {values.tolist()}")




def check_positions_shape(shape: Sequence[int], batch_shape: Sequence[int], length: int) -> None:
    """ValueError unless ``shape`` is ``(len,)`` or ``(*batch, len)`` with batch axes broadcasting
    to the input's."""
    shape, batch_shape = tuple(shape), tuple(batch_shape)
    lead = shape[:-1]
    ok = len(shape) >= 1 and shape[-1] == length and len(lead) <= len(batch_shape) and all(
        a in (1, b) for a, b in zip(reversed(lead), reversed(batch_shape))
    )
    if not ok:
        raise ValueError(
            f"positions must have shape (len,) = ({length},) or (*batch, len) with batch axes broadcasting "
            f"to {batch_shape}, got {shape}"
        )
