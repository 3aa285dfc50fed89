"""Logit soft-capping and attention sinks in both functional cores.

Every implementation (JAX ``"xla"``, ``"blockwise"`` over many small blocks; PyTorch ``"math"``,
``"sdpa"`` where it applies) against the float64 oracle and against each other, forward and
every gradient (query, key, value, a learned bias, the sinks), in float64 and float32; the
oracle's hand-written backward against central differences; transformers' own Gemma 2 and
gpt-oss eager attention functions as anchors; and the default implementation choice.

One shape throughout (each configuration is compiled once by ``cores``' jit), large enough
for grouped heads, several query and key blocks and a padded last block of each.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mha_jax
import mha_torch
from mha_jax import testing
from parity_tests import cores
from parity_tests.tool import arrays, harness, oracle

B, H, HK, Q, K, D = 2, 4, 2, 7, 9, 8
CAP = 2.0  # the scaled logits below have a spread of about 2: the cap bends most of them
TOLERANCES = {"float64": (1e-13, 1e-12), "float32": (1e-6, 1e-5)}  # (forward, gradients)

# Structured terms: causal with a window, padding (lengths), packed segments, and the last
# query's segment (7) has no key, so that its row is fully masked.
MASKS = dict(
    is_causal=True,
    terms=dict(
        local_window_size=(3, 1),
        key_value_seq_lengths=np.array([K, 6]),
        query_segment_ids=np.array([[0, 0, 0, 1, 1, 1, 7], [0, 0, 1, 1, 1, 1, 7]]),
        key_segment_ids=np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 1]]),
    ),
)
DROPOUT_RATE = 0.3
# name -> (soft-cap, sinks, learned bias, structured masks and an explicit dropout mask)
CASES = {
    "cap": (True, False, True, False),
    "sinks": (False, True, True, False),
    "cap+sinks": (True, True, False, False),
    "sinks+masks": (False, True, False, True),
    "cap+sinks+bias+masks+dropout": (True, True, True, True),
}
ORACLE_NAMES = {"local_window_size": "window", "key_value_seq_lengths": "lengths",
                "query_segment_ids": "query_segment_ids", "key_segment_ids": "key_segment_ids"}


@pytest.fixture(autouse=True)
def tiny_blocks():
    """Blockwise forward blocks of 4 queries x 3 keys, backward blocks of 2 x 4: several blocks
    each way, the last padded, and the backward re-blocked."""
    with testing.tuned(blocks=(4, 3), backward_blocks=(2, 4)):
        yield


def _inputs(dtype: str, seed: int = 0) -> dict:
    """q, k, v, d_out, bias ``(1, H, Q, K)`` and sinks ``(H,)``, rounded to ``dtype`` (so that
    the oracle sees the very numbers the frameworks get)."""
    rng = np.random.default_rng(seed)
    drawn = dict(q=rng.normal(size=(B, H, Q, D)) * 1.4, k=rng.normal(size=(B, HK, K, D)) * 1.4,
                 v=rng.normal(size=(B, HK, K, D)), d_out=rng.normal(size=(B, H, Q, D)),
                 bias=rng.normal(size=(1, H, Q, K)) * 0.5, sinks=rng.normal(size=(H,)))
    keep = rng.random((B, H, Q, K)) < 1.0 - DROPOUT_RATE
    return {name: arrays.rounded(x, dtype) for name, x in drawn.items()} | {"keep": keep}


def _call(case: str, x: dict) -> dict:
    """``cores.run_core``'s keyword arguments of a case."""
    cap, sinks, bias, structured = CASES[case]
    kw = dict(logit_soft_cap=CAP if cap else None, sinks=x["sinks"] if sinks else None,
              bias=x["bias"] if bias else None)
    if structured and "dropout" in case:
        kw.update(dropout_mask=x["keep"], dropout_rate=DROPOUT_RATE)
    return dict(kw, **MASKS) if structured else kw


