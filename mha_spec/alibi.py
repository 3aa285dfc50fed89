"""ALiBi: head ``h`` adds ``-slope[h] * |q_pos - k_pos|`` to every logit (flash-attn's convention; under
causality transformers' bloom/falcon/MPT terms up to a constant per row), and the slopes as transformers
computes them (float32, as Python floats)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def bias(slopes: Any, q_position: Any, k_position: Any) -> Any:
    """``-slopes * |q_position - k_position|`` of broadcasting NumPy, JAX or PyTorch arrays."""
    return -slopes * abs(q_position - k_position)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _powers(base: float, exponents: Sequence[int]) -> list[float]:
    """``base ** e`` as float32 ``pow`` of a float32 base gives it."""
    base = _f32(base)
    return [_f32(base ** e) for e in exponents]


def bloom_slopes(num_heads: int) -> tuple[float, ...]:
    """Bloom's slopes (transformers' ``_get_alibi_slopes``, float32): for the largest power of two ``n <= num_heads``,
    ``b ** 1 .. b ** n`` with ``b = 2 ** (-8 / n)``; the remaining heads the odd powers of ``c = 2 ** (-4 / n)``."""
    num_heads = _check_heads(num_heads)
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = _powers(2 ** (-(2 ** -(math.log2(n) - 3))), range(1, n + 1))
    if n != num_heads:
        remaining = min(n, num_heads - n)
        slopes += _powers(2 ** (-(2 ** -(math.log2(2 * n) - 3))), range(1, 1 + 2 * remaining, 2))
    return tuple(slopes)


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> tuple[float, ...]:
    """MPT's slopes (transformers' ``build_mpt_alibi_tensor``, float32): ``2 ** -(k * alibi_bias_max / n)`` for
    ``k = 1 .. n``, ``n`` the smallest power of two ``>= num_heads``; with fewer heads, odd ``k`` after even."""
    num_heads = _check_heads(num_heads)
    n = 2 ** math.ceil(math.log2(num_heads))
    step = _f32(alibi_bias_max / n)
    slopes = [_f32(1.0 / _f32(2.0 ** _f32(_f32(k) * step))) for k in range(1, n + 1)]
    if n != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return tuple(slopes)


def _check_heads(num_heads) -> int:
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    return int(num_heads)


def check_slopes_shape(shape: Sequence[int], batch: int, heads: int) -> None:
    """ValueError unless ``shape`` is ``(heads,)`` or ``(batch, heads)``."""
    if tuple(shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = ({batch}, {heads}), "
                         f"one slope per query head, got {tuple(shape)}")


def check_module_slopes(slopes: Sequence[float] | None, num_heads: int) -> tuple[float, ...] | None:
    """A module's ``alibi_slopes``: None or ``num_heads`` finite real numbers, as a tuple of floats."""
    if slopes is None:
        return None
    values = tuple(np.asarray(slopes, dtype=np.float64).reshape(-1).tolist()) if hasattr(slopes, "shape") else None
    if values is None:
        try:
            values = tuple(float(s) for s in slopes)
        except (TypeError, ValueError):
            raise TypeError(f"alibi_slopes must be a sequence of num_heads={num_heads} numbers or None, "
                            f"got {slopes!r}") from None
    if len(values) != num_heads or not all(math.isfinite(s) for s in values):
        raise ValueError(f"alibi_slopes must hold num_heads={num_heads} finite numbers, one per query head, "
                         f"got {len(values)}: {values}")
    return values
