"""On an NVIDIA GPU: check ``"cudnn"`` and ``"flash"`` against the float64 oracle, and time them.

Needs ``jax[cuda]`` and ``torch`` (CUDA) installed; nothing of this project beyond the checkout:

    PYTHONPATH=. python benchmarks/gpu.py                 # every part, one JSON on stdout
    PYTHONPATH=. python benchmarks/gpu.py --part check    # one part: check | jax | torch

Each framework runs in a process of its own (neither holds the other's GPU memory or threads).

- ``check`` (JAX): ``mha_jax.dot_product_attention`` with ``implementation="cudnn"`` and
  ``"flash"`` in bfloat16 and float16, forward and gradients (q, k, v), against the float64
  NumPy oracle (``parity_tests/tool/oracle.py``), over causal, key lengths (a row with no key
  included), a causal window and segments, with grouped heads; relative errors
  (``||got - want|| / ||want||``) and whether they are within the suite's bfloat16 tolerances.
- ``jax``: forward and forward+backward times (median of ``--repeats`` after a warm-up) of ours
  (``"cudnn"``, ``"flash"``) and of ``jax.nn.dot_product_attention(implementation="cudnn")``,
  causal, Llama-3-8B heads (32 query, 8 key/value, head_dim 128), bfloat16.
- ``torch``: the same with ``F.scaled_dot_product_attention`` under its flash kernel
  (``SDPBackend.FLASH_ATTENTION``; key/value heads repeated to the query heads, which that kernel
  takes) and our ``mha_torch`` ``"sdpa"`` path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.decode import median_of  # a warm-up call, then the median of the timed ones

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CHECK = dict(batch=2, length=256, heads=8, kv_heads=2, head_dim=64)
TOLERANCES = (2e-2, 5e-2)  # the suite's bfloat16 (forward, gradients); float16 is held to the same


def check() -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mha_jax
    from parity_tests.tool import oracle

    b, n, h, hk, d = (CHECK[k] for k in ("batch", "length", "heads", "kv_heads", "head_dim"))
    rng = np.random.default_rng(0)
    q, k, v, d_out = rng.normal(size=(b, h, n, d)), *rng.normal(size=(2, b, hk, n, d)), rng.normal(size=(b, h, n, d))
    segments = np.stack([np.arange(n) * 3 // n, np.arange(n) // 100])
    cases = {
        "causal": (dict(is_causal=True), {}),
        "lengths (one row empty)": (dict(key_value_seq_lengths=np.array([n // 2, 0])),
                                    dict(lengths=np.array([n // 2, 0]))),
        "causal window": (dict(is_causal=True, local_window_size=(64, 0)), dict(window=(64, 0))),
        "segments": (dict(query_segment_ids=segments, key_segment_ids=segments),
                     dict(query_segment_ids=segments, key_segment_ids=segments)),
    }
    results = []
    for name, (kw, terms) in cases.items():
        att = oracle.Attention(is_causal=kw.get("is_causal", False), **terms)
        want, _, cache = oracle.attention(q, k, v, att)
        want_grads = oracle.attention_grad(cache, d_out)
        for implementation in ("cudnn", "flash"):
            for dtype in ("bfloat16", "float16"):
                def T(x, dtype=dtype):
                    return jnp.asarray(x.transpose(0, 2, 1, 3), dtype)

                args = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}

                def f(q, k, v):
                    return mha_jax.dot_product_attention(q, k, v, implementation=implementation, **args)  # noqa: B023

                entry = dict(case=name, implementation=implementation, dtype=dtype)
                try:
                    out, vjp = jax.vjp(jax.jit(f), T(q), T(k), T(v))
                    grads = vjp(T(d_out))
                except Exception as error:  # a refusal is a result too
                    results.append(dict(entry, error=f"{type(error).__name__}: {error}"[:300]))
                    continue

                def rel(got, ref):
                    got = np.asarray(got, np.float64).transpose(0, 2, 1, 3)
                    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))

                errors = dict(out=rel(out, want), dq=rel(grads[0], want_grads[0]), dk=rel(grads[1], want_grads[1]),
                              dv=rel(grads[2], want_grads[2]))
                text = jax.jit(f).lower(T(q), T(k), T(v)).as_text()
                results.append(dict(entry, errors=errors, cudnn_call="__cudnn$fmha" in text,
                                    within=errors["out"] <= TOLERANCES[0]
                                    and max(errors[g] for g in ("dq", "dk", "dv")) <= TOLERANCES[1]))
    return results


def time_jax(lengths, repeats) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import mha_jax

    def ours(implementation):
        return lambda q, k, v: mha_jax.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    def jax_nn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    variants = {"ours cudnn": ours("cudnn"), "ours flash": ours("flash"), "jax.nn cudnn": jax_nn}
    results = []
    for n in lengths:
        key = jax.random.key(n)
        q = jax.random.normal(key, (1, n, HEADS, HEAD_DIM), jnp.bfloat16)
        k = jax.random.normal(jax.random.fold_in(key, 1), (1, n, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 2), (1, n, KV_HEADS, HEAD_DIM), jnp.bfloat16)
        for name, f in variants.items():
            forward = jax.jit(f)
            backward = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))  # noqa: B023
            entry = dict(framework="jax", variant=name, length=n)
            try:
                fwd = median_of(lambda: forward(q, k, v).block_until_ready(), repeats)  # noqa: B023
                both = median_of(lambda: jax.block_until_ready(backward(q, k, v)), repeats)  # noqa: B023
            except Exception as error:
                results.append(dict(entry, error=f"{type(error).__name__}: {error}"[:300]))
                continue
            flops = 2 * 2 * HEADS * n * n * HEAD_DIM / 2  # causal forward
            results.append(dict(entry, forward_s=fwd, forward_backward_s=both, forward_tflops=flops / fwd / 1e12,
                                forward_backward_tflops=3.5 * flops / both / 1e12))
    return results


def time_torch(lengths, repeats) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import mha_torch

    def flash(q, k, v):
        groups = HEADS // KV_HEADS
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                  is_causal=True)

    def ours(q, k, v):
        return mha_torch.dot_product_attention(q, k, v, is_causal=True, implementation="sdpa")

    results = []
    for n in lengths:
        gen = torch.Generator(device="cuda").manual_seed(n)

        def tensor(heads):
            return torch.randn(1, heads, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: B023

        q, k, v = tensor(HEADS), tensor(KV_HEADS), tensor(KV_HEADS)
        for name, f in {"torch sdpa flash": flash, "ours sdpa (mha_torch)": ours}.items():
            entry = dict(framework="torch", variant=name, length=n)

            def forward():
                with torch.no_grad():
                    f(q, k, v)  # noqa: B023
                torch.cuda.synchronize()

            def both():
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))  # noqa: B023
                f(qq, kk, vv).float().sum().backward()  # noqa: B023
                torch.cuda.synchronize()

            try:
                fwd, fb = median_of(forward, repeats), median_of(both, repeats)
            except Exception as error:
                results.append(dict(entry, error=f"{type(error).__name__}: {error}"[:300]))
                continue
            flops = 2 * 2 * HEADS * n * n * HEAD_DIM / 2
            results.append(dict(entry, forward_s=fwd, forward_backward_s=fb, forward_tflops=flops / fwd / 1e12,
                                forward_backward_tflops=3.5 * flops / fb / 1e12))
    return results


def _device() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return {"nvidia_smi": out}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("check", "jax", "torch"), help="run one part in this process")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.part:
        run = {"check": lambda: check(), "jax": lambda: time_jax(args.lengths, args.repeats),
               "torch": lambda: time_torch(args.lengths, args.repeats)}[args.part]
        print(json.dumps(run()))
        return
    report = {"device": _device(), "lengths": args.lengths, "repeats": args.repeats}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    for part in ("check", "jax", "torch"):
        cmd = [sys.executable, __file__, "--part", part, "--repeats", str(args.repeats), "--lengths",
               *map(str, args.lengths)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = done.stdout.strip().splitlines()
        report[part] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-3000:]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
