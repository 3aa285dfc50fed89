"""The pieces every comparison's verdict is made of: three outcomes per row, the bound that knows
rounding, and the verdict line a report ends with.

A row is ``PASSED``, ``FAILED`` or ``NOT_COMPARED`` (its error could not be computed; the row
says why). A not-compared row is never counted as passed, and never as failed.

The bound: float32 rounding of a module grows with its inputs (a softmax of large logits rounds
worse than one of small ones), so a fixed tolerance is either too tight for real weights or too
loose for random ones. The reference side's own error against the same computation in float64
measures the rounding of *that* module on *those* inputs; a port may add up to ``ROUNDING_FACTOR``
times that. The bound is never below a few units of the dtype's rounding (``ROUNDING_FLOORS``; or
the fixed tolerance where that is smaller), since two correct sides may order their sums
differently where the reference happens to round well; it may be below the fixed tolerance, so that
a small defect in a module that rounds well (a norm's epsilon) is seen. Where the reference
computes in float64 already, or its float64 run could not be made, the bound is the fixed tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

PASSED, FAILED, NOT_COMPARED = "passed", "failed", "not compared"

# how far beyond the reference's own rounding a port's error may go: two sides that round alike
# differ from each other by up to about twice what either differs from the exact result
ROUNDING_FACTOR = 4.0
# the least a measured bound may be: 16 units in the last place of the dtype (relative)
ROUNDING_FLOORS = {"float64": 16 * 2.0**-52, "float32": 16 * 2.0**-23, "bfloat16": 16 * 2.0**-7,
                   "float16": 16 * 2.0**-10}


def bound(tolerance: float, reference_error: float | None, dtype: str = "float32",
          factor: float = ROUNDING_FACTOR) -> float:
    """What an error may be: ``max(min(tolerance, ROUNDING_FLOORS[dtype]), factor * reference_error)``;
    the tolerance alone without a reference error (None, or not finite)."""
    if reference_error is None or reference_error != reference_error or reference_error == float("inf"):
        return tolerance
    return max(min(tolerance, ROUNDING_FLOORS.get(dtype, tolerance)), factor * reference_error)


def outcome(error: float | None, limit: float) -> str:
    """``PASSED`` when ``error <= limit``, ``FAILED`` when not (NaN fails), ``NOT_COMPARED`` when None."""
    if error is None:
        return NOT_COMPARED
    return PASSED if error <= limit else FAILED


def counts(outcomes: Iterable[str]) -> str:
    """``"5 passed, 1 failed, 2 not compared"``."""
    found = list(outcomes)
    return ", ".join(f"{found.count(o)} {o}" for o in (PASSED, FAILED, NOT_COMPARED))


def line(passed: bool, failures: Iterable[str], what: str = "") -> str:
    """The verdict line: ``"PASSED"`` or ``"FAILED: a; b"``, naming what failed (``what`` before it)."""
    prefix = f"{what}: " if what else ""
    if passed:
        return f"{prefix}PASSED"
    named = [f for f in failures if f]
    return f"{prefix}FAILED: " + ("; ".join(named) if named else "see above")


class Measured:
    """A result row (a dataclass with ``tolerance``) whose ``error`` passes within it; ``as_json``
    adds ``passed`` to its fields."""

    error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance

    def as_json(self) -> dict:
        return dict(dataclasses.asdict(self), passed=self.passed)
