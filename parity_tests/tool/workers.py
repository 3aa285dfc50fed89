"""The grid's cases, in this process or in worker processes: ``run_cases``.

Nearly all the time goes to compiling JAX programs, of two kinds that are shared differently:

- the eager XLA path compiles one small program per operation, shape and dtype, shared by
  every case that has them, across configurations and dtypes: its cases run best all in one
  process (the oracle and PyTorch, which are quick, run with them);
- the blockwise path compiles one program per configuration, dtype and static option
  (causality, window, dropout), shared with nothing else: its cases split freely.

So the work is split into eager tasks (the cases of a configuration and dtype, all sides but
the blockwise one) and blockwise tasks (the cases of one blockwise program). The first worker
takes the eager tasks, the others the blockwise ones, each in the order of the cases; a worker
with none of its kind left takes the other kind. The main process merges each case's parts and
compares them. A case's parts are those of the implementations it runs (``Case.sides``).
"""

from __future__ import annotations

import pickle
import queue
import traceback
from dataclasses import dataclass

from parity_tests.tool import compile_cache as caching
from parity_tests.tool import harness
from parity_tests.tool.cases import SIDES, Case

BLOCKWISE = ("jax-blockwise",)
EAGER = tuple(name for name in SIDES if name not in BLOCKWISE)
KINDS = (EAGER, BLOCKWISE)  # a case comes back in one part per kind


class WorkerError(RuntimeError):
    """An exception raised in a worker process, as its traceback there."""


@dataclass
class Task:
    """``sides`` (``EAGER`` or ``BLOCKWISE``) of the cases at ``indices`` (into the run's
    cases), one after the other in one process."""

    sides: tuple[str, ...]
    indices: list[int]


def tasks(cases: list[Case], seed: int) -> list[Task]:
    """The eager tasks, then the blockwise ones, each in the order of ``cases``; a case is in
    a task of each kind whose sides it runs (every case runs the oracle, an eager side)."""
    groups: dict[tuple, list[int]] = {}
    programs: dict[tuple, list[int]] = {}
    for i, case in enumerate(cases):
        groups.setdefault((case.config, case.dtype), []).append(i)
        if set(BLOCKWISE) & set(case.sides):
            options = harness.static_options(harness.make_data(case, seed).attention)
            programs.setdefault((case.config, case.dtype, options), []).append(i)
    return ([Task(EAGER, indices) for indices in groups.values()]
            + [Task(BLOCKWISE, indices) for indices in programs.values()])


def next_task(pending: list[Task], worker: int) -> Task | None:
    """The task worker ``worker`` takes from ``pending``: the first of its kind (eager for the
    first worker, blockwise for the others), else the first; removed from ``pending``."""
    own = KINDS[0] if worker == 0 else KINDS[1]
    for task in [t for t in pending if t.sides == own] or pending[:1]:
        pending.remove(task)
        return task
    return None


def run_cases(cases: list[Case], *, weights=None, jit: bool = False, seed: int = 0, workers: int = 1, done=None,
              compile_cache: str | None = None) -> list[harness.Result]:
    """``harness.run_case`` for every case, in ``workers`` processes (1: in this one);
    ``done(result)`` is called as each case finishes. Results come back in the order of ``cases``.

    With more than one worker the work is split by what the compiled programs share (see the
    module's docstring). ``compile_cache``: the directory of JAX's persistent compilation cache
    for the workers, or None for none (``compile_cache.use``); this process keeps its own
    settings."""
    if workers <= 1 or len(cases) < 2:
        results = []
        for case in cases:
            results.append(harness.run_case(case, weights=weights, jit=jit, seed=seed))
            if done:
                done(results[-1])
        return results
    return _run(cases, weights=weights, jit=jit, seed=seed, workers=workers, done=done, compile_cache=compile_cache)


def _run(cases: list[Case], *, weights, jit: bool, seed: int, workers: int, done, compile_cache: str | None
         ) -> list[harness.Result]:
    """``run_cases`` in ``workers`` spawned processes."""
    import multiprocessing

    import jax

    pending = tasks(cases, seed)
    context = multiprocessing.get_context("spawn")  # JAX's threads do not survive a fork
    outbox = context.Queue()
    inboxes = [context.Queue() for _ in range(min(workers, len(pending)))]
    x64 = bool(jax.config.jax_enable_x64)
    processes = [
        context.Process(target=_work, args=(w, inbox, outbox, x64, compile_cache, weights, jit, seed), daemon=True)
        for w, inbox in enumerate(inboxes)
    ]
    for process in processes:
        process.start()
    results: list[harness.Result | None] = [None] * len(cases)
    parts: list[list[dict]] = [[] for _ in cases]  # each case's parts come back, one per kind
    left = [0] * len(processes)  # cases of each worker's task not yet back

    def hand_out(w: int) -> None:
        task = next_task(pending, w)
        inboxes[w].put(None if task is None else (task.sides, [(i, cases[i]) for i in task.indices]))
        left[w] = 0 if task is None else len(task.indices)

    try:
        for w in range(len(processes)):
            hand_out(w)
        while any(r is None for r in results):
            w, i, part = _receive(outbox, processes)
            left[w] -= 1
            if not left[w]:
                hand_out(w)
            parts[i].append(part)
            if len(parts[i]) == _kinds(cases[i]):
                merged = {k: v for part in parts[i] for k, v in part.items()}
                results[i] = harness.compare(cases[i], {n: merged[n] for n in SIDES if n in merged})
                parts[i] = []
                if done:
                    done(results[i])
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join()
    return results


def _kinds(case: Case) -> int:
    """How many parts ``case`` comes back in: one for each kind of side it runs."""
    return sum(bool(set(kind) & set(case.sides)) for kind in KINDS)


def _receive(outbox, processes) -> tuple[int, int, dict]:
    """The next finished part ``(worker, index, sides' results)``; raises a worker's exception,
    or an error if a worker died without one."""
    while True:
        try:
            message = outbox.get(timeout=0.5)
            break
        except queue.Empty:
            for process in processes:
                if process.exitcode not in (None, 0):
                    raise RuntimeError(f"a worker process exited with code {process.exitcode}") from None
    if message[0] == "error":
        _, error, remote = message
        raise error from WorkerError(remote)
    return message[1:]


def _work(w: int, inbox, outbox, x64: bool, compile_cache: str | None, weights, jit: bool, seed: int) -> None:
    """A worker: run each task it is handed, sending every case's part, until handed None."""
    try:
        import jax

        jax.config.update("jax_enable_x64", x64)
        caching.use(compile_cache)
        for sides, indexed in iter(inbox.get, None):
            if any(harness.IMPLEMENTATIONS[n][0] == "torch" for n in sides if n != "oracle"):
                import torch  # not before: a worker of blockwise tasks never needs it

                torch.set_num_threads(1)  # one core per worker
            for i, case in indexed:
                outbox.put(("part", w, i, harness.run_sides(case, sides, weights=weights, jit=jit, seed=seed)))
    except Exception as error:  # handed to the main process, which raises it
        remote = traceback.format_exc()
        try:  # the queue pickles in a thread of its own, where a failure would be lost
            pickle.dumps(error)
        except Exception:  # its traceback says what it was
            error = WorkerError(remote)
        outbox.put(("error", error, remote))
