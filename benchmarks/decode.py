"""One-token decode step with a key/value cache, ours against the anchors, each framework in a
process of its own.

    python -m benchmarks.decode                                   # the full grid
    python -m benchmarks.decode --lengths 1024 4096 --batches 1 8  # a smaller one

8 query heads, 2 key/value heads, head_dim 128 (features 1024), float32, CPU; the cache holds
``length - 1`` tokens and the step appends one, at lengths 1024 to 32768, batch 1 and 8.
JAX: our nnx module (``decode=True``, ``nnx.jit``) against ``flax.nnx.MultiHeadAttention``'s
decode (same weights). PyTorch: our module with ``mha_torch.KVCache`` against a plain step of
``F.scaled_dot_product_attention`` over a hand-written cache (the same projections,
``enable_gqa=True``), and the same step with each key/value head's group of query heads passed as
rows of one head (what ours does without a mask; SDPA's ``enable_gqa`` reads every key/value head
once per query head). Both: against
recomputing the whole prefix with our module (``is_causal=True``, the last token's output; JAX
``"blockwise"``, PyTorch its default), up to ``--recompute-limit``.

Timing: wall time (``time.perf_counter``) per call; ours and its anchor alternate call by call
(at least ``--reps`` calls each and ``--min-seconds``), the median and the best are kept; full
recompute is timed apart (3 calls, median). Each framework runs in a child process with
``--threads`` threads (default 1: ``OMP_NUM_THREADS``/``torch.set_num_threads`` for PyTorch,
``XLA_FLAGS`` single-threaded Eigen for JAX). With more threads than free cores (a shared
machine) every OpenMP parallel region waits for a descheduled thread until the next scheduler
tick, so PyTorch's times land on multiples of the tick (4 ms) and say nothing of the step; one
thread per process measures the step itself. Writes ``benchmarks/results/cpu-decode.json`` and
``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
FEATURES = HEADS * HEAD_DIM
LENGTHS = (1024, 4096, 16384, 32768)
BATCHES = (1, 8)
RECOMPUTE_LIMIT = 4096
ANCHOR = {"jax": "flax.nnx decode", "torch": "sdpa step"}
ROWS = "sdpa step, groups as rows"


def _interleaved(steps: dict[str, Callable[[], None]], reps: int, min_seconds: float,
                 max_reps: int = 400) -> dict[str, dict[str, float]]:
    """{name: {"median", "best" (seconds per call), "runs"}} of each step, the calls alternating
    between the steps (a load change hits all of them alike), after a warm-up call of each."""
    for step in steps.values():  # compile and warm up
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    start = time.perf_counter()
    while True:
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
        runs = len(times[next(iter(times))])
        if runs >= max_reps or runs >= reps and time.perf_counter() - start >= min_seconds:
            break
    return {name: {"median": statistics.median(t), "best": min(t), "runs": len(t)} for name, t in times.items()}


def median_of(step: Callable[[], None], reps: int = 3) -> float:
    """Median wall seconds of ``reps`` calls after a warm-up call."""
    step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _row(framework: str, batch: int, length: int, cache_bytes: int, timed: dict, recompute: float | None) -> dict:
    row = dict(framework=framework, batch=batch, length=length, cache_bytes=cache_bytes,
               formula_bytes=2 * batch * length * KV_HEADS * HEAD_DIM * 4, runs=timed["ours"]["runs"])
    for name, t in timed.items():
        row[name], row[f"{name} best"] = t["median"], t["best"]
    if recompute is not None:
        row["full recompute"] = recompute
    print(json.dumps(row), file=sys.stderr)
    return row


def _jax_rows(args: argparse.Namespace) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import mha_jax

    rows = []
    for batch in args.batches:
        for length in args.lengths:
            ours = mha_jax.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, rngs=nnx.Rngs(0))
            theirs = nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, decode=True, rngs=nnx.Rngs(0))
            ours.init_cache((batch, length, FEATURES), jnp.float32)
            theirs.init_cache((batch, length, FEATURES), jnp.float32)
            token = jax.random.normal(jax.random.key(1), (batch, 1, FEATURES), jnp.float32)
            ours_step = nnx.jit(lambda m, x: m(x, decode=True), donate_argnums=0)
            flax_step = nnx.jit(lambda m, x: m(x), donate_argnums=0)

            # each step's index from the host alike (the step donates the one it is given)
            def run_ours(ours=ours, step=ours_step, token=token, length=length):
                ours.cache_index[...] = jnp.asarray(np.full(ours.cache_index.shape, length - 1, np.int32))
                jax.block_until_ready(step(ours, token))

            def run_flax(theirs=theirs, step=flax_step, token=token, length=length):
                theirs.cache_index[...] = jnp.asarray(np.full(theirs.cache_index.shape, length - 1, np.int32))
                jax.block_until_ready(step(theirs, token))

            timed = _interleaved({"ours": run_ours, ANCHOR["jax"]: run_flax}, args.reps, args.min_seconds)
            recompute = None
            if length <= args.recompute_limit:
                prefix = jax.random.normal(jax.random.key(2), (batch, length, FEATURES), jnp.float32)
                full = mha_jax.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, implementation="blockwise",
                                                  rngs=nnx.Rngs(0))
                full_step = nnx.jit(lambda m, x: m(x, is_causal=True)[:, -1:])
                recompute = median_of(
                    lambda step=full_step, full=full, prefix=prefix: jax.block_until_ready(step(full, prefix)))
            cache_bytes = ours.cached_key[...].nbytes + ours.cached_value[...].nbytes
            rows.append(_row("jax", batch, length, cache_bytes, timed, recompute))
    return rows


def _torch_rows(args: argparse.Namespace) -> list[dict]:
    import torch

    import mha_torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for batch in args.batches:
        for length in args.lengths:
            layer = mha_torch.MultiHeadAttention(FEATURES, HEADS, num_kv_heads=KV_HEADS).eval()
            cache = mha_torch.KVCache(batch, length, KV_HEADS, HEAD_DIM)
            token = torch.randn(batch, 1, FEATURES)
            index = length - 1

            def run_ours(cache=cache, layer=layer, token=token, index=index):
                cache.index.fill_(index)
                with torch.no_grad():
                    layer(token, cache=cache)

            steps = {"ours": run_ours, ANCHOR["torch"]: _sdpa_step(layer, token, length, rows=False),
                     ROWS: _sdpa_step(layer, token, length, rows=True)}
            timed = _interleaved(steps, args.reps, args.min_seconds)
            recompute = None
            if length <= args.recompute_limit:
                prefix = torch.randn(batch, length, FEATURES)

                def run_full(layer=layer, prefix=prefix):
                    with torch.no_grad():
                        layer(prefix, is_causal=True)[:, -1:]

                recompute = median_of(run_full)
            cache_bytes = cache.key.nbytes + cache.value.nbytes
            rows.append(_row("torch", batch, length, cache_bytes, timed, recompute))
    return rows


def _sdpa_step(layer, token, length: int, rows: bool) -> Callable[[], None]:
    """A plain one-token step of ``layer``'s projections and ``F.scaled_dot_product_attention``
    at position ``length - 1`` of a hand-written cache of its own (so that no other step's call
    leaves it warm): ``enable_gqa=True``, or with ``rows`` each key/value head's group of query
    heads passed as rows of one head."""
    import torch
    import torch.nn.functional as F

    batch, index = token.shape[0], length - 1
    k_cache, v_cache = (torch.zeros(batch, KV_HEADS, length, HEAD_DIM) for _ in range(2))
    q_shape = (batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM) if rows else (batch, 1, HEADS, HEAD_DIM)

    def step():
        with torch.no_grad():
            q = layer.q_proj(token).view(q_shape)
            q = q if rows else q.transpose(1, 2)
            k_cache[:, :, index] = layer.k_proj(token).view(batch, KV_HEADS, HEAD_DIM)
            v_cache[:, :, index] = layer.v_proj(token).view(batch, KV_HEADS, HEAD_DIM)
            out = F.scaled_dot_product_attention(q, k_cache[:, :, :index + 1], v_cache[:, :, :index + 1],
                                                 enable_gqa=not rows)
            layer.out_proj((out if rows else out.transpose(1, 2)).reshape(batch, 1, FEATURES))

    return step


def markdown(rows: list[dict], meta: dict) -> str:
    """The results as a Markdown table (medians; the best call in brackets), after a line saying
    how they were taken."""
    lines = [f"Wall time per one-token step, median of >= {meta['reps']} interleaved calls (best in brackets); "
             f"{meta['threads']} thread(s) per framework process; {meta['machine']}.", "",
             "| framework | batch | cache length | ours (ms) | anchor | anchor (ms) | anchor / ours "
             f"| {ROWS} (ms) | that / ours | full recompute (ms) | full recompute / ours | cache bytes = formula |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        anchor = ANCHOR[r["framework"]]
        full = r.get("full recompute")
        recompute = (f"{1e3 * full:.1f} | {full / r['ours']:.1f}x") if full is not None else "- | -"
        rows = (f"{1e3 * r[ROWS]:.2f} ({1e3 * r[ROWS + ' best']:.2f}) | {r[ROWS] / r['ours']:.2f}x"
                if ROWS in r else "- | -")
        lines.append(
            f"| {r['framework']} | {r['batch']} | {r['length']} | {1e3 * r['ours']:.2f} "
            f"({1e3 * r['ours best']:.2f}) | {anchor} | {1e3 * r[anchor]:.2f} ({1e3 * r[anchor + ' best']:.2f}) "
            f"| {r[anchor] / r['ours']:.2f}x | {rows} | {recompute} "
            f"| {r['cache_bytes'] == r['formula_bytes']} |"
        )
    return "\n".join(lines) + "\n"


def _child_env(framework: str, threads: int) -> dict[str, str]:
    """The environment of a framework's process: its thread count, set before it starts."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if framework == "jax" and threads == 1:
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("jax", "torch"), help="one framework, in this process (JSON to stdout)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="cache lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes")
    parser.add_argument("--threads", type=int, default=1, help="threads per framework process (default 1)")
    parser.add_argument("--reps", type=int, default=21, help="least calls of each step (default 21)")
    parser.add_argument("--min-seconds", type=float, default=2.0, help="least seconds per point (default 2)")
    parser.add_argument("--recompute-limit", type=int, default=RECOMPUTE_LIMIT, help="longest prefix recomputed")
    parser.add_argument("--note", default="", help="added to the results' header (say that the machine was shared)")
    args = parser.parse_args(argv)
    if args.framework:
        print(json.dumps(_jax_rows(args) if args.framework == "jax" else _torch_rows(args)))
        return 0
    options = (("threads", args.threads), ("reps", args.reps), ("min-seconds", args.min_seconds),
               ("recompute-limit", args.recompute_limit))
    passed = [f"--{name}={value}" for name, value in options]
    passed += ["--lengths", *map(str, args.lengths), "--batches", *map(str, args.batches)]
    rows = []
    for framework in ("jax", "torch"):
        done = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--framework", framework, *passed],
                              capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                              env=_child_env(framework, args.threads), check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores" + (f", {args.note}" if args.note else "")
    meta = dict(threads=args.threads, reps=args.reps, min_seconds=args.min_seconds, machine=machine,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu-decode.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    table = markdown(rows, meta)
    (RESULTS / "cpu-decode.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
