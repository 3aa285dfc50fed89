"""Values that must not leak, and numbers that must not overflow, in both frameworks.

- NaN/Inf at key/value positions that no query may see reach neither outputs nor the gradients
  of the other positions (raw ``F.scaled_dot_product_attention`` lets them through);
- outputs never depend on keys outside the mask; permuting masked-out keys changes nothing;
- logits of magnitude 1e4 stay finite in float32; bfloat16/float16 inputs are computed in
  float32 (bitwise: the half-precision result is the float32 result rounded once), finite where
  a float16 product would overflow; a constant input gives uniform weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import mha_torch
from parity_tests import cores, strategies
from parity_tests.tool import arrays, harness, oracle

FRAMEWORK_IMPLS = [(fw, impl) for fw, impls in cores.IMPLEMENTATIONS.items() for impl in impls]


POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 1e30}


def _normal(rng, shape, dtype="float64"):
    return arrays.rounded(rng.normal(size=shape), dtype)


def _assert_close(got, want, tol, what):
    assert np.all(np.isfinite(got)), f"{what}: not finite"
    assert max(harness.errors(got, want)) <= tol, f"{what}: {harness.errors(got, want)} > {tol}"


# --- padding that must not leak ----------------------------------------------------------


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_module_padding_garbage_reaches_no_output_or_input_gradient(poison):
    """Cross-attention through both modules (both implementations of each), float64: garbage
    in the padded rows of ``inputs_k``/``inputs_v`` changes neither the output nor the gradient
    of ``inputs_q`` or of the real key/value rows; the padded rows' own gradient is exactly 0.
    Reference: the oracle on the same inputs with the padded rows set to 0. (The weight
    gradients do see the garbage: test_found_defects.py.)"""
    dtype = "float64"
    config = harness.Config("pad", q_len=4, kv_len=6, in_kv_features=10, num_heads=4, num_kv_heads=2)
    case = harness.Case(config, "padding", dtype)
    data = harness.make_data(case, seed=1)
    padded = ~data.padding_valid  # (batch, kv_len); the second batch element has 3 padded keys
    clean = harness.run_oracle(case, data)
    for x in (data.xk, data.xv):
        x[padded] = 0.0
    want = harness.run_oracle(case, data)
    for x in (data.xk, data.xv):
        x[padded] = POISONS[poison]
    tol, grad_tol = harness.TOLERANCES[dtype]
    results = {f"jax-{impl}": harness.run_jax(case, data, implementation=impl) for impl in ("xla", "blockwise")}
    results.update({f"torch-{impl}": harness.run_torch(case, data, implementation=impl) for impl in ("math", "sdpa")})
    assert max(harness.errors(want["out"], clean["out"])) <= 1e-15  # padding never mattered
    for name, got in results.items():
        _assert_close(got["out"], want["out"], tol, name)
        for arg in ("inputs_q", "inputs_k", "inputs_v"):
            _assert_close(got["grads"][arg], want["grads"][arg], grad_tol, f"{name} d{arg}")
        for arg in ("inputs_k", "inputs_v"):
            assert np.all(got["grads"][arg][padded] == 0), name


def test_raw_sdpa_lets_padding_garbage_through_and_ours_does_not():
    """What PyTorch's own ``F.scaled_dot_product_attention`` does with NaN in masked-out keys
    and values: every query's output is NaN (0 * NaN in its weights-times-values product); ours,
    through the same SDPA, gives the oracle's answer. ``jax.nn.dot_product_attention`` leaks too."""
    rng = np.random.default_rng(2)
    q, k, v = _normal(rng, (1, 2, 3, 4)), _normal(rng, (1, 2, 5, 4)), _normal(rng, (1, 2, 5, 4))
    attend = np.array([True, True, True, False, False])
    want, _, _ = oracle.attention(q, k, v, oracle.Attention(mask=attend))
    k[..., 3:, :] = np.nan
    v[..., 3:, :] = np.nan
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    raw = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(attend).expand(3, 5))
    assert torch.isnan(raw).all()
    anchor = jax.nn.dot_product_attention(*(jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)),
                                          mask=jnp.asarray(attend))
    assert jnp.isnan(anchor).all()
    ours = mha_torch.dot_product_attention(tq, tk, tv, mask=torch.from_numpy(attend), implementation="sdpa")
    _assert_close(ours.numpy(), want, 1e-13, "mha_torch sdpa")


