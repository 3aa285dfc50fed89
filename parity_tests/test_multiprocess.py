"""The JAX attention on JAX's multi-controller runtime: 2 processes on this machine, as hosts of a TPU pod
slice or a GPU cluster, each driving 4 CPU devices of a global 8 (``jax.distributed`` with a localhost
coordinator, CPU collectives over gloo). Each process feeds only its own block of every input
(``jax.make_array_from_process_local_data``); the results, gathered with ``multihost_utils``, equal those of
the same functions run here on one device (float32, to 1e-6 of the largest value):

- ring attention over 8 devices, the length split across the processes, forward and gradients, causal
  and with packed segments;
- ``implementation="flash"`` (the blockwise kernel on a CPU), batch over the processes, heads over each
  one's devices;
- the nnx module's training step (loss and gradients), batch over the processes, heads and the
  parameters' heads over each one's devices;
- decoding with the inputs and the cache sharded over the batch, the prompt outside ``jit``;
- the per-host program of ``docs/launching.md`` (batch across the processes, ring within each).

The 2 processes (``parity_tests/multiprocess_worker.py``) start once for this file and run every check;
each test asserts one of them. They need no service: the coordinator is process 0, on a free port.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from parity_tests import multiprocess_worker as worker

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 300  # both processes, all checks; on 2 busy cores they take about a minute
TOLERANCE = 1e-6  # max |2 processes - one device| / max |one device|, float32
PAGE = "launching.md"  # its per-host JAX program runs in the 2 processes
DEVICES_FLAG = f"--xla_force_host_platform_device_count={worker.LOCAL_DEVICES}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    """This process's environment with 4 CPU devices per process (any other device count flag dropped)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return dict(os.environ, XLA_FLAGS=" ".join(flags + [DEVICES_FLAG]), JAX_PLATFORMS="cpu")


def _log_tail(path: pathlib.Path, lines: int = 40) -> str:
    """The end of a process's output, without gloo's connection lines."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no output)"]
    return "\n".join([line for line in text if not line.startswith("[Gloo]")][-lines:])


def _start(out: pathlib.Path) -> list[subprocess.Popen]:
    """The 2 processes, each in a session of its own (so that it is killed with whatever it started)."""
    port, env = _free_port(), _environment()
    processes = []
    for process_id in range(worker.PROCESSES):
        with open(out / f"log_{process_id}.txt", "w") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "parity_tests.multiprocess_worker", str(process_id), str(port), str(out),
                 str(ROOT / "docs" / PAGE)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return processes


def _wait(processes: list[subprocess.Popen], out: pathlib.Path) -> None:
    """Both processes ended by ``TIMEOUT_S``, with status 0; else both are killed and the test fails."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in processes:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for i, p in enumerate(processes):
        if p.returncode != 0:
            pytest.fail(f"process {i} ended with status {p.returncode} (timeout {TIMEOUT_S} s):\n"
                        + _log_tail(out / f"log_{i}.txt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(reference, per process (results, errors))``: the processes' gathered results and the errors of
    their checks, and the one-device results computed here while they run."""
    out = tmp_path_factory.mktemp("multiprocess")
    processes = _start(out)
    try:
        reference = worker.reference()
    finally:
        _wait(processes, out)
    gathered = [(dict(np.load(out / f"results_{i}.npz")), json.loads((out / f"errors_{i}.json").read_text()))
                for i in range(worker.PROCESSES)]
    return reference, gathered


def _assert_equal_to_one_device(runs, name: str) -> None:
    """In each process, the results of check ``name`` equal the one-device ones: each leaf to 1e-6 of its
    largest value, the gradients of the training step to 1e-6 of the largest gradient (the key projection's
    bias has a gradient of 0 in exact arithmetic, rounding noise here)."""
    reference, gathered = runs
    want = {key: value for key, value in reference.items() if key.split("/")[0] == name}
    assert want, name
    gradients = [np.abs(v).max() for k, v in want.items() if name == "train_step" and not k.endswith("/0")]
    for process, (results, errors) in enumerate(gathered):
        check = name.split("[")[0]
        if check in errors:
            pytest.fail(f"process {process}, check {check!r}:\n{errors[check]}")
        for key, value in want.items():
            got = results[key]
            assert got.shape == value.shape and got.dtype == value.dtype, (process, key, got.shape, value.shape)
            scale = max(gradients) if gradients and not key.endswith("/0") else np.abs(value).max()
            error = np.abs(got - value).max() / scale
            assert error <= TOLERANCE, (process, key, error)


def _leaves(results: dict, name: str) -> list[np.ndarray]:
    """The leaves ``name/0``, ``name/1``, ... of ``results``, in order."""
    return [results[f"{name}/{i}"] for i in range(sum(key.startswith(name + "/") for key in results))]


def test_each_process_drives_4_of_the_8_devices(runs):
    for results, _ in runs[1]:
        assert results["layout"].tolist() == [worker.PROCESSES, 8, worker.LOCAL_DEVICES]


@pytest.mark.parametrize("case", worker.RING_CASES)
def test_ring_attention_with_the_length_across_processes_equals_one_device(runs, case):
    """Output and gradients by q, k, v; 8 devices in a ring, the first 4 in one process, the last 4 in the
    other, so that key/value blocks and their gradients cross from process to process at two steps."""
    _assert_equal_to_one_device(runs, f"ring[{case}]")


def test_flash_with_the_batch_across_processes_equals_one_device(runs):
    """Output and gradients under ``jit``, and the output of a call outside it (global key lengths)."""
    _assert_equal_to_one_device(runs, "flash")
    want = runs[0]["flash/0"]
    for results, _ in runs[1]:
        assert np.abs(results["flash-eager/0"] - want).max() <= TOLERANCE * np.abs(want).max()


def test_module_training_step_with_the_batch_across_processes_equals_one_device(runs):
    """The loss and every parameter's gradient, the parameters sharded over the heads."""
    _assert_equal_to_one_device(runs, "train_step")


def test_decoding_with_the_batch_across_processes_equals_the_full_pass(runs):
    """A prompt and one-token steps over the cache, against the full causal pass on one device; one step
    more, outside ``jit``, sets each row's overflow flag (one device would raise)."""
    _assert_equal_to_one_device(runs, "decode")
    for results, _ in runs[1]:
        assert results["decode-overflow"].tolist() == [[False, True]] * worker.B


def test_docs_launching_example_runs_on_two_processes(runs):
    """The page's per-host program: each process feeds its own example, the global batch is both; its loss
    and gradients equal the same step on one device."""
    for results, errors in runs[1]:
        assert "page" not in errors, errors.get("page")
        assert results["page-x"].shape == (worker.PROCESSES, worker.L, worker.FEATURES)
        got, want = _leaves(results, "page"), _leaves(results, "page-alone")
        assert len(got) == len(want) > 1
        scale = max(np.abs(w).max() for w in want[1:])  # the gradients, against the largest
        assert abs(got[0] - want[0]) <= TOLERANCE * abs(want[0])
        for a, b in zip(got[1:], want[1:]):
            assert a.shape == b.shape and np.abs(a - b).max() <= TOLERANCE * scale
