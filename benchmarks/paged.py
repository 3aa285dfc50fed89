"""A decode step over a paged cache against a contiguous cache padded to the longest sequence, in both frameworks.

    python -m benchmarks.paged           # batch 32, lengths 128 to 8192 (log-uniform), 32 heads, 8 kv heads, dim 128
    python -m benchmarks.paged --cpu     # batch 8, lengths 64 to 1024, 8 heads, 2 kv heads, dim 64

One step appends one token to every sequence and attends over its cache, float32, the pool's pages shuffled:
ours paged in place (``mha_jax.paged``/``mha_torch.paged``: ``write`` then ``ragged_attention(max_q_len=1)``; JAX
jitted with the cache donated); the same with the pages gathered into a padded batch (``implementation=``, the
former path: JAX's ``"xla"``, PyTorch's ``"sdpa"``); a contiguous cache ``(batch, longest, kv_heads, head_dim)``
written at each row's length and read by ``dot_product_attention`` with ``key_value_seq_lengths`` (``"xla"`` /
``"sdpa"``, and JAX's ``"blockwise"``, which skips the key blocks past the longest length), without (every padded
slot attended: the cost of ignoring lengths, not a correct step), and row by row over each row's own keys (a bound:
no padding read at all; JAX compiles it for these lengths); PyTorch's ``PagedAttention`` (its ``assign``, then
``flex_attention`` over its pages, eager; ``--cpu`` only). Tokens per second: batch / step time, the median of
``--reps`` steps after a warm-up (one thread per framework); ``--runs`` rounds alternate the variants, the table
gives the median round and the spread (lowest to highest). Cache memory: the bytes the cache holds (paged: the
pages held; contiguous: every slot up to the longest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402  (after the thread settings)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention.experimental._paged_attention import PagedAttention  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import mha_jax  # noqa: E402
import mha_torch  # noqa: E402
from benchmarks.decode import median_of  # noqa: E402
from mha_jax import paged as pj  # noqa: E402
from mha_spec.paged import PageTable  # noqa: E402
from mha_torch import paged as pt  # noqa: E402

FULL = dict(batch=32, shortest=128, longest=8192, heads=32, kv_heads=8, head_dim=128, page_size=16)
CPU = dict(batch=8, shortest=64, longest=1024, heads=8, kv_heads=2, head_dim=64, page_size=16)
FORMER = {"jax": "xla", "torch": "sdpa"}  # the default implementation the former gathered path ran


def pool(shape: dict, lengths: np.ndarray, rng) -> tuple[PageTable, int]:
    """A table of exactly the pages the cache and one more token per sequence need, handed out in a shuffled
    order; the longest length + 1."""
    ps, longest = shape["page_size"], int(lengths.max()) + 1
    table = PageTable(int((-(-(lengths + 1) // ps)).sum()), ps, shape["batch"], -(-longest // ps))
    table.free = rng.permutation(table.num_pages).tolist()
    return table, longest


def jax_steps(shape: dict, lengths: np.ndarray, rng) -> dict:
    """``{name: (step, cache bytes)}`` of JAX's variants; each step appends one token per row."""
    b, h, kvh, d = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim"))
    table, longest = pool(shape, lengths, rng)
    key, value = (jnp.asarray(rng.standard_normal((b, longest, kvh, d)), jnp.float32) for _ in range(2))
    state = {"paged": pj.schedule(pj.from_contiguous(key, value, lengths, table), table.append([1] * b)),
             "contiguous": (key, value)}
    q, new = jnp.ones((b, h, d), jnp.float32), jnp.ones((b, kvh, d), jnp.float32)
    rows, positions = jnp.arange(b), jnp.asarray(lengths)

    def paged(implementation):
        def step(cache):
            cache = pj.write(cache, new, new)
            return cache, pj.ragged_attention(q, cache, max_q_len=1, implementation=implementation)
        return jax.jit(step, donate_argnums=0)

    def contiguous(**terms):
        def step(kv):
            key, value = (x.at[rows, positions].set(new) for x in kv)
            if terms.get("each_row"):
                return (key, value), [mha_jax.dot_product_attention(q[r:r + 1, None], key[r:r + 1, :n + 1],
                                                                    value[r:r + 1, :n + 1])
                                      for r, n in enumerate(lengths.tolist())]
            return (key, value), mha_jax.dot_product_attention(q[:, None], key, value, **terms)
        return jax.jit(step, donate_argnums=0)

    def timed(name, function):
        def run():
            state[name], out = function(state[name])
            jax.block_until_ready(out)
        return run

    held, padded = int((table.pages >= 0).sum()) * table.page_size * 2 * kvh * d * 4, key.nbytes * 2
    lengths_after = positions + 1
    return {"jax paged, in place": (timed("paged", paged(None)), held),
            "jax paged, gathered (former)": (timed("paged", paged(FORMER["jax"])), held),
            "jax contiguous, key lengths": (timed("contiguous", contiguous(key_value_seq_lengths=lengths_after)),
                                            padded),
            "jax contiguous, key lengths, blockwise": (timed("contiguous", contiguous(
                key_value_seq_lengths=lengths_after, implementation="blockwise")), padded),
            "jax contiguous, no lengths": (timed("contiguous", contiguous()), padded),
            "jax contiguous, each row to its length": (timed("contiguous", contiguous(each_row=True)), padded)}


