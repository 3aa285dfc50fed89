"""A value whose head dim differs from the query's and key's (multi-head latent attention's
``v_head_dim``): value ``(batch, kv_len, kv_heads, v_head_dim)`` in JAX's layout, ``(batch,
kv_heads, kv_len, v_head_dim)`` in PyTorch's, output ``(..., v_head_dim)``. Every implementation
of both twins, under the masking terms, forward and gradients, against the float64 oracle; the
checks that refuse a value not matching the key on batch, length and heads, alike in both twins.

Shapes: batch 2, 8 queries over 16 keys, 4 heads over 2 key/value heads, head_dim 8, the value's
4 or 12.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mha_jax
import mha_torch
from mha_jax import _blockwise
from parity_tests import cores
from parity_tests.tool import harness, oracle

B, Q, K, H, HK, D = 2, 8, 16, 4, 2, 8
TOL = {"float64": 1e-12, "float32": 1e-6}  # relative (harness.errors), outputs and gradients
IMPLEMENTATIONS = [("jax", "xla"), ("jax", "blockwise"), ("torch", "math"), ("torch", "sdpa")]
# the cores' names of the terms -> the oracle's
ORACLE_NAMES = {"local_window_size": "window", "key_value_seq_lengths": "lengths", "attention_chunk_size": "chunk_size"}


def _case(name: str, rng) -> dict:
    """``cores.run_core``'s keywords of a named case (``terms`` by the cores' names)."""
    ids = dict(query_segment_ids=np.stack([np.arange(Q) * 2 // Q, np.arange(Q) // 6]),
               key_segment_ids=np.stack([np.arange(K) * 2 // K, np.arange(K) // 12]))
    mask = rng.random((B, 1, Q, K)) < 0.7
    mask[0, :, 0] = False  # a query that sees no key: output 0
    return {
        "causal": dict(is_causal=True),
        "mask+bias+sinks+lengths": dict(mask=mask, bias=rng.normal(size=(1, H, Q, K)), sinks=rng.normal(size=H),
                                        terms=dict(key_value_seq_lengths=np.array([K, 5]))),
        # queries at positions 4..11 over keys 0..15, with every positional term
        "positional terms": dict(is_causal=True, terms=dict(
            ids, query_positions=np.arange(Q)[None] + 4, key_positions=np.arange(K)[None], local_window_size=(6, 0),
            attention_chunk_size=8, key_value_seq_lengths=np.array([K, 11]))),
        "window": dict(terms=dict(local_window_size=(3, 1))),  # blockwise runs it as a band
        "soft_cap+dropout": dict(is_causal=True, logit_soft_cap=2.0, dropout_mask=rng.random((B, H, Q, K)) < 0.7,
                                 dropout_rate=0.3),
    }[name]


def _takes(implementation: str, case: dict) -> bool:
    """Whether ``implementation`` takes the case (SDPA takes no soft-cap nor explicit dropout mask)."""
    return implementation != "sdpa" or not ("logit_soft_cap" in case or "dropout_mask" in case)


def _oracle(q, k, v, d_out, case: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """(output, weights, gradients) of the float64 oracle for ``run_core``'s keywords ``case``."""
    terms = {ORACLE_NAMES.get(n, n): x for n, x in case.get("terms", {}).items()}
    att = oracle.Attention(mask=case.get("mask"), bias=case.get("bias"), is_causal=case.get("is_causal", False),
                           sinks=case.get("sinks"), soft_cap=case.get("logit_soft_cap"), keep=case.get("dropout_mask"),
                           dropout_rate=case.get("dropout_rate", 0.0), **terms)
    out, weights, cache = oracle.attention(q, k, v, att)
    return out, weights, oracle.attention_grads(cache, d_out)


def _inputs(rng, dv: int, dtype: str, q_len: int = Q):
    """q ``(B, H, q_len, D)``, k ``(B, HK, K, D)``, v ``(B, HK, K, dv)``, a cotangent ``(B, H, q_len, dv)``,
    torch layout, rounded to ``dtype``."""
    shapes = ((B, H, q_len, D), (B, HK, K, D), (B, HK, K, dv), (B, H, q_len, dv))
    return tuple(np.asarray(rng.normal(size=s)).astype(dtype).astype(np.float64) for s in shapes)


def _check(framework, implementation, dtype, q, k, v, d_out, case):
    """One core against the oracle: output, weights where formed, every gradient (bias's, sinks')."""
    want, want_weights, grads = _oracle(q, k, v, d_out, case)
    got = cores.run_core(framework, q, k, v, d_out, dtype=dtype, implementation=implementation, **case)
    assert got["out"].shape == q.shape[:3] + v.shape[3:]
    checks = [("out", got["out"], want), ("dq", got["grads"][0], grads["query"]),
              ("dk", got["grads"][1], grads["key"]), ("dv", got["grads"][2], grads["value"])]
    if got["weights"] is not None:
        checks.append(("weights", got["weights"], want_weights))
    if case.get("bias") is not None:
        checks.append(("d_bias", got["d_bias"], grads["logits"].sum(axis=0, keepdims=True)))
    if case.get("sinks") is not None:
        checks.append(("d_sinks", got["d_sinks"], grads["sinks"]))
    for name, a, b in checks:
        assert max(harness.errors(a, b)) <= TOL[dtype], (name, harness.errors(a, b))
    return got


