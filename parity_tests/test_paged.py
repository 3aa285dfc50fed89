"""The paged key/value cache (``mha_spec.paged``, ``mha_jax.paged``, ``mha_torch.paged``) against a float64 NumPy
oracle, our contiguous attention, JAX's ``ref_ragged_paged_attention`` and its TPU kernel, PyTorch's
``PagedAttention`` (flex_attention over pages), and the other twin on the same cache."""

import importlib.util
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import mha_jax
import mha_torch
from mha_jax import paged as pj
from mha_spec import paged as paged_spec
from mha_spec.paged import PageTable
from mha_torch import paged as pt
from parity_tests import strategies

NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ, HEADS, HEAD_DIM, TOKENS = 24, 4, 3, 6, 4, 8, 12


def oracle(q, k, v, positions, *, scale=None, left=None, chunk=None, cap=None, sinks=None, slopes=None):
    """float64 attention of ``q`` ``(n, heads, d)`` at ``positions`` over ``k``/``v`` ``(length, kv_heads, d)``
    at positions ``0..length-1``, causal."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, k) * (scale or q.shape[-1] ** -0.5)
    if cap:
        logits = cap * np.tanh(logits / cap)
    kp, qp = np.arange(k.shape[0])[None], np.asarray(positions)[:, None]
    if slopes is not None:
        logits = logits - slopes[:, None, None] * np.abs(qp - kp)
    seen = (kp <= qp) & (kp >= qp - (left if left is not None else 1 << 30))
    if chunk:
        seen &= kp // chunk == qp // chunk
    logits = np.where(seen, logits, -np.inf)
    top = logits.max(-1, keepdims=True) if sinks is None else np.maximum(logits.max(-1, keepdims=True),
                                                                           sinks[:, None, None])
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True) + (0 if sinks is None else np.exp(sinks[:, None, None] - top))
    return np.einsum("hqk,khd->qhd", weights / total, v)


@st.composite
def scenarios(draw):
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    lengths = draw(st.lists(st.integers(1, 20), min_size=MAX_SEQS, max_size=MAX_SEQS))
    chunks = []
    for n in lengths:  # n tokens in chunks of 1 to 4
        sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=n))
        cuts = sorted({min(sum(sizes[:i + 1]), n) for i in range(len(sizes))} | set(range(4, n, 4)) | {n})
        chunks.append(np.diff([0, *cuts]).tolist())
    steps = [[cs[i] if i < len(cs) else 0 for cs in chunks] for i in range(max(map(len, chunks)))]
    terms = dict(left=draw(st.sampled_from([None, 0, 2, 5])), chunk=draw(st.sampled_from([None, 3, 8])),
                 cap=draw(st.sampled_from([None, 2.0])), sinks=draw(st.booleans()), slopes=draw(st.booleans()))
    return kv_heads, steps, terms, draw(st.permutations(range(NUM_PAGES))), draw(st.integers(0, 2**31 - 1))


def release(table, terms):
    """Frees the pages no later query sees, under a window and/or chunks."""
    for s, length in enumerate(table.lengths.tolist()):
        bounds = [length - terms["left"]] if terms["left"] is not None else []
        bounds += [length // terms["chunk"] * terms["chunk"]] if terms["chunk"] else []
        if bounds:
            table.release_before(s, max(bounds))


def ours(terms, sinks, slopes, module):
    """``terms`` as ``dot_product_attention``'s keywords, arrays of ``module`` (jnp or torch)."""
    return dict(local_window_size=None if terms["left"] is None else (terms["left"], 0),
                attention_chunk_size=terms["chunk"], logit_soft_cap=terms["cap"],
                sinks=None if not terms["sinks"] else module.asarray(sinks),
                alibi_slopes=None if not terms["slopes"] else module.asarray(slopes))


