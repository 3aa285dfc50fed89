"""The TPU kernel (``implementation="splash"``, JAX's Pallas splash attention) on this CPU, in
Pallas interpret mode: the same kernel a TPU compiles, checked forward and backward against the
float64 oracle at the float32 tolerances of the grid, and against ``"xla"``; what it cannot
express is refused by name; ``"flash"`` runs ``"blockwise"`` on a CPU.

Interpret mode is slow (each mask structure and size builds its own kernel): shapes are small,
with odd lengths (padded to a block of 128) and grouped heads.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mha_jax
from mha_jax import testing
from parity_tests import cores, strategies
from parity_tests.tool import harness, oracle

B, H, HK, Q, K, D = 2, 4, 2, 37, 45, 16
FWD_TOL, GRAD_TOL = harness.TOLERANCES["float32"]
ORACLE_NAMES = {"local_window_size": "window", "key_value_seq_lengths": "lengths", "attention_chunk_size": "chunk_size"}
SEGMENTS = dict(query_segment_ids=np.stack([np.arange(Q) * 3 // Q, np.arange(Q) // 20]),
                key_segment_ids=np.stack([np.arange(K) * 3 // K, np.arange(K) // 9]))
CASES = {  # (is_causal, terms, soft cap, sinks)
    "none": (False, {}, None, False),
    "causal": (True, {}, None, False),
    "window": (False, dict(local_window_size=(5, 3)), None, False),
    "causal window": (True, dict(local_window_size=(6, 6)), None, False),
    "segments": (False, SEGMENTS, None, False),  # the second row's last queries have no key of their segment
    "causal chunks": (True, dict(attention_chunk_size=16), None, False),
    "lengths+causal": (True, dict(key_value_seq_lengths=np.array([K, 0])), None, False),  # a row with no key
    "soft cap+sinks+segments": (True, dict(SEGMENTS, key_value_seq_lengths=np.array([30, K])), 3.0, True),
}


def _inputs(rng, q_len=Q, kv_len=K, heads=H, kv_heads=HK):
    q = rng.normal(size=(B, heads, q_len, D))
    k, v = rng.normal(size=(2, B, kv_heads, kv_len, D))
    return q, k, v, rng.normal(size=(B, heads, q_len, D))


def _check(q, k, v, d_out, is_causal, terms, soft_cap, sinks):
    """splash against the oracle (float64) and ``"xla"`` (float32), outputs and every gradient."""
    att = oracle.Attention(is_causal=is_causal, soft_cap=soft_cap, sinks=sinks,
                           **{ORACLE_NAMES.get(n, n): x for n, x in terms.items()})
    want, _, cache = oracle.attention(q, k, v, att)
    want_grads = oracle.attention_grads(cache, d_out)
    run = dict(dtype="float32", is_causal=is_causal, logit_soft_cap=soft_cap, sinks=sinks, terms=terms)
    got = cores.run_core("jax", q, k, v, d_out, implementation="splash", **run)
    xla = cores.run_core("jax", q, k, v, d_out, implementation="xla", **run)
    assert max(harness.errors(got["out"], want)) <= FWD_TOL
    assert np.array_equal(got["out"] == 0, want == 0)  # a query that sees no key gets 0
    for g, name in zip(got["grads"], ("query", "key", "value")):
        assert max(harness.errors(g, want_grads[name])) <= GRAD_TOL, name
    if sinks is not None:
        assert max(harness.errors(got["d_sinks"], want_grads["sinks"])) <= GRAD_TOL
    assert max(harness.errors(got["out"], xla["out"])) <= FWD_TOL
    for g, x in zip(got["grads"], xla["grads"]):
        assert max(harness.errors(g, x)) <= GRAD_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_splash_matches_oracle_and_xla(name):
    rng = np.random.default_rng(0)
    is_causal, terms, soft_cap, with_sinks = CASES[name]
    sinks = rng.normal(size=H) if with_sinks else None
    _check(*_inputs(rng), is_causal, terms, soft_cap, sinks)


@st.composite
def _calls(draw):
    """Lengths around a block's edge, grouped or multi-query heads, and the terms the kernel takes."""
    q_len = draw(st.sampled_from([1, 9, 128, 130]))
    kv_len = draw(st.sampled_from([q_len, 7, 129]))
    kv_heads = draw(st.sampled_from([1, 2]))
    causal = draw(st.booleans())
    window = draw(st.none() | st.tuples(st.integers(0, 9), st.integers(0, 9)))
    segments = draw(st.sampled_from([0, 1, 3]))
    lengths = draw(st.booleans())
    return q_len, kv_len, kv_heads, causal, window, segments, lengths, draw(st.integers(0, 2**31))


