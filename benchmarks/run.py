"""Attention speed and memory, ours against the anchors, in one run.

    python -m benchmarks.run            # the full grid (about 15 minutes on a 2-core CPU)
    python -m benchmarks.run --quick    # lengths up to 2048, for a smoke test
    python -m benchmarks.run --only structured   # the structured-mask points alone (about 5 minutes)

Core (B=1, H=8, head_dim=64, float32): ``mha_jax.dot_product_attention`` (``"blockwise"``, the
implementation for long inputs; the default, ``"xla"``, forms the score matrix as ``jax.nn``) and
``mha_torch.dot_product_attention`` against ``jax.nn.dot_product_attention`` and
``F.scaled_dot_product_attention``, lengths 512..16384, forward and forward+backward, causal and
not. Module (B=4, S=1024, embed 512, 8 heads): our nnx and linen modules against ``flax.nnx.MultiHeadAttention`` and
``flax.linen.MultiHeadDotProductAttention``, our PyTorch module against
``torch.nn.MultiheadAttention``. JAX compile time is reported apart from run time (best of
several runs). Peak memory growth is measured in a fresh process per point. Structured masks
(blockwise, same shapes): a sliding window of 512 against full causal at 16384, 8 packed
segments against none at 8192 and causal against full at 4096, forward and forward+backward,
each pair timed interleaved in one process (medians), after a check of the timed outputs
against ``implementation="xla"``. Writes ``benchmarks/results/<device>.json``, ``.md`` and
``.png`` and prints a table of ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
B, H, D = 1, 8, 64
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
LONG = 32768  # forward only, ours and SDPA: must run on a 24 GiB machine
# Anchors that form the (S, S) score matrix: beyond these lengths they need more than the
# machine's 24 GiB (jax.nn's gradient takes 10.9 GiB at 8192), so they are not run there.
QUADRATIC_LIMIT = {"fwd": 8192, "fwd+bwd": 8192}
CORE = ("mha_jax", "jax.nn", "mha_torch", "torch sdpa")
QUADRATIC = {"jax.nn"}
# Structured masks, blockwise: (workload, length, its terms, the baseline's terms, target speed-up).
STRUCTURED = (
    ("window 512 vs causal", 16384, "window", "causal", 8.0),
    ("8 segments vs none", 8192, "segments", "full", 4.0),
    ("causal vs full", 4096, "causal", "full", 1.6),
    # the same window as bands (``_band``) and as blockwise's tiles, which skip the same blocks
    ("window 512: bands vs tiles", 16384, "window", "window tiles", 1.0),
)
WINDOW, SEGMENTS = (512, 0), 8
CHECK_LENGTH = 2048  # the structured terms against implementation="xla", output and gradients


def _core_fn(name: str, causal: bool, mode: str, length: int, dtype: str = "float32"):
    """(callable running one step, framework) for a core implementation at one length."""
    import numpy as np

    x = np.random.default_rng(0).normal(size=(B, length, H, D)).astype(np.float32)
    if name in ("mha_jax", "jax.nn"):
        import jax
        import jax.numpy as jnp

        import mha_jax

        q = jnp.asarray(x, dtype=dtype)
        attend = {
            "mha_jax": lambda q, k, v: mha_jax.dot_product_attention(q, k, v, is_causal=causal,
                                                                     implementation="blockwise"),
            "jax.nn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal),
        }[name]
        if mode == "fwd":
            f = jax.jit(attend)
        else:
            f = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        start = time.perf_counter()
        compiled = f.lower(q, q, q).compile()
        compile_s = time.perf_counter() - start
        return (lambda: jax.block_until_ready(compiled(q, q, q))), compile_s

    import torch
    import torch.nn.functional as F

    import mha_torch

    t = torch.from_numpy(x.transpose(0, 2, 1, 3).copy()).to(getattr(torch, dtype))
    attend = {
        "mha_torch": lambda q, k, v: mha_torch.dot_product_attention(q, k, v, is_causal=causal),
        "torch sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }[name]
    if mode == "fwd":
        def step():
            with torch.no_grad():
                attend(t, t, t)
        return step, 0.0
    q, k, v = (t.clone().requires_grad_(True) for _ in range(3))

    def step():
        attend(q, k, v).float().sum().backward()
    return step, 0.0


def _terms(terms: str, length: int) -> dict:
    """``mha_jax.dot_product_attention`` keywords of one structured workload: ``full`` (none),
    ``causal``, ``window`` (causal, ``WINDOW``) or ``segments`` (``SEGMENTS`` equal packed
    segments, ids 0.. in order)."""
    import jax.numpy as jnp

    if terms == "full":
        return {}
    if terms == "causal":
        return {"is_causal": True}
    if terms in ("window", "window tiles"):
        return {"is_causal": True, "local_window_size": WINDOW}
    ids = jnp.repeat(jnp.arange(SEGMENTS, dtype=jnp.int32), -(-length // SEGMENTS))[None, :length]
    return {"query_segment_ids": ids, "key_segment_ids": ids}


def _structured_fn(terms: str, mode: str, length: int, implementation: str = "blockwise"):
    """(callable running one step, compile seconds) of ``mha_jax`` with structured ``terms``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mha_jax

    q = jnp.asarray(np.random.default_rng(0).normal(size=(B, length, H, D)).astype(np.float32))
    kwargs = _terms(terms, length)

    def attend(q, k, v):
        return mha_jax.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
    if mode == "fwd":
        f = jax.jit(attend)
    else:
        f = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
    start = time.perf_counter()
    with _tiles_only(terms == "window tiles"):
        compiled = f.lower(q, q, q).compile()
    compile_s = time.perf_counter() - start
    return (lambda: jax.block_until_ready(compiled(q, q, q))), compile_s


