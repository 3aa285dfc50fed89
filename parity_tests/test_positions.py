"""Positions, windows, segments and lengths: what users bring them for, in both frameworks.

The grid and ``test_blockwise`` check every term against the float64 oracle; here they are
checked against the foreign implementations that take the same arguments (``jax.nn``'s
``local_window_size``/``key_value_seq_lengths``/``is_causal``), and by the identities users
rely on: a chunk of queries at later positions is the matching rows of full causal attention,
and packed sequences equal the sequences run one by one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch

B, T, H, KV, D = 2, 12, 4, 2, 8
JAX_IMPLEMENTATIONS = ("xla", "blockwise")
TORCH_IMPLEMENTATIONS = ("math", "sdpa")


def _qkv(seed=0, q_len=T, kv_len=T):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, q_len, H, D)), rng.normal(size=(B, kv_len, KV, D)), rng.normal(size=(B, kv_len, KV, D)))


def _jax(q, k, v, implementation, **kw):
    return np.asarray(mha_jax.dot_product_attention(*map(jnp.asarray, (q, k, v)), implementation=implementation, **kw))


def _torch(q, k, v, implementation, **kw):
    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))

    kw = {n: torch.from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    return mha_torch.dot_product_attention(t(q), t(k), t(v), implementation=implementation,
                                           **kw).numpy().transpose(0, 2, 1, 3)


@pytest.mark.parametrize("window", [(3, 0), (2, 4), 5])
@pytest.mark.parametrize("causal", [False, True])
def test_window_and_lengths_match_jax_nn(window, causal):
    """``jax.nn.dot_product_attention`` with the same ``local_window_size``, ``is_causal`` and
    ``key_value_seq_lengths``; its float32 softmax bounds the agreement (about 1e-7). Where a
    query sees no key it gives the mean of V, ours 0."""
    q, k, v = _qkv(1)
    lengths = np.array([T, 7])
    theirs = np.asarray(jax.nn.dot_product_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), is_causal=causal, local_window_size=window,
        key_value_seq_lengths=jnp.asarray(lengths, jnp.int32)))
    left, right = (window, window) if isinstance(window, int) else window
    offset = np.arange(T)[None, :] - np.arange(T)[:, None]  # key - query
    seen = (offset >= -left) & (offset <= (0 if causal else right))
    live = (seen[None] & (np.arange(T) < lengths[:, None, None])).any(axis=2)  # (B, T)
    kw = dict(is_causal=causal, local_window_size=window, key_value_seq_lengths=lengths)
    for impl in JAX_IMPLEMENTATIONS + TORCH_IMPLEMENTATIONS:
        ours = (_jax if impl in JAX_IMPLEMENTATIONS else _torch)(q, k, v, impl, **kw)
        np.testing.assert_allclose(ours[live], theirs[live], atol=2e-6, err_msg=impl)
        assert np.all(ours[~live] == 0), impl


def test_a_chunk_at_later_positions_is_those_rows_of_causal_attention():
    """Queries at positions 8..11 over keys 0..11 (chunked prefill, decoding) with ``is_causal``
    and no mask are rows 8..11 of full causal attention, in every implementation."""
    q, k, v = _qkv(2)
    want = _jax(q, k, v, "xla", is_causal=True)[:, 8:]
    chunk = q[:, 8:]
    positions = np.arange(8, T)
    for impl in JAX_IMPLEMENTATIONS:
        np.testing.assert_allclose(_jax(chunk, k, v, impl, is_causal=True, query_positions=positions), want, atol=1e-13)
    for impl in TORCH_IMPLEMENTATIONS:
        np.testing.assert_allclose(_torch(chunk, k, v, impl, is_causal=True, query_positions=positions), want,
                                   atol=1e-13)
    # without positions the same call is top-left aligned: a different (and wrong) answer
    assert np.abs(_jax(chunk, k, v, "xla", is_causal=True) - want).max() > 1e-2


def test_packed_sequences_equal_the_sequences_one_by_one():
    """Three documents packed into one row with segment ids (and positions restarting in each,
    with causality) give what each document gives alone."""
    q, k, v = _qkv(3)
    ids = np.array([0] * 5 + [1] * 4 + [2] * 3)
    positions = np.concatenate([np.arange(5), np.arange(4), np.arange(3)])
    kw = dict(is_causal=True, query_segment_ids=ids, key_segment_ids=ids, query_positions=positions,
              key_positions=positions)
    for impl in JAX_IMPLEMENTATIONS + TORCH_IMPLEMENTATIONS:
        run = _jax if impl in JAX_IMPLEMENTATIONS else _torch
        packed = run(q, k, v, impl, **kw)
        for doc in range(3):
            rows = ids == doc
            alone = run(q[:, rows], k[:, rows], v[:, rows], impl, is_causal=True)
            np.testing.assert_allclose(packed[:, rows], alone, atol=1e-13, err_msg=f"{impl} document {doc}")


def test_a_query_that_sees_no_key_gives_zero():
    """Causality with queries before every key, a window past the keys, a segment of its own and
    a length of 0 each leave a query nothing: exactly 0, in every implementation."""
    q, k, v = _qkv(4)
    cases = {
        "before every key": dict(is_causal=True, query_positions=np.arange(T) - T, key_positions=np.arange(T)),
        "window past the keys": dict(local_window_size=(0, 2), query_positions=np.arange(T) + 100),
        "own segment": dict(query_segment_ids=np.full((B, T), 7), key_segment_ids=np.zeros((B, T), int)),
        "length 0": dict(key_value_seq_lengths=np.array([0, 0])),
    }
    for name, kw in cases.items():
        for impl in JAX_IMPLEMENTATIONS:
            assert np.all(_jax(q, k, v, impl, **kw) == 0), (name, impl)
        for impl in TORCH_IMPLEMENTATIONS:
            assert np.all(_torch(q, k, v, impl, **kw) == 0), (name, impl)


def test_self_attention_keys_default_to_the_query_positions_and_segments():
    """Through a module's self-attention, key positions and segment ids follow the query's;
    given explicitly they give the same; in both frameworks."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(B, T, 16))
    positions = np.stack([rng.permutation(T), np.arange(T) + 5])
    ids = np.stack([np.arange(T) // 4, np.arange(T) // 6])
    kw = dict(is_causal=True, local_window_size=(3, 0))
    ours = mha_jax.MultiHeadAttention(H, 16, num_kv_heads=KV, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    xj = jnp.asarray(x)
    implicit = ours(xj, query_positions=jnp.asarray(positions), query_segment_ids=jnp.asarray(ids), **kw)
    explicit = ours(xj, xj * 1, xj * 1, query_positions=jnp.asarray(positions), key_positions=jnp.asarray(positions),
                    query_segment_ids=jnp.asarray(ids), key_segment_ids=jnp.asarray(ids), **kw)
    np.testing.assert_array_equal(np.asarray(implicit), np.asarray(explicit))
    torch_layer = mha_torch.MultiHeadAttention(16, H, num_kv_heads=KV, dtype=torch.float64)
    mha_torch.load_weights(torch_layer, mha_jax.to_torch(ours))
    xt = torch.from_numpy(x)
    got = torch_layer(xt, query_positions=torch.from_numpy(positions), query_segment_ids=torch.from_numpy(ids), **kw)
    np.testing.assert_allclose(got.detach().numpy(), np.asarray(implicit), atol=1e-13)


def test_cudnn_mapping_through_jax_nn(monkeypatch):
    """The ``"cudnn"`` path hands causality and lengths to ``jax.nn.dot_product_attention`` and
    materialises the rest; with its cuDNN kernel replaced by its XLA one (no GPU here), the
    mapping gives what ``"xla"`` gives, zero rows included."""
    nn_attention = jax.nn.dot_product_attention

    def xla_instead(*args, implementation=None, **kw):
        return nn_attention(*args, implementation="xla", **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_instead)
    # the branch a program lowered for an NVIDIA GPU runs
    monkeypatch.setattr(jax.lax, "platform_dependent", lambda *args, cuda, **_: cuda(*args))
    q, k, v = (x.astype(np.float32) for x in _qkv(6))
    q[:, :3] *= 0  # rows with no key below: lengths 0 in the second batch element
    rng = np.random.default_rng(6)
    cases = [
        dict(is_causal=True),
        dict(is_causal=True, key_value_seq_lengths=np.array([T, 0])),
        dict(is_causal=True, query_positions=np.arange(T) + 2, local_window_size=(4, 0)),
        dict(query_segment_ids=np.arange(T) // 5, key_segment_ids=np.arange(T) // 5,
             mask=rng.random((B, 1, T, T)) < 0.7),
        dict(local_window_size=(1, 2), bias=rng.normal(size=(H, T, T)).astype(np.float32),
             key_value_seq_lengths=np.array([9, 4])),
    ]
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    for kw in cases:
        kw = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
        got = mha_jax.dot_product_attention(*as_bf16, implementation="cudnn", **kw)
        want = mha_jax.dot_product_attention(*as_bf16, implementation="xla", **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2,
                                   err_msg=str(sorted(kw)))
        assert np.array_equal(np.asarray(got) == 0, np.asarray(want) == 0)
