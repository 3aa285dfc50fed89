"""A decode step over a paged cache against a contiguous cache padded to the longest sequence, in both frameworks.

    python -m benchmarks.paged           # batch 32, lengths 128 to 8192 (log-uniform), 32 heads, 8 kv heads, dim 128
    python -m benchmarks.paged --cpu     # batch 8, lengths 64 to 1024, 8 heads, 2 kv heads, dim 64

One step appends one token to every sequence and attends over its cache, float32: ours paged
(``mha_jax.paged``/``mha_torch.paged``: ``write`` then ``ragged_attention(max_q_len=1)``; JAX jitted with the
cache donated), a contiguous cache ``(batch, longest, kv_heads, head_dim)`` written at each row's length and read
by ``dot_product_attention`` with ``key_value_seq_lengths`` (right) and without (every padded slot attended: the
cost of ignoring lengths, not a correct step), and PyTorch's ``PagedAttention`` (its ``assign``, then
``flex_attention`` over its pages, eager: flex_attention compiled needs a C++ toolchain and minutes on a CPU).
Tokens per second: batch / median step time (``--reps`` steps after a warm-up, one thread per framework). Cache
memory: the bytes the cache holds for its tokens (paged: the pages held; contiguous: every slot up to the longest).
"""

from __future__ import annotations

import argparse
import os
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


def pool(shape: dict, lengths: np.ndarray) -> tuple[PageTable, int]:
    """A table of exactly the pages the cache and one more token per sequence need; the longest length + 1."""
    ps, longest = shape["page_size"], int(lengths.max()) + 1
    return PageTable(int((-(-(lengths + 1) // ps)).sum()), ps, shape["batch"], -(-longest // ps)), longest


def jax_steps(shape: dict, lengths: np.ndarray, rng) -> dict:
    """``{name: step}`` of JAX's variants; each step appends one token per row."""
    b, h, kvh, d, ps = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "page_size"))
    table, longest = pool(shape, lengths)
    key, value = (jnp.asarray(rng.standard_normal((b, longest, kvh, d)), jnp.float32) for _ in range(2))
    state = {"paged": pj.from_contiguous(key, value, lengths, table), "key": key, "value": value}
    state["paged"] = pj.schedule(state["paged"], table.append([1] * b))
    q, new = jnp.ones((b, h, d), jnp.float32), jnp.ones((b, kvh, d), jnp.float32)
    rows, positions = jnp.arange(b), jnp.asarray(lengths)

    def paged(cache):
        cache = pj.write(cache, new, new)
        return cache, pj.ragged_attention(q, cache, max_q_len=1)

    def contiguous(with_lengths):
        def step(key, value):
            key, value = key.at[rows, positions].set(new), value.at[rows, positions].set(new)
            terms = dict(key_value_seq_lengths=positions + 1) if with_lengths else {}
            return key, value, mha_jax.dot_product_attention(q[:, None], key, value, **terms)
        return step

    paged_step = jax.jit(paged, donate_argnums=0)
    steps = {flag: jax.jit(contiguous(flag), donate_argnums=(0, 1)) for flag in (True, False)}

    def run_paged():
        state["paged"], out = paged_step(state["paged"])
        out.block_until_ready()

    def run_contiguous(with_lengths):
        state["key"], state["value"], out = steps[with_lengths](state["key"], state["value"])
        out.block_until_ready()

    held = int((table.pages >= 0).sum()) * ps * 2 * kvh * d * 4
    return {"jax paged": (run_paged, held),
            "jax contiguous, key lengths": (lambda: run_contiguous(True), key.nbytes * 2),
            "jax contiguous, no lengths": (lambda: run_contiguous(False), key.nbytes * 2)}


def torch_steps(shape: dict, lengths: np.ndarray, rng) -> dict:
    """``{name: step}`` of PyTorch's variants; each step appends one token per row."""
    b, h, kvh, d, ps = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "page_size"))
    table, longest = pool(shape, lengths)
    key, value = (torch.from_numpy(rng.standard_normal((b, longest, kvh, d)).astype(np.float32)) for _ in range(2))
    cache = pt.schedule(pt.from_contiguous(key, value, lengths, table), table.append([1] * b))
    q, new = torch.ones(b, h, d), torch.ones(b, kvh, d)
    rows, positions = torch.arange(b), torch.from_numpy(lengths)
    key_t, value_t = key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous()

    def run_paged():
        pt.ragged_attention(q, pt.write(cache, new, new), max_q_len=1)

    def run_contiguous(with_lengths):
        key_t[rows, :, positions], value_t[rows, :, positions] = new, new
        terms = dict(key_value_seq_lengths=positions + 1) if with_lengths else {}
        mha_torch.dot_product_attention(q[:, :, None], key_t, value_t, **terms)

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

    def run_flex():
        pa.assign(rows, positions[:, None], new[:, :, None], new[:, :, None], k_cache, v_cache)
        flex_attention(q[:, :, None], k_cache, v_cache, block_mask=block_mask, enable_gqa=True)

    held = int((table.pages >= 0).sum()) * ps * 2 * kvh * d * 4
    return {"torch paged": (run_paged, held), "torch contiguous, key lengths": (lambda: run_contiguous(True),
                                                                                 key.nbytes * 2),
            "torch contiguous, no lengths": (lambda: run_contiguous(False), key.nbytes * 2),
            "torch PagedAttention (flex, eager)": (run_flex, k_cache.nbytes * 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU-sized shapes")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    shape = CPU if args.cpu else FULL
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(shape["shortest"]), np.log(shape["longest"]), shape["batch"])).astype(np.int64)
    lengths[:2] = shape["shortest"], shape["longest"] - 1
    tokens = int(lengths.sum())
    print(f"shape {shape}, {tokens} tokens cached, lengths {sorted(lengths.tolist())}")
    print("| step | tokens/s | cache bytes | bytes per token held |\n|---|---:|---:|---:|")
    for name, (step, held) in {**jax_steps(shape, lengths, rng), **torch_steps(shape, lengths, rng)}.items():
        seconds = median_of(step, args.reps)
        print(f"| {name} | {shape['batch'] / seconds:,.0f} | {held:,} | {held / tokens:,.0f} |")


if __name__ == "__main__":
    main()