@contextlib.contextmanager
def _tiles_only(tiles: bool):
    """With ``tiles``, a window over default positions is traced as blockwise's tiles rather
    than as ``_band``'s bands."""
    from mha_jax import _band

    band = _band.band
    if tiles:
        _band.band = lambda *args: None
    try:
        yield
    finally:
        _band.band = band


def structured_check(rows: int = 512) -> list[dict]:
    """Max |blockwise - xla| in float32, so that a fast wrong kernel is caught: the output of
    each timed workload at its timed length, on query rows at its start, middle and end (the
    reference computed for those rows alone, from their positions or segment ids), and output
    and gradients (of a random projection of the output) of each term at ``CHECK_LENGTH``."""
    out = []
    for terms in sorted({t for _, _, w, b, _ in STRUCTURED for t in (w, b)} - {"window tiles"}):
        length = max(L for _, L, w, b, _ in STRUCTURED if terms in (w, b))
        out.append({"terms": terms, "length": length, "what": f"output, {rows}-row slices",
                    "max_abs_diff": _check_slices(terms, length, rows)})
        for what, diff in _check_all(terms, CHECK_LENGTH).items():
            out.append({"terms": terms, "length": CHECK_LENGTH, "what": what, "max_abs_diff": diff})
    return out


def _inputs(length: int, n: int = 3, seed: int = 1):
    import jax.numpy as jnp
    import numpy as np

    return [jnp.asarray(a) for a in np.random.default_rng(seed).normal(size=(n, B, length, H, D)).astype(np.float32)]


