"""What ``mha-parity verify`` reports of its own: a header saying what is compared, a line per case
as it finishes (when the output is not a terminal: CI logs), and each case as a row of the report
core (``table``): the table, its counts and failures, and optionally a Markdown file with a plot
per dtype of each case's error against its tolerance."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from parity_tests.tool import files, harness, table, verdict

COLUMNS = ("case", "dtype", "abs error", "rel error", "grad error", "JAX vs PyTorch", "worst pair", "pass")


@dataclass
class Header:
    """What a run compares: ``title``, the implementations, the source the weights came from,
    the weights, shapes and seed."""

    title: str
    implementations: list[str]
    shapes: str
    seed: int
    source: str | None = None
    notes: list[str] = field(default_factory=list)
    weights: str | None = None

    def lines(self) -> list[str]:
        lines = [self.title, "  implementations: " + ", ".join(self.implementations)]
        if self.source:
            lines.append(f"  source: {self.source}")
        if self.weights:
            lines.append(f"  weights: {self.weights}")
        lines += [f"  shapes: {self.shapes}", f"  seed: {self.seed}"]
        tolerances = ", ".join(f"{d} {f:.0e}/{g:.0e}" for d, (f, g) in harness.TOLERANCES.items())
        lines.append(f"  tolerances (forward/gradients): {tolerances}")
        return lines + [f"  note: {n}" for n in self.notes]


def row(r: harness.Result) -> list[str]:
    """A case's cells, in ``COLUMNS`` order."""
    return CaseRow(r).cells()


@dataclass
class CaseRow(table.Row):
    """A case of the grid as a row: passed or failed (against the float64 oracle, the fixed tolerance)."""

    result: harness.Result

    @property
    def outcome(self) -> str:
        return verdict.PASSED if self.result.passed else verdict.FAILED

    def cells(self) -> list[str]:
        r = self.result
        return [f"{r.case.config.name}/{r.case.mask}", r.case.dtype, f"{r.abs:.2e}", f"{max(r.rel, r.max_abs):.2e}",
                f"{r.grad:.2e}", f"{r.jax_vs_torch:.2e}", r.worst_pair, "yes" if r.passed else "NO"]

    def failure(self) -> str:
        r = self.result
        tol, grad_tol = harness.TOLERANCES[r.case.dtype]
        return (f"FAILED {r.case.id}: {r.worst_pair} is off by {max(r.rel, r.max_abs):.2e} (outputs; tolerance "
                f"{tol:.0e}) and {r.grad:.2e} (gradients; tolerance {grad_tol:.0e})")


def cases(results: list[harness.Result]) -> table.Table:
    """The cases as the report core's table."""
    return table.Table(COLUMNS, [CaseRow(r) for r in results])


class Printer:
    """Prints the header at once (unless None), then one line per finished case when stdout is
    not a terminal (a progress bar when it is), then the table and the totals."""

    def __init__(self, header: Header | None, *, echo: bool = True, total: int | None = None):
        self.echo, self.total, self.count = echo, total, 0
        self.tty = sys.stdout.isatty()
        from rich.console import Console

        self.console = Console(width=None if self.tty else 160, highlight=False)
        self._bar = None
        if echo and header is not None:
            for line in header.lines():
                print(line, flush=True)

    def __enter__(self):
        if self.echo and self.tty and self.total:
            from rich.progress import Progress

            self._bar = Progress(console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("verifying", total=self.total)
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.stop()

    def done(self, result: harness.Result) -> None:
        """One case finished: a line (or a step of the bar)."""
        self.count += 1
        if not self.echo:
            return
        if self._bar:
            self._bar.update(self._task, description=result.case.id, advance=1)
            return
        of = f"/{self.total}" if self.total else ""
        cells = row(result)
        print(f"[{self.count}{of}] {cells[0]} {cells[1]}: rel {cells[3]}, grad {cells[4]}, "
              f"JAX vs PyTorch {cells[5]} {'ok' if result.passed else 'FAILED (' + cells[6] + ')'}", flush=True)

    def table(self, results: list[harness.Result], title: str = "",
              elapsed: float | None = None) -> list[harness.Result]:
        """Print the table, the counts and what failed; return the failed results."""
        failed = [r for r in results if not r.passed]
        if not self.echo:
            return failed
        rows = cases(results)
        when = f", {elapsed:.1f} s" if elapsed is not None else ""
        print(f"{title}{len(results)} cases{when}", rows.text(), rows.counts(), *rows.failures(), sep="\n", flush=True)
        return failed


def write_markdown(path: str, header: Header,
                   sections: dict[str, list[harness.Result]] | list[harness.Result]) -> list[str]:
    """Write the report as Markdown at ``path`` (a table per section) and, if matplotlib can be
    imported, a plot per dtype of error against tolerance beside it. Returns the files written."""
    if not isinstance(sections, dict):
        sections = {"": sections}
    lines = ["# mha-parity report", ""] + [f"- {line.strip()}" for line in header.lines()[1:]]
    lines[1:1] = ["", header.title]
    for title, results in sections.items():
        rows = cases(results)
        lines += ["", f"## {title or 'cases'}: {rows.counts()}", "", *rows.markdown()]
    written = [path]
    every = [r for results in sections.values() for r in results]
    plots = [_plot(f"{os.path.splitext(path)[0]}-{dtype}.png", dtype, [r for r in every if r.case.dtype == dtype])
             for dtype in harness.DTYPES]
    if any(p is False for p in plots):
        lines += ["", "(no plots: matplotlib cannot be imported here)"]
    elif any(plots):
        lines += ["", "## Error against tolerance", ""]
        lines += [f"![{dtype}]({os.path.basename(p)})" for dtype, p in zip(harness.DTYPES, plots) if p]
        written += [p for p in plots if p]
    files.write_text(path, "\n".join(lines) + "\n")
    return written


def _plot(path: str, dtype: str, chosen: list[harness.Result]) -> str | None | bool:
    """The plot of one dtype's cases against its tolerances: its path, None without cases, False without matplotlib."""
    if not chosen:
        return None
    tol, grad_tol = harness.TOLERANCES[dtype]
    written = table.plot(path, [f"{r.case.config.name}/{r.case.mask}" for r in chosen],
                         {"outputs": [max(r.rel, r.max_abs) for r in chosen], "gradients": [r.grad for r in chosen]},
                         {f"tolerance {tol:.0e}": tol, f"gradient tolerance {grad_tol:.0e}": grad_tol},
                         f"{dtype}: worst error of each case")
    return False if written is None else written
