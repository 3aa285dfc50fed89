"""Key/value cache arithmetic for decoding: where new tokens go and what each slot holds, for the
twins' ``_cache.py`` (each passes its framework's arrays and operations).

A cache of ``max_length`` slots per row holds the token at position ``p`` in slot
``p % max_length``; each row keeps its own end (one past its last position written). Slot ``s``
of a row whose end is ``e`` then holds position ``s + max_length * floor((e - 1 - s) /
max_length)``, a negative one if never written. While ``e <= max_length`` nothing is overwritten;
past it the oldest positions are, which is right only when every query's window starts after them
(a rolling buffer for sliding-window attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def check_step_positions(shape: Sequence[int], kind: str, dtype: Any, batch: int, n: int) -> None:
    """A decoding step's ``query_positions`` (``kind`` and ``dtype`` as the framework names
    them): integer ``(batch, n)`` or ``(n,)``."""
    if kind != "int":
        raise TypeError(f"query_positions must be integer, got dtype {dtype}")
    if tuple(shape) not in ((n,), (batch, n)):
        raise ValueError(
            f"query_positions must have shape (batch, n) = {(batch, n)} or (n,) = ({n},) "
            f"while decoding, got {tuple(shape)}"
        )


def advance(end: Any, last: Any, maximum: Callable) -> Any:
    """Each row's new end ``(batch,)``: one past the last position written (``last``, each row's
    largest new position), never before the old ``end``."""
    return maximum(end, last + 1)


def slot_positions(end: Any, max_length: int, slots: Any, minimum: Callable) -> tuple[Any, Any]:
    """(int32 ``(batch, max_length)`` positions each slot holds, int32 ``(batch,)`` count of
    written slots) of rows ending at ``end`` int32 ``(batch,)``; ``slots``: int32
    ``arange(max_length)[None]``. The key positions and lengths the attention reads."""
    held = slots + max_length * ((end[:, None] - 1 - slots) // max_length)
    return held, minimum(end, max_length)


def check_overflow(overflow: np.ndarray | None, end: np.ndarray, max_length: int) -> None:
    """Refuse a step that overwrote a position its queries may still see: ``overflow`` bool
    ``(batch,)`` (None where its values are not known here: under ``jit`` or compilation, where the
    cache's flag records it instead), ``end`` the rows' new ends."""
    if overflow is None or not overflow.any():
        return
    row = int(np.argmax(overflow))
    raise ValueError(
        f"the cache overflows: row {row} would hold positions up to {int(end[row]) - 1} in max_length "
        f"{max_length} slots, overwriting positions its queries may still see (a window of left + chunk "
        "<= max_length makes it a rolling buffer)"
    )
