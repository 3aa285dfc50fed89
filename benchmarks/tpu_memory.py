"""Compile a Llama-3-8B-sized attention for TPU v5e and v6e on this CPU host, and tabulate memory.

No TPU is needed: ``libtpu`` (a test dependency) compiles for a described topology
(``jax.experimental.topologies.get_topology_desc("v5e:2x2", "tpu")``), and
``compiled.memory_analysis()`` reports what the program would hold on each chip. The attention
is Llama 3 8B's: 32 query heads, 8 key/value heads, head_dim 128, bfloat16, causal. Steps:

- ``train``: the gradient of the attention output's sum with respect to q, k and v (forward
  and backward), batch 1 on one chip, batch 2 on a 2x2 mesh (batch over ``data``, heads over
  ``heads``, Explicit axes);
- ``decode``: one new token's query over a cache of the whole length (the keys beyond each
  row's length are padding), the same batches and meshes.

Each case reports HBM temporaries, arguments and outputs per chip, or the compiler's refusal
(``RESOURCE_EXHAUSTED`` beyond HBM, a VMEM overflow of a kernel's blocks); and, on paper, a
roofline time from the chip's published peak bfloat16 FLOP/s and HBM bandwidth (Google Cloud's
TPU v5e and v6e (Trillium) pages: v5e 197 TFLOP/s, 819 GB/s, 16 GiB; v6e 918 TFLOP/s, 1640 GB/s,
32 GiB): FLOPs counted from the matrix products (causal: half the scores; the backward of a
flash kernel recomputes the scores: 5 products against the forward's 2), bytes as the least
traffic (each operand and result read or written once).

    PYTHONPATH=. python -m benchmarks.tpu_memory            # the whole table, two chips in parallel
    PYTHONPATH=. python -m benchmarks.tpu_memory --chip v5e --case flash:train:8192:1 ...

Writes ``benchmarks/results/tpu_memory.json`` and ``tpu_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

CHIPS = {  # topology, HBM bytes per chip, peak bf16 FLOP/s, HBM bytes/s (vendors' published figures)
    "v5e": dict(topology="v5e:2x2", hbm=16 * 2**30, flops=197e12, bandwidth=819e9),
    "v6e": dict(topology="v6e:2x2", hbm=32 * 2**30, flops=918e12, bandwidth=1640e9),
}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
LENGTHS = (8192, 32768)
DEVICES = (1, 4)
STEPS = {"train": ("xla", "blockwise", "flash"), "decode": ("xla", "blockwise", "flash")}
RESULTS = pathlib.Path(__file__).parent / "results"


def all_cases() -> list[str]:
    return [f"{impl}:{step}:{length}:{devices}" for step, impls in STEPS.items() for impl in impls
            for length in LENGTHS for devices in DEVICES]


def paper(step: str, length: int, devices: int, chip: str) -> dict:
    """FLOPs and least HBM bytes per chip, and the roofline time from the chip's peaks."""
    batch = 2 if devices == 4 else 1
    q_rows = 1 if step == "decode" else length
    scores = batch * HEADS * q_rows * length * (0.5 if step == "train" else 1.0)  # causal: half
    products = 7 if step == "train" else 2  # forward 2; a flash backward 5 (scores recomputed)
    flops = 2 * HEAD_DIM * scores * products / devices
    q = batch * q_rows * HEADS * HEAD_DIM * 2  # bytes, bfloat16
    kv = 2 * batch * length * KV_HEADS * HEAD_DIM * 2
    moved = (2 * q + kv) if step == "decode" else (q + kv + q) + (q + kv + 2 * q) + (q + kv)  # fwd; bwd reads; grads
    moved /= devices
    peak = CHIPS[chip]
    return dict(flops=flops, bytes=moved, roofline_s=max(flops / peak["flops"], moved / peak["bandwidth"]),
                bound="compute" if flops / peak["flops"] >= moved / peak["bandwidth"] else "memory")


