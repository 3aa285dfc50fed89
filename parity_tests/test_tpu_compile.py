"""Compiled for real TPUs, on this CPU host: a Llama-3-8B-sized attention (32 query heads, 8
key/value heads, head_dim 128, bfloat16) for TPU v5e and v6e, one chip and a 2x2 mesh (batch
over one axis, heads over the other), at 8K and 32K tokens; the training step (forward and
backward) and the decoding step, for each implementation that claims to fit. Each compiles
(``libtpu``, the TPU compiler, for a described topology), its memory stays within the chip's HBM
(``memory_analysis()``), and the TPU kernel's blocks compile (a block too large for VMEM is a
compile error, shown here too). The whole table is ``benchmarks/tpu_memory.py``'s.

Every chip compiles in a process of its own (libtpu is loaded once per process), side by side.
"""

import importlib.util
import subprocess
import sys

import pytest

from benchmarks import tpu_memory

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the test extra) is not installed"),
]
# What claims to fit: the memory-efficient kernels train at both lengths on every chip and mesh;
# a decoding step (one query over the cache) fits for all three.
CLAIMED = [f"flash:train:{n}:{d}" for n in tpu_memory.LENGTHS for d in tpu_memory.DEVICES] + [
    "blockwise:train:32768:1", "blockwise:train:8192:4",
    "xla:decode:32768:1", "blockwise:decode:32768:1", "flash:decode:32768:1", "flash:decode:8192:4",
]
DEFAULT_TRAINING = "xla:train:8192:1"  # the default (flax's formulation) does not fit even at 8K


@pytest.fixture(scope="module")
def results():
    jobs = {chip: CLAIMED + [DEFAULT_TRAINING] for chip in tpu_memory.CHIPS}
    found = tpu_memory.run_parallel(jobs)
    return {(r["chip"], f"{r['implementation']}:{r['step']}:{r['length']}:{r['devices']}"): r for r in found}


@pytest.mark.parametrize("chip", sorted(tpu_memory.CHIPS))
def test_claimed_cases_compile_within_hbm(results, chip):
    hbm = tpu_memory.CHIPS[chip]["hbm"]
    for case in CLAIMED:
        r = results[chip, case]
        assert r["compiled"], (chip, case, r.get("error"))
        assert r["temp"] + r["arguments"] + r["outputs"] <= hbm, (chip, case, r)
        # "flash" on a TPU is the Pallas kernel; the other implementations hold none
        assert r["tpu_kernel"] == case.startswith("flash"), (chip, case)


@pytest.mark.parametrize("chip", sorted(tpu_memory.CHIPS))
def test_default_training_step_exceeds_hbm_at_8k(results, chip):
    """The plain formulation forms every score: at 8K tokens its gradient is beyond one chip's
    HBM, which is what the memory-efficient implementations are for."""
    r = results[chip, DEFAULT_TRAINING]
    assert not r["compiled"] and "RESOURCE_EXHAUSTED" in r["error"], r


def test_a_block_too_large_for_vmem_fails_to_compile():
    """The check has teeth: the TPU kernel with 2048 x 2048 blocks overflows VMEM on v5e."""
    found = tpu_memory.run_parallel({"v5e": ["flash:train:8192:1"]}, block=2048)
    assert not found[0]["compiled"] and "vmem" in found[0]["error"].lower(), found[0]


def test_example_compiles_a_sharded_training_step():
    run = subprocess.run([sys.executable, "examples/tpu_compile.py", "--length", "2048"], capture_output=True,
                         text=True, cwd=tpu_memory.RESULTS.parents[1], env=tpu_memory.child_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled for TPU v5 lite x4" in run.stdout and "TPU kernel: True" in run.stdout, run.stdout
