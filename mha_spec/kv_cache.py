"""Key/value cache arithmetic for decoding, over each twin's arrays and operations.

A cache of ``max_length`` slots per row holds the token at position ``p`` in slot ``p % max_length``;
each row keeps its end ``e`` (one past its last position written), and slot ``s`` holds position
``s + max_length * floor((e - 1 - s) / max_length)``, negative if never written. Past ``e = max_length``
the oldest positions are overwritten: a rolling buffer, right when every query's window starts after them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mha_spec import terms


def check_step_positions(shape: Sequence[int], kind: str, dtype: Any, batch: int, n: int) -> None:
    """A decoding step's ``query_positions``: integer ``(batch, n)`` or ``(n,)``."""
    if kind != "int":
        raise TypeError(f"query_positions must be integer, got dtype {dtype}")
    if tuple(shape) not in ((n,), (batch, n)):
        raise ValueError(
            f"query_positions must have shape (batch, n) = {(batch, n)} or (n,) = ({n},) "
            f"while decoding, got {tuple(shape)}"
        )


def check_cache(names: tuple[str, str], remedy: str, key_shape: Sequence[int], index_shape: Sequence[int],
                batch_shape: Sequence[int], kv_heads: int, head_dim: int, n: int) -> None:
    """Keys ``(*batch, max_length, kv_heads, head_dim)`` and index ``(*batch,)`` fit a step of ``n`` tokens."""
    max_length, batch_shape = key_shape[-3], tuple(batch_shape)
    expected = (*batch_shape, max_length, kv_heads, head_dim)
    if tuple(key_shape) != expected or tuple(index_shape) != batch_shape:
        raise ValueError(
            f"the cache holds {names[0]} {tuple(key_shape)} and {names[1]} {tuple(index_shape)}, but the inputs "
            f"need (*batch, max_length, num_kv_heads, head_dim) = {expected} and (*batch,) = {batch_shape}; {remedy}"
        )
    if n > max_length:
        raise ValueError(f"a chunk of {n} tokens does not fit a cache of max_length {max_length}")


def check_dtype(cached: str, dtype: str, name: str, remedy: str) -> None:
    """A step's keys in the cache's dtype (``name``: the cache's keys, as the twin calls them)."""
    if cached != dtype:
        raise TypeError(f"{name} has dtype {cached} but the keys are {dtype}: {remedy}")


def advance(end: Any, last: Any, maximum: Callable) -> Any:
    """Each row's new end ``(batch,)``: ``max(end, last + 1)``."""
    return maximum(end, last + 1)


def slot_positions(end: Any, max_length: int, slots: Any, minimum: Callable) -> tuple[Any, Any]:
    """(int32 ``(batch, max_length)`` position each slot holds, int32 ``(batch,)`` written slots);
    ``slots``: int32 ``arange(max_length)[None]``."""
    held = slots + max_length * ((end[:, None] - 1 - slots) // max_length)
    return held, minimum(end, max_length)


def check_step(start: Any, end: Any, max_length: int, step_terms: Any, values: Callable) -> Any:
    """bool ``(batch,)``: the step overwrote a position its queries may still see; raises where
    ``values(overflow)`` is not None (outside ``jit``/compilation)."""
    overflow = terms.cache_overflows(start, end, max_length, step_terms)
    found = values(overflow)
    if found is None or not found.any():
        return overflow
    row = int(np.argmax(found))
    raise ValueError(
        f"the cache overflows: row {row} would hold positions up to {int(end[row]) - 1} in max_length "
        f"{max_length} slots, overwriting positions its queries may still see (a window of left + chunk "
        "<= max_length makes it a rolling buffer)"
    )