def _oracle(case: str, x: dict) -> dict:
    """The oracle's output and gradients, named as ``run_core`` names them."""
    kw = _call(case, x)
    att = oracle.Attention(
        bias=kw["bias"], soft_cap=kw["logit_soft_cap"], sinks=kw["sinks"], is_causal=kw.get("is_causal", False),
        keep=kw.get("dropout_mask"), dropout_rate=kw.get("dropout_rate", 0.0),
        **{ORACLE_NAMES[n]: t for n, t in kw.get("terms", {}).items()},
    )
    out, weights, cache = oracle.attention(x["q"], x["k"], x["v"], att)
    g = oracle.attention_grads(cache, x["d_out"])
    return {"out": out, "weights": weights, "grads": (g["query"], g["key"], g["value"]),
            "d_bias": None if kw["bias"] is None else g["logits"].sum(axis=0, keepdims=True),
            "d_sinks": g["sinks"]}


def _implementations(case: str) -> list[tuple[str, str]]:
    """(framework, implementation) pairs that take the case: SDPA can neither cap logits nor
    take an explicit dropout mask."""
    pairs = [("jax", "xla"), ("jax", "blockwise"), ("torch", "math")]
    return pairs + ([] if CASES[case][0] or "dropout" in case else [("torch", "sdpa")])


def _worst(got: dict, want: dict) -> tuple[float, float]:
    """(forward, gradients): the worst of ``harness.errors`` over the output, the weights
    where both have them, and every gradient both have."""
    forward = [harness.errors(got[n], want[n]) for n in ("out", "weights")
               if got[n] is not None and want[n] is not None]
    pairs = list(zip(got["grads"], want["grads"])) + [(got[n], want[n]) for n in ("d_bias", "d_sinks")]
    for a, b in pairs:
        assert (a is None) == (b is None), "a gradient is missing on one side"
    backward = [harness.errors(a, b) for a, b in pairs if a is not None]
    return max(max(e) for e in forward), max(max(e) for e in backward)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_implementation_matches_the_oracle_and_each_other(case, dtype):
    x = _inputs(dtype)
    want = _oracle(case, x)
    got = {
        (fw, impl): cores.run_core(fw, x["q"], x["k"], x["v"], x["d_out"], dtype=dtype, implementation=impl,
                                   **_call(case, x))
        for fw, impl in _implementations(case)
    }
    fwd_tol, grad_tol = TOLERANCES[dtype]
    first = next(iter(got))
    for name, result in got.items():
        assert result["d_sinks"] is None or result["d_sinks"].shape == (H,)
        for other, label in ((want, "oracle"), (got[first], "/".join(first))):
            fwd, grad = _worst(result, other)
            assert fwd <= fwd_tol and grad <= grad_tol, (name, label, fwd, grad)
    if "masks" in case:  # the last query sees no key: output 0 and, from it, no gradient
        for result in got.values():
            assert np.all(result["out"][:, :, -1] == 0.0)
            assert np.all(result["grads"][0][:, :, -1] == 0.0)


def test_oracle_gradients_match_central_differences():
    """The oracle's hand-written backward (cap and sinks included) against its own forward."""
    x = _inputs("float64", seed=1)
    kw = _call("cap+sinks+bias+masks+dropout", x)
    terms = {ORACLE_NAMES[n]: t for n, t in kw["terms"].items()}

    dropout = dict(keep=x["keep"], dropout_rate=DROPOUT_RATE)

    def loss(q, k, v, bias, sinks):
        att = oracle.Attention(bias=bias, soft_cap=CAP, sinks=sinks, is_causal=True, **dropout, **terms)
        return float(np.sum(oracle.attention(q, k, v, att)[0] * x["d_out"]))

    primal = [x["q"], x["k"], x["v"], x["bias"], x["sinks"]]
    att = oracle.Attention(bias=x["bias"], soft_cap=CAP, sinks=x["sinks"], is_causal=True, **dropout, **terms)
    g = oracle.attention_grads(oracle.attention(x["q"], x["k"], x["v"], att)[2], x["d_out"])
    analytic = [g["query"], g["key"], g["value"], g["logits"].sum(axis=0, keepdims=True), g["sinks"]]
    rng = np.random.default_rng(2)
    for i, grad in enumerate(analytic):
        direction = rng.normal(size=primal[i].shape)
        eps = 1e-6
        plus, minus = list(primal), list(primal)
        plus[i], minus[i] = primal[i] + eps * direction, primal[i] - eps * direction
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert abs(np.sum(grad * direction) - numeric) <= 1e-7 * max(1.0, abs(numeric)), i


