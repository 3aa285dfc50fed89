"""The kernels' tunables and what a call's trace observed of its path (``mha_jax.testing`` sets and reads them)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The constants the kernels read while a call is traced (``docs/performance.md``: how each was chosen).

    ``blocks``/``backward_blocks``: blockwise's (query, key) blocks, forward and backward; None: by length
    (``_blockwise.block_sizes``). ``band_block``: queries per band of a window. ``ring_tile``: the largest tile of
    queries (and keys) a ring step scores at once. ``rows_over_heads``, ``many_keys``: ``"xla"`` forms one product
    over every key/value head when ``q_len x groups x kv_heads^2 <= rows_over_heads`` and ``kv_len >= many_keys``.
    """

    blocks: tuple[int, int] | None = None
    backward_blocks: tuple[int, int] | None = None
    band_block: int = 128
    ring_tile: int = 512
    rows_over_heads: int = 1024
    many_keys: int = 128


_DEFAULT = Tuning()
_TUNING: contextvars.ContextVar[Tuning | None] = contextvars.ContextVar("mha_jax_tuning", default=None)
_SEEN: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar("mha_jax_seen", default=())


def current() -> Tuning:
    """The tuning of the calls traced here."""
    return _TUNING.get() or _DEFAULT


@contextlib.contextmanager
def tuned(**changes: Any):
    """The calls traced inside use ``current()`` with ``changes`` (fields of ``Tuning``); yields that tuning."""
    token = _TUNING.set(dataclasses.replace(current(), **changes))
    try:
        yield current()
    finally:
        _TUNING.reset(token)


@contextlib.contextmanager
def observed():
    """Yields a list that gets ``(event, detail)`` for each ``observe`` of the calls traced inside."""
    seen: list = []
    token = _SEEN.set(_SEEN.get() + (seen,))
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def observe(event: str, detail: Any = None) -> None:
    """Tell the ``observed`` lists that a trace took ``event`` (the path run, the blocks taken)."""
    for seen in _SEEN.get():
        seen.append((event, detail))