@pytest.fixture
def small_blocks(monkeypatch):
    """Blockwise over 2 query blocks of 4 and 6 key blocks of 3 (the last padded), backward
    blocks of 8 x 4: whole, partial and empty blocks, each with the value's head dim."""
    monkeypatch.setattr(_blockwise, "block_sizes", lambda *shape: (4, 3))
    monkeypatch.setattr(_blockwise, "backward_block_sizes", lambda *shape: (8, 4))


CASES = ["causal", "mask+bias+sinks+lengths", "positional terms", "window", "soft_cap+dropout"]
GRID = [(fw, impl, 4, case) for fw, impl in IMPLEMENTATIONS for case in CASES] + [
    (fw, impl, 12, "positional terms") for fw, impl in IMPLEMENTATIONS]


@pytest.mark.parametrize("framework, implementation, dv, case", GRID)
def test_cores_match_oracle_float64(framework, implementation, dv, case, small_blocks):
    rng = np.random.default_rng(0)
    kwargs = _case(case, rng)
    if not _takes(implementation, kwargs):
        pytest.skip(f"{implementation!r} takes neither logit_soft_cap nor dropout_mask")
    _check(framework, implementation, "float64", *_inputs(rng, dv, "float64"), kwargs)


@pytest.mark.parametrize("framework, implementation", IMPLEMENTATIONS)
def test_cores_match_oracle_float32(framework, implementation, small_blocks):
    rng = np.random.default_rng(1)
    kwargs = _case("positional terms", rng)
    _check(framework, implementation, "float32", *_inputs(rng, 12, "float32"), kwargs)


@pytest.mark.parametrize("framework, implementation", IMPLEMENTATIONS)
def test_decode_step(framework, implementation):
    """The functional decoding shape: one query per row over 16 cached keys, each row at its own
    position with its own number of keys."""
    rng = np.random.default_rng(2)
    q, k, v, d_out = _inputs(rng, 12, "float64", q_len=1)
    case = dict(is_causal=True, terms=dict(query_positions=np.array([[9], [4]]), key_positions=np.arange(K)[None],
                                           key_value_seq_lengths=np.array([10, 5])))
    _check(framework, implementation, "float64", q, k, v, d_out, case)


@pytest.mark.parametrize("framework, implementation", IMPLEMENTATIONS)
def test_no_keys_give_zeros_of_the_value_head_dim(framework, implementation):
    q, k, v = np.ones((B, H, Q, D)), np.ones((B, HK, 0, D)), np.ones((B, HK, 0, 12))
    got = cores.run_core(framework, q, k, v, np.ones((B, H, Q, 12)), implementation=implementation)
    assert got["out"].shape == (B, H, Q, 12) and not got["out"].any()


# --- bad input: the same message in both twins ---------------------------------------------------

def _call(framework: str, q, k, v, **kw):
    """The core on zeros of these shapes, given in JAX's layout (transposed for PyTorch)."""
    if framework == "jax":
        return mha_jax.dot_product_attention(*(jnp.zeros(s) for s in (q, k, v)), **kw)
    return mha_torch.dot_product_attention(*(torch.zeros(s[0], s[2], s[1], s[3]) for s in (q, k, v)), **kw)


BAD = {
    "value's length": ((B, K + 1, HK, D), "key and value must have the same shape but for the last axis: batch, "
                                          "kv_len and kv_heads must agree"),
    "value's heads": ((B, K, H, D), "key and value must have the same shape but for the last axis"),
    "value's batch": ((B + 1, K, HK, D), "key and value must have the same shape but for the last axis"),
    "value's head dim 0": ((B, K, HK, 0), "value needs a head dim >= 1 (its last axis), got value"),
}


@pytest.mark.parametrize("framework", ["jax", "torch"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_value_is_refused_alike(framework, name):
    shape, message = BAD[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        _call(framework, (B, Q, H, D), (B, K, HK, D), shape)


def test_messages_name_the_shapes_in_each_layout():
    with pytest.raises(ValueError, match=re.escape("got key (2, 16, 2, 8) and value (2, 17, 2, 4)")):
        _call("jax", (B, Q, H, D), (B, K, HK, D), (B, K + 1, HK, 4))
    with pytest.raises(ValueError, match=re.escape("got key (2, 2, 16, 8) and value (2, 2, 17, 4)")):
        _call("torch", (B, Q, H, D), (B, K, HK, D), (B, K + 1, HK, 4))


def test_cudnn_refuses_by_name():
    """``jax.nn.dot_product_attention`` requires the value's shape to be the key's."""
    with pytest.raises(ValueError, match=re.escape("implementation='cudnn' does not take a value head dim apart")):
        _call("jax", (B, Q, H, D), (B, K, HK, D), (B, K, HK, 4), implementation="cudnn")
