"""The grid in worker processes: how its cases are split into tasks by what their compiled
programs share, that what the workers send back merges into what one process computes, and
that the harness does not import the workers back."""

import ast
import os
import pathlib

import numpy as np
import pytest
import torch

from parity_tests.tool import harness, workers
from parity_tests.tool.cases import covering_grid, full_grid

GRID = full_grid()


def _program(case: harness.Case) -> tuple:
    """What a blockwise program is specialised on: configuration, dtype, static options."""
    return case.config, case.dtype, harness.static_options(harness.make_data(case).attention)


@pytest.mark.parametrize("grid", [GRID, covering_grid()], ids=["full", "covering"])
def test_every_case_is_in_one_task_of_each_kind_it_runs(grid):
    """Every case is in one eager task (the oracle is an eager side) and, when it runs the
    blockwise side, in one blockwise task; a task's cases share their programs."""
    tasks = workers.tasks(grid, seed=0)
    assert sorted(workers.EAGER + workers.BLOCKWISE) == sorted(harness.SIDES)
    for kind, key in ((workers.EAGER, lambda c: (c.config, c.dtype)), (workers.BLOCKWISE, _program)):
        mine = [t for t in tasks if t.sides == kind]
        runs = [i for i, c in enumerate(grid) if set(kind) & set(c.sides)]
        assert sorted(i for t in mine for i in t.indices) == runs, kind
        keys = [{key(grid[i]) for i in t.indices} for t in mine]
        assert all(len(k) == 1 for k in keys), kind  # a task's cases share their programs
        assert len({k.pop() for k in keys}) == len(mine), kind  # and no other task has them
    if grid is not GRID:
        assert len(runs) < len(grid)  # the covering grid's cases without the blockwise side


def test_the_first_worker_takes_the_eager_tasks_the_others_the_blockwise_ones():
    eager = [workers.Task(workers.EAGER, [0]), workers.Task(workers.EAGER, [1])]
    blockwise = [workers.Task(workers.BLOCKWISE, [0]), workers.Task(workers.BLOCKWISE, [1])]
    pending = eager + blockwise
    assert workers.next_task(pending, 1) is blockwise[0]
    assert workers.next_task(pending, 0) is eager[0]
    assert workers.next_task(pending, 0) is eager[1]
    assert workers.next_task(pending, 0) is blockwise[1]  # none of its own kind left
    assert workers.next_task(pending, 1) is None and not pending


def test_the_workers_give_what_one_process_gives(tmp_path):
    """Each case's eager and blockwise parts, run in two processes, merge into ``run_case``'s
    comparisons, in the same order, to the bit (a case without PyTorch's SDPA included, and
    cases of some implementations only, as the covering grid has). The workers run PyTorch on
    one thread, whose float32 sums differ in the last bits from two's. They keep their compiled
    programs in the compilation cache given."""
    some = [harness.Case(harness.CONFIGS["cross-gqa"], "bool", "float32", ("jax-blockwise", "torch-sdpa")),
            harness.Case(harness.CONFIGS["cross-gqa"], "window", "float32", ("jax", "torch"))]
    cases = [c for c in GRID
             if c.config.name == "cross-gqa" and c.dtype == "float32" and c.mask in ("padding", "dropout", "window")]
    cases += some
    in_workers = workers.run_cases(cases, workers=2, compile_cache=str(tmp_path))
    assert len(os.listdir(tmp_path)) > 100
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        in_one = [harness.run_case(case) for case in cases]
    finally:
        torch.set_num_threads(threads)
    for case, result, alone in zip(cases, in_workers, in_one):
        assert result.case == case
        sdpa = case.mask != "dropout" and "torch-sdpa" in case.implementations
        assert ("torch-sdpa vs oracle" in alone.details) == sdpa
        assert list(result.details) == list(alone.details)
        for pair, entries in alone.details.items():
            assert list(result.details[pair]) == list(entries)
            for name, e in entries.items():
                assert result.details[pair][name] == e, (case.id, pair, name)
    # the window case with two implementations gives the numbers it gives with all four
    whole = in_one[[c.id for c in cases].index(some[1].id)]
    assert whole.case.implementations == GRID[0].implementations and in_one[-1].case == some[1]
    assert list(in_one[-1].details) == ["jax vs oracle", "torch vs oracle", "jax vs torch"]
    assert {pair: whole.details[pair] for pair in in_one[-1].details} == in_one[-1].details


def test_an_error_in_a_worker_is_raised_by_the_caller():
    cases = [c for c in GRID if c.config.name == "self" and c.dtype == "float32"][:3]
    weights = dict(harness.make_data(cases[0]).params, stray=np.zeros(3))
    with pytest.raises(ValueError, match="unexpected key 'stray'"):
        workers.run_cases(cases, weights=weights, workers=2)


def _tool_imports() -> dict[str, set[str]]:
    """Each module of ``parity_tests.tool`` -> the modules of it that it imports, anywhere in
    its text (an import inside a function too)."""
    tool = pathlib.Path(harness.__file__).parent
    modules = {p.stem for p in tool.glob("*.py")} - {"__init__"}
    graph = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((tool / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "parity_tests.tool":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parity_tests.tool."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("parity_tests.tool.")}
        graph[name] = found & modules
    return graph


def test_the_tool_modules_import_one_another_without_a_circle():
    """The harness runs a case and knows nothing of the workers, which run many: no module of
    the tool imports, however indirectly, one that imports it."""
    graph = _tool_imports()
    assert "harness" in graph["workers"] and "workers" not in graph["harness"]

    def reaches(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += graph[name]
        return seen

    assert [name for name in sorted(graph) if name in reaches(name)] == []
