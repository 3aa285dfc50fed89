"""``mha-parity verify``'s grids and its compilation cache.

The covering grid (the default) has every pair of parameter values that the full grid has:
checked here by enumerating every pair of values, not with the generator's own bookkeeping.
``--grid full`` is every configuration's mask forms in every dtype with every implementation.
JAX's persistent compilation cache is on by default, in the directory asked for (the tests'
own, see conftest.py), in the main process and the workers, and a second run reads back what
the first compiled, giving the same numbers."""

import itertools
import json
import os
import subprocess
import sys

import jax
import pytest

from parity_tests.tool import cases, cli, compile_cache, harness, workers

# What the grids are over: every value of each parameter of a case.
DOMAINS = {
    "config": tuple(harness.CONFIGS), "mask": harness.MASKS, "dtype": harness.DTYPES,
    "jax": ("jax", "jax-blockwise"), "torch": ("torch", "torch-sdpa"),
}
FORMS_ELSEWHERE = ("none", "padding+causal", "fully-masked", "dropout", "everything")  # the other configurations'


def _possible(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Whether the full grid can run values ``a`` and ``b`` (each ``(parameter, value)``)
    together: the configurations other than self- and grouped cross-attention run five mask
    forms, and PyTorch's SDPA takes neither a dropout mask nor a soft-cap."""
    given = dict([a, b])
    if given.get("config") not in (None, "self", "cross-gqa") and given.get("mask") not in (None, *FORMS_ELSEWHERE):
        return False
    sdpa_cannot = given.get("mask") == "dropout" or given.get("config") == "rope-cap-sinks"
    return not (given.get("torch") == "torch-sdpa" and sdpa_cannot)


def _pairs_run(grid: list[harness.Case]) -> set[tuple]:
    """Every pair of ``(parameter, value)`` that some case of ``grid`` runs together."""
    found = set()
    for case in grid:
        for j, t in itertools.product(case.sides, case.sides):
            if j.startswith("jax") and t.startswith("torch"):
                row = dict(config=case.config.name, mask=case.mask, dtype=case.dtype, jax=j, torch=t)
                found |= set(itertools.combinations(row.items(), 2))
    return found


def _every_pair() -> list[tuple]:
    return [(a, b) for p, q in itertools.combinations(DOMAINS, 2)
            for a, b in itertools.product([(p, v) for v in DOMAINS[p]], [(q, v) for v in DOMAINS[q]])]


def test_the_covering_grid_runs_every_possible_pair_of_values():
    covering, full = _pairs_run(cases.covering_grid()), _pairs_run(cases.full_grid())
    possible = [pair for pair in _every_pair() if _possible(*pair)]
    assert len(possible) == 55 + 60 + 15 + 10 + 9 + 40 + 39 + 6 + 6 + 4
    assert [pair for pair in possible if pair not in full] == []  # the full grid runs each
    assert [pair for pair in _every_pair() if pair in full and pair not in possible] == []  # and no other
    assert [pair for pair in possible if pair not in covering] == []


def test_the_pair_check_can_fail():
    """A grid of every case with only the ``xla`` and ``math`` implementations misses every
    pair with blockwise or SDPA."""
    narrow = _pairs_run([harness.Case(c.config, c.mask, c.dtype, ("jax", "torch")) for c in cases.full_grid()])
    missing = [pair for pair in _every_pair() if _possible(*pair) and pair not in narrow]
    assert missing and all({"jax-blockwise", "torch-sdpa"} & {v for _, v in pair} for pair in missing)


def test_the_full_grid_is_every_case_with_every_implementation():
    expected = [
        harness.Case(harness.CONFIGS[c], mask, dtype) for c in harness.CONFIGS
        for mask in (harness.MASKS if c in ("self", "cross-gqa") else FORMS_ELSEWHERE) for dtype in harness.DTYPES
    ]
    assert cases.full_grid() == expected and len(expected) == 165
    assert all(c.implementations == ("jax", "jax-blockwise", "torch", "torch-sdpa") for c in expected)
    assert sum("torch-sdpa" not in c.sides for c in expected) == 5 * 3 + 5 * 3 - 3  # dropout; the soft-capped config


def test_the_covering_grid_is_a_part_of_the_full_grid_with_both_frameworks_in_each_case():
    grid, full = cases.covering_grid(), cases.full_grid()
    ids = [c.id for c in full]
    assert [ids.index(c.id) for c in grid] == sorted({ids.index(c.id) for c in grid})  # distinct, in order
    assert all(any(n.startswith("jax") for n in c.sides) and any(n.startswith("torch") for n in c.sides) for c in grid)
    assert len(grid) <= 75  # pairs of 20 mask forms and 3 dtypes alone take 60


def test_the_covering_grid_is_the_same_in_every_process():
    """Deterministic: the same cases whatever Python's string hashing."""
    code = "from parity_tests.tool import cases; print([(c.id, c.implementations) for c in cases.covering_grid()])"
    here = repr([(c.id, c.implementations) for c in cases.covering_grid()])
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert out.stdout.strip() == here


def test_a_narrowed_covering_grid_covers_the_pairs_of_what_is_left():
    """``--mask``/``--dtype`` narrow the parameters and the covering grid covers their pairs:
    one mask form and one dtype leave every configuration, as in the full grid."""
    narrowed = [(c.id, c.sides) for c in cases.covering_grid(["padding+causal"], ["float32"])]
    assert narrowed == [(c.id, c.sides) for c in cases.full_grid(["padding+causal"], ["float32"])]
    grid = cases.covering_grid(None, ["bfloat16"])
    run = _pairs_run(grid)
    missing = [pair for pair in _every_pair() if _possible(*pair) and pair not in run
               and dict(pair).get("dtype") in (None, "bfloat16")]
    assert missing == [] and {c.dtype for c in grid} == {"bfloat16"}


@pytest.fixture
def recorded(monkeypatch):
    """Runs ``mha-parity verify`` with the grid's run replaced by one that records what it was
    asked (and the JAX cache settings while it runs) and passes every case."""
    seen = {}

    def run_cases(grid, **kwargs):
        seen.update(kwargs, cases=grid, settings={name: getattr(jax.config, name) for name in compile_cache.SETTINGS})
        return [harness.Result(case) for case in grid]

    monkeypatch.setattr(workers, "run_cases", run_cases)

    def verify(*args):
        assert cli.main(["verify", *args]) == 0
        return dict(seen)

    return verify


def test_verify_runs_the_covering_grid_unless_told_full(recorded):
    assert recorded()["cases"] == cases.covering_grid()
    assert recorded("--grid", "covering")["cases"] == cases.covering_grid()
    assert recorded("--grid", "full")["cases"] == cases.full_grid()
    narrowed = recorded("--grid", "full", "--dtype", "float32", "--mask", "none")
    assert narrowed["cases"] == cases.full_grid(["none"], ["float32"])


def test_verify_keeps_the_compile_cache_where_asked_and_only_while_it_runs(recorded, tmp_path, monkeypatch):
    before = {name: getattr(jax.config, name) for name in compile_cache.SETTINGS}
    default = recorded("--mask", "none")
    assert default["compile_cache"] == os.environ[compile_cache.ENVIRONMENT]  # the tests' own directory
    assert default["settings"] == {
        "jax_enable_compilation_cache": True, "jax_compilation_cache_dir": default["compile_cache"],
        "jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    assert {name: getattr(jax.config, name) for name in compile_cache.SETTINGS} == before
    asked = recorded("--mask", "none", "--compile-cache", str(tmp_path))
    assert asked["compile_cache"] == asked["settings"]["jax_compilation_cache_dir"] == str(tmp_path)
    off = recorded("--mask", "none", "--no-compile-cache")
    assert off["compile_cache"] is None and off["settings"] == {**before, "jax_enable_compilation_cache": False}
    assert {name: getattr(jax.config, name) for name in compile_cache.SETTINGS} == before
    monkeypatch.delenv(compile_cache.ENVIRONMENT)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_directory() == str(tmp_path / "xdg" / "mha-parity" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_directory() == str(tmp_path / "home" / ".cache" / "mha-parity" / "jax")


def test_grid_goes_with_the_built_in_grid_only(capsys):
    for other in (["--weights", "w.safetensors"], ["--config", "config.json", "--weights", "w.safetensors"]):
        with pytest.raises(SystemExit) as exit:
            cli.main(["verify", "--grid", "full", *other])
        assert exit.value.code == 2 and "--grid chooses the built-in grid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["verify", "--compile-cache", "somewhere", "--no-compile-cache"])


_COUNTING = """
import json, sys
import jax
from jax import monitoring
from parity_tests.tool import compile_cache, harness
jax.config.update("jax_enable_x64", True)
counts = {"hits": 0, "writes": 0}
events = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "writes"}
def count(event, **_):
    if event in events:
        counts[events[event]] += 1
monitoring.register_event_listener(count)
case = harness.Case(harness.CONFIGS["cross-gqa"], "window", "float32", ("jax", "jax-blockwise"))
with compile_cache.using(sys.argv[1]):
    result = harness.run_case(case)
print(json.dumps(dict(counts, details=result.details)))
"""


def test_a_second_run_reads_back_what_the_first_compiled(tmp_path):
    """Two processes, one after the other, on one cache, each running a case's ``xla`` (one
    program per operation) and blockwise (one jitted program) sides: the first compiles and
    writes every program, the second compiles none and reads them all back, and the numbers
    are equal to the bit."""
    first, second = (
        json.loads(subprocess.run([sys.executable, "-c", _COUNTING, str(tmp_path)], capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines()[-1])
        for _ in range(2)
    )
    assert first["writes"] > 100 and len(os.listdir(tmp_path)) >= first["writes"]
    assert second["writes"] == 0 and second["hits"] == first["writes"] + first["hits"]
    assert second["details"] == first["details"]