@settings(max_examples=strategies.examples(6), deadline=None)
@given(scenarios())
def test_paged_equals_contiguous_and_oracle_float64(scenario):
    """Random page ids, lengths and chunkings (prefill chunks and decode steps in one call), windows, chunks,
    soft-cap, sinks, ALiBi, grouped heads: both twins' paged attention == our contiguous attention == the
    float64 oracle, token by token; both twins' pools bitwise equal after every write (JAX's jitted); pages out of
    sight freed and reused."""
    kv_heads, steps, terms, order, seed = scenario
    rng = np.random.default_rng(seed)
    sinks, slopes = rng.standard_normal(HEADS), rng.uniform(0, 0.5, HEADS)
    table = PageTable(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ)
    table.free = list(order)
    cache, twin = pj.init_cache(table, kv_heads, HEAD_DIM, jnp.float64), pt.init_cache(table, kv_heads, HEAD_DIM,
                                                                                      torch.float64)
    history = np.zeros((2, MAX_SEQS, PAGES_PER_SEQ * PAGE_SIZE, kv_heads, HEAD_DIM))
    for q_lens in steps:
        start, step = table.lengths.copy(), table.append(q_lens)
        cache, twin = pj.schedule(cache, step), pt.schedule(twin, step)
        kv = rng.standard_normal((2, TOKENS, kv_heads, HEAD_DIM))
        q = rng.standard_normal((TOKENS, HEADS, HEAD_DIM))
        cache, twin = jax.jit(pj.write)(cache, *kv), pt.write(twin, *torch.from_numpy(kv))
        np.testing.assert_array_equal(np.asarray(cache.kv_pages), twin.kv_pages.numpy())
        out = np.asarray(pj.ragged_attention(q, cache, max_q_len=4, **ours(terms, sinks, slopes, jnp)))
        out_t = pt.ragged_attention(torch.from_numpy(q), twin, max_q_len=4, **ours(terms, sinks, slopes, torch))
        np.testing.assert_allclose(out_t.numpy(), out, rtol=0, atol=1e-12)
        cu = step["cu_q_lens"]
        queries, positions = np.zeros((MAX_SEQS, 4, HEADS, HEAD_DIM)), np.zeros((MAX_SEQS, 4), np.int64)
        for s, n in enumerate(q_lens):
            history[:, s, start[s]:start[s] + n] = kv[:, cu[s]:cu[s] + n]
            queries[s, :n], positions[s, :n] = q[cu[s]:cu[s] + n], np.arange(start[s], start[s] + n)
        contiguous = mha_jax.dot_product_attention(queries, *history, is_causal=True, query_positions=positions,
                                                   key_value_seq_lengths=table.lengths,
                                                   **ours(terms, sinks, slopes, jnp))
        for s, n in enumerate(q_lens):
            length, got = table.lengths[s], out[cu[s]:cu[s] + n]
            expected = oracle(q[cu[s]:cu[s] + n], history[0, s, :length], history[1, s, :length], positions[s, :n],
                              sinks=sinks if terms["sinks"] else None, slopes=slopes if terms["slopes"] else None,
                              **{k: terms[k] for k in ("left", "chunk", "cap")})
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
            np.testing.assert_allclose(got, np.asarray(contiguous)[s, :n], rtol=0, atol=1e-12)
        np.testing.assert_array_equal(out[cu[len(q_lens)]:], 0)
        release(table, terms)
    assert sorted(table.free + table.pages[table.pages >= 0].tolist()) == list(range(NUM_PAGES))


def seen_pages(kv_len, q_len, page_size, left, chunk):
    """The page slots holding a key one of the last ``q_len`` of ``kv_len`` queries sees (the oracle's mask)."""
    kp, qp = np.arange(kv_len)[None], np.arange(kv_len - q_len, kv_len)[:, None]
    seen = (kp <= qp) & (kp >= qp - (left if left is not None else kv_len))
    if chunk:
        seen &= kp // chunk == qp // chunk
    return sorted(set((np.flatnonzero(seen.any(0)) // page_size).tolist()))


@settings(max_examples=strategies.examples(30), deadline=None)
@given(st.integers(1, 40), st.integers(0, 40), st.integers(1, 8), st.sampled_from([None, 0, 1, 5, 17]),
       st.sampled_from([None, 1, 3, 8, 16]))
def test_page_range_is_the_pages_holding_seen_keys(kv_len, q_len, page_size, left, chunk):
    """``page_range`` is exactly the page slots holding a key some query sees: none past the length, none wholly
    before the first query's window or chunk, none skipped that holds a seen key, none for a sequence without
    queries."""
    q_len = min(q_len, kv_len)
    first, end = paged_spec.page_range(kv_len, q_len, page_size, None if left is None else (left, 0), chunk, max)
    assert list(range(first, end)) == seen_pages(kv_len, q_len, page_size, left, chunk)


@st.composite
def pools(draw):
    """A pool of shuffled pages with random values, 3 sequences of random lengths and query counts, terms."""
    kv_heads, page_size = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 4, 8]))
    kv_lens = [draw(st.integers(0 if s == 2 else 1, PAGES_PER_SEQ * page_size)) for s in range(MAX_SEQS)]
    q_lens = [draw(st.integers(min(n, 1), min(n, 4))) for n in kv_lens]
    terms = dict(left=draw(st.sampled_from([None, 0, 3, 9])), chunk=draw(st.sampled_from([None, 5, 8])),
                 cap=draw(st.sampled_from([None, 2.0])), sinks=draw(st.booleans()),
                 slopes=draw(st.sampled_from([False, (HEADS,), (MAX_SEQS, HEADS)])))
    seed, block_pages = draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([1, 2, 32]))  # pages per key block
    return kv_heads, page_size, kv_lens, q_lens, terms, seed, block_pages


@settings(max_examples=strategies.examples(8), deadline=None)
@given(pools())
@example((2, 4, [20, 13, 0], [1, 4, 0], dict(left=3, chunk=None, cap=2.0, sinks=True, slopes=(HEADS,)), 0, 2))
@example((1, 4, [7, 12, 3], [1, 2, 1], dict(left=None, chunk=5, cap=None, sinks=False, slopes=(MAX_SEQS, HEADS)), 1,
          1))
