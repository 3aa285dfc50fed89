"""The report core both commands share: a table of rows under named columns, each row a compared
item with one outcome (``verdict.PASSED``, ``FAILED`` or ``NOT_COMPARED``), its cells and, when it
failed, what failed in words; rendered as aligned plain text or as Markdown, with the counts of the
outcomes, the failures and the verdict line beneath; a plot of each row's error against its limit.
``mha-parity verify``'s cases (``tool/report.py``) and ``mha-parity compare``'s modules and
parameters (``porting/report.py``, ``porting/gradients.py``) are such rows; each command keeps only
what is its own (verify's header and progress, compare's first divergence and data flow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parity_tests.tool import files, verdict


class Row:
    """A compared item: a subclass gives ``outcome``, ``cells()`` (in its table's columns) and
    ``failure()`` (what failed, in words; "" when it did not)."""

    @property
    def outcome(self) -> str:
        raise NotImplementedError

    @property
    def passed(self) -> bool:
        return self.outcome == verdict.PASSED

    @property
    def failed(self) -> bool:
        return self.outcome == verdict.FAILED

    def cells(self) -> list[str]:
        raise NotImplementedError

    def failure(self) -> str:
        return ""


@dataclass
class Measured(Row):
    """A row (a dataclass whose subclass gives ``error`` and ``tolerance``; keywords ``reference`` and ``floor``)
    whose ``error`` passes within its ``bound``, ``verdict.bound(tolerance, reference, floor)``: ``reference``
    PyTorch's own error against its float64 copy where it was measured (None: the tolerance alone);
    ``as_json`` adds ``bound`` and ``passed`` to its fields."""

    reference: float | None = dataclasses.field(default=None, kw_only=True)
    floor: float | None = dataclasses.field(default=None, kw_only=True)

    @property
    def bound(self) -> float:
        return verdict.bound(self.tolerance, self.reference, self.floor)

    @property
    def outcome(self) -> str:
        return verdict.outcome(self.error, self.bound)

    def as_json(self) -> dict:
        return dict(dataclasses.asdict(self), bound=self.bound, passed=self.passed)


@dataclass
class Table:
    """``rows`` under ``columns``: their cells, counts, failures and verdict, as text or Markdown."""

    columns: Sequence[str]
    rows: Sequence[Row]

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.rows)

    def counts(self) -> str:
        """``"5 passed, 1 failed, 2 not compared"``."""
        return verdict.counts(r.outcome for r in self.rows)

    def failures(self) -> list[str]:
        """What each failed row says failed."""
        return [r.failure() for r in self.rows if r.failed and r.failure()]

    def verdict(self, what: str = "verdict") -> str:
        return verdict.line(self.passed, self.failures(), what)

    def text(self, cells: list[list[str]] | None = None) -> str:
        """The columns and each row's cells (or ``cells``, the rows' own), aligned, a rule beneath the header."""
        cells = [r.cells() for r in self.rows] if cells is None else cells
        header = list(self.columns)
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
        line = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
        return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])

    def markdown(self, cells: list[list[str]] | None = None) -> list[str]:
        """The table's Markdown lines (a ``|`` in a cell written ``/``)."""
        cells = [r.cells() for r in self.rows] if cells is None else cells
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        return lines + ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]


def plot(path: str, labels: Sequence[str], points: dict[str, Sequence[float]], limits: dict[str, object],
         title: str, marks: Callable | None = None) -> str | None:
    """Each series of ``points`` (one value per label, on a log scale, an error of 0 drawn at 1e-18)
    against ``limits`` (a number: a horizontal line; a sequence: a step per label), written to
    ``path``; ``marks(axes)`` draws more. None, and nothing written, without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    floor = 1e-18
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.12), 3.5))
    for (name, values), style in zip(points.items(), (".", "x", "o", "+")):
        ax.semilogy(x, [max(v or 0, floor) for v in values], style, label=name)
    for (name, limit), color in zip(limits.items(), ("C3", "C1", "C0")):
        if isinstance(limit, (int, float)):
            ax.axhline(limit, color=color, linestyle="--", label=name)
        else:
            ax.step(x, list(limit), where="mid", color=color, label=name)
    if marks is not None:
        marks(ax)
    if len(labels) <= 60:
        ax.set_xticks(list(x), list(labels), rotation=90, fontsize=6)
    ax.set_title(f"{title} (an error of 0 drawn at {floor:.0e})", fontsize=9)
    ax.set_ylabel("relative error")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.write_atomically(path, lambda target: fig.savefig(target, dpi=100))
    plt.close(fig)
    return path
