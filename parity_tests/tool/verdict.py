"""The pieces every comparison's verdict is made of: three outcomes per row, the one bound that
knows rounding, and the verdict line a report ends with. ``mha-parity compare`` judges modules,
logits, gradients, optimizer steps, decoding and training by ``bound`` and ``outcome``, and
``mha-parity verify`` its cases (against a float64 oracle: the fixed tolerance).

A row is ``PASSED``, ``FAILED`` or ``NOT_COMPARED`` (its error could not be computed; the row
says why). A not-compared row is never counted as passed, and never as failed.

The bound: float32 rounding of a module grows with its inputs (a softmax of large logits rounds
worse than one of small ones), and in training with the steps, so a fixed tolerance is either too
tight for real weights or too loose for random ones. The reference side's own error against the
same computation in float64 measures the rounding of *that* module on *those* inputs (of *that*
parameter after *those* steps); a port may make up to 16 times that (``bound``), and never
less than a floor: a few units of the dtype's rounding (``ULP_FLOORS``, or the fixed tolerance
where that is smaller) for a module, since two correct sides may order their sums differently where
the reference happens to round well; a few roundings of a parameter in training. The bound may be
below the fixed tolerance, so that a small defect in a module that rounds well (a norm's epsilon)
is seen. Where the reference computes in float64 already, or its float64 run could not be made,
the bound is the fixed tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable

PASSED, FAILED, NOT_COMPARED = "passed", "failed", "not compared"

# how many times the reference's own rounding error a correct port may make: two sides that round
# alike differ by about twice what either differs from the exact result, but AdamW moves an entry
# whose gradient is rounding-sized by the whole learning rate either way: correct float32 ports
# drift up to 11.5 times the reference run's own drift in training (docs/training-comparison.md)
ROUNDING_FACTOR = 16.0
# the least a measured bound of a module may be: 16 units in the last place of the dtype (relative)
ULP_FLOORS = {"float64": 16 * 2.0**-52, "float32": 16 * 2.0**-23, "bfloat16": 16 * 2.0**-7, "float16": 16 * 2.0**-10}


def bound(tolerance: float, reference_error: float | None = None, floor: float | None = None) -> float:
    """What an error may be, the one rule of every verdict: ``max(floor, 16 * reference_error)`` where
    the reference's own error is measured (finite), ``floor`` defaulting to ``tolerance``; the fixed
    ``tolerance`` where it is not (None, NaN or infinite)."""
    if reference_error is None or reference_error != reference_error or reference_error == float("inf"):
        return tolerance
    return max(tolerance if floor is None else floor, ROUNDING_FACTOR * reference_error)


def module_floor(tolerance: float, dtype: str) -> float:
    """A module's floor: ``ULP_FLOORS[dtype]``, or the fixed tolerance where that is smaller."""
    return min(tolerance, ULP_FLOORS.get(dtype, tolerance))


def outcome(error: float | None, limit: float) -> str:
    """``PASSED`` when ``error <= limit``, ``FAILED`` when not (NaN fails), ``NOT_COMPARED`` when None."""
    if error is None:
        return NOT_COMPARED
    return PASSED if error <= limit else FAILED


def within(error: float | None, limit: float) -> bool:
    """Whether ``error`` passes within ``limit`` (``outcome`` is ``PASSED``)."""
    return outcome(error, limit) == PASSED


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

