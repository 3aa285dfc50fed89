"""Which keys a query may see: the masking terms on positions."""

from __future__ import annotations

from typing import Any


def cache_overflows(start: Any, end: Any, max_length: int, window: tuple[int, int] | None, causal: bool) -> Any:
    """bool ``(batch,)``: the step overwrote a position some new query may still see. Past
    ``max_length`` positions the oldest are overwritten; with a window of ``left`` (causal or
    ``right == 0``) a chunk from ``start`` to ``end`` still sees them unless
    ``left + (end - start) <= max_length``."""
    wrapped = end > max_length
    if window is not None and (causal or window[1] == 0):
        return wrapped & (end - start + window[0] > max_length)
    return wrapped
