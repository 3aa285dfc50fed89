"""One-token decode step of multi-head latent attention: the latent cache (``kv_lora_rank +
qk_rope_head_dim`` numbers per token, ``kv_b_proj`` absorbed into the query and the output) against
a cache of full keys and values (each head's ``qk_nope_head_dim + qk_rope_head_dim`` key and
``v_head_dim`` value features per token), each framework in a process of its own.

    python -m benchmarks.mla_decode                        # 4K and 16K cached keys
    python -m benchmarks.mla_decode --lengths 1024 --reps 5

DeepSeek-V2-Lite's attention: hidden 2048, 16 heads, qk_nope_head_dim 128, qk_rope_head_dim 64,
v_head_dim 128, kv_lora_rank 512, a plain ``q_proj``; float32, batch 1, CPU. The cache holds
``length - 1`` tokens and the step appends one. Ours: the module's decoding step
(``mha_jax.MultiHeadAttention(latent=...)``, ``decode=True``, ``nnx.jit``; ``mha_torch`` with a
``LatentCache``). The full-key step: the same module's projections, the token's latent lifted by
``kv_b_proj`` into full keys and values, written into a full-key cache and attended
(``mha_jax.dot_product_attention`` over the filled length, jitted; PyTorch
``F.scaled_dot_product_attention`` over the filled slots). Timing as ``benchmarks.decode``: the
two steps alternate call by call, medians (best in brackets), one thread per process by default.
Writes ``benchmarks/results/cpu-mla-decode.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.decode import _child_env, _interleaved

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, HEADS, NOPE, ROPE, V, RANK = 2048, 16, 128, 64, 128, 512
LENGTHS = (4096, 16384)
LATENT_BYTES, FULL_BYTES = (RANK + ROPE) * 4, HEADS * (NOPE + ROPE + V) * 4  # float32 per token and layer


def _latent():
    from mha_spec.latent import Latent

    return Latent(kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=V)


def _row(framework: str, length: int, cache_bytes: tuple[int, int], timed: dict) -> dict:
    row = dict(framework=framework, length=length, latent_cache_bytes=cache_bytes[0],
               full_cache_bytes=cache_bytes[1], runs=timed["latent"]["runs"])
    for name, t in timed.items():
        row[name], row[f"{name} best"] = t["median"], t["best"]
    print(json.dumps(row), file=sys.stderr)
    return row


def _jax_rows(args: argparse.Namespace) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import mha_jax
    from mha_jax import latent as mla

    rows = []
    for length in args.lengths:
        module = mha_jax.MultiHeadAttention(HEADS, HIDDEN, latent=_latent(), use_bias=False,
                                            rotary=mha_jax.RotaryEmbedding(head_dim=ROPE), rngs=nnx.Rngs(0))
        module.init_cache((1, length, HIDDEN), jnp.float32)
        token = jax.random.normal(jax.random.key(1), (1, 1, HIDDEN), jnp.float32)
        step = nnx.jit(lambda m, x: m(x, decode=True, is_causal=True), donate_argnums=0)

        def run_latent(module=module, step=step, token=token, length=length):
            module.cache_index[...] = jnp.asarray(np.full((1,), length - 1, np.int32))
            jax.block_until_ready(step(module, token))

        keys = jnp.zeros((1, length, HEADS, NOPE + ROPE), jnp.float32)
        values = jnp.zeros((1, length, HEADS, V), jnp.float32)

        @nnx.jit(donate_argnums=(1, 2))
        def full_step(module, keys, values, token, index):
            pos = jnp.full((1, 1), index, jnp.int32)
            rope = mla.rope_part(module.rotary, module.latent)
            query, entries = rope(mla.project_query(module, token), pos), rope(mla.project_latent(module, token), pos)
            key, value = mla.expand(module, entries, HEADS)
            keys, values = keys.at[:, index].set(key[:, 0]), values.at[:, index].set(value[:, 0])
            out = mha_jax.dot_product_attention(query, keys, values, scale=module.scale,
                                                key_value_seq_lengths=jnp.full((1,), index + 1, jnp.int32))
            return module.out(out), keys, values

        cache = [keys, values]

        def run_full(module=module, token=token, length=length, cache=cache):
            out, cache[0], cache[1] = full_step(module, cache[0], cache[1], token, length - 1)
            jax.block_until_ready(out)

        timed = _interleaved({"latent": run_latent, "full keys": run_full}, args.reps, args.min_seconds)
        latent_bytes = module.cached_key[...].nbytes
        rows.append(_row("jax", length, (latent_bytes, cache[0].nbytes + cache[1].nbytes), timed))
    return rows


def _torch_rows(args: argparse.Namespace) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return [_torch_row(length, args) for length in args.lengths]


def _torch_row(length: int, args: argparse.Namespace) -> dict:
    """The two steps of PyTorch at ``length`` cached keys, timed."""
    import torch
    import torch.nn.functional as F

    import mha_torch
    from mha_torch import latent as mla

    module = mha_torch.MultiHeadAttention(HIDDEN, HEADS, latent=_latent(), bias=False,
                                          rotary=mha_torch.RotaryEmbedding(head_dim=ROPE)).eval()
    cache = mla.LatentCache(1, length, module.latent)
    token = torch.randn(1, 1, HIDDEN)

    def run_latent(module=module, cache=cache, token=token, length=length):
        cache.index.fill_(length - 1)
        with torch.no_grad():
            module(token, cache=cache, is_causal=True)

    keys, values = torch.zeros(1, HEADS, length, NOPE + ROPE), torch.zeros(1, HEADS, length, V)

    def run_full(module=module, keys=keys, values=values, token=token, index=length - 1):
        with torch.no_grad():
            pos = torch.full((1, 1), index, dtype=torch.int32)
            rope = mla.rope_part(module.rotary, module.latent)
            query = rope(mla.project_query(module, token, 1, HEADS), pos)
            key, value = mla.expand(module, rope(mla.project_latent(module, token), pos), HEADS)
            keys[:, :, index], values[:, :, index] = key[:, :, 0], value[:, :, 0]
            out = F.scaled_dot_product_attention(query, keys[:, :, :index + 1], values[:, :, :index + 1],
                                                 scale=module.scale)
            module.out_proj(out.transpose(1, 2).reshape(1, 1, HEADS * V))

    timed = _interleaved({"latent": run_latent, "full keys": run_full}, args.reps, args.min_seconds)
    return _row("torch", length, (cache.key.nbytes, keys.nbytes + values.nbytes), timed)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Wall time per one-token step, median of >= {meta['reps']} interleaved calls (best in brackets); "
             f"{meta['threads']} thread(s) per framework process; {meta['machine']}. DeepSeek-V2-Lite's attention "
             f"(hidden {HIDDEN}, {HEADS} heads, nope {NOPE}, rope {ROPE}, v {V}, kv_lora_rank {RANK}), float32, "
             f"batch 1. Cache bytes per token and layer: latent {LATENT_BYTES}, full keys and values {FULL_BYTES} "
             f"({FULL_BYTES / LATENT_BYTES:.1f}x).", "",
             "| framework | cached keys | latent (ms) | full keys (ms) | full / latent | latent cache (MB) "
             "| full-key cache (MB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['framework']} | {r['length']} | {1e3 * r['latent']:.2f} ({1e3 * r['latent best']:.2f}) "
            f"| {1e3 * r['full keys']:.2f} ({1e3 * r['full keys best']:.2f}) | {r['full keys'] / r['latent']:.2f}x "
            f"| {r['latent_cache_bytes'] / 2**20:.1f} | {r['full_cache_bytes'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("jax", "torch"), help="one framework, in this process (JSON to stdout)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="cache lengths")
    parser.add_argument("--threads", type=int, default=1, help="threads per framework process (default 1)")
    parser.add_argument("--reps", type=int, default=11, help="least calls of each step (default 11)")
    parser.add_argument("--min-seconds", type=float, default=2.0, help="least seconds per point (default 2)")
    parser.add_argument("--note", default="", help="added to the results' header (say that the machine was shared)")
    args = parser.parse_args(argv)
    if args.framework:
        print(json.dumps(_jax_rows(args) if args.framework == "jax" else _torch_rows(args)))
        return 0
    passed = [f"--threads={args.threads}", f"--reps={args.reps}", f"--min-seconds={args.min_seconds}",
              "--lengths", *map(str, args.lengths)]
    rows = [row for framework in ("jax", "torch") for row in _child_rows(framework, passed, args.threads)]
    machine = [f"{platform.machine()} CPU, {os.cpu_count()} cores"] + ([args.note] if args.note else [])
    meta = dict(threads=args.threads, reps=args.reps, min_seconds=args.min_seconds, machine=", ".join(machine),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    RESULTS.mkdir(exist_ok=True)
    table = markdown(rows, meta)
    for suffix, text in ((".json", json.dumps(dict(meta=meta, rows=rows), indent=1)), (".md", table)):
        (RESULTS / f"cpu-mla-decode{suffix}").write_text(text)
    print(table)
    return 0


def _child_rows(framework: str, passed: list[str], threads: int) -> list[dict]:
    """The rows of one framework, measured in a process of its own."""
    command = [sys.executable, "-m", "benchmarks.mla_decode", "--framework", framework, *passed]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                          env=_child_env(framework, threads), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