def torch_steps(shape: dict, lengths: np.ndarray, rng, flex: bool) -> dict:
    """``{name: (step, cache bytes)}`` of PyTorch's variants; each step appends one token per row."""
    b, h, kvh, d, ps = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "page_size"))
    table, longest = pool(shape, lengths, rng)
    key, value = (torch.from_numpy(rng.standard_normal((b, longest, kvh, d)).astype(np.float32)) for _ in range(2))
    cache = pt.schedule(pt.from_contiguous(key, value, lengths, table), table.append([1] * b))
    q, new = torch.ones(b, h, d), torch.ones(b, kvh, d)
    rows, positions = torch.arange(b), torch.from_numpy(lengths)
    key_t, value_t = key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous()
    del key, value

    def run_paged(implementation):
        return lambda: pt.ragged_attention(q, pt.write(cache, new, new), max_q_len=1, implementation=implementation)

    def run_contiguous(**terms):
        def run():
            key_t[rows, :, positions], value_t[rows, :, positions] = new, new
            if terms.get("each_row"):
                for r, n in enumerate(lengths.tolist()):
                    mha_torch.dot_product_attention(q[r:r + 1, :, None], key_t[r:r + 1, :, :n + 1],
                                                    value_t[r:r + 1, :, :n + 1])
            else:
                mha_torch.dot_product_attention(q[:, :, None], key_t, value_t, **terms)
        return run

    held, padded = int((table.pages >= 0).sum()) * ps * 2 * kvh * d * 4, key_t.nbytes * 2
    steps = {"torch paged, in place": (run_paged(None), held),
             "torch paged, gathered (former)": (run_paged(FORMER["torch"]), held),
             "torch contiguous, key lengths": (run_contiguous(key_value_seq_lengths=positions + 1), padded),
             "torch contiguous, no lengths": (run_contiguous(), padded),
             "torch contiguous, each row to its length": (run_contiguous(each_row=True), padded)}
    if flex:
        steps["torch PagedAttention (flex, eager)"] = flex_step(table, lengths, q, new, key_t, value_t)
    return steps


def flex_step(table: PageTable, lengths: np.ndarray, q, new, key_t, value_t) -> tuple:
    """PyTorch's ``PagedAttention`` over the same tokens: ``(step, cache bytes)``."""
    (b, kvh, _, d), ps = key_t.shape, table.page_size
    rows, positions = torch.arange(b), torch.from_numpy(lengths)
    pa = PagedAttention(table.num_pages, ps, b, device="cpu")
    k_cache, v_cache = (torch.zeros(1, kvh, table.num_pages * ps, d) for _ in range(2))
    for row, n in enumerate(lengths.tolist()):
        pa.reserve(torch.tensor(row), torch.tensor(n + 1))
        pa.assign(torch.tensor([row]), torch.arange(n)[None], key_t[row:row + 1, :, :n], value_t[row:row + 1, :, :n],
                  k_cache, v_cache)
    kv_len = positions + 1
    logical = create_block_mask(lambda b_, h_, q_, k_: k_ < kv_len[b_], b, None, 1, table.pages.shape[1] * ps,
                                device="cpu", BLOCK_SIZE=ps)
    block_mask = pa.convert_logical_block_mask(logical, kv_len=kv_len)

    def run():
        pa.assign(rows, positions[:, None], new[:, :, None], new[:, :, None], k_cache, v_cache)
        flex_attention(q[:, :, None], k_cache, v_cache, block_mask=block_mask, enable_gqa=True)
    return run, k_cache.nbytes * 2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU-sized shapes")
    parser.add_argument("--longest", type=int, help="the longest length (default: the shape's)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    shape = dict(CPU if args.cpu else FULL, **({"longest": args.longest} if args.longest else {}))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(shape["shortest"]), np.log(shape["longest"]), shape["batch"])).astype(np.int64)
    lengths[:2] = shape["shortest"], shape["longest"] - 1
    tokens = int(lengths.sum())
    print(f"shape {shape}, {tokens} tokens cached, lengths {sorted(lengths.tolist())}", flush=True)
    steps = {**jax_steps(shape, lengths, rng), **torch_steps(shape, lengths, rng, args.cpu)}
    seconds = {name: [] for name in steps}
    for _ in range(args.runs):
        for name, (step, _) in steps.items():
            seconds[name].append(median_of(step, args.reps))
    print("| step | tokens/s (median of runs) | spread | cache bytes | bytes per token held |")
    print("|---|---:|---:|---:|---:|")
    for name, (_, held) in steps.items():
        rates = [shape["batch"] / s for s in seconds[name]]
        print(f"| {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f} to {max(rates):,.0f} | {held:,} | "
              f"{held / tokens:,.0f} |")
    for framework in ("jax", "torch"):
        ours = statistics.median(seconds[f"{framework} paged, in place"])
        for other in ("contiguous, no lengths", "contiguous, key lengths", "contiguous, each row to its length"):
            ratio = statistics.median(seconds[f"{framework} {other}"]) / ours
            print(f"{framework}: paged in place is {ratio:.2f}x the speed of {other}")


if __name__ == "__main__":
    main()
