"""The report of a whole-model comparison: a row per paired module in execution order, the
outputs (logit metrics on ``logits``), the settings; as a table, JSON or Markdown with a plot."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from parity_tests.porting.logits import LogitMetrics


@dataclass
class ModuleResult:
    """A paired module: ``name`` (PyTorch's), ``jax_name``, ``occurrence`` (0: its first call),
    ``added`` (relative error of the JAX module on PyTorch's inputs), ``inherited`` (of its output
    in the end-to-end run), ``tolerance`` (for ``added``; the attention tolerance for ours)."""

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

    @property
    def passed(self) -> bool:
        return self.added is None or self.added <= self.tolerance

    @property
    def label(self) -> str:
        return self.name if not self.occurrence else f"{self.name} (call {self.occurrence + 1})"

    def as_json(self) -> dict:
        return {"name": self.name, "jax_name": self.jax_name, "occurrence": self.occurrence, "class": self.cls,
                "attention": self.attention, "dtype": self.dtype, "tolerance": self.tolerance, "added": self.added,
                "inherited": self.inherited, "passed": self.passed, "note": self.note}


@dataclass
class OutputResult:
    """One output field: relative and max-abs error, the tolerance of its relative error."""

    name: str
    relative: float
    max_abs: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative <= self.tolerance

    def as_json(self) -> dict:
        return dict(asdict(self), passed=self.passed)


@dataclass
class Report:
    """``modules`` in execution order; ``first_divergence``: the PyTorch name of the first module
    adding more than its tolerance, or None; ``outputs``; ``logits`` (None without a ``logits``
    field); ``settings`` (precision, dtypes, versions); the modules either side left unpaired."""

    modules: list[ModuleResult]
    outputs: list[OutputResult]
    logits: LogitMetrics | None
    settings: dict
    unpaired_torch: list[str] = field(default_factory=list)
    unpaired_jax: list[str] = field(default_factory=list)

    @property
    def first_divergence(self) -> str | None:
        return next((m.name for m in self.modules if not m.passed), None)

    @property
    def passed(self) -> bool:
        return self.first_divergence is None and all(o.passed for o in self.outputs)

    def module(self, name: str, occurrence: int = 0) -> ModuleResult:
        """The row of PyTorch module ``name``; a KeyError names the paired modules when it is not one."""
        for m in self.modules:
            if m.name == name and m.occurrence == occurrence:
                return m
        raise KeyError(f"{name!r} is not a paired module; paired: {', '.join(m.name for m in self.modules[:20])}...")

    def as_json(self) -> dict:
        return {"passed": self.passed, "first_divergence": self.first_divergence, "settings": self.settings,
                "outputs": [o.as_json() for o in self.outputs],
                "logits": None if self.logits is None else self.logits.as_json(),
                "modules": [m.as_json() for m in self.modules],
                "unpaired_torch": self.unpaired_torch, "unpaired_jax": self.unpaired_jax}

    def rows(self) -> list[list[str]]:
        """The table's cells: module, JAX module, added, inherited, tolerance, pass (the first divergence marked)."""
        first = self.first_divergence
        out = []
        for m in self.modules:
            mark = "FIRST DIVERGENCE" if m.name == first and not m.passed else ("yes" if m.passed else "NO")
            out.append([m.label, m.jax_name, _e(m.added), _e(m.inherited), f"{m.tolerance:.0e}"
                        + (" (attention)" if m.attention else ""), mark if not m.note else f"{mark} ({m.note})"])
        return out

    def summary(self) -> list[str]:
        lines = [f"{o.name}: relative error {o.relative:.2e}, max abs {o.max_abs:.2e} (tolerance {o.tolerance:.0e}) "
                 + ("ok" if o.passed else "FAILED") for o in self.outputs]
        if self.logits is not None:
            g = self.logits
            lines.append(f"logits: KL mean {g.kl_mean:.2e}, max {g.kl_max:.2e} at token {g.kl_max_token}; "
                         f"top-1 agreement {g.top1:.3f}, top-{g.k} overlap {g.topk:.3f}")
        first = self.first_divergence
        lines.append(f"{len(self.modules)} paired modules; "
                     + (f"first divergence: {first}" if first else "none adds more than its tolerance"))
        if self.unpaired_torch:
            lines.append(f"PyTorch modules without a JAX pair ({len(self.unpaired_torch)}): "
                         + ", ".join(self.unpaired_torch[:8]) + (" ..." if len(self.unpaired_torch) > 8 else ""))
        return lines

    def table(self) -> str:
        """A plain-text table, one row per module in order, then the outputs and settings."""
        header = ["module (PyTorch)", "JAX module", "added", "inherited", "tolerance", "pass"]
        rows = self.rows()
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows), "", *self.summary(),
                          "settings: " + ", ".join(f"{k} {v}" for k, v in self.settings.items())])

    def markdown(self, path: str, title: str = "Comparing a port") -> list[str]:
        """Write the report as Markdown at ``path``, with a plot of the error each module adds and
        inherits beside it when matplotlib can be imported (the ``bench`` extra). Returns the files."""
        header = ["module (PyTorch)", "JAX module", "added", "inherited", "tolerance", "pass"]
        lines = [f"# {title}", "", *[f"- {s}" for s in self.summary()],
                 "- settings: " + ", ".join(f"`{k}` {v}" for k, v in self.settings.items()), "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in self.rows()]
        written = [path]
        png = plot(self, os.path.splitext(path)[0] + ".png")
        if png:
            written.append(png)
            lines += ["", f"![error per module]({os.path.basename(png)})"]
        else:
            lines += ["", "(no plot: matplotlib cannot be imported here; it comes with the bench extra)"]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return written

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_json(), f, indent=1)


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def plot(report: Report, path: str) -> str | None:
    """Error added and inherited per module against its tolerance, on a log scale; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    floor = 1e-18
    x = range(len(report.modules))
    fig, ax = plt.subplots(figsize=(max(6, len(report.modules) * 0.12), 3.5))
    ax.semilogy(x, [max(m.added or 0, floor) for m in report.modules], ".", label="added")
    ax.semilogy(x, [max(m.inherited or 0, floor) for m in report.modules], "x", label="inherited", alpha=0.5)
    ax.step(x, [m.tolerance for m in report.modules], where="mid", color="C3", label="tolerance")
    first = next((i for i, m in enumerate(report.modules) if not m.passed), None)
    if first is not None:
        ax.axvline(first, color="C3", linestyle=":", label=f"first divergence: {report.modules[first].label}")
    ax.set_title(f"error per module (an error of 0 drawn at {floor:.0e})", fontsize=9)
    ax.set_xlabel("module, in execution order")
    ax.set_ylabel("relative error")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