def _torch_grads(fn, x: dict, with_sinks: bool):
    """Output (torch layout) and gradients of q, k, v (and sinks) of a transformers eager
    attention function ``fn(module, q, k, v) -> (out (B, Q, H, D), weights)``."""
    q, k, v = (torch.tensor(x[n], requires_grad=True) for n in ("q", "k", "v"))
    sinks = torch.tensor(x["sinks"], requires_grad=True)
    module = types.SimpleNamespace(num_key_value_groups=H // HK, head_dim=D, training=False, sinks=sinks)
    out = fn(module, q, k, v)[0].transpose(1, 2)
    out.backward(torch.tensor(x["d_out"]))
    grads = [t.grad.numpy() for t in (q, k, v)]
    return out.detach().numpy(), grads, sinks.grad.numpy() if with_sinks else None


def _anchor(case: str, fn):
    x = _inputs("float64")
    kw = _call(case, x)
    att = oracle.Attention(is_causal=kw.get("is_causal", False),
                           **{ORACLE_NAMES[n]: t for n, t in kw.get("terms", {}).items()})
    allowed, _ = oracle.allowed_and_bias(att, (B, H, Q, K))
    additive = np.where(allowed, 0.0, -np.inf) + (0.0 if kw["bias"] is None else kw["bias"])
    want_out, want_grads, want_sinks = _torch_grads(lambda m, q, k, v: fn(m, q, k, v, torch.tensor(additive)), x,
                                                    kw["sinks"] is not None)
    for fw, impl in _implementations(case):
        got = cores.run_core(fw, x["q"], x["k"], x["v"], x["d_out"], implementation=impl, **kw)
        assert max(harness.errors(got["out"], want_out)) <= 1e-12, (fw, impl)
        for a, b in zip(got["grads"], want_grads):
            assert max(harness.errors(a, b)) <= 1e-12, (fw, impl)
        if want_sinks is not None:
            assert max(harness.errors(got["d_sinks"], want_sinks)) <= 1e-12, (fw, impl)


def test_gemma2_eager_attention_is_an_anchor(monkeypatch):
    """transformers' Gemma 2 eager attention, cap then additive mask (here a learned bias):
    the same outputs and gradients. Its softmax is upcast to float32 for half inputs, which
    would round float64 ones; it is computed in the input's dtype here."""
    from transformers.models.gemma2 import modeling_gemma2

    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda x, dim, dtype=None: softmax(x, dim=dim, dtype=x.dtype))
    _anchor("cap", lambda m, q, k, v, mask: modeling_gemma2.eager_attention_forward(
        m, q, k, v, mask, scaling=D**-0.5, softcap=CAP))


@pytest.mark.parametrize("case", ["sinks", "sinks+masks"])
def test_gpt_oss_eager_attention_is_an_anchor(case):
    """transformers' gpt-oss eager attention with its ``sinks``: the same outputs and gradients
    (of the sinks too), with a bias, and with causality, window, padding, segments and a query
    that sees no key (the sink alone: output 0)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    _anchor(case, lambda m, q, k, v, mask: modeling_gpt_oss.eager_attention_forward(m, q, k, v, mask, scaling=D**-0.5))


def test_weights_leave_out_the_sink():
    """The returned weights are those applied to the values: with sinks each row sums to
    1 - the sink's share, a fully masked row to 0; both frameworks agree with the oracle."""
    x = _inputs("float64")
    want = _oracle("sinks+masks", x)
    totals = want["weights"].sum(axis=-1)
    assert np.all(totals < 1.0) and np.all(totals[:, :, -1] == 0.0)
    for fw, impl in (("jax", "xla"), ("torch", "math")):
        got = cores.run_core(fw, x["q"], x["k"], x["v"], x["d_out"], implementation=impl, **_call("sinks+masks", x))
        assert max(harness.errors(got["weights"], want["weights"])) <= 1e-13


