"""The twins say once what they share: no block of six lines stands in both packages, and the
docstring sections they share are put in whole."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import mha_jax
import mha_jax.linen
import mha_torch
from mha_spec import docstrings

ROOT = Path(__file__).resolve().parents[1]


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, whitespace-folded text) of the lines that carry code or prose: blank lines,
    comments, imports and lone punctuation (a docstring's closing quotes too) left out."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = " ".join(line.split())
        if not text or text.startswith(("#", "import ", "from ")) or re.fullmatch(r'[()\[\]{},:]+|"""', text):
            continue
        lines.append((number, text))
    return lines


def _shared_runs(a: list[tuple[int, str]], b: list[tuple[int, str]], n: int) -> list[tuple[int, int, int]]:
    """(first line in a, first line in b, length) of each maximal run of ``n`` or more equal lines."""
    where: dict[str, list[int]] = {}
    for j, (_, text) in enumerate(b):
        where.setdefault(text, []).append(j)
    runs = []
    for i, (_, text) in enumerate(a):
        for j in where.get(text, ()):
            if i and j and a[i - 1][1] == b[j - 1][1]:
                continue  # inside a run found from its start
            k = 0
            while i + k < len(a) and j + k < len(b) and a[i + k][1] == b[j + k][1]:
                k += 1
            if k >= n:
                runs.append((a[i][0], b[j][0], k))
    return runs


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).glob("*.py"))


def test_the_detector_finds_a_planted_copy(tmp_path):
    source = (ROOT / "mha_jax" / "masks.py").read_text().splitlines()
    body = "\n".join(source[40:80])
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text("x = 1\n" + body)
    runs = _shared_runs(_code_lines(tmp_path / "a.py"), _code_lines(tmp_path / "b.py"), 6)
    assert runs and runs[0][2] >= 20


@pytest.mark.parametrize("jax_path", _files("mha_jax"), ids=lambda p: p.name)
def test_twins_repeat_no_block_of_six_lines(jax_path):
    """Every file of mha_jax against every file of mha_torch (a shared step may sit in a file of
    another name: mha_jax's _layer.py holds what mha_torch's module.py does)."""
    found = {}
    for torch_path in _files("mha_torch"):
        runs = _shared_runs(_code_lines(jax_path), _code_lines(torch_path), 6)
        if runs:
            found[torch_path.name] = runs
    assert not found, f"{jax_path.name}: lines (mha_jax, mha_torch, count) repeated in both twins: {found}"


def _documented():
    """Every public function, class and method of both twins, with its docstring."""
    for package in (mha_jax, mha_torch, mha_jax.linen):
        for name in getattr(package, "__all__", dir(package)):
            obj = getattr(package, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not obj.__module__.startswith(("mha_", "flax")):
                continue
            yield f"{package.__name__}.{name}", obj
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    if inspect.isfunction(value) and value.__doc__:
                        yield f"{package.__name__}.{name}.{member}", value


def test_every_section_is_put_in():
    placeholder = re.compile(r"^ *\{\w+\}$", re.MULTILINE)
    left = [name for name, obj in _documented() if obj.__doc__ and placeholder.search(obj.__doc__)]
    assert not left, f"docstrings with a section left as a placeholder: {left}"


def test_the_twins_share_their_sections_whole():
    masking = docstrings.SECTIONS["masking_terms"].splitlines()
    for core in (mha_jax.dot_product_attention, mha_torch.dot_product_attention):
        doc = [line.strip() for line in inspect.getdoc(core).splitlines()]
        start = doc.index(masking[0])
        assert doc[start:start + len(masking)] == [line.strip() for line in masking]


def test_an_unknown_section_is_named():
    with pytest.raises(KeyError, match="no docstring section 'nothing'; the sections are"):
        docstrings.expand("Args:\n  {nothing}\n")
    assert docstrings.expand("keys under ``model.layers.{layer}.self_attn.``") == \
        "keys under ``model.layers.{layer}.self_attn.``"  # braces inside a line are text


def test_the_api_reference_puts_the_sections_in():
    import importlib.util

    import griffe

    spec = importlib.util.spec_from_file_location("_griffe_hook", ROOT / "docs" / "_griffe.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    extensions = griffe.load_extensions(hook.JoinArgumentNames)
    package = griffe.load("mha_torch", search_paths=[str(ROOT)], extensions=extensions)
    doc = package["dot_product_attention"].docstring.value
    assert "{masking_terms}" not in doc and docstrings.SECTIONS["masking_terms"].splitlines()[0] in doc