def test_in_place_reads_only_the_pages_it_must(pool):
    """float64, prefill chunks and decode steps at random lengths over shuffled pages, ALiBi slopes per head or per
    sequence and head: every pool slot that holds no key a query sees (whole pages outside the lengths, windows and
    chunks, other sequences' pages, free pages, slots past a length) is NaN, and both twins still equal the float64
    oracle and each other (1e-12): a page read that holds no seen key would bring its NaN values in. PyTorch's
    twin reads 1, 2 or 32 pages as one key block (``mha_torch.testing.tuned(paged_block_pages=)``)."""
    kv_heads, page_size, kv_lens, q_lens, terms, seed, block_pages = pool
    rng = np.random.default_rng(seed)
    sinks, slopes = rng.standard_normal(HEADS), rng.uniform(0, 0.5, terms["slopes"] or HEADS)
    kv_lens, q_lens = np.array(kv_lens, np.int32), np.array(q_lens)
    page_indices = rng.permutation(NUM_PAGES * 2)[:MAX_SEQS * PAGES_PER_SEQ].reshape(MAX_SEQS, -1).astype(np.int32)
    pool_values = rng.standard_normal((NUM_PAGES * 2, page_size, 2 * kv_heads, HEAD_DIM))
    poisoned = np.full_like(pool_values, np.nan)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    for s in np.flatnonzero(q_lens):
        for j in seen_pages(kv_lens[s], q_lens[s], page_size, terms["left"], terms["chunk"]):
            held = min(page_size, kv_lens[s] - j * page_size)
            poisoned[page_indices[s, j], :held] = pool_values[page_indices[s, j], :held]
    q = rng.standard_normal((TOKENS, HEADS, HEAD_DIM))
    step = (kv_lens, page_indices, cu, np.array([MAX_SEQS], np.int32))
    out = np.asarray(pj.ragged_attention(q, pj.PagedKVCache(*map(jnp.asarray, (poisoned, *step))), max_q_len=4,
                                         **ours(terms, sinks, slopes, jnp)))
    with mha_torch.testing.tuned(paged_block_pages=block_pages):
        twin = pt.ragged_attention(torch.from_numpy(q), pt.PagedKVCache(*map(torch.from_numpy, (poisoned, *step))),
                                   max_q_len=4, **ours(terms, sinks, slopes, torch)).numpy()
    np.testing.assert_allclose(twin, out, rtol=0, atol=1e-12)
    kv = pool_values[page_indices].reshape(MAX_SEQS, -1, 2 * kv_heads, HEAD_DIM)
    rows = np.broadcast_to(slopes, (MAX_SEQS, HEADS))  # (heads,) or (max_seqs, heads): one row per sequence
    for s in np.flatnonzero(q_lens):
        n, length = q_lens[s], kv_lens[s]
        expected = oracle(q[cu[s]:cu[s] + n], kv[s, :length, 0::2], kv[s, :length, 1::2], np.arange(length - n, length),
                          sinks=sinks if terms["sinks"] else None, slopes=rows[s] if terms["slopes"] else None,
                          **{k: terms[k] for k in ("left", "chunk", "cap")})
        np.testing.assert_allclose(out[cu[s]:cu[s] + n], expected, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(out[cu[-1]:], 0)


def test_window_releases_pages_for_reuse():
    """A window of 3 keys: two sequences decode 40 tokens each from a pool of 6 pages of 4 (20 pages' worth of
    tokens without release), every output equal to the oracle's."""
    rng = np.random.default_rng(0)
    table, left = PageTable(6, 4, 2, 10), 3
    cache, keys = pj.init_cache(table, 2, HEAD_DIM, jnp.float64), np.zeros((2, 2, 40, 2, HEAD_DIM))
    for i in range(40):
        cache = pj.schedule(cache, table.append([1, 1]))
        kv, q = rng.standard_normal((2, 2, 2, HEAD_DIM)), rng.standard_normal((2, HEADS, HEAD_DIM))
        keys[:, :, i] = kv
        cache = pj.write(cache, *kv)
        out = pj.ragged_attention(q, cache, max_q_len=1, local_window_size=(left, 0))
        for s in range(2):
            expected = oracle(q[s:s + 1], keys[0, s, :i + 1], keys[1, s, :i + 1], [i], left=left)
            np.testing.assert_allclose(np.asarray(out)[s:s + 1], expected, rtol=0, atol=1e-12)
            table.release_before(s, i + 1 - left)
    assert (table.pages >= 0).sum(1).tolist() == [1, 1]  # positions 36..39: page 9


def reference_inputs(kv_heads, seed=0, dtype=np.float32, head_dim=HEAD_DIM, page_size=PAGE_SIZE):
    """``ref_ragged_paged_attention``'s inputs: 3 live sequences of 4 (a prefill of 9 queries over 9 keys, a chunk
    of 4 over 23, a decode step over 17), 2 padding tokens; page ids shuffled over the pool."""
    rng = np.random.default_rng(seed)
    kv_lens, q_lens = np.array([9, 23, 17, 0], np.int32), np.array([9, 4, 1, 0])
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    page_indices = rng.permutation(NUM_PAGES)[:4 * PAGES_PER_SEQ].reshape(4, PAGES_PER_SEQ).astype(np.int32)
    kv_pages = rng.standard_normal((NUM_PAGES, page_size, 2 * kv_heads, head_dim)).astype(dtype)
    queries = rng.standard_normal((16, HEADS, head_dim)).astype(dtype)  # 2 padding tokens
    return queries, kv_pages, kv_lens, page_indices, cu_q_lens, np.array([3], np.int32)


REFERENCE_OPTIONS = {"none": {}, "sliding_window": dict(sliding_window=5), "soft_cap": dict(soft_cap=2.5),
                     "k_scale,v_scale": dict(k_scale=0.5, v_scale=2.0),
                     "all": dict(sliding_window=3, soft_cap=4.0, k_scale=1.5, v_scale=0.25)}


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("option", sorted(REFERENCE_OPTIONS))
def test_ragged_paged_attention_reference(option, kv_heads):
    """JAX's ``ref_ragged_paged_attention`` on its own inputs, float32, with each of its options: both twins
    equal it (its ``sliding_window=w`` is our ``local_window_size=(w - 1, 0)``; its ``k_scale``/``v_scale``
    dequantize the pool, which ours reads already scaled); under ``jax.jit`` too; and so do the pages gathered for a
    named implementation (JAX's ``"xla"``, PyTorch's ``"math"``)."""
    options, (queries, kv_pages, *step) = REFERENCE_OPTIONS[option], reference_inputs(kv_heads)
    expected = np.asarray(rpa.ref_ragged_paged_attention(queries, kv_pages, *step, sm_scale=0.3, **options))
    scaled = kv_pages * np.tile([options.get("k_scale", 1.0), options.get("v_scale", 1.0)], kv_heads)[:, None]
    cache = pj.PagedKVCache(jnp.asarray(scaled.astype(np.float32)), *map(jnp.asarray, step))
    window = options.get("sliding_window")
    terms = dict(scale=0.3, logit_soft_cap=options.get("soft_cap"), local_window_size=window and (window - 1, 0))
    got = pj.ragged_attention(jnp.asarray(queries), cache, **terms)
    jitted = jax.jit(lambda q, c: pj.ragged_attention(q, c, max_q_len=9, **terms))(jnp.asarray(queries), cache)
    twin = pt.ragged_attention(torch.from_numpy(queries), pt.convert(cache), max_q_len=9, **terms)
    gathered = [pj.ragged_attention(jnp.asarray(queries), cache, max_q_len=9, implementation="xla", **terms),
                pt.ragged_attention(torch.from_numpy(queries), pt.convert(cache), implementation="math", **terms)]
    valid = int(step[2][step[3][0]])
    for out in (np.asarray(got), np.asarray(jitted), twin.numpy(), *map(np.asarray, gathered)):
        np.testing.assert_allclose(out[:valid], expected[:valid], rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(out[valid:], 0)


def test_conversions_are_bitwise():
    """A cache moves between the twins as it is, both ways; ``from_contiguous`` of our contiguous cache holds
    each row's keys and values at their positions (read back through the page table); ``split_pages`` is
    vLLM's layout in both."""
    queries, kv_pages, *step = reference_inputs(2)
    cache = pj.PagedKVCache(*map(jnp.asarray, (kv_pages, *step)))
    for a, b in zip(pj.convert(pt.convert(cache)), cache):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(pj.split_pages(cache), pt.split_pages(pt.convert(cache))):
        np.testing.assert_array_equal(np.asarray(a), b.numpy())
    rng, lengths = np.random.default_rng(1), np.array([7, 0, 13])
    key, value = rng.standard_normal((2, 3, 16, 2, HEAD_DIM))
    tables = [PageTable(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ) for _ in range(2)]
    for table in tables:
        table.free = list(rng.permutation(NUM_PAGES))
    tables[1].free = list(tables[0].free)
    paged = pj.from_contiguous(jnp.asarray(key), jnp.asarray(value), lengths, tables[0])
    twin = pt.from_contiguous(torch.from_numpy(key), torch.from_numpy(value), torch.from_numpy(lengths), tables[1])
    np.testing.assert_array_equal(np.asarray(paged.kv_pages), twin.kv_pages.numpy())
    pages = np.asarray(paged.kv_pages)[tables[0].pages.clip(0)].reshape(MAX_SEQS, -1, 4, HEAD_DIM)
    for s, n in enumerate(lengths):
        np.testing.assert_array_equal(pages[s, :n, 0::2], key[s, :n])
        np.testing.assert_array_equal(pages[s, :n, 1::2], value[s, :n])
    for twin, module in ((pj, jnp.asarray), (pt, torch.from_numpy)):
        fresh = PageTable(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ)
        for wrong in ((key, value[:, :8], lengths), (key, value, np.array([7, 0, 17])), (key, value, lengths[:2])):
            with pytest.raises(ValueError, match="from_contiguous needs key and value"):
                twin.from_contiguous(module(wrong[0]), module(wrong[1]), wrong[2], fresh)
        with pytest.raises(ValueError, match="a table with those rows empty"):  # a table already holding row 0
            twin.from_contiguous(module(key), module(value), lengths, tables[0] if twin is pj else tables[1])


def flex_paged(queries, key, value, lengths, q_lens, *, left, cap, slopes, scale):
    """PyTorch's ``PagedAttention``: its pages (shuffled) filled by its ``assign``, sequence by sequence, and
    ``flex_attention`` over them with its converted block mask and score_mod; ``(its k_cache, v_cache, its page
    table, output (batch, heads, max_q, head_dim))``."""
    batch, kv_heads, _, head_dim = key.shape
    pa = PagedAttention(NUM_PAGES, PAGE_SIZE, batch, device="cpu")
    pa.empty_pages = np.random.default_rng(2).permutation(NUM_PAGES).tolist()
    k_cache, v_cache = (torch.zeros(1, kv_heads, NUM_PAGES * PAGE_SIZE, head_dim) for _ in range(2))
    for b, n in enumerate(lengths.tolist()):
        pa.reserve(torch.tensor(b), torch.tensor(n))
        pa.assign(torch.tensor([b]), torch.arange(n)[None], key[b:b + 1, :, :n], value[b:b + 1, :, :n], k_cache,
                  v_cache)

    def visible(b, h, q_idx, kv_idx):
        position = lengths[b] - q_lens[b] + q_idx
        return (kv_idx <= position) & (kv_idx >= position - left) & (kv_idx < lengths[b])

    def score(logit, b, h, q_idx, kv_idx):
        return cap * torch.tanh(logit / cap) - slopes[h] * (lengths[b] - q_lens[b] + q_idx - kv_idx).abs()

    logical = create_block_mask(visible, batch, None, queries.shape[2], PAGES_PER_SEQ * PAGE_SIZE, device="cpu",
                                BLOCK_SIZE=PAGE_SIZE)
    out = flex_attention(queries, k_cache, v_cache, score_mod=pa.get_score_mod(score, lengths), scale=scale,
                         block_mask=pa.convert_logical_block_mask(logical, kv_len=lengths), enable_gqa=True)
    return k_cache, v_cache, pa.page_table, out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_torch_paged_attention():
    """PyTorch's ``PagedAttention`` (flex_attention over pages, eager on this CPU), float32, grouped heads, a
    window, soft-cap and ALiBi: its ``assign`` and our ``write`` lay the same pages out alike (bitwise, through
    ``split_pages``), and its flex_attention over them equals our ragged attention over its page table."""
    rng = np.random.default_rng(3)
    lengths, q_lens, kv_heads = torch.tensor([9, 23, 17]), torch.tensor([9, 4, 1]), 2
    key, value = (torch.from_numpy(rng.standard_normal((3, kv_heads, 24, HEAD_DIM)).astype(np.float32))
                  for _ in range(2))
    queries = torch.from_numpy(rng.standard_normal((3, HEADS, 9, HEAD_DIM)).astype(np.float32))
    slopes = torch.tensor([0.0, 0.1, 0.2, 0.4])
    k_cache, v_cache, page_table, expected = flex_paged(queries, key, value, lengths, q_lens, left=5, cap=3.0,
                                                        slopes=slopes, scale=0.3)
    table = PageTable(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ)
    cache = pt.init_cache(table, kv_heads, HEAD_DIM, torch.float32)
    step = dict(kv_lens=lengths, page_indices=page_table[:, :PAGES_PER_SEQ].clip(min=0),
                cu_q_lens=torch.cat([torch.zeros(1), lengths.cumsum(0)]), num_seqs=torch.tensor([3]))
    packed = [torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths.tolist())]) for x in (key, value)]
    cache = pt.write(pt.schedule(cache, step), *packed)
    for ours_pages, theirs in zip(pt.split_pages(cache), (k_cache, v_cache)):
        assert torch.equal(ours_pages.reshape(kv_heads, -1, HEAD_DIM), theirs[0])
    cache = pt.schedule(cache, dict(step, cu_q_lens=torch.cat([torch.zeros(1), q_lens.cumsum(0)])))
    packed_q = torch.cat([queries[b, :, :n].transpose(0, 1) for b, n in enumerate(q_lens.tolist())])
    got = pt.ragged_attention(packed_q, cache, scale=0.3, local_window_size=(5, 0), logit_soft_cap=3.0,
                              alibi_slopes=slopes)
    want = torch.cat([expected[b, :, :n].transpose(0, 1) for b, n in enumerate(q_lens.tolist())])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn calls aten::_flash_attention_forward, which has "
                    "no CPU kernel (NotImplementedError on the 'CPU' backend)")
