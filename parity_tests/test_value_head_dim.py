"""A value whose head dim differs from the query's and key's (multi-head latent attention's
``v_head_dim``): value ``(batch, kv_len, kv_heads, v_head_dim)`` in JAX's layout, ``(batch,
kv_heads, kv_len, v_head_dim)`` in PyTorch's, output ``(..., v_head_dim)``. Every implementation
of both twins (blockwise over several blocks, and as a band), under the masking terms, forward and
gradients (the bias's and sinks' too), against the float64 oracle; a decoding step; drawn dropout;
the ring and the per-device calls on 4 devices (a process of their own); the checks that refuse a
value not matching the key on batch, length and heads, alike in both twins. ``"cudnn"``'s refusal
and ``"splash"`` on one device: ``test_kernel_records.py``.

Shapes: batch 2, 8 queries over 16 keys, 4 heads over 2 key/value heads, head_dim 8, the value's
4 or 12 (on 4 devices: 16 queries and keys, the value's 4).
"""

import functools
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mha_jax
import mha_torch
from mha_jax import testing
from parity_tests import cores
from parity_tests.test_kernels_mesh import run_on_4_devices
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
        "none": {},
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
def small_blocks():
    """Blockwise over 2 query blocks of 4 and 6 key blocks of 3 (the last padded), backward
    blocks of 8 x 4: whole, partial and empty blocks, each with the value's head dim."""
    with testing.tuned(blocks=(4, 3), backward_blocks=(8, 4)):
        yield


CASES = ["causal", "mask+bias+sinks+lengths", "positional terms", "window", "soft_cap+dropout"]
GRID = [(fw, impl, 4, case) for fw, impl in IMPLEMENTATIONS for case in CASES] + [
    (fw, impl, 12, "none") for fw, impl in IMPLEMENTATIONS]  # SDPA: a key/value head's group of heads as rows


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
    kwargs = _case("mask+bias+sinks+lengths", rng)
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


def _drawn(framework: str, implementation: str, q, k, v, d_out):
    """(output, (dq, dk, dv)) in torch layout, float64, with dropout drawn from one seed."""
    if framework == "torch":
        torch.manual_seed(0)
        tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
        out = mha_torch.dot_product_attention(tq, tk, tv, is_causal=True, dropout_p=0.3, implementation=implementation)
        out.backward(torch.from_numpy(d_out))
        return out.detach().numpy(), tuple(x.grad.numpy() for x in (tq, tk, tv))
    t = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3))  # noqa: E731
    out, grads = _jax_drawn(t(q), t(k), t(v), t(d_out), implementation=implementation)
    return np.asarray(out).transpose(0, 2, 1, 3), tuple(np.asarray(g).transpose(0, 2, 1, 3) for g in grads)


@functools.partial(jax.jit, static_argnames="implementation")
def _jax_drawn(q, k, v, d_out, implementation):
    def f(q, k, v):
        return mha_jax.dot_product_attention(q, k, v, is_causal=True, dropout_rate=0.3, dropout_rng=jax.random.key(0),
                                             implementation=implementation)

    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(d_out)


@pytest.mark.parametrize("framework, implementation", [("jax", "blockwise"), ("torch", "math")])
def test_drawn_dropout_splits_over_the_value_columns(framework, implementation, small_blocks):
    """Dropout drawn block by block from a key (JAX's blockwise; ``"xla"`` draws the whole keep-mask
    first, then runs as with an explicit one) or from a seed (PyTorch) does not depend on the value's
    head dim, and the output is linear in the value: a value of 12 columns gives the outputs of its
    two halves of 6 side by side, the value's gradient likewise, and the query's and key's gradients
    their sum."""
    rng = np.random.default_rng(3)
    q, k, v, d_out = _inputs(rng, 12, "float64")
    whole, parts = _drawn(framework, implementation, q, k, v, d_out), [
        _drawn(framework, implementation, q, k, v[..., cols], d_out[..., cols]) for cols in (slice(0, 6), slice(6, 12))]
    want = (np.concatenate([p[0] for p in parts], -1), parts[0][1][0] + parts[1][1][0], parts[0][1][1] + parts[1][1][1],
            np.concatenate([p[1][2] for p in parts], -1))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (whole[0], *whole[1]), want):
        assert max(harness.errors(a, b)) <= TOL["float64"], name
    assert not np.allclose(whole[0], oracle.attention(q, k, v, oracle.Attention(is_causal=True))[0])  # some dropped


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


# --- on 4 devices: the ring, and one call per device -----------------------------------------------