# --- keys outside the mask do not matter (properties) ------------------------------------

# A moderate set of core shapes (batch, heads, kv_heads, q_len, kv_len, head_dim): the JAX side
# compiles each (with each mask shape and option) once, not once per example.
CORE_SHAPES = [(1, 2, 1, 1, 3, 4), (2, 4, 2, 5, 7, 8), (3, 3, 3, 9, 4, 5), (2, 6, 2, 16, 33, 16)]


@st.composite
def masked_cores(draw):
    """A core shape, a mask form and broadcast shape, causality, dtype and implementations."""
    b, h, hk, q, k, d = draw(st.sampled_from(CORE_SHAPES))
    return dict(
        shape=(b, h, hk, q, k, d), form=draw(st.sampled_from(["bool", "int32", "float"])),
        mask_shape=draw(strategies.broadcast_shapes((b, h, q, k))),
        is_causal=draw(st.booleans()), dtype=draw(st.sampled_from(["float64", "float32"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _core_case(c):
    """q, k, v, d_out, the drawn mask's ``attend`` (bool) and the mask as passed (its form)."""
    b, h, hk, q_len, kv_len, d = c["shape"]
    rng = np.random.default_rng(c["seed"])
    q, k, v = (_normal(rng, s, c["dtype"]) for s in ((b, h, q_len, d), (b, hk, kv_len, d), (b, hk, kv_len, d)))
    d_out = _normal(rng, (b, h, q_len, d), c["dtype"])
    attend = np.broadcast_to(rng.random(c["mask_shape"]) < 0.7, (b, h, q_len, kv_len))
    return q, k, v, d_out, rng, attend


def _as_form(attend, form, rng, dtype):
    if form == "bool":
        return attend
    if form == "int32":
        return attend.astype(np.int32) * 3
    return arrays.rounded(np.where(attend, rng.normal(size=attend.shape), -np.inf), dtype)


def _causal(attend, is_causal):
    q_len, kv_len = attend.shape[-2:]
    return attend & np.tri(q_len, kv_len, dtype=bool) if is_causal else attend


@settings(max_examples=strategies.examples(12))
@given(masked_cores(), st.sampled_from([*POISONS, "random", "permuted"]))
def test_keys_that_no_query_sees_change_nothing(c, replacement):
    """Keys excluded for every query of every head of their group (padding, per batch
    element) are replaced by NaN, Inf, 1e30, other random values or a permutation of
    themselves: outputs, weights and the gradients of every other position stay bitwise the
    same, in every implementation; their own gradients are exactly 0; and the outputs match
    the oracle."""
    q, k, v, d_out, rng, attend = _core_case(c)
    b, kv_len = attend.shape[0], attend.shape[-1]
    padded = np.zeros((b, kv_len), bool)
    for row in padded:  # about a third of each batch element's keys, at least one
        row[rng.permutation(kv_len)[: max(1, kv_len // 3)]] = True
    attend = attend & ~padded[:, None, None, :]
    mask = _as_form(attend, c["form"], rng, c["dtype"])
    k2, v2 = k.copy(), v.copy()
    where = np.broadcast_to(padded[:, None, :, None], k.shape)
    if replacement == "permuted":
        for i in range(b):
            cols = np.flatnonzero(padded[i])
            k2[i][:, cols], v2[i][:, cols] = k[i][:, rng.permutation(cols)], v[i][:, rng.permutation(cols)]
    else:
        fill = _normal(rng, k.shape, c["dtype"]) if replacement == "random" else POISONS[replacement]
        k2, v2 = np.where(where, fill, k), np.where(where, fill, v)
    seen = oracle.Attention(mask=mask, is_causal=c["is_causal"])
    want, _, _ = oracle.attention(q, np.where(where, 0, k), np.where(where, 0, v), seen)
    for fw, impl in FRAMEWORK_IMPLS:
        kw = dict(dtype=c["dtype"], mask=mask, implementation=impl, is_causal=c["is_causal"])
        before, after = cores.run_core(fw, q, k, v, d_out, **kw), cores.run_core(fw, q, k2, v2, d_out, **kw)
        assert np.array_equal(after["out"], before["out"]), (fw, impl)
        assert after["weights"] is None or np.array_equal(after["weights"], before["weights"])
        assert np.array_equal(after["grads"][0], before["grads"][0]), (fw, impl)
        for g_after, g_before in zip(after["grads"][1:], before["grads"][1:]):
            assert np.all(g_after[where] == 0) and np.array_equal(g_after[~where], g_before[~where]), (fw, impl)
        _assert_close(after["out"], want, harness.TOLERANCES[c["dtype"]][0], f"{fw}-{impl}")


@settings(max_examples=strategies.examples(12))
@given(masked_cores())
def test_a_query_ignores_the_keys_its_mask_excludes(c):
    """Changing some keys and values to other (finite) numbers changes no output row whose
    mask excludes all of them, bitwise, in every implementation, even where other queries do
    attend to those keys."""
    q, k, v, d_out, rng, attend = _core_case(c)
    attend = _causal(attend, c["is_causal"])
    changed = rng.permutation(attend.shape[-1])[: max(1, attend.shape[-1] // 3)]
    untouched = ~attend[..., changed].any(axis=-1)  # (b, h, q): rows that see none of them
    k2, v2 = k.copy(), v.copy()
    k2[:, :, changed] = _normal(rng, k2[:, :, changed].shape, c["dtype"])
    v2[:, :, changed] = _normal(rng, v2[:, :, changed].shape, c["dtype"])
    mask = _as_form(attend, c["form"], rng, c["dtype"])
    for fw, impl in FRAMEWORK_IMPLS:
        kw = dict(dtype=c["dtype"], mask=mask, implementation=impl, is_causal=c["is_causal"])
        before, after = cores.run_core(fw, q, k, v, d_out, **kw), cores.run_core(fw, q, k2, v2, d_out, **kw)
        assert np.array_equal(after["out"][untouched], before["out"][untouched]), (fw, impl)
        if before["weights"] is not None:
            assert np.array_equal(after["weights"][untouched], before["weights"][untouched]), (fw, impl)


# --- large logits and half precision -----------------------------------------------------


def _shifted_logits(rng, b, h, q_len, kv_len, sign):
    """q and k whose logits (scale 1) are ``sign * 10000`` plus small integers, all exact in
    float32: the softmax is that of the small integers, so the float64 oracle's answer is what
    a float32 computation that avoids overflow can reach."""
    q = np.zeros((b, h, q_len, 4))
    k = np.zeros((b, h, kv_len, 4))
    q[..., 0], q[..., 1] = 100.0, rng.integers(-2, 3, size=(b, h, q_len))
    k[..., 0], k[..., 1] = sign * 100.0, rng.integers(-3, 4, size=(b, h, kv_len))
    return q, k


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the oracle's, of masked-out logits
@pytest.mark.parametrize("sign", [1, -1])
def test_logits_of_1e4_stay_finite_in_float32(sign):
    """Logits of +1e4 (exp overflows float32) and -1e4 (exp underflows to 0, 0/0): outputs
    and weights match the oracle within the float32 tolerance in every implementation, and
    gradients are finite and within 1e-3, the float32 rounding of a logit of magnitude 1e4
    (1e4 * 2**-24 = 6e-4), which any float32 implementation may lose."""
    rng = np.random.default_rng(3)
    q, k = _shifted_logits(rng, 2, 2, 5, 7, sign)
    v, d_out = _normal(rng, (2, 2, 7, 4), "float32"), _normal(rng, (2, 2, 5, 4), "float32")
    mask = rng.random((2, 1, 5, 7)) < 0.8
    att = oracle.Attention(mask=mask, scale=1.0)
    want, want_w, cache = oracle.attention(q, k, v, att)
    want_grads = oracle.attention_grad(cache, d_out)
    for fw, impl in FRAMEWORK_IMPLS:
        got = cores.run_core(fw, q, k, v, d_out, dtype="float32", mask=mask, implementation=impl, scale=1.0)
        _assert_close(got["out"], want, 1e-6, f"{fw}-{impl}")
        if got["weights"] is not None:
            _assert_close(got["weights"], want_w, 1e-6, f"{fw}-{impl} weights")
        for g, w in zip(got["grads"], want_grads):
            _assert_close(g, w, 1e-3, f"{fw}-{impl} gradient")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_is_the_float32_result_rounded_once(dtype):
    """bfloat16/float16 inputs are computed in float32: output, weights and gradients are
    bitwise the float32 computation on the same values, rounded once to the input dtype."""
    rng = np.random.default_rng(4)
    q, k, v = (_normal(rng, s, dtype) for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)))
    d_out = _normal(rng, (2, 4, 5, 8), dtype)
    mask = arrays.rounded(np.where(rng.random((2, 1, 5, 7)) < 0.7, rng.normal(size=(2, 1, 5, 7)), -np.inf), dtype)
    for fw, impl in FRAMEWORK_IMPLS:
        kw = dict(mask=mask, implementation=impl, is_causal=True)
        half = cores.run_core(fw, q, k, v, d_out, dtype=dtype, **kw)
        full = cores.run_core(fw, q, k, v, d_out, dtype="float32", **kw)
        for key in ("out", "weights"):
            if half[key] is not None:
                assert np.array_equal(half[key], arrays.rounded(full[key], dtype)), (fw, impl, key)
        for g_half, g_full in zip(half["grads"], full["grads"]):
            assert np.array_equal(g_half, arrays.rounded(g_full, dtype)), (fw, impl)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_beyond_float16_range_stay_finite(dtype):
    """q.k up to ~1e5, beyond float16's largest number (65504), computed from integers that
    are exact in the input dtype: results are finite and within one rounding of the input
    dtype of the oracle (2**-8 for bfloat16, 2**-11 for float16, doubled)."""
    rng = np.random.default_rng(5)
    b, h, q_len, kv_len, d = 2, 2, 5, 7, 64
    base = rng.integers(-64, 65, size=(b, h, 1, d))  # q and k near one vector: q.k near |base|^2
    q = (base + rng.integers(-8, 9, size=(b, h, q_len, d))).astype(np.float64)
    k = (base + rng.integers(-1, 2, size=(b, h, kv_len, d))).astype(np.float64)
    assert np.abs(np.einsum("bhqd,bhkd->bhqk", q, k)).max() > 65504
    v, d_out = _normal(rng, (b, h, kv_len, d), dtype), _normal(rng, (b, h, q_len, d), dtype)
    att = oracle.Attention(scale=1 / 64)  # a power of two: the logits stay exact in float32
    want, want_w, _ = oracle.attention(q, k, v, att)
    tol = 2 * (2.0**-8 if dtype == "bfloat16" else 2.0**-11)
    for fw, impl in FRAMEWORK_IMPLS:
        got = cores.run_core(fw, q, k, v, d_out, dtype=dtype, implementation=impl, scale=1 / 64)
        _assert_close(got["out"], want, tol, f"{fw}-{impl}")
        if got["weights"] is not None:
            _assert_close(got["weights"], want_w, tol, f"{fw}-{impl} weights")
        assert all(np.all(np.isfinite(g)) for g in got["grads"]), (fw, impl)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_constant_input_gives_uniform_weights(dtype):
    """A constant input (every position the same vector) makes every key alike: each query
    weighs its allowed keys (padding and causality) equally, 1/count, in both modules."""
    config = harness.Config("const", batch=2, q_len=5, kv_len=5, in_features=8, num_heads=2)
    case = harness.Case(config, "padding+causal", dtype)
    data = harness.make_data(case, seed=6)
    data.xq[:] = data.xq[:, :1]  # self-attention: xk and xv are xq
    allowed = data.padding_valid[:, None, None, :] & np.tri(5, dtype=bool)
    count = allowed.sum(axis=-1, keepdims=True)
    uniform = np.broadcast_to(np.where(allowed, 1.0 / count, 0.0), (2, 2, 5, 5))
    tol = harness.TOLERANCES[dtype][0]
    for name, got in (("jax", harness.run_jax(case, data)), ("torch", harness.run_torch(case, data))):
        _assert_close(got["weights"], uniform, tol, name)
        assert np.all(got["weights"][~np.broadcast_to(allowed, uniform.shape)] == 0), name