@settings(max_examples=strategies.examples(3), deadline=None)
@given(_calls())
def test_splash_drawn_calls(call):
    q_len, kv_len, kv_heads, causal, window, segments, lengths, seed = call
    rng = np.random.default_rng(seed)
    terms = {}
    if window is not None:
        terms["local_window_size"] = window
    if segments:
        terms["query_segment_ids"] = np.sort(rng.integers(0, segments, size=(B, q_len)), axis=1)
        terms["key_segment_ids"] = np.sort(rng.integers(0, segments, size=(B, kv_len)), axis=1)
    if lengths:
        terms["key_value_seq_lengths"] = rng.integers(0, kv_len + 1, size=B)
    _check(*_inputs(rng, q_len, kv_len, H, kv_heads), causal, terms, None, None)


REFUSED = {  # argument: (call arguments, the name in the message)
    "mask": (dict(mask=jnp.ones((1, 1, Q, K), bool)), "a dense mask"),
    "bias": (dict(bias=jnp.zeros((1, 1, Q, K))), "bias"),
    "dropout": (dict(dropout_rate=0.5, dropout_rng=jax.random.key(0)), "dropout"),
    "positions": (dict(is_causal=True, query_positions=jnp.arange(Q) + 3), "query_positions/key_positions"),
    "chunks": (dict(attention_chunk_size=16), "attention_chunk_size without is_causal"),
    "weights": (dict(return_weights=True), "return_weights=True needs implementation='xla'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_splash_refuses_what_it_cannot_express_by_name(name):
    kw, named = REFUSED[name]
    q = jnp.zeros((B, Q, H, D))
    k = jnp.zeros((B, K, HK, D))
    with pytest.raises(ValueError, match=re.escape(named)):
        mha_jax.dot_product_attention(q, k, k, implementation="splash", **kw)


def test_flash_is_blockwise_on_cpu():
    """On a CPU, ``"flash"`` is ``"blockwise"`` (lowered for the CPU: its branch of the program)."""
    rng = np.random.default_rng(3)
    q, k, v, d_out = _inputs(rng)
    run = dict(dtype="float32", is_causal=True, terms=dict(key_value_seq_lengths=np.array([20, K])))
    flash = cores.run_core("jax", q, k, v, d_out, implementation="flash", **run)
    block = cores.run_core("jax", q, k, v, d_out, implementation="blockwise", **run)
    np.testing.assert_array_equal(flash["out"], block["out"])
    for a, b in zip(flash["grads"], block["grads"]):
        np.testing.assert_array_equal(a, b)


def test_splash_internals_are_where_they_were_written_for():
    """The kernel is built from jax's splash modules that their package does not export; when a
    jax release moves one of those names, this says which, and for which jax it was written."""
    _splash = testing.splash

    found = _splash.jax_internals()
    assert set(found) == {n for names in _splash.INTERNALS.values() for n in names}
    for chunk in (None, 64):  # the kernel as built from them (NumPy work: no device)
        try:
            _splash.kernel(2, 128, 256, True, None, chunk, 2.0, True)
        except TypeError as error:
            raise AssertionError(f"jax {jax.__version__}'s splash kernel no longer takes what mha_jax._splash "
                                 f"passes (written for jax {testing.platform.JAX_VERSION}): {error}") from error


HAS_KEY = {  # (q_len, kv_len, Spec keywords): rows with no key in every case
    "window (3, 0), more queries": (45, 37, dict(window=(3, 0))),
    "window (0, 4), more queries": (45, 37, dict(window=(0, 4))),
    "causal window, more queries": (45, 37, dict(is_causal=True, window=(5, 0))),
    "lengths inside (0, K)": (37, 45, dict(is_causal=True, window=(2, 0), lengths=np.array([17, 3]))),
    "window and lengths": (45, 37, dict(window=(2, 1), lengths=np.array([37, 30]))),
    "causal chunks and lengths": (45, 37, dict(is_causal=True, chunk_size=8, lengths=np.array([20, 37]))),
    "segments and a window": (37, 45, dict(window=(4, 0), query_segment_ids=SEGMENTS["query_segment_ids"],
                                           key_segment_ids=SEGMENTS["key_segment_ids"])),
    "segments alone": (37, 45, dict(query_segment_ids=SEGMENTS["query_segment_ids"],
                                    key_segment_ids=SEGMENTS["key_segment_ids"] + 1)),
}


@pytest.mark.parametrize("name", list(HAS_KEY))
def test_splash_rows_with_no_key_are_the_dense_masks(name):
    """Which queries see some key (the rows set to 0 after the kernel), from the terms' block
    ranges, is exactly where the dense mask of the same terms has a key: windows either side,
    causality, chunks, lengths strictly between 0 and the key count, and segments."""
    _splash = testing.splash
    from mha_spec.terms import Spec

    q_len, kv_len, kw = HAS_KEY[name]
    kw = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    if "query_segment_ids" in kw:
        kw["query_segment_ids"], kw["key_segment_ids"] = kw["query_segment_ids"][:, :q_len], kw["key_segment_ids"]
    spec = Spec((B, H, q_len, kv_len), **kw)
    dense = np.broadcast_to(np.asarray(spec.dense(jnp.arange)).any(axis=-1), (B, 1, q_len))[:, 0]
    got = np.asarray(_splash.has_key(spec))[:, :, 0, 0]
    assert not dense.all(), "the case has rows with no key"
    np.testing.assert_array_equal(got, dense)