def _check_slices(terms: str, length: int, rows: int) -> float:
    """The timed blockwise output at ``length`` against xla on three slices of ``rows`` queries."""
    import jax
    import jax.numpy as jnp

    import mha_jax

    q, k, v = _inputs(length)
    kwargs = _terms(terms, length)
    ours = jax.jit(lambda q, k, v: mha_jax.dot_product_attention(q, k, v, implementation="blockwise", **kwargs))
    ours = ours(q, k, v)
    worst = 0.0
    for start in sorted({0, (length // 2 // rows) * rows, length - rows}):
        part = dict(kwargs)
        if "query_segment_ids" in part:
            part["query_segment_ids"] = part["query_segment_ids"][:, start:start + rows]
        elif part:
            part["query_positions"] = jnp.arange(start, start + rows, dtype=jnp.int32)
        ref = mha_jax.dot_product_attention(q[:, start:start + rows], k, v, implementation="xla", **part)
        worst = max(worst, float(jnp.abs(ours[:, start:start + rows] - ref).max()))
    return worst


def _check_all(terms: str, length: int) -> dict[str, float]:
    """Output and (q, k, v) gradients of a random projection, blockwise against xla."""
    import jax
    import jax.numpy as jnp

    import mha_jax

    q, k, v = _inputs(length)
    (w,) = _inputs(length, 1, seed=2)
    kwargs = _terms(terms, length)

    def output(q, k, v, implementation):
        return mha_jax.dot_product_attention(q, k, v, implementation=implementation, **kwargs)

    def grads(q, k, v, implementation):
        return jax.grad(lambda *x: (output(*x, implementation) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    diffs = {}
    for what, f in (("output", output), ("dq, dk, dv", grads)):
        f = jax.jit(f, static_argnums=3)
        a, b = (jax.tree.leaves(f(q, k, v, i)) for i in ("blockwise", "xla"))
        diffs[what] = max(float(jnp.abs(x - y).max()) for x, y in zip(a, b))
    return diffs


def _time_interleaved(steps, min_total=2.0, min_reps=3, max_reps=10) -> list[tuple[float, float, int]]:
    """(median, best, runs) of each step, run in turn (A, B, A, B, ...) after a warm-up of each,
    so that another load on the machine reaches all of them alike."""
    for step in steps:
        step()
    times = [[] for _ in steps]
    spent = 0.0
    while len(times[0]) < max_reps and (len(times[0]) < min_reps or spent < min_total):
        for step, t in zip(steps, times):
            start = time.perf_counter()
            step()
            t.append(time.perf_counter() - start)
            spent += t[-1]
        if spent > 60.0 and len(times[0]) >= min_reps:  # long steps: the minimum is enough
            break
    return [(statistics.median(t), min(t), len(t)) for t in times]


def _module_fn(name: str, mode: str, batch=4, length=1024, embed=512, heads=8):
    import numpy as np

    x = np.random.default_rng(0).normal(size=(batch, length, embed)).astype(np.float32)
    if name in ("mha_jax nnx", "mha_jax linen", "flax.nnx MHA", "flax.linen MHDPA"):
        import flax.linen
        import jax
        import jax.numpy as jnp
        from flax import nnx

        import mha_jax

        xs = jnp.asarray(x)
        if name in ("mha_jax nnx", "flax.nnx MHA"):
            cls = mha_jax.MultiHeadAttention if name == "mha_jax nnx" else nnx.MultiHeadAttention
            extra = {} if name == "mha_jax nnx" else {"decode": False}
            model = cls(heads, embed, rngs=nnx.Rngs(0), **extra)
            graphdef, params = nnx.split(model)
            apply = lambda p, x: nnx.merge(graphdef, p)(x)  # noqa: E731
        else:
            cls = (mha_jax.linen.MultiHeadDotProductAttention if name == "mha_jax linen"
                   else flax.linen.MultiHeadDotProductAttention)
            model = cls(heads)
            params = model.init(jax.random.key(0), xs)
            apply = model.apply
        if mode == "fwd":
            f = jax.jit(apply)
        else:
            f = jax.jit(jax.grad(lambda p, x: apply(p, x).sum(), argnums=(0, 1)))
        start = time.perf_counter()
        compiled = f.lower(params, xs).compile()
        compile_s = time.perf_counter() - start
        return (lambda: jax.block_until_ready(compiled(params, xs))), compile_s

    import torch

    import mha_torch

    if name == "mha_torch":
        model = mha_torch.MultiHeadAttention(embed, heads)
        call = lambda x: model(x)  # noqa: E731
    else:
        model = torch.nn.MultiheadAttention(embed, heads, batch_first=True)
        call = lambda x: model(x, x, x, need_weights=False)[0]  # noqa: E731
    xt = torch.from_numpy(x)
    if mode == "fwd":
        model.eval()

        def step():
            with torch.no_grad():
                call(xt)
        return step, 0.0
    xg = xt.clone().requires_grad_(True)

    def step():
        call(xg).sum().backward()
    return step, 0.0


def _time(step, min_total=1.0, max_reps=10) -> float:
    """Best of several runs after a warm-up; fewer runs for long steps."""
    step()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < max_reps and (reps < 2 or spent < min_total):
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
        if elapsed > 4.0 and reps >= 1:
            break
    return best


def _flops(length: int, mode: str, causal: bool) -> float:
    fwd = 4.0 * B * H * length * length * D
    total = fwd * (3.5 if mode == "fwd+bwd" else 1.0)  # backward: 5 products of the forward's size, with recompute
    return total / (2.0 if causal else 1.0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_probe(kind: str, name: str, length: int, mode: str) -> float:
    """Peak RSS growth (MiB) of one step, measured after inputs exist and compilation is done.

    The peak is reset first (``/proc/self/clear_refs``): ``ru_maxrss`` would carry the parent
    process's high-water mark across ``execve``."""
    step, _ = _core_fn(name, False, mode, length) if kind == "core" else _module_fn(name, mode, length=length)
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    step()
    return (_status_kib("VmHWM") - base) / 1024.0, time.perf_counter() - start


def _child(*args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.run *args`` in a fresh process, from the repository root."""
    cmd = [sys.executable, "-m", "benchmarks.run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)


def _memory(kind: str, name: str, length: int, mode: str) -> tuple[float | None, float | None]:
    """(peak growth MiB, seconds of that single first run) from a fresh process; None on failure."""
    out = _child("--memory-probe", kind, name, str(length), mode)
    if out.returncode != 0:
        return None, None
    mib, seconds = out.stdout.strip().splitlines()[-1].split()
    return float(mib), float(seconds)


MODULES = ("mha_jax nnx", "mha_jax linen", "flax.nnx MHA", "flax.linen MHDPA", "mha_torch", "torch.nn.MHA")
JAX_NAMES = {"mha_jax", "jax.nn", "mha_jax nnx", "mha_jax linen", "flax.nnx MHA", "flax.linen MHDPA"}


def time_probe(framework: str, what: str, impls: tuple[str, ...] | None = None) -> list[dict]:
    """Timings of one framework's implementations, at one length (``what``), for the modules
    (``what == "modules"``) or for the structured masks (``what == "structured"``, JAX only), in
    this process; ``impls`` limits a length's to those named. Run by ``_probe`` in a fresh
    process per call: once JAX is loaded, PyTorch's SDPA ran 30-60% slower in the same process
    on the 2-core CPU, so the frameworks never share one."""
    def ours(name):
        return (name in JAX_NAMES) == (framework == "jax") and (impls is None or name in impls)

    rows = []
    if what == "modules":
        for mode in ("fwd", "fwd+bwd"):
            for name in filter(ours, MODULES):
                step, compile_s = _module_fn(name, mode)
                rows.append({"impl": name, "mode": mode, "seconds": _time(step), "compile_s": compile_s})
        return rows
    if what == "structured":
        for workload, length, terms, baseline, _ in STRUCTURED:
            for mode in ("fwd", "fwd+bwd"):
                built = [_structured_fn(t, mode, length) for t in (terms, baseline)]
                timed = _time_interleaved([step for step, _ in built])
                for t, (_, compile_s), (median, best, runs) in zip((terms, baseline), built, timed):
                    rows.append({"kind": "structured", "impl": "mha_jax blockwise", "workload": workload,
                                 "terms": t, "baseline": t == baseline, "length": length, "mode": mode,
                                 "seconds": median, "best_s": best, "runs": runs, "compile_s": compile_s})
        return rows
    length = int(what)
    for mode in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            for name in filter(ours, CORE):
                if name in QUADRATIC and length > QUADRATIC_LIMIT[mode]:
                    continue
                step, compile_s = _core_fn(name, causal, mode, length)
                seconds = _time(step)
                rows.append({"kind": "core", "impl": name, "length": length, "mode": mode, "causal": causal,
                             "seconds": seconds, "compile_s": compile_s,
                             "gflops": _flops(length, mode, causal) / seconds / 1e9})
    return rows


def _probe(framework: str, what: str, impls: tuple[str, ...] | None = None) -> list[dict]:
    out = _child("--time-probe", framework, what, *(("--impls", *impls) if impls else ()))
    if out.returncode != 0:
        raise RuntimeError(f"timing {framework} {what} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check() -> list[dict]:
    out = _child("--check-probe")
    if out.returncode != 0:
        raise RuntimeError(f"structured check failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _structured(progress, task) -> tuple[list, dict]:
    """The structured-mask timings and their check against ``"xla"``, two steps of ``task``."""
    progress.update(task, description="structured: check against xla")
    check = _check()
    progress.advance(task)
    progress.update(task, description="structured masks")
    structured = _probe("jax", "structured")
    progress.advance(task)
    return structured, check


def run_structured(progress, rounds: int = 3, length: int = 4096) -> dict:
    """The structured-mask points alone: the check against ``"xla"``, the structured timings,
    and ``mha_jax`` (blockwise) against torch SDPA at ``length``, the two frameworks' processes
    alternating for ``rounds`` rounds; each core row is the median over rounds of each round's
    best run (``rounds_s`` lists them)."""
    task = progress.add_task("structured", total=2 + 2 * rounds)
    structured, check = _structured(progress, task)
    runs: dict[tuple, list[dict]] = {}
    for r in range(rounds):
        for framework in ("torch", "jax"):
            progress.update(task, description=f"{framework} S={length}, round {r + 1}")
            for row in _probe(framework, str(length), ("mha_jax", "torch sdpa")):
                runs.setdefault((row["impl"], row["mode"], row["causal"]), []).append(row)
            progress.advance(task)
    core = []
    for rows in runs.values():
        median = statistics.median(r["seconds"] for r in rows)
        row = dict(rows[0], seconds=median, rounds_s=[r["seconds"] for r in rows])
        row["gflops"] = _flops(row["length"], row["mode"], row["causal"]) / median / 1e9
        core.append(row)
    return {"core": core, "memory": [], "modules": [], "structured": structured, "structured_check": check}


def run(lengths, memory_lengths, module: bool, progress, long_length: int | None = None) -> dict:
    rows = []
    # The frameworks alternate at each length, so that drift in the machine's speed over the
    # run reaches both alike.
    task = progress.add_task("core timings", total=2 * len(lengths))
    for length in lengths:
        for framework in ("torch", "jax"):
            progress.update(task, description=f"{framework} S={length}")
            rows += _probe(framework, str(length))
            progress.advance(task)
    mem_points = [(n, L, mode) for L in memory_lengths for mode in ("fwd", "fwd+bwd") for n in CORE
                  if not (n in QUADRATIC and L > QUADRATIC_LIMIT[mode])]
    task = progress.add_task("peak memory", total=len(mem_points))
    memory = []
    for name, length, mode in mem_points:
        progress.update(task, description=f"memory {name} S={length} {mode}")
        mib, seconds = _memory("core", name, length, mode)
        memory.append({"impl": name, "length": length, "mode": mode, "mib": mib, "first_run_s": seconds})
        progress.advance(task)
    if long_length:  # the longest input: does it run at all, in what memory
        for name in ("mha_jax", "torch sdpa"):
            progress.update(task, description=f"memory {name} S={long_length} fwd")
            mib, seconds = _memory("core", name, long_length, "fwd")
            memory.append({"impl": name, "length": long_length, "mode": "fwd", "mib": mib, "first_run_s": seconds})
    modules = []
    if module:
        task = progress.add_task("modules", total=2)
        for framework in ("torch", "jax"):
            progress.update(task, description=f"modules {framework}")
            modules += _probe(framework, "modules")
            progress.advance(task)
    structured, check = _structured(progress, progress.add_task("structured masks", total=2))
    return {"core": rows, "memory": memory, "modules": modules, "structured": structured, "structured_check": check}


def _lookup(rows, **key):
    for r in rows:
        if all(r.get(k) == v for k, v in key.items()):
            return r
    return None


def structured_ratios(results: dict) -> list[dict]:
    """Per structured workload and mode: its median seconds, its baseline's, and the speed-up."""
    out = []
    rows = results.get("structured", [])
    for workload, length, _, _, target in STRUCTURED:
        for mode in ("fwd", "fwd+bwd"):
            a = _lookup(rows, workload=workload, mode=mode, baseline=False)
            b = _lookup(rows, workload=workload, mode=mode, baseline=True)
            if a and b:
                out.append({"workload": workload, "length": length, "mode": mode, "seconds": a["seconds"],
                            "baseline_s": b["seconds"], "ratio": b["seconds"] / a["seconds"], "target": target})
    return out


def summary(results: dict) -> list[tuple[str, str, str]]:
    """(what, measured, target) rows: the issue's targets as ratios from this run."""
    core, memory, modules = results["core"], results["memory"], results["modules"]
    out = []

    def ratio(mode, length=4096, causal=False):
        ours = _lookup(core, impl="mha_jax", length=length, mode=mode, causal=causal)
        sdpa = _lookup(core, impl="torch sdpa", length=length, mode=mode, causal=causal)
        return None if not (ours and sdpa) else sdpa["seconds"] / ours["seconds"]

    for mode, target in (("fwd", ">= 0.9"), ("fwd+bwd", ">= 0.7")):
        r = ratio(mode)
        if r is not None:
            out.append((f"mha_jax / torch SDPA throughput, S=4096 {mode}", f"{r:.2f}x", target))
    for mode in ("fwd", "fwd+bwd"):  # causal both sides
        r = ratio(mode, causal=True)
        if r is not None:
            out.append((f"mha_jax / torch SDPA throughput, S=4096 causal {mode}", f"{r:.2f}x", ""))
    for impl in ("mha_jax", "torch sdpa", "jax.nn"):
        a = _lookup(core, impl=impl, length=4096, mode="fwd", causal=False)
        c = _lookup(core, impl=impl, length=4096, mode="fwd", causal=True)
        if a and c:
            out.append((f"{impl}: causal speed-up, S=4096 fwd", f"{a['seconds'] / c['seconds']:.2f}x",
                        ">= 1.6" if impl == "mha_jax" else ""))
    for mode, target in (("fwd", "<= 256 MiB"), ("fwd+bwd", "<= 512 MiB")):
        for impl in ("mha_jax", "torch sdpa", "jax.nn"):
            m = _lookup(memory, impl=impl, length=8192, mode=mode)
            if m and m["mib"] is not None:
                out.append((f"{impl}: peak memory growth, S=8192 {mode}", f"{m['mib']:.0f} MiB",
                            target if impl == "mha_jax" else ""))
    for impl in ("mha_jax", "torch sdpa"):
        m = _lookup(memory, impl=impl, length=LONG, mode="fwd")
        if m:
            ran = "failed" if m["mib"] is None else f"{m['first_run_s']:.1f} s, {m['mib']:.0f} MiB"
            out.append((f"{impl}: S={LONG} forward", ran, "runs" if impl == "mha_jax" else ""))
    for ours, theirs, target in (("mha_jax nnx", "flax.nnx MHA", ">= 2"), ("mha_jax linen", "flax.linen MHDPA", ""),
                                 ("mha_torch", "torch.nn.MHA", ">= 1.3")):
        for mode in ("fwd", "fwd+bwd"):
            a, b = _lookup(modules, impl=ours, mode=mode), _lookup(modules, impl=theirs, mode=mode)
            if a and b:
                out.append((f"module {ours} vs {theirs} ({mode})", f"{b['seconds'] / a['seconds']:.2f}x",
                            target if mode == "fwd" else ""))
    for r in structured_ratios(results):
        out.append((f"blockwise {r['workload']}, S={r['length']} {r['mode']} (interleaved medians)",
                    f"{r['ratio']:.2f}x", f">= {r['target']:g}"))
    for c in results.get("structured_check", []):
        out.append((f"blockwise - xla, {c['terms']}, S={c['length']}: {c['what']}", f"{c['max_abs_diff']:.1e}",
                    "max abs, float32"))
    return out


def markdown(results: dict) -> str:
    """The targets table and the S=4096 core timings, as Markdown for README.md."""
    lines = ["| what | measured | target |", "|---|---|---|"]
    lines += [f"| {w} | {m} | {t} |" for w, m, t in summary(results)]
    lines += ["", "| S=4096 | fwd s | fwd GFLOP/s | fwd+bwd s | fwd+bwd GFLOP/s | causal fwd s | compile s |",
              "|---|---|---|---|---|---|---|"]
    for impl in CORE:
        f = _lookup(results["core"], impl=impl, length=4096, mode="fwd", causal=False)
        b = _lookup(results["core"], impl=impl, length=4096, mode="fwd+bwd", causal=False)
        c = _lookup(results["core"], impl=impl, length=4096, mode="fwd", causal=True)
        if f and b and c:
            compile_s = f"{f['compile_s']:.2f}" if f["compile_s"] else "-"
            lines.append(f"| {impl} | {f['seconds']:.3f} | {f['gflops']:.0f} | {b['seconds']:.3f} | "
                         f"{b['gflops']:.0f} | {c['seconds']:.3f} | {compile_s} |")
    ratios = structured_ratios(results)
    if ratios:
        header = "| blockwise, structured (median ms, interleaved) | S | mode | ms | baseline ms | speed-up | target |"
        lines += ["", header,
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['workload']} | {r['length']} | {r['mode']} | {1e3 * r['seconds']:.0f} | "
                  f"{1e3 * r['baseline_s']:.0f} | {r['ratio']:.2f}x | >= {r['target']:g} |" for r in ratios]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = structured_ratios(results)
    fig, axes = plt.subplots(1, 4 if ratios else 3, figsize=(21 if ratios else 16, 4.8))
    for ax, mode in zip(axes[:2], ("fwd", "fwd+bwd")):
        for impl in CORE:
            for causal, style in ((False, "-"), (True, ":")):
                pts = sorted((r["length"], r["seconds"]) for r in results["core"]
                             if r["impl"] == impl and r["mode"] == mode and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{impl}{' causal' if causal else ''}")
        ax.set(xscale="log", yscale="log", xlabel="length", ylabel="seconds (best run)",
               title=f"attention {mode}, B=1 H=8 D=64 float32")
        ax.legend(fontsize=7)
    for impl in CORE:
        for mode, style in (("fwd", "-"), ("fwd+bwd", "--")):
            pts = sorted((r["length"], r["mib"]) for r in results["memory"]
                         if r["impl"] == impl and r["mode"] == mode and r["mib"] is not None)
            if pts:
                axes[2].plot(*zip(*pts), style, marker="o", label=f"{impl} {mode}")
    axes[2].set(xscale="log", yscale="log", xlabel="length", ylabel="peak RSS growth (MiB)",
                title="memory, one process per point")
    if results["memory"]:
        axes[2].legend(fontsize=7)
    else:  # --only structured measures no memory
        axes[2].set_visible(False)
    if ratios:
        labels = [f"{r['workload']}\nS={r['length']} {r['mode']}" for r in ratios]
        x = range(len(ratios))
        axes[3].bar([i - 0.2 for i in x], [r["baseline_s"] for r in ratios], 0.4, label="baseline")
        axes[3].bar([i + 0.2 for i in x], [r["seconds"] for r in ratios], 0.4, label="structured")
        for i, r in zip(x, ratios):
            axes[3].annotate(f"{r['ratio']:.1f}x", (i + 0.2, r["seconds"]), ha="center", va="bottom", fontsize=7)
        axes[3].set_xticks(list(x), labels, fontsize=6, rotation=30, ha="right")
        axes[3].set(yscale="log", ylabel="seconds (median, interleaved)", title="blockwise, structured masks")
        axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# The instruction-set extensions that decide XLA:CPU's and PyTorch's vector code.
_ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16",
              "amx_tile", "asimd", "sve", "sve2")


def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Bytes of CPU 0's highest-level cache (Linux sysfs), or None where unreadable: with the
    model and ISA, what says which CPU a result is of (block sizes fit one cache and not another)."""
    best = None
    for entry in Path(root).glob("index*"):
        try:
            level, text = int((entry / "level").read_text()), (entry / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * scale)
    return None if best is None else best[1]


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name and its vector ISA (from ``/proc/cpuinfo``; empty where unreadable):
    the same benchmark differs between CPUs (an AMD EPYC with AVX-512 against the README's)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"cpu_model": fields.get("model name") or fields.get("CPU part", ""),
            "cpu_isa": [f for f in _ISA_FLAGS if f in flags]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths up to 2048 only")
    parser.add_argument("--lengths", type=int, nargs="*", help="override the lengths")
    parser.add_argument("--no-modules", action="store_true", help="skip the module-level comparison")
    parser.add_argument("--name", default=None,
                        help="results file name (default: cpu or gpu, with -structured for --only)")
    parser.add_argument("--only", choices=("structured",), help="only these points: 'structured' runs the structured "
                        "masks, their check against xla, and blockwise against torch SDPA at 4096")
    parser.add_argument("--rounds", type=int, default=3, help="with --only structured: rounds of the S=4096 processes")
    parser.add_argument("--memory-probe", nargs=4, metavar=("KIND", "IMPL", "LENGTH", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--time-probe", nargs=2, metavar=("FRAMEWORK", "WHAT"), help=argparse.SUPPRESS)
    parser.add_argument("--impls", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--check-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.time_probe:
        print(json.dumps(time_probe(*args.time_probe, tuple(args.impls) if args.impls else None)))
        return 0
    if args.check_probe:
        print(json.dumps(structured_check()))
        return 0
    if args.memory_probe:
        kind, name, length, mode = args.memory_probe
        mib, seconds = memory_probe(kind, name, int(length), mode)
        print(f"{mib:.1f} {seconds:.3f}")
        return 0

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    lengths = args.lengths or ((512, 1024, 2048) if args.quick else LENGTHS)
    memory_lengths = [L for L in lengths if L >= 1024]
    console = Console(width=None if sys.stdout.isatty() else 110)
    start, load_before = time.perf_counter(), os.getloadavg()
    with Progress(console=console, transient=True) as progress:
        if args.only == "structured":
            results = run_structured(progress, args.rounds)
        else:
            results = run(lengths, memory_lengths, not args.no_modules, progress, None if args.quick else LONG)
    import jax
    import torch

    results["meta"] = {
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), **cpu_model(),
        "last_level_cache_bytes": last_level_cache(),
        "jax": jax.__version__, "torch": torch.__version__, "device": jax.devices()[0].device_kind,
        "seconds": time.perf_counter() - start,
        # 1-minute load averages before and after: above ~0.5 before, something else was running.
        "loadavg_before": load_before[0], "loadavg_after": os.getloadavg()[0],
    }
    best = f"median over {args.rounds} rounds of the best run" if args.only else "best run"
    table = Table(title=f"core timings ({best}, seconds; JAX compile apart)")
    for col in ("impl", "length", "mode", "causal", "seconds", "GFLOP/s", "compile s"):
        table.add_column(col, justify="left" if col in ("impl", "mode") else "right")
    for r in results["core"]:
        table.add_row(r["impl"], str(r["length"]), r["mode"], "yes" if r["causal"] else "", f"{r['seconds']:.3f}",
                      f"{r['gflops']:.0f}", f"{r['compile_s']:.2f}" if r["compile_s"] else "")
    console.print(table)
    if results.get("structured"):
        table = Table(title="blockwise, structured masks (median of interleaved runs, seconds)")
        for col in ("workload", "terms", "length", "mode", "seconds", "best", "runs", "compile s"):
            table.add_column(col, justify="left" if col in ("workload", "terms", "mode") else "right")
        for r in results["structured"]:
            table.add_row(r["workload"], r["terms"], str(r["length"]), r["mode"], f"{r['seconds']:.3f}",
                          f"{r['best_s']:.3f}", str(r["runs"]), f"{r['compile_s']:.2f}")
        console.print(table)
    ratios = Table(title="targets (ratios from this run)")
    for col in ("what", "measured", "target"):
        ratios.add_column(col)
    for row in summary(results):
        ratios.add_row(*row)
    console.print(ratios)
    RESULTS.mkdir(exist_ok=True)
    name = args.name or ("gpu" if jax.default_backend() == "gpu" else "cpu") + ("-structured" if args.only else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    (RESULTS / f"{name}.md").write_text(markdown(results))
    plot(results, RESULTS / f"{name}.png")
    console.print(f"wrote {RESULTS / name}.json and .png in {results['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
