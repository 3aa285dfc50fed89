"""The library's code stays small enough to read: no function body over 50 lines, no arguments gathered with
``locals()``, in ``mha_jax``, ``mha_torch`` and ``mha_spec`` (read from their files' syntax trees)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(path for package in ("mha_jax", "mha_torch", "mha_spec") for path in (ROOT / package).glob("*.py"))
LONGEST = 50  # lines of a function's body, its docstring left out


def _functions(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = function.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
            body[0].value.value, str):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_no_function_body_is_longer_than_50_lines_and_none_calls_locals(path):
    tree = ast.parse(path.read_text())
    long = {f.name: _body_lines(f) for f in _functions(tree) if _body_lines(f) > LONGEST}
    assert not long, f"{path.name}: function bodies over {LONGEST} lines: {long}"
    calls = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "locals"]
    assert not calls, f"{path.name}: locals() at lines {calls}"


def test_the_measure_counts_a_body_without_its_docstring():
    (function,) = _functions(ast.parse('def f():\n    """doc\n    more"""\n    a = 1\n\n    return a\n'))
    assert _body_lines(function) == 3