def test_soft_cap_makes_torch_default_math_and_sdpa_refuses_it():
    """The default is ``"math"`` with a cap (whatever the size) and ``"sdpa"`` without;
    an explicit ``"sdpa"`` with a cap names the argument and the way out."""
    x = _inputs("float64")
    q, k, v = (torch.from_numpy(x[n]) for n in ("q", "k", "v"))
    capped = mha_torch.dot_product_attention(q, k, v, logit_soft_cap=CAP)
    assert torch.equal(capped, mha_torch.dot_product_attention(q, k, v, logit_soft_cap=CAP, implementation="math"))
    sinks = torch.from_numpy(x["sinks"])
    assert torch.equal(mha_torch.dot_product_attention(q, k, v, sinks=sinks),
                       mha_torch.dot_product_attention(q, k, v, sinks=sinks, implementation="sdpa"))
    with pytest.raises(ValueError, match="logit_soft_cap needs implementation='math'"):
        mha_torch.dot_product_attention(q, k, v, logit_soft_cap=CAP, implementation="sdpa")


def test_cudnn_refuses_soft_cap_and_sinks():
    """cuDNN (through ``jax.nn``) has neither; the message names what was given, on any backend."""
    q = jnp.zeros((B, Q, H, D), jnp.bfloat16)
    k = jnp.zeros((B, K, HK, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="'cudnn' does not take logit_soft_cap and sinks"):
        mha_jax.dot_product_attention(q, k, k, logit_soft_cap=CAP, sinks=jnp.zeros(H), implementation="cudnn")
    with pytest.raises(ValueError, match="'cudnn' does not take sinks;"):
        mha_jax.dot_product_attention(q, k, k, sinks=jnp.zeros(H), implementation="cudnn")


def test_user_sinks_are_not_modified():
    """Gradients flow to the caller's sinks; their values stay as given."""
    x = _inputs("float64")
    sinks = torch.tensor(x["sinks"], requires_grad=True)
    before = sinks.detach().clone()
    q, k, v = (torch.tensor(x[n]) for n in ("q", "k", "v"))
    for impl in ("math", "sdpa"):
        mha_torch.dot_product_attention(q, k, v, sinks=sinks, implementation=impl).sum().backward()
    assert torch.equal(sinks.detach(), before) and sinks.grad is not None


def test_no_key_at_all_gives_zeros_and_a_zero_sink_gradient():
    """kv_len = 0: the output is 0 (the sink alone) and the sinks' gradient is 0, not missing."""
    x = _inputs("float32")
    q = x["q"].astype(np.float32)
    empty = np.zeros((B, HK, 0, D), np.float32)
    T = lambda a: jnp.asarray(a.transpose(0, 2, 1, 3))  # noqa: E731
    out, vjp = jax.vjp(lambda s: mha_jax.dot_product_attention(T(q), T(empty), T(empty), sinks=s, logit_soft_cap=CAP),
                       jnp.asarray(x["sinks"], jnp.float32))
    assert out.dtype == jnp.float32 and not np.any(out)
    assert np.array_equal(vjp(jnp.ones_like(out))[0], np.zeros(H, np.float32))
    sinks = torch.tensor(x["sinks"], dtype=torch.float32, requires_grad=True)
    out = mha_torch.dot_product_attention(torch.from_numpy(q), torch.from_numpy(empty), torch.from_numpy(empty),
                                          sinks=sinks)
    out.sum().backward()
    assert out.dtype == torch.float32 and not out.any() and torch.equal(sinks.grad, torch.zeros(H))


def test_sinks_over_no_keys_give_zeros_and_a_zero_gradient():
    """kv_len 0 with sinks: an output of zeros in both twins, and the sinks stay in the graph: a
    gradient of zeros (in PyTorch a tensor, not None)."""
    q, kv = np.ones((1, 3, H, D)), np.ones((1, 0, HK, D))
    sinks = np.linspace(-1.0, 1.0, H)
    out, grad = jax.value_and_grad(lambda s: mha_jax.dot_product_attention(
        jnp.asarray(q), jnp.asarray(kv), jnp.asarray(kv), sinks=s).sum())(jnp.asarray(sinks))
    assert float(out) == 0.0 and not np.asarray(grad).any()
    t_sinks = torch.tensor(sinks, requires_grad=True)
    t_q, t_kv = torch.from_numpy(q).transpose(1, 2), torch.from_numpy(kv).transpose(1, 2)
    t_out = mha_torch.dot_product_attention(t_q, t_kv, t_kv, sinks=t_sinks)
    t_out.sum().backward()
    assert not t_out.detach().numpy().any() and t_sinks.grad is not None and not t_sinks.grad.any()
