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
# What claims to fit, per chip: the memory-efficient kernels' training step at 32K tokens (8K is
# smaller) on one chip and on the mesh, "flash" at 8K on the mesh too; a decoding step (one query
# over the cache) for all three. ``benchmarks/tpu_memory.py`` compiles every length and mesh.
CLAIMED = ["flash:train:32768:1", "flash:train:32768:4", "flash:train:8192:4", "blockwise:train:32768:4",
           "xla:decode:32768:1", "blockwise:decode:32768:1", "flash:decode:32768:4"]
# The default (flax's formulation) forms every score: its gradient is beyond one v5e chip's HBM
# at 8K tokens, and beyond a v6e's at 32K.
BEYOND = {"v5e": "xla:train:8192:1", "v6e": "xla:train:32768:4"}
VMEM = "flash:train:4096:1"  # with 2048 x 2048 blocks


@pytest.fixture(scope="module")
def results():
    jobs = [(chip, CLAIMED + [BEYOND[chip]], None) for chip in tpu_memory.CHIPS] + [("v5e", [VMEM], 2048)]
    found = tpu_memory.run_parallel(jobs)
    return {(r["chip"], f"{r['implementation']}:{r['step']}:{r['length']}:{r['devices']}", r["block"]): r
            for r in found}


@pytest.mark.parametrize("chip", sorted(tpu_memory.CHIPS))
def test_claimed_cases_compile_within_hbm(results, chip):
    hbm = tpu_memory.CHIPS[chip]["hbm"]
    for case in CLAIMED:
        r = results[chip, case, None]
        assert r["compiled"], (chip, case, r.get("error"))
        assert r["temp"] + r["arguments"] + r["outputs"] <= hbm, (chip, case, r)
        # "flash" on a TPU is the Pallas kernel; the other implementations hold none
        assert r["tpu_kernel"] == case.startswith("flash"), (chip, case)


@pytest.mark.parametrize("chip", sorted(tpu_memory.CHIPS))
def test_default_training_step_exceeds_hbm(results, chip):
    r = results[chip, BEYOND[chip], None]
    assert not r["compiled"] and "RESOURCE_EXHAUSTED" in r["error"], r


def test_a_block_too_large_for_vmem_fails_to_compile(results):
    """The check has teeth: the TPU kernel with 2048 x 2048 blocks overflows VMEM on v5e (the
    default blocks, 512 at most, compile above)."""
    r = results["v5e", VMEM, 2048]
    assert not r["compiled"] and "vmem" in r["error"].lower(), r


def test_example_compiles_a_sharded_training_step():
    run = subprocess.run([sys.executable, "examples/tpu_compile.py", "--length", "2048"], capture_output=True,
                         text=True, cwd=tpu_memory.RESULTS.parents[1], env=tpu_memory.child_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled for TPU v5 lite x4" in run.stdout and "TPU kernel: True" in run.stdout, run.stdout
