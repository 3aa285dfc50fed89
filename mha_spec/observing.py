"""A package's tunables and what its calls report, for tests: ``tuned`` sets fields of a record for the calls
made inside, ``observed`` collects the ``(event, detail)`` they report with ``observe``."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any


class Observing:
    """The current tuning (``default`` with the changes of the ``tuned`` blocks around) and the observers."""

    def __init__(self, name: str, default: Any):
        self._tuning = contextvars.ContextVar(f"{name}_tuning", default=default)
        self._seen: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(f"{name}_seen", default=())

    def current(self) -> Any:
        """The tuning of the calls made here."""
        return self._tuning.get()

    @contextlib.contextmanager
    def tuned(self, **changes: Any):
        """The calls inside use ``current()`` with ``changes`` (fields of the record); yields that tuning."""
        token = self._tuning.set(dataclasses.replace(self.current(), **changes))
        try:
            yield self.current()
        finally:
            self._tuning.reset(token)

    @contextlib.contextmanager
    def observed(self):
        """Yields a list that gets ``(event, detail)`` for each ``observe`` of the calls inside."""
        seen: list = []
        token = self._seen.set(self._seen.get() + (seen,))
        try:
            yield seen
        finally:
            self._seen.reset(token)

    def observe(self, event: str, detail: Any = None) -> None:
        """Tell the ``observed`` lists that a call took ``event`` (the path run, the blocks taken)."""
        for seen in self._seen.get():
            seen.append((event, detail))
