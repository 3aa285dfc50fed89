"""The blockwise implementation across many small blocks (odd lengths, padded last blocks,
causal skipping, grouped heads, every mask form, bias gradients) against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from mha_jax import testing
from mha_jax.testing import blockwise as _blockwise
from parity_tests.tool import harness, oracle

B, H, HK, Q, K, D = 2, 6, 2, 9, 11, 5


@pytest.fixture
def tiny_blocks():
    """Forward blocks of 4 queries x 3 keys (3 x 4 blocks), backward blocks of 2 x 4 (5 x 3):
    the last of each padded, and the backward re-blocked."""
    with testing.tuned(blocks=(4, 3), backward_blocks=(2, 4)):
        yield


def _case(name, rng):
    """(mask, is_causal, keep, structured terms) of a named case."""
    # queries 4..12 over keys 0..10 (a chunk after a prefix), and positions out of order
    chunk = dict(query_positions=np.arange(Q)[None] + 4, key_positions=np.arange(K)[None])
    shuffled = dict(query_positions=np.stack([rng.permutation(Q) * 2, np.arange(Q)]),
                    key_positions=np.stack([rng.permutation(K), np.arange(K) + 3]))
    segments = dict(query_segment_ids=np.stack([np.arange(Q) * 3 // Q, np.arange(Q) // 5]),
                    key_segment_ids=np.stack([np.arange(K) * 3 // K, np.arange(K) // 7]))
    return {
        "none": (None, False, None, {}),
        "causal": (None, True, None, {}),
        "bool+causal": (rng.random((B, H, Q, K)) < 0.6, True, None, {}),
        "padding-float": (np.where(rng.random((B, 1, 1, K)) < 0.7, 0.0, -np.inf), False, None, {}),
        "bias-per-head+causal": (rng.normal(size=(1, H, Q, K)), True, None, {}),
        "bias-keys": (rng.normal(size=(K,)), False, None, {}),
        "dropout-mask+causal": (None, True, rng.random((B, H, Q, K)) < 0.7, {}),
        "fully-masked": (np.concatenate([np.zeros((1, H, Q, K), bool), rng.random((1, H, Q, K)) < 0.5]), False, None,
                         {}),
        "chunk+causal": (None, True, None, chunk),
        "shuffled+window": (None, False, None, dict(shuffled, window=(3, 2))),
        "window+causal": (None, True, None, dict(window=(2, 2))),
        "segments": (None, False, None, segments),
        "lengths+causal": (None, True, None, dict(lengths=np.array([K, 5]))),
        "everything": (rng.random((B, 1, Q, K)) < 0.8, True, rng.random((B, H, Q, K)) < 0.7,
                       dict(chunk, **segments, window=(4, 0), lengths=np.array([9, K]))),
    }[name]


CASES = ["none", "causal", "bool+causal", "padding-float", "bias-per-head+causal", "bias-keys",
         "dropout-mask+causal", "fully-masked", "chunk+causal", "shuffled+window", "window+causal",
         "segments", "lengths+causal", "everything"]
NAMES = {"query_positions": "query_positions", "key_positions": "key_positions", "window": "local_window_size",
         "query_segment_ids": "query_segment_ids", "key_segment_ids": "key_segment_ids",
         "lengths": "key_value_seq_lengths"}


@pytest.mark.parametrize("name", CASES)
def test_blockwise_matches_oracle_across_blocks(name, tiny_blocks):
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(B, H, Q, D)), rng.normal(size=(B, HK, K, D)), rng.normal(size=(B, HK, K, D))
    mask, causal, keep, terms = _case(name, rng)
    rate = 0.3 if keep is not None else 0.0
    want, _, cache = oracle.attention(
        q, k, v, oracle.Attention(mask=mask, is_causal=causal, keep=keep, dropout_rate=rate, **terms))
    d_out = rng.normal(size=want.shape)
    want_grads = oracle.attention_grad(cache, d_out)
    T = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    additive = mask is not None and mask.dtype.kind == "f"  # JAX's masks are nonzero = attend
    structured = {NAMES[n]: x if n == "window" else jnp.asarray(x) for n, x in terms.items()}

    def f(q, k, v, m):
        return mha_jax.dot_product_attention(
            q, k, v, **{"bias" if additive else "mask": m}, is_causal=causal, dropout_rate=rate,
            dropout_mask=None if keep is None else jnp.asarray(keep), implementation="blockwise",
            **structured)

    m = None if mask is None else jnp.asarray(mask)
    out, vjp = jax.vjp(f, T(q), T(k), T(v), m)
    grads = vjp(T(d_out))
    assert max(harness.errors(np.asarray(out).transpose(0, 2, 1, 3), want)) <= 1e-13
    for got, w in zip(grads[:3], want_grads):
        assert max(harness.errors(np.asarray(got).transpose(0, 2, 1, 3), w)) <= 1e-12
    if mask is not None and mask.dtype.kind == "f" and np.isfinite(mask).all():
        # a learned bias gets its gradient: dS summed over the axes the bias broadcasts along
        ds = oracle.attention_grads(cache, d_out)["logits"]
        lead = ds.ndim - mask.ndim
        axes = tuple(range(lead)) + tuple(lead + a for a in range(mask.ndim) if mask.shape[a] == 1)
        want_bias = ds.sum(axis=axes, keepdims=True).reshape(mask.shape)
        assert max(harness.errors(np.asarray(grads[3]), want_bias)) <= 1e-12


def _visits(q_len, kv_len, block_q, block_k, *, causal=False, window=None, terms=(None,) * 5, allowed=None):
    """Per query block: (whole key blocks, partial key blocks), as the forward visits them."""
    cfg = _blockwise.Config(block_q, block_k, q_len, kv_len, causal, window, 1.0, 1.0, 0.0, None)
    tokens = testing.Tokens(*terms)
    if tokens.query_positions is None and (causal or window):
        tokens = tokens._replace(query_positions=jnp.arange(q_len)[None], key_positions=jnp.arange(kv_len)[None])
    order, whole, live = _blockwise.schedule(*_blockwise.classes(cfg, allowed, tokens, padding=True))
    return [(int(w), int(n) - int(w)) for w, n in zip(whole, live)]


def test_blocks_visited_follow_positions():
    """Empty blocks are skipped and whole blocks go unmasked, counted by hand for each term."""
    # causal, 16 x 16 in 4 x 4 blocks: the diagonal block is partial, those below it whole
    assert _visits(16, 16, 4, 4, causal=True) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    # keys past the last query (6 queries, 16 keys in blocks of 2): never visited
    assert _visits(6, 16, 4, 2, causal=True) == [(0, 2), (2, 1)]
    # window (4, 0) with causality at 32, blocks 4 x 4: the diagonal and the one before it partial
    assert _visits(32, 32, 4, 4, causal=True, window=(4, 0)) == [(0, 1)] + [(0, 2)] * 7
    # a chunk of 4 queries at positions 12..15 over 16 keys: three whole blocks and the diagonal
    chunk = (jnp.arange(12, 16)[None], jnp.arange(16)[None], None, None, None)
    assert _visits(4, 16, 4, 4, causal=True, terms=chunk) == [(3, 1)]
    # two packed segments of 8 in blocks of 4: each query block sees its own segment's two blocks, whole
    ids = jnp.arange(16)[None] // 8
    assert _visits(16, 16, 4, 4, terms=(None, None, ids, ids, None)) == [(2, 0)] * 2 + [(2, 0)] * 2
    # lengths 6 and 10 of 16 keys in blocks of 4: block 1 is whole in the second row only, block 2
    # partial there, block 3 empty in both
    lengths = (None, None, None, None, jnp.array([6, 10]))
    assert _visits(4, 16, 4, 4, terms=lengths) == [(1, 2)]
    # a boolean mask: a block it empties is skipped, a block it fills is whole
    allowed = jnp.zeros((1, 1, 1, 8, 8), bool).at[..., :4, :4].set(True).at[..., 4:, :].set(True)
    allowed = allowed.at[..., 4, 5].set(False)
    assert _visits(8, 8, 4, 4, allowed=allowed) == [(1, 0), (1, 1)]


def test_dropout_rng_backward_uses_the_forward_mask(tiny_blocks):
    """The backward pass regenerates each block's dropout mask: a directional derivative by
    central differences in float64 agrees with the VJP."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=s)) for s in ((B, Q, H, D), (B, K, HK, D), (B, K, HK, D)))
    key = jax.random.key(5)
    f = lambda q: mha_jax.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, dropout_rate=0.4, dropout_rng=key, implementation="blockwise")
    direction, d_out = jnp.asarray(rng.normal(size=q.shape)), jnp.asarray(rng.normal(size=(B, Q, H, D)))
    out, vjp = jax.vjp(f, q)
    analytic = float(jnp.vdot(vjp(d_out)[0], direction))
    eps = 1e-6
    numeric = float(jnp.vdot(f(q + eps * direction) - f(q - eps * direction), d_out)) / (2 * eps)
    assert abs(analytic - numeric) <= 1e-7 * abs(analytic)
    again = mha_jax.dot_product_attention(  # a key made again from the same seed: the same mask
        q, k, v, is_causal=True, dropout_rate=0.4, dropout_rng=jax.random.key(5), implementation="blockwise")
    assert np.array_equal(out, again)
    dropped = jnp.mean(f(q) == mha_jax.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise"))
    assert dropped < 0.5  # dropout really acted


def test_default_is_one_implementation_at_every_length():
    """No size threshold: the default at 8 and at 512 positions is the same (jvp works at both)."""
    for length in (8, 512):
        q = jnp.asarray(np.random.default_rng(length).normal(size=(1, length, 2, 8)))
        default = jax.jvp(lambda q: mha_jax.dot_product_attention(q, q, q, is_causal=True), (q,), (q,))
        xla = jax.jvp(lambda q: mha_jax.dot_product_attention(q, q, q, is_causal=True, implementation="xla"),
                      (q,), (q,))
        assert all(np.array_equal(a, b) for a, b in zip(default, xla))
    with pytest.raises(ValueError, match="return_weights=True needs implementation='xla'"):
        mha_jax.dot_product_attention(q, q, q, return_weights=True, implementation="blockwise")
    with pytest.raises(ValueError, match="implementation must be one of"):
        mha_jax.dot_product_attention(q, q, q, implementation="turbo")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            mha_jax.dot_product_attention(q, q, q, implementation="cudnn")


BAND_CASES = {  # (is_causal, structured terms), all over default positions
    "window+causal": (True, dict(window=(5, 0))),
    "window both sides": (False, dict(window=(3, 6))),
    "window wider than the keys": (True, dict(window=(40, 0))),
    "window+segments+lengths": (True, dict(window=(4, 0), lengths=np.array([7, 11]), segments=True)),
}


@pytest.mark.parametrize("shape", [(Q, K), (K, Q)], ids=["keys longer", "queries longer"])
@pytest.mark.parametrize("name", list(BAND_CASES))
def test_windows_over_default_positions_run_as_bands(name, shape):
    """A window over default positions, with no dense mask, bias, dropout, sinks or cap, takes
    one band of keys per query block (``_band``); bands of 4 queries here, the last one padded,
    against the float64 oracle, outputs and gradients, grouped heads."""
    q_len, kv_len = shape
    rng = np.random.default_rng(1)
    q = rng.normal(size=(B, H, q_len, D))
    k, v = rng.normal(size=(B, HK, kv_len, D)), rng.normal(size=(B, HK, kv_len, D))
    causal, terms = BAND_CASES[name]
    terms = {n: np.minimum(x, kv_len) if n == "lengths" else x for n, x in terms.items()}
    if terms.pop("segments", False):  # ids of documents of 4 and 6 tokens
        terms.update({f"{side}_segment_ids": np.stack([np.arange(n) // 4, np.arange(n) // 6])
                      for side, n in (("query", q_len), ("key", kv_len))})
    want, _, cache = oracle.attention(q, k, v, oracle.Attention(is_causal=causal, **terms))
    d_out = rng.normal(size=want.shape)
    want_grads = oracle.attention_grad(cache, d_out)
    T = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    structured = {NAMES[n]: x if n == "window" else jnp.asarray(x) for n, x in terms.items()}
    with testing.tuned(band_block=4), testing.observed() as seen:
        out, vjp = jax.vjp(lambda q, k, v: mha_jax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="blockwise", **structured), T(q), T(k), T(v))
        grads = vjp(T(d_out))
    assert [(c.block_q, c.n_q) for event, c in seen if event == "band"] == [(4, -(-q_len // 4))]
    assert max(harness.errors(np.asarray(out).transpose(0, 2, 1, 3), want)) <= 1e-13
    for got, w in zip(grads, want_grads):
        assert max(harness.errors(np.asarray(got).transpose(0, 2, 1, 3), w)) <= 1e-12


def test_bands_only_where_nothing_else_is_per_score():
    """A bias, a mask, explicit positions or a soft-cap send a window to the tiles."""
    x = jnp.ones((1, 16, 2, 4))
    with testing.observed() as seen:
        for extra in (dict(bias=jnp.zeros((16, 16))), dict(mask=jnp.ones((16, 16), bool)),
                      dict(query_positions=jnp.arange(16)), dict(logit_soft_cap=5.0), {}):
            mha_jax.dot_product_attention(x, x, x, is_causal=True, local_window_size=(3, 0),
                                          implementation="blockwise", **extra)
    assert [event for event, _ in seen].count("band") == 1  # the last call only


@pytest.mark.parametrize("terms", [dict(is_causal=True), dict(is_causal=True, local_window_size=(3, 0))],
                         ids=["causal", "window"])
def test_no_query_gives_an_empty_output(terms):
    """Zero queries over keys: an empty output and zero key gradients, as ``"xla"`` gives (the
    blocks used to be sliced from the empty queries and fail to trace)."""
    q, k = jnp.ones((1, 0, 2, 4)), jnp.ones((1, 5, 2, 4))
    f = lambda q, k: mha_jax.dot_product_attention(q, k, k, implementation="blockwise", **terms)  # noqa: E731
    assert f(q, k).shape == (1, 0, 2, 4)
    dk = jax.grad(lambda k: f(q, k).sum())(k)
    assert dk.shape == k.shape and not np.asarray(dk).any()