# A process of its own (the device count is fixed before JAX starts). The ring over 4 devices (the
# lengths sharded) in float64; batch and heads sharded over a (2, 2) mesh, where blockwise (float64)
# and splash (interpret mode, float32) run once per device on their examples and heads.
MESH_PROGRAM = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    jax.config.update("jax_enable_x64", True)
    import mha_jax
    from parity_tests.tool import oracle

    B, L, H, HK, D, DV = 2, 16, 4, 2, 8, 4
    rng = np.random.default_rng(0)
    def normal(*shape):  # float32 values, held in float64: the same inputs for both dtypes
        return rng.normal(size=shape).astype(np.float32).astype(np.float64)


    q, k, v, cot = normal(B, L, H, D), normal(B, L, HK, D), normal(B, L, HK, DV), normal(B, L, H, DV)
    sinks, bias = normal(H), normal(1, H, L, L)
    mask, keep = rng.random((B, 1, L, L)) < 0.8, rng.random((B, H, L, L)) < 0.7
    ids = np.stack([np.arange(L) // 6, np.arange(L) // 11])
    pos = np.arange(L)[None] + rng.integers(0, 5, (B, 1))
    lengths = np.array([L, 11])
    T = lambda x: np.asarray(x).transpose(0, 2, 1, 3)  # noqa: E731

    CASES = {  # core keywords (those differentiated: sinks, bias), the oracle's
        "causal+sinks+soft_cap+segments+lengths": (
            dict(is_causal=True, logit_soft_cap=2.0, query_segment_ids=ids, key_segment_ids=ids,
                 key_value_seq_lengths=lengths), dict(sinks=sinks),
            dict(is_causal=True, soft_cap=2.0, query_segment_ids=ids, key_segment_ids=ids, lengths=lengths,
                 sinks=sinks)),
        "mask+bias+dropout+window+positions": (
            dict(mask=mask, dropout_mask=keep, dropout_rate=0.3, local_window_size=(5, 2), query_positions=pos,
                 key_positions=pos), dict(bias=bias),
            dict(mask=mask, keep=keep, dropout_rate=0.3, window=(5, 2), query_positions=pos, key_positions=pos,
                 bias=bias)),
    }


    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


    def want(att):
        out, _, cache = oracle.attention(T(q), T(k), T(v), oracle.Attention(**att))
        g = oracle.attention_grads(cache, T(cot))
        extra = {"sinks": g["sinks"], "bias": g["logits"].sum(axis=0, keepdims=True)}
        return T(out), [T(g["query"]), T(g["key"]), T(g["value"])], extra


    def run(fixed, learned, dtype, **kw):
        def loss(q, k, v, learned):
            out = mha_jax.dot_product_attention(q, k, v, **fixed, **learned, **kw)
            return jnp.sum(out * cot.astype(dtype)), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


    def check(got, want_out, want_grads, extra, learned, tol, where):
        (_, out), grads = got
        errors = [rel(out, want_out)] + [rel(g, w) for g, w in zip(grads[:3], want_grads)]
        errors += [rel(grads[3][n], extra[n]) for n in learned]
        assert np.asarray(out).shape == (B, L, H, DV), (where, np.asarray(out).shape)
        assert max(errors) <= tol, (where, errors)


    # the ring over 4 devices: the lengths sharded, float64
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Explicit,))
    for name, (fixed, learned, att) in CASES.items():
        want_out, want_grads, extra = want(att)
        with jax.set_mesh(mesh):
            placed = [jax.device_put(x, NamedSharding(mesh, P(None, "seq"))) for x in (q, k, v)]
            got = jax.jit(run(fixed, learned, jnp.float64, sequence_axis="seq"))(*placed, learned)
        check(got, want_out, want_grads, extra, learned, 1e-12, ("ring", name))

    # one call per device on its examples and heads (batch and heads sharded): blockwise in float64,
    # splash (interpret mode) in float32
    mesh = jax.make_mesh((2, 2), ("data", "heads"), axis_types=(AxisType.Explicit,) * 2)
    fixed, learned, att = CASES["causal+sinks+soft_cap+segments+lengths"]
    want_out, want_grads, extra = want(att)
    for impl, dtype, tol in (("blockwise", jnp.float64, 1e-12), ("splash", jnp.float32, 1e-6)):
        with jax.set_mesh(mesh):
            sharding = NamedSharding(mesh, P("data", None, "heads"))
            placed = [jax.device_put(jnp.asarray(x, dtype), sharding) for x in (q, k, v)]
            here = {n: jnp.asarray(x, dtype) for n, x in learned.items()}
            got = jax.jit(run(fixed, here, dtype, implementation=impl))(*placed, here)
            assert jax.typeof(got[0][1]).sharding.spec == P("data", None, "heads", None), jax.typeof(got[0][1]).sharding
        check(got, want_out, want_grads, extra, learned, tol, ("per device", impl))
    print("ok")
''')


def test_ring_and_per_device_calls_on_4_devices():
    run_on_4_devices(MESH_PROGRAM)
