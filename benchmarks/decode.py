"""One-token decode step with a key/value cache, ours against the anchors, each framework in a
process of its own.

    python -m benchmarks.decode             # both frameworks (about 5 minutes on a 2-core CPU)

8 query heads, 2 key/value heads, head_dim 128 (features 1024), float32, CPU; the cache holds
``length - 1`` tokens and the step appends one, at lengths 1024 to 32768, batch 1 and 8.
JAX: our nnx module (``decode=True``, ``nnx.jit``) against ``flax.nnx.MultiHeadAttention``'s
decode (same weights), and against recomputing the whole prefix (``"blockwise"``, up to 4096).
PyTorch: our module with ``mha_torch.KVCache`` against a plain step of
``F.scaled_dot_product_attention`` over a hand-written cache (the same projections). Each pair is
timed interleaved (median of the reps). Writes ``benchmarks/results/cpu-decode.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
FEATURES = HEADS * HEAD_DIM
LENGTHS = (1024, 4096, 16384, 32768)
BATCHES = (1, 8)
RECOMPUTE_LIMIT = 4096


def _interleaved(steps: dict, reps: int = 7, min_total: float = 1.0) -> dict[str, float]:
    """Median seconds per call of each step, calls alternating between the steps."""
    for step in steps.values():  # compile and warm up
        step()
    times = {name: [] for name in steps}
    start = time.perf_counter()
    while min(len(t) for t in times.values()) < reps or time.perf_counter() - start < min_total:
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
        if len(times[next(iter(times))]) >= 50:
            break
    return {name: statistics.median(t) for name, t in times.items()}


def _jax_rows() -> list[dict]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import mha_jax

    rows = []
    for batch in BATCHES:
        for length in LENGTHS:
            ours = mha_jax.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, rngs=nnx.Rngs(0))
            theirs = nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, decode=True, rngs=nnx.Rngs(0))
            ours.init_cache((batch, length, FEATURES), jnp.float32)
            theirs.init_cache((batch, length, FEATURES), jnp.float32)
            ours.cache_index[...] = jnp.full((batch,), length - 1, jnp.int32)
            theirs.cache_index[...] = jnp.array(length - 1, jnp.int32)
            token = jax.random.normal(jax.random.key(1), (batch, 1, FEATURES), jnp.float32)
            ours_step = nnx.jit(lambda m, x: m(x, decode=True), donate_argnums=0)
            flax_step = nnx.jit(lambda m, x: m(x), donate_argnums=0)

            def run_ours(ours=ours, step=ours_step, token=token, length=length):
                ours.cache_index[...] = jnp.full(ours.cache_index.shape, length - 1, jnp.int32)
                jax.block_until_ready(step(ours, token))

            def run_flax(theirs=theirs, step=flax_step, token=token, length=length):
                theirs.cache_index[...] = jnp.array(length - 1, jnp.int32)
                jax.block_until_ready(step(theirs, token))

            steps = {"ours": run_ours, "flax.nnx decode": run_flax}
            if length <= RECOMPUTE_LIMIT:
                prefix = jax.random.normal(jax.random.key(2), (batch, length, FEATURES), jnp.float32)
                full = mha_jax.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=KV_HEADS, implementation="blockwise", rngs=nnx.Rngs(0))
                full_step = nnx.jit(lambda m, x: m(x, is_causal=True)[:, -1:])
                steps["full recompute"] = lambda full=full, step=full_step, prefix=prefix: jax.block_until_ready(step(full, prefix))
            times = _interleaved(steps)
            cache_bytes = ours.cached_key[...].nbytes + ours.cached_value[...].nbytes
            rows.append(dict(framework="jax", batch=batch, length=length, cache_bytes=cache_bytes,
                             formula_bytes=2 * batch * length * KV_HEADS * HEAD_DIM * 4, **times))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _torch_rows() -> list[dict]:
    import torch
    import torch.nn.functional as F

    import mha_torch

    torch.manual_seed(0)
    rows = []
    for batch in BATCHES:
        for length in LENGTHS:
            layer = mha_torch.MultiHeadAttention(FEATURES, HEADS, num_kv_heads=KV_HEADS).eval()
            cache = mha_torch.KVCache(batch, length, KV_HEADS, HEAD_DIM)
            token = torch.randn(batch, 1, FEATURES)
            k_cache = torch.zeros(batch, KV_HEADS, length, HEAD_DIM)
            v_cache = torch.zeros(batch, KV_HEADS, length, HEAD_DIM)
            index = length - 1

            def run_ours(cache=cache, layer=layer, token=token, index=index):
                cache.index.fill_(index)
                with torch.no_grad():
                    layer(token, cache=cache)

            def run_sdpa(layer=layer, token=token, k_cache=k_cache, v_cache=v_cache, index=index, batch=batch):
                with torch.no_grad():
                    q = layer.q_proj(token).view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
                    k_cache[:, :, index] = layer.k_proj(token).view(batch, KV_HEADS, HEAD_DIM)
                    v_cache[:, :, index] = layer.v_proj(token).view(batch, KV_HEADS, HEAD_DIM)
                    out = F.scaled_dot_product_attention(q, k_cache[:, :, :index + 1], v_cache[:, :, :index + 1], enable_gqa=True)
                    layer.out_proj(out.transpose(1, 2).reshape(batch, 1, FEATURES))

            times = _interleaved({"ours": run_ours, "sdpa step": run_sdpa})
            cache_bytes = cache.key.nbytes + cache.value.nbytes
            rows.append(dict(framework="torch", batch=batch, length=length, cache_bytes=cache_bytes,
                             formula_bytes=2 * batch * length * KV_HEADS * HEAD_DIM * 4, **times))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| framework | batch | cache length | ours (ms) | anchor | anchor (ms) | anchor / ours | full recompute / ours | cache bytes = formula |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        anchor = "flax.nnx decode" if r["framework"] == "jax" else "sdpa step"
        recompute = f"{r['full recompute'] / r['ours']:.1f}x" if "full recompute" in r else "-"
        lines.append(
            f"| {r['framework']} | {r['batch']} | {r['length']} | {1e3 * r['ours']:.2f} | {anchor} | {1e3 * r[anchor]:.2f} "
            f"| {r[anchor] / r['ours']:.2f}x | {recompute} | {r['cache_bytes'] == r['formula_bytes']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("jax", "torch"), help="one framework, in this process (JSON to stdout)")
    args = parser.parse_args(argv)
    if args.framework:
        print(json.dumps(_jax_rows() if args.framework == "jax" else _torch_rows()))
        return 0
    rows = []
    for framework in ("jax", "torch"):
        done = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--framework", framework], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parent.parent, check=True)
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu-decode.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (RESULTS / "cpu-decode.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
