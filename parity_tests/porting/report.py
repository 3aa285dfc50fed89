"""What ``mha-parity compare`` reports of its own: a row of the report core (``tool/table.py``) per
paired module in execution order, the first divergence, the outputs (logit metrics on ``logits``),
the settings; as a table, JSON or Markdown with a plot."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from parity_tests.porting.logits import LogitMetrics
from parity_tests.tool import files, table, verdict


@dataclass
class ModuleResult(table.Row):
    """A paired module: ``name`` (PyTorch's), ``jax_name``, ``occurrence`` (0: its first call),
    ``added`` (relative error of the JAX module on PyTorch's inputs), ``inherited`` (of its output
    in the end-to-end run), ``tolerance`` (the floor of its bound; the attention tolerance for
    ours), ``reference`` (the PyTorch module's own error against itself in float64, on the same
    inputs) and ``reference_inherited`` (PyTorch's output against the whole model run in float64),
    ``note`` (why a value is missing), ``sources`` (the PyTorch modules whose outputs its inputs
    are: ``name#occurrence``, ``input.N`` for the model's inputs; ``jax_sources`` the same on the
    JAX side, in JAX's names), ``by_flow`` (failed by inherited error: see ``outcome``), ``layout``
    (how the JAX output was read in PyTorch's layout: ``"as is"``, or the axes it was brought in by)."""

    name: str
    jax_name: str
    occurrence: int
    cls: str
    attention: bool
    dtype: str
    tolerance: float
    added: float | None
    inherited: float | None
    note: str = ""
    reference: float | None = None
    reference_inherited: float | None = None
    sources: list[str] = field(default_factory=list)
    by_flow: bool = False
    jax_sources: list[str] = field(default_factory=list)
    layout: str = "as is"

    @property
    def bound(self) -> float:
        """What ``added`` may be (``verdict.bound``): a multiple of PyTorch's own rounding (at least a
        few units of the dtype's rounding), or the tolerance without it."""
        return verdict.bound(self.tolerance, self.reference, verdict.module_floor(self.tolerance, self.dtype))

    @property
    def inherited_bound(self) -> float:
        """What ``inherited`` may be (``verdict.bound``): the tolerance, or a multiple of PyTorch's own
        error against the whole model in float64 at this module."""
        return verdict.bound(self.tolerance, self.reference_inherited,
                             verdict.module_floor(self.tolerance, self.dtype))

    @property
    def outcome(self) -> str:
        """``added`` against ``bound``; without ``added``: failed when found by inherited error
        (``by_flow``), else not compared."""
        if self.added is None:
            return verdict.FAILED if self.by_flow else verdict.NOT_COMPARED
        return verdict.outcome(self.added, self.bound)

    def cells(self, first: bool = False) -> list[str]:
        """Its cells (``HEADER``): ``first``: marked the first divergence; a not-compared row says why."""
        how = " (found by inherited error)" if self.by_flow else ""
        mark = ("FIRST DIVERGENCE" + how if first else "FAILED" + how.replace("found ", "")) if self.failed \
            else self.outcome
        if self.outcome == verdict.NOT_COMPARED and self.note:
            mark = f"{mark} ({self.note})"
        allowed = f"{self.bound:.1e}" + (" (attention)" if self.attention else "")
        jax = self.jax_name if self.layout == "as is" else f"{self.jax_name} [{self.layout}]"
        return [self.label, jax, _e(self.added), _e(self.reference), allowed, _e(self.inherited), mark]

    def failure(self) -> str:
        if self.by_flow:
            return f"{self.label} (found by inherited error)"
        return f"{self.label} adds {self.added:.2e} > {self.bound:.1e}" if self.failed else ""

    @property
    def label(self) -> str:
        return self.name if not self.occurrence else f"{self.name} (call {self.occurrence + 1})"

    @property
    def key(self) -> str:
        return f"{self.name}#{self.occurrence}"

    def as_json(self) -> dict:
        return {"name": self.name, "jax_name": self.jax_name, "occurrence": self.occurrence, "class": self.cls,
                "attention": self.attention, "dtype": self.dtype, "tolerance": self.tolerance, "added": self.added,
                "inherited": self.inherited, "reference": self.reference,
                "reference_inherited": self.reference_inherited, "bound": self.bound,
                "inherited_bound": self.inherited_bound, "layout": self.layout, "sources": self.sources,
                "jax_sources": self.jax_sources,
                "outcome": self.outcome,
                "found_by_inherited_error": self.by_flow, "passed": self.passed, "note": self.note}


@dataclass
class OutputResult(table.Measured):
    """One output field: relative and max-abs error, the tolerance of its relative error and
    (``reference``, ``floor``) the bound ``verdict.bound`` makes of PyTorch's own rounding."""

    name: str
    relative: float
    max_abs: float
    tolerance: float

    @property
    def error(self) -> float:
        return self.relative


HEADER = ["module (PyTorch)", "JAX module", "added", "PyTorch's own", "allowed", "inherited", "outcome"]


@dataclass
class Report:
    """``modules`` in execution order; ``first_divergence``: the PyTorch name of the first module
    that failed (adding more than it may, or found by inherited error), or None; ``outputs``;
    ``logits`` (None without a ``logits`` field); ``settings`` (precision, dtypes, versions); the
    modules either side left unpaired."""

    modules: list[ModuleResult]
    outputs: list[OutputResult]
    logits: LogitMetrics | None
    settings: dict
    unpaired_torch: list[str] = field(default_factory=list)
    unpaired_jax: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> str | None:
        return next((m.name for m in self.modules if m.failed), None)

    @property
    def not_compared(self) -> list[ModuleResult]:
        return [m for m in self.modules if m.outcome == verdict.NOT_COMPARED]

    @property
    def passed(self) -> bool:
        return self.first_divergence is None and all(o.passed for o in self.outputs)

    def failures(self) -> list[str]:
        """What failed, in words: the first divergence and every output beyond its tolerance."""
        first = next((m for m in self.modules if m.failed), None)
        found = []
        if first is not None:
            how = " (found by inherited error)" if first.by_flow else ""
            found.append(f"first divergence at {first.label}{how}")
        found += [f"{o.name} relative error {o.relative:.2e} > {o.bound:.1e}" for o in self.outputs if not o.passed]
        return found

    def module(self, name: str, occurrence: int = 0) -> ModuleResult:
        """The row of PyTorch module ``name``; a KeyError names the paired modules when it is not one."""
        for m in self.modules:
            if m.name == name and m.occurrence == occurrence:
                return m
        raise KeyError(f"{name!r} is not a paired module; paired: {', '.join(m.name for m in self.modules[:20])}...")

    def as_json(self) -> dict:
        return {"passed": self.passed, "first_divergence": self.first_divergence, "failures": self.failures(),
                "counts": {o: sum(m.outcome == o for m in self.modules)
                           for o in (verdict.PASSED, verdict.FAILED, verdict.NOT_COMPARED)},
                "settings": self.settings, "outputs": [o.as_json() for o in self.outputs],
                "logits": None if self.logits is None else self.logits.as_json(),
                "modules": [m.as_json() for m in self.modules],
                "unpaired_torch": self.unpaired_torch, "unpaired_jax": self.unpaired_jax}

    def rows(self) -> list[list[str]]:
        """The table's cells (``HEADER``): the first divergence marked, a not-compared row saying why."""
        first = next((m for m in self.modules if m.failed), None)
        return [m.cells(first=m is first) for m in self.modules]

    def core(self) -> table.Table:
        """The modules as the report core's table."""
        return table.Table(HEADER, self.modules)

    def summary(self) -> list[str]:
        lines = [f"{o.name}: relative error {o.relative:.2e}, max abs {o.max_abs:.2e} (allowed {o.bound:.1e}) "
                 + ("ok" if o.passed else "FAILED") for o in self.outputs]
        if self.logits is not None:
            g = self.logits
            lines.append(f"logits: KL mean {g.kl_mean:.2e}, max {g.kl_max:.2e} at token {g.kl_max_token}; "
                         f"top-1 agreement {g.top1:.3f}, top-{g.k} overlap {g.topk:.3f}")
        first = self.first_divergence
        lines.append(f"{len(self.modules)} paired modules ({self.core().counts()}); "
                     + (f"first divergence: {first}" if first else "none adds more than it may"))
        if self.not_compared:
            lines.append(f"not compared ({len(self.not_compared)}, neither passed nor failed): "
                         + ", ".join(m.label for m in self.not_compared[:8])
                         + (" ..." if len(self.not_compared) > 8 else ""))
        if self.unpaired_torch:
            lines.append(f"PyTorch modules without a JAX pair ({len(self.unpaired_torch)}): "
                         + ", ".join(self.unpaired_torch[:8]) + (" ..." if len(self.unpaired_torch) > 8 else ""))
        lines.append(verdict.line(self.passed, self.failures(), "verdict"))
        return lines

    def table(self) -> str:
        """A plain-text table, one row per module in order, then the outputs, the verdict and the settings."""
        return "\n".join([self.core().text(self.rows()), "", *self.summary(),
                          "settings: " + ", ".join(f"{k} {v}" for k, v in self.settings.items())])

    def markdown(self, path: str, title: str = "Comparing a port") -> list[str]:
        """Write the report as Markdown at ``path``, with a plot of the error each module adds and
        inherits beside it when matplotlib can be imported (the ``bench`` extra). Returns the files."""
        lines = [f"# {title}", "", *[f"- {s}" for s in self.summary()],
                 "- settings: " + ", ".join(f"`{k}` {v}" for k, v in self.settings.items()), "",
                 *self.core().markdown(self.rows())]
        written = [path]
        png = plot(self, os.path.splitext(path)[0] + ".png")
        if png:
            written.append(png)
            lines += ["", f"![error per module]({os.path.basename(png)})"]
        else:
            lines += ["", "(no plot: matplotlib cannot be imported here; it comes with the bench extra)"]
        files.write_text(path, "\n".join(lines) + "\n")
        return written

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_json(), f, indent=1)


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def plot(report: Report, path: str) -> str | None:
    """Error added and inherited per module against what it may add, on a log scale; None without matplotlib."""
    first = next((i for i, m in enumerate(report.modules) if m.failed), None)

    def marks(ax):
        if first is not None:
            ax.axvline(first, color="C3", linestyle=":", label=f"first divergence: {report.modules[first].label}")
            ax.legend(fontsize=7)

    return table.plot(path, [m.label for m in report.modules],
                      {"added": [m.added for m in report.modules], "inherited": [m.inherited for m in report.modules]},
                      {"allowed": [m.bound for m in report.modules]}, "error per module", marks)