def test_torch_varlen_attn_over_pages():
    """PyTorch's ``varlen_attn`` with ``block_table`` (flash-attention over pages, CUDA only), float16: our
    ragged attention over the same pool (vLLM's per-head pages transposed to its ``(pages, page_size, kv_heads,
    head_dim)``) equals it."""
    from torch.nn.attention.varlen import varlen_attn

    queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = reference_inputs(2)
    cache = pt.convert(pj.PagedKVCache(kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
    cache = pt.PagedKVCache(*(t.cuda() for t in cache))._replace(kv_pages=cache.kv_pages.cuda().half())
    k_pages, v_pages = (p.permute(1, 2, 0, 3).contiguous() for p in pt.split_pages(cache))
    q = torch.from_numpy(queries).cuda().half()
    n = int(cu_q_lens[3])
    out = varlen_attn(q[:n], k_pages, v_pages, cache.cu_q_lens[:4], None, 9, 24, window_size=(-1, 0), scale=0.3,
                      enable_gqa=True, seqused_k=cache.kv_lens[:3], block_table=cache.page_indices[:3])
    torch.testing.assert_close(pt.ragged_attention(q, cache, scale=0.3)[:n], out, rtol=2e-3, atol=2e-3)


def test_bad_input_names_the_argument_and_shapes():
    """Alike in both twins: lengths beyond the pages held, a page table too short, a full pool, more queries than
    ``max_q_len``, a sequence with more queries than keys, keys of the wrong shape, a term a ragged call does not
    take, queries of another dtype than the pool."""
    queries, kv_pages, *step = reference_inputs(2)
    table = PageTable(3, PAGE_SIZE, 2, 2)
    with pytest.raises(ValueError, match=r"length 9 needs 3 pages, but the page table holds 2"):
        table.append([9, 1])
    table.append([4, 0])
    with pytest.raises(ValueError, match=r"needs 3 new pages but 2 of 3 are free"):
        table.append([4, 8])
    bad = [
        ("kv_lens", np.array([9, 25, 17, 0], np.int32),
         r"kv_lens \[9, 25, 17, 0\] go beyond the pages held: page_indices \(4, 6\) of page_size 4 hold 24"),
        ("kv_lens", np.array([9, 3, 17, 0], np.int32), r"more queries \(cu_q_lens .*\) than keys \(kv_lens"),
        ("page_indices", step[1][:, :5], r"go beyond the pages held: page_indices \(4, 5\) of page_size 4 hold 20"),
        ("page_indices", step[1][:3], r"kv_lens \(4,\), page_indices \(3, 6\), cu_q_lens \(5,\), num_seqs \(1,\)"),
        ("page_indices", step[1] + NUM_PAGES, r"page_indices must be in \[0, num_pages 24\)"),
    ]
    for twin, module in ((pj, jnp.asarray), (pt, torch.from_numpy)):
        cache = twin.PagedKVCache(*map(module, (kv_pages, *step)))
        q, kv = module(queries), module(queries[:, :2])
        for name, value, message in bad:
            broken = cache._replace(**{name: module(value)})
            with pytest.raises(ValueError, match=message):
                twin.ragged_attention(q, broken)
            with pytest.raises(ValueError, match=message):
                twin.write(broken, kv, kv)
        with pytest.raises(ValueError, match=r"a sequence has 9 queries, more than max_q_len 4"):
            twin.ragged_attention(q, cache, max_q_len=4)
        with pytest.raises(ValueError, match=r"keys must be packed \(total_q, heads, head_dim\) with heads 2 and "
                           r"head_dim 8 \(kv_pages \(24, 4, 4, 8\)\), got \(16, 4, 8\)"):
            twin.write(cache, q, q)
        with pytest.raises(TypeError, match=r"not \['mask'\]"):
            twin.ragged_attention(q, cache, mask=None)
        with pytest.raises(TypeError, match=r"queries and kv_pages must have one dtype, got float64 and float32"):
            twin.ragged_attention(module(queries.astype(np.float64)), cache)


def compile_for_v5e() -> dict:
    """JAX's TPU kernel ``ragged_paged_attention`` and our ragged attention (jitted, float32, the reference's
    inputs but head_dim 128, the kernel's lanes), compiled by libtpu for one chip of a described
    v5e topology; whether each compiled and holds the kernel; ours also with sinks, which the kernel lacks."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, SingleDeviceSharding

    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in reference_inputs(2, head_dim=128)]
    kernel = jax.jit(lambda *a: rpa.ragged_paged_attention(*a, sm_scale=0.3, sliding_window=5, soft_cap=2.5,
                                                            num_kv_pages_per_block=2, num_queries_per_block=8))
    ragged = jax.jit(lambda q, *step: pj.ragged_attention(q, pj.PagedKVCache(*step), max_q_len=9, scale=0.3,
                                                          local_window_size=(4, 0), logit_soft_cap=2.5))
    sinks = jax.jit(lambda q, *step: pj.ragged_attention(q, pj.PagedKVCache(*step), max_q_len=9, scale=0.3,
                                                         sinks=jnp.zeros(HEADS, jnp.float32)))
    found = {}
    with jax.set_mesh(Mesh(np.array([device]), ("x",))):  # the Pallas lowering reads the chip from the mesh
        for name, function in (("kernel", kernel), ("ours", ragged), ("ours with sinks", sinks)):
            text = function.lower(*args).compile().as_text()
            found[name] = dict(compiled=True, tpu_kernel="tpu_custom_call" in text)
    return found


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the test extra) is not installed")
def test_tpu_kernel_compiles_for_v5e():
    """The TPU kernel (block sizes given: off a TPU its tuned table refuses, "TPU version must be 4 or higher")
    and our ragged attention both compile for TPU v5e on this CPU host; ours calls the kernel where it takes the
    terms (a window, a soft cap), and runs its own page loop with sinks."""
    from benchmarks import tpu_memory

    code = "import json; from parity_tests import test_paged as t; print(json.dumps(t.compile_for_v5e()))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=tpu_memory.child_env(),
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == {"kernel": dict(compiled=True, tpu_kernel=True), "ours": dict(compiled=True, tpu_kernel=True),
                     "ours with sinks": dict(compiled=True, tpu_kernel=False)}


def test_tpu_kernel_in_interpret_mode():
    """The TPU kernel in Pallas's TPU interpret mode on this CPU (without float64, where it mixes int32 and int64)
    equals its reference; expected to fail where the interpreter cannot read the kernel's reshaped refs (JAX 0.10.2:
    "'ReshapeTransform' object has no attribute 'indices'")."""
    from jax.experimental.pallas import tpu as pltpu

    queries, kv_pages, *step = reference_inputs(2, head_dim=128)
    expected = rpa.ref_ragged_paged_attention(queries, kv_pages, *step, sm_scale=0.3, sliding_window=5)
    try:
        with pltpu.force_tpu_interpret_mode(), jax.enable_x64(False):
            got = rpa.ragged_paged_attention(queries, kv_pages, *step, sm_scale=0.3, sliding_window=5,
                                             num_kv_pages_per_block=2, num_queries_per_block=8).block_until_ready()
    except jax.errors.JaxRuntimeError as error:
        if "'ReshapeTransform' object has no attribute 'indices'" not in str(error):
            raise
        pytest.xfail("Pallas's TPU interpreter cannot read the kernel's reshaped refs (ReshapeTransform)")
    np.testing.assert_allclose(np.asarray(got)[:14], np.asarray(expected)[:14], rtol=2e-5, atol=2e-6)


# three sequences of 7, 4 and 6 tokens served in mixed steps: prefill chunks and single tokens together, the third
# joining late (each row: the new tokens of each sequence)
SERVED = ((3, 2, 0), (2, 1, 4), (1, 1, 2), (1, 0, 0))
MODULE_TERMS = dict(num_kv_heads=2, normalize_qk=mha_jax.QKNorm("rms", eps=1e-6), local_window_size=(3, 0),
                    logit_soft_cap=5.0, use_sinks=True, output_gate="head")


def _served(step_fn, x, table: PageTable, cache, schedule):
    """Each sequence's outputs ``(length, out)`` from ``step_fn(packed inputs, cache, max_q_len) -> (out, cache)``
    over ``SERVED``; ``x``: each sequence's inputs."""
    done, outs = [0] * len(x), [[] for _ in x]
    for q_lens in SERVED:
        cache = schedule(cache, table.append(q_lens))
        packed = np.concatenate([x[s][done[s]:done[s] + n] for s, n in enumerate(q_lens)])
        out, cache = step_fn(packed, cache, max(q_lens))
        for s, (start, n) in enumerate(zip(np.cumsum((0, *q_lens))[:-1], q_lens)):
            outs[s].append(np.asarray(out)[start:start + n])
            done[s] += n
    return [np.concatenate(o) for o in outs]


def test_a_module_s_paged_steps_equal_its_full_pass_over_each_sequence_in_both_twins():
    """``MultiHeadAttention.paged_step`` (rotary, grouped heads, RMS QK-norm, a window of 4 keys, soft-cap, sinks,
    a gate per head): every token's output over ``SERVED`` equals the module's own causal pass over its whole
    sequence, float64, in both twins from the same weights."""
    e, heads = 32, 4
    torch.manual_seed(0)
    theirs = mha_torch.MultiHeadAttention(e, heads, rotary=mha_torch.RotaryEmbedding(8), dtype=torch.float64,
                                          **MODULE_TERMS).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(n, e)) for n in np.sum(SERVED, axis=0)]
    with torch.no_grad():
        whole = [theirs(torch.tensor(xs)[None], is_causal=True)[0].numpy() for xs in x]
        table = PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ)
        cache = pt.init_cache(table, 2, 8, torch.float64)
        torch_out = _served(lambda inputs, cache, n: theirs.paged_step(torch.tensor(inputs), cache, max_q_len=n),
                            x, table, cache, pt.schedule)
    assert max(np.abs(t - w).max() for t, w in zip(torch_out, whole)) < 1e-12
    with jax.enable_x64(True):
        ours = mha_jax.MultiHeadAttention(heads, e, rotary=mha_jax.RotaryEmbedding(8), param_dtype=jnp.float64,
                                          rngs=nnx.Rngs(0), **MODULE_TERMS)
        mha_jax.load_weights(ours, {k: v.numpy() for k, v in theirs.state_dict().items()})
        table = PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ)
        step = nnx.jit(lambda module, inputs, cache, n: module.paged_step(inputs, cache, max_q_len=n),
                       static_argnums=3)
        jax_out = _served(lambda inputs, cache, n: step(ours, jnp.asarray(inputs), cache, n), x, table,
                          pj.init_cache(table, 2, 8, jnp.float64), pj.schedule)
        linen_out = [_served(fn, x, fresh, pj.init_cache(fresh, 2, 8, jnp.float64), pj.schedule)
                     for fn in _linen_steps(heads, {k: v.numpy() for k, v in theirs.state_dict().items()})
                     for fresh in [PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ)]]
    for served in (jax_out, *linen_out):
        assert max(np.abs(j - t).max() for j, t in zip(served, torch_out)) < 1e-12


