"""The report people read: a header saying what is compared, a line per case as it finishes
(when the output is not a terminal: CI logs), a table, and optionally a Markdown file with a
plot per dtype of each case's error against its tolerance."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from parity_tests.tool import files, harness

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
    return [
        f"{r.case.config.name}/{r.case.mask}", r.case.dtype, f"{r.abs:.2e}", f"{max(r.rel, r.max_abs):.2e}",
        f"{r.grad:.2e}", f"{r.jax_vs_torch:.2e}", r.worst_pair, "yes" if r.passed else "NO",
    ]


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
        """Print the table and the totals; return the failed results."""
        failed = [r for r in results if not r.passed]
        if not self.echo:
            return failed
        from rich.table import Table

        when = f", {elapsed:.1f} s" if elapsed is not None else ""
        table = Table(title=f"{title}{len(results)} cases{when}")
        for column in COLUMNS:
            left = column in ("case", "dtype", "worst pair")
            table.add_column(column, justify="left" if left else "right", no_wrap=column != "worst pair")
        for r in results:
            cells = row(r)
            cells[-1] = "[green]yes[/]" if r.passed else "[red]NO[/]"
            table.add_row(*cells)
        self.console.print(table)
        self.console.print(f"{len(results) - len(failed)} passed, {len(failed)} failed", markup=False)
        for r in failed:
            tol, grad_tol = harness.TOLERANCES[r.case.dtype]
            self.console.print(
                f"FAILED {r.case.id}: {r.worst_pair} is off by {max(r.rel, r.max_abs):.2e} "
                f"(outputs; tolerance {tol:.0e}) "
                f"and {r.grad:.2e} (gradients; tolerance {grad_tol:.0e})", markup=False)
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
        failed = sum(not r.passed for r in results)
        lines += ["", f"## {title or 'cases'}: {len(results) - failed} passed, {failed} failed", ""]
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    written = [path]
    every = [r for results in sections.values() for r in results]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines += ["", "(no plots: matplotlib cannot be imported here)"]
    else:
        lines += ["", "## Error against tolerance", ""]
        stem = os.path.splitext(path)[0]
        for dtype in harness.DTYPES:
            chosen = [r for r in every if r.case.dtype == dtype]
            if not chosen:
                continue
            tol, grad_tol = harness.TOLERANCES[dtype]
            fig, ax = plt.subplots(figsize=(8, 3.5))
            x = range(len(chosen))
            floor = 1e-18
            ax.semilogy(x, [max(r.rel, r.max_abs, floor) for r in chosen], "o", label="outputs")
            ax.semilogy(x, [max(r.grad, floor) for r in chosen], "x", label="gradients")
            ax.axhline(tol, color="C0", linestyle="--", label=f"tolerance {tol:.0e}")
            ax.axhline(grad_tol, color="C1", linestyle=":", label=f"gradient tolerance {grad_tol:.0e}")
            ax.set_xticks(list(x), [f"{r.case.config.name}/{r.case.mask}" for r in chosen], rotation=90, fontsize=6)
            ax.set_ylabel("worst error")
            ax.set_title(f"{dtype}: worst error of each case")
            ax.legend(fontsize=7)
            fig.tight_layout()
            png = f"{stem}-{dtype}.png"
            files.write_atomically(png, lambda path, fig=fig: fig.savefig(path, dpi=100))
            plt.close(fig)
            written.append(png)
            lines.append(f"![{dtype}]({os.path.basename(png)})")
    files.write_text(path, "\n".join(lines) + "\n")
    return written