def compile_case(chip: str, case: str, block: int | None = None) -> dict:
    """Compile one ``implementation:step:length:devices`` case for ``chip``; what it holds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import mha_jax
    from mha_jax import _splash

    impl, step, length, devices = case.split(":")
    length, devices = int(length), int(devices)
    if block is not None:  # a kernel block size to try (the default's are 512/256/128)
        _splash.BLOCKS = (block,) + _splash.BLOCKS
        _splash.kernel.cache_clear()
    topology = topologies.get_topology_desc(CHIPS[chip]["topology"], "tpu")
    grid = (2, 2) if devices == 4 else (1, 1)
    mesh = Mesh(np.array(topology.devices[:devices]).reshape(grid), ("data", "heads"),
                axis_types=(AxisType.Explicit,) * 2)
    batch = 2 if devices == 4 else 1
    rows = 1 if step == "decode" else length

    def array(shape, entries, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*entries)))

    q = array((batch, rows, HEADS, HEAD_DIM), ("data", None, "heads"))
    k = array((batch, length, KV_HEADS, HEAD_DIM), ("data", None, "heads"))

    def train(q, k, v):
        def loss(q, k, v):
            out = mha_jax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def decode(q, k, v, lengths):
        return mha_jax.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=impl)

    args = (q, k, k) if step == "train" else (q, k, k, array((batch,), ("data",), jnp.int32))
    result = dict(chip=chip, implementation=impl, step=step, length=length, devices=devices, block=block,
                  **paper(step, length, devices, chip))
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(train if step == "train" else decode).lower(*args).compile()
    except Exception as error:  # the compiler's refusal is the result
        result.update(compiled=False, error=str(error).split("\n")[0][:300], compile_s=time.perf_counter() - start)
        return result
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    result.update(
        compiled=True, compile_s=time.perf_counter() - start, temp=memory.temp_size_in_bytes,
        arguments=memory.argument_size_in_bytes, outputs=memory.output_size_in_bytes,
        fits=memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        <= CHIPS[chip]["hbm"],
        tpu_kernel="tpu_custom_call" in text,
    )
    return result


def run_chip(chip: str, cases: list[str], block: int | None = None) -> list[dict]:
    """Every case for one chip, in this process (one libtpu)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # before JAX loads libtpu (see ``child_env``)
    return [compile_case(chip, case, block) for case in cases]


def child_env() -> dict:
    """A child process's environment: this checkout first on the path; libtpu's lock not taken
    (another JAX process on the host may hold it)."""
    return dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(pathlib.Path(__file__).parents[1]))


def run_parallel(jobs: list[tuple[str, list[str], int | None]]) -> list[dict]:
    """``(chip, cases, block)`` jobs, each in a process of its own (they run side by side)."""
    env = child_env()
    procs = []
    for chip, cases, block in jobs:
        cmd = [sys.executable, "-m", "benchmarks.tpu_memory", "--chip", chip, "--json", *cases]
        if block is not None:
            cmd += ["--block", str(block)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{proc.args} failed:\n{err[-3000:]}")
        results += json.loads(out.strip().splitlines()[-1])
    return results


def table(results: list[dict]) -> str:
    gib = 2**30
    lines = ["| chip | devices | step | length | implementation | temporaries (GiB/chip) | total (GiB/chip) | "
             "compiles | roofline (ms) | bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["chip"], r["devices"], r["step"], r["length"], r["implementation"])):
        if r["compiled"]:
            total = (r["temp"] + r["arguments"] + r["outputs"]) / gib
            status, temp, total = "yes", f"{r['temp'] / gib:.2f}", f"{total:.2f}"
        else:
            why = "beyond HBM" if "RESOURCE_EXHAUSTED" in r["error"] else r["error"][:60]
            status, temp, total = f"no: {why}", "-", "-"
        lines.append(f"| {r['chip']} | {r['devices']} | {r['step']} | {r['length']} | {r['implementation']} | {temp} | "
                     f"{total} | {status} | {r['roofline_s'] * 1e3:.3g} | {r['bound']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help="implementation:step:length:devices (default: all)")
    parser.add_argument("--chip", choices=sorted(CHIPS), help="run in this process for one chip")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line")
    parser.add_argument("--block", type=int, help="try this splash block size first")
    args = parser.parse_args(argv)
    cases = args.cases or all_cases()
    if args.chip:
        results = run_chip(args.chip, cases, args.block)
    else:
        results = run_parallel([(chip, cases, args.block) for chip in CHIPS])
    if args.json:
        print(json.dumps(results))
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tpu_memory.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "tpu_memory.md").write_text(table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