def _linen_steps(heads: int, state: dict) -> list:
    """linen's ``paged_step`` as ``(inputs, cache, max_q_len) -> (out, cache)``, jitted: through ``apply``'s
    ``method``, and called by a parent module's compact method."""
    from flax import linen as nn

    layer = dict(rotary=mha_jax.RotaryEmbedding(8), param_dtype=jnp.float64, dtype=jnp.float64, **MODULE_TERMS)
    params = mha_jax.from_torch(state, num_heads=heads, num_kv_heads=MODULE_TERMS["num_kv_heads"])

    class Block(nn.Module):
        @nn.compact
        def __call__(self, inputs, cache, n):
            return mha_jax.linen.MultiHeadDotProductAttention(heads, name="attn", **layer).paged_step(
                inputs, cache, max_q_len=n)

    direct = jax.jit(lambda inputs, cache, n: mha_jax.linen.MultiHeadDotProductAttention(heads, **layer).apply(
        {"params": params}, inputs, cache, max_q_len=n, method="paged_step"), static_argnums=2)
    parent = jax.jit(lambda inputs, cache, n: Block().apply({"params": {"attn": params}}, inputs, cache, n),
                     static_argnums=2)
    return [lambda inputs, cache, n, f=f: f(jnp.asarray(inputs), cache, n) for f in (direct, parent)]


