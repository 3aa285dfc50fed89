"""Packaging promises: import isolation, the console script, and the README's commands."""

import json
import pathlib
import subprocess
import sys

import pytest

from parity_tests.tool import cases, cli

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "package, forbidden", [("mha_jax", ("torch",)), ("mha_torch", ("jax", "flax"))]
)
def test_packages_do_not_import_the_other_framework(package, forbidden):
    code = f"import sys, {package}; print([m for m in {forbidden!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_ci_runs_exactly_the_readme_test_command():
    """README gives two set-up commands: the main job and the tests; CI runs the latter."""
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("python3 -m venv")]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(readme) == 2 and len(ci) == 1
    assert readme[0].endswith("&& mha-parity verify")
    assert readme[1] == ci[0] and "pytest" in ci[0]


def test_verify_writes_a_report_and_exits_zero(tmp_path, capsys):
    path = tmp_path / "report.json"
    code = cli.main(["verify", "--dtype", "float32", "--mask", "padding+causal", "--workers", "1", "--json", str(path)])
    report = json.loads(path.read_text())
    assert code == 0 and report["passed"]
    assert [c["case"] for c in report["cases"]] == [
        c.id for c in cases.full_grid() if c.dtype == "float32" and c.mask == "padding+causal"
    ]
    assert "abs error" in capsys.readouterr().out


def test_readme_examples_run(capsys):
    """Flax, PyTorch, and verifying your own attention (which prints its report); the docs' blocks
    run in test_docs."""
    blocks = (ROOT / "README.md").read_text().split("```python\n")[1:]
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block.split("```")[0], "README.md", "exec"), {})
    assert "5 passed, 0 failed" in capsys.readouterr().out


def test_with_one_framework_missing_the_command_names_the_extra():
    """A PyTorch-only install (torch present, JAX hidden) and a JAX-only one (torch hidden):
    ``mha-parity`` exits 2 naming what is missing and the extra to install, no traceback."""
    for hidden, named in ((("torch",), "torch is not installed (the mha-parity[torch] extra)"),
                          (("jax", "flax"), "jax and flax are not installed (the mha-parity[jax] extra)")):
        code = (f"import sys; sys.modules.update(dict.fromkeys({hidden!r})); from parity_tests.tool.cli import main; "
                "sys.exit(main(['verify', '--dtype', 'float32']))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert named in out.stderr and 'pip install "mha-parity[parity]"' in out.stderr
