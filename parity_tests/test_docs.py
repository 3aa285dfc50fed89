"""The docs site (``docs/``, built by ``mkdocs.yml``): every code block runs, or says why not.

A fenced block is run here when it is ``python``; a ``text`` block is output or a listing, not
code. Any other block is preceded by a marker line saying what happens to it instead:
``<!-- skip: REASON -->`` (it cannot run here: a shell, a model directory, several devices), or
``<!-- run by: parity_tests/test_x.py::test_name -->`` (a test of its own runs it, with what it
needs: 8 devices, files written by an earlier block, a check of what it prints).
"""

import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!-- (skip|run by): ?(.*?) -->\n\Z")


def _blocks(page: pathlib.Path) -> list[tuple[str, str, tuple[str, str] | None, int]]:
    """``(language, code, (marker, what) or None, line)`` of each fenced block of ``page``."""
    text = page.read_text()
    found = []
    for m in _FENCE.finditer(text):
        marker = _MARKER.search(text, 0, m.start())
        found.append((m[1], m[2], marker.groups() if marker else None, text.count("\n", 0, m.start()) + 1))
    return found


def _name(page: pathlib.Path) -> str:
    return page.relative_to(DOCS).as_posix()


RUN = [pytest.param(page, code, id=f"{_name(page)}:{line}")
       for page in PAGES for lang, code, marker, line in _blocks(page) if lang == "python" and marker is None]


def test_the_docs_have_pages_and_blocks_to_run():
    assert len(PAGES) >= 10 and len(RUN) >= 5


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_block_runs_or_says_why_not(page):
    text = page.read_text()
    blocks = _blocks(page)
    fences = [line for line in text.splitlines() if line.lstrip().startswith("```")]
    assert len(fences) == 2 * len(blocks), f"{_name(page)}: a fence that is not at the start of a line, or unclosed"
    for lang, _, marker, line in blocks:
        where = f"{_name(page)}, line {line}"
        if marker is None:
            assert lang in ("python", "text"), (f"{where}: a ```{lang} block needs "
                                                "<!-- skip: REASON --> or <!-- run by: ... -->")
            continue
        kind, what = marker
        if kind == "skip":
            assert len(what.split()) >= 3, f"{where}: the skip gives no reason: {what!r}"
            continue
        path, _, test = what.split(" ")[0].partition("::")
        source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
        assert f"def {test}(" in source, f"{where}: run by {what!r}, which does not exist"
        assert f'"{_name(page)}"' in source, f"{where}: {path} does not read {_name(page)}"


@pytest.mark.parametrize("page, code", RUN)
def test_python_block_runs(page, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a block may write files
    exec(compile(code, str(page.relative_to(ROOT)), "exec"), {})


class _Loader(yaml.SafeLoader):
    """mkdocs.yml as YAML, its tags (``!relative``) read as nothing."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def test_navigation_lists_every_page():
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), _Loader)["nav"]

    def entries(items):
        for item in items:
            for value in (item.values() if isinstance(item, dict) else [item]):
                yield from (entries(value) if isinstance(value, list) else [value])

    assert sorted(entries(nav)) == sorted(_name(page) for page in PAGES)


def test_readme_sections_the_docs_include_exist():
    """The pages show README.md's examples from one source, by section (``--8<-- "README.md:NAME"``)."""
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page.read_text(), re.MULTILINE):
            assert f"--8<-- [start:{name}]" in readme and f"--8<-- [end:{name}]" in readme, (_name(page), name)