def test_the_serving_example_gives_each_request_the_tokens_it_gets_alone():
    """``examples/serve.py``: five requests of 2 to 9 prompt tokens served 3 at a time from 16 pages (prompts read
    while others decode, pages released and reused): each request's greedy tokens are those of decoding it alone
    with a contiguous cache."""
    import pathlib
    import runpy

    example = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "serve.py"))
    model, rng = example["Decoder"](), np.random.default_rng(1)
    requests = [(rng.integers(0, 64, size=n).tolist(), new) for n, new in ((6, 4), (1, 7), (9, 2), (4, 5))]
    served, steps = example["serve"](model, requests)
    assert served == [example["alone"](model, prompt, new) for prompt, new in requests]
    assert steps < sum(new for _, new in requests)  # sequences shared steps


def test_a_layer_s_paged_step_refuses_inputs_of_another_shape_alike():
    table = PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ)
    layers = [(mha_jax.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0)), pj.init_cache(table, 4, 8, jnp.float32), jnp),
              (mha_torch.MultiHeadAttention(32, 4), pt.init_cache(table, 4, 8, torch.float32), torch)]
    for layer, cache, xp in layers:
        cache = (pj if xp is jnp else pt).schedule(cache, PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ).append([3]))
        for inputs in (xp.ones((3, 16)), xp.ones((1, 3, 32))):
            with pytest.raises(ValueError, match=rf"paged_step takes inputs \(total_q, 32\), the packed tokens .*, "
                                                 rf"got {re.escape(str(tuple(inputs.shape)))}"):
                layer.paged_step(inputs, cache)
    cache, key = layers[0][1], jax.random.key(0)
    linen = mha_jax.linen.MultiHeadDotProductAttention(4)
    variables = linen.init(key, jnp.ones((3, 32), jnp.float32), cache, method="paged_step")
    for inputs in (jnp.ones((3, 16), jnp.float32), jnp.ones((1, 3, 32), jnp.float32)):
        with pytest.raises(ValueError, match=rf"paged_step takes inputs \(total_q, 32\), the packed tokens .*, "
                                             rf"got {re.escape(str(inputs.shape))}"):
            linen.apply(variables, inputs, cache, method="paged_step")
    latent = mha_jax.Latent(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    wrong = "paged_step: this layer's pages hold {} (init_cache(table, {}, dtype)), got kv_pages (24, 2, 8, 8)"
    for (_, cache, xp), layer in zip(layers, (mha_jax.MultiHeadAttention(4, 32, latent=latent, rngs=nnx.Rngs(0)),
                                               mha_torch.MultiHeadAttention(32, 4, latent=latent))):
        with pytest.raises(ValueError, match=re.escape(wrong.format("1 key/value head of 12", "1, 12"))):
            layer.paged_step(xp.ones((3, 32), dtype=xp.float32), cache)
    with pytest.raises(ValueError, match=re.escape(wrong.format("4 key/value heads of 4", "4, 4"))):
        mha_jax.linen.MultiHeadDotProductAttention(4, qkv_features=16).init(key, jnp.ones((3, 32), jnp.float32), cache,
                                                                         method="paged_step")


def test_gradients_through_a_write_and_a_ragged_call_equal_the_contiguous_ones():
    """With autograd recording (a step trained through a paged cache), the gradients of the queries, keys and values
    through ``write`` then ``ragged_attention`` (prefills of 5 and 3 in one call, shuffled pages; PyTorch's page
    loop one page a block; JAX's loop is forward only, so its ``"xla"``) equal those of our contiguous causal
    attention over each sequence, float64; and the queries' alone over a cache written without gradients (the
    blocks autograd keeps are not overwritten by the next)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((8, HEADS, HEAD_DIM))
    k, v = rng.standard_normal((2, 8, 2, HEAD_DIM))
    weights, order = rng.standard_normal(q.shape), list(rng.permutation(NUM_PAGES))

    def scheduled(twin, dtype):
        table = PageTable(NUM_PAGES, PAGE_SIZE, MAX_SEQS, PAGES_PER_SEQ)
        table.free = list(order)
        return twin.schedule(twin.init_cache(table, 2, HEAD_DIM, dtype), table.append([5, 3, 0]))

    def contiguous(q, k, v):
        outs = [mha_jax.dot_product_attention(q[None, a:b], k[None, a:b], v[None, a:b], is_causal=True)[0]
                for a, b in ((0, 5), (5, 8))]
        return jnp.sum(jnp.concatenate(outs) * weights)

    def paged(q, k, v):
        cache = pj.write(scheduled(pj, jnp.float64), k, v)
        return jnp.sum(pj.ragged_attention(q, cache, max_q_len=5, implementation="xla") * weights)

    expected = jax.grad(contiguous, argnums=(0, 1, 2))(q, k, v)
    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    with mha_torch.testing.tuned(paged_block_pages=1):
        out = pt.ragged_attention(tensors[0], pt.write(scheduled(pt, torch.float64), *tensors[1:]), max_q_len=5)
    (out * torch.from_numpy(weights)).sum().backward()
    for got, jax_got, want in zip(tensors, jax.grad(paged, argnums=(0, 1, 2))(q, k, v), expected):
        np.testing.assert_allclose(got.grad.numpy(), want, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(jax_got), want, rtol=0, atol=1e-12)
    queries = torch.tensor(q, requires_grad=True)
    with torch.no_grad():
        cache = pt.write(scheduled(pt, torch.float64), torch.from_numpy(k), torch.from_numpy(v))
    with mha_torch.testing.tuned(paged_block_pages=1):
        (pt.ragged_attention(queries, cache, max_q_len=5) * torch.from_numpy(weights)).sum().backward()
    np.testing.assert_allclose(queries.grad.numpy(), expected[0], rtol=0, atol=1e-12)
