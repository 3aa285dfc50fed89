"""The functional cores directly: ``mha_jax.dot_product_attention`` (layout (B, Q, H, D)) and
``mha_torch.dot_product_attention`` (layout (B, H, Q, D)) against the oracle and each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import mha_jax
import mha_torch
from mha_jax import testing
from mha_torch import testing as torch_testing
from parity_tests.tool import arrays, harness, oracle

B, H, Q, K, D = 2, 6, 5, 7, 8
MASKS = {
    "none": lambda rng: None,
    "bool": lambda rng: rng.random((B, H, Q, K)) < 0.6,
    "int": lambda rng: (rng.random((B, 1, Q, K)) < 0.6).astype(np.int32),
    "float": lambda rng: np.where(rng.random((1, H, Q, K)) < 0.2, -np.inf, rng.normal(size=(1, H, Q, K))),
    "rank2": lambda rng: rng.random((Q, K)) < 0.6,
}


def _inputs(rng, kv_heads, dtype):
    q = arrays.rounded(rng.normal(size=(B, H, Q, D)), dtype)
    k = arrays.rounded(rng.normal(size=(B, kv_heads, K, D)), dtype)
    v = arrays.rounded(rng.normal(size=(B, kv_heads, K, D)), dtype)
    return q, k, v


def _jax_masking(mask) -> dict:
    """A mask in PyTorch's convention as the JAX core's keyword: a float mask is its ``bias``."""
    if mask is None:
        return {}
    return {"bias" if arrays.is_floating(mask) else "mask": jnp.asarray(mask)}


def _jax(q, k, v, dtype, mask=None, **kw):
    """Call the JAX core from torch-layout NumPy arrays (a float ``mask`` is added, as in
    PyTorch); results back in torch layout."""
    t = lambda x: jnp.asarray(arrays.cast(x, dtype).transpose(0, 2, 1, 3))  # noqa: E731
    masking = _jax_masking(None if mask is None else arrays.cast(mask, dtype))
    out, w = mha_jax.dot_product_attention(t(q), t(k), t(v), **masking, return_weights=True, **kw)
    return arrays.to_float64(out).transpose(0, 2, 1, 3), arrays.to_float64(w)


def _torch(q, k, v, dtype, mask=None, **kw):
    t = lambda x: torch.from_numpy(x).to(getattr(torch, dtype))  # noqa: E731
    m = None if mask is None else (t(mask) if mask.dtype.kind == "f" else torch.from_numpy(mask))
    out, w = mha_torch.dot_product_attention(t(q), t(k), t(v), mask=m, need_weights=True, **kw)
    return arrays.to_float64(out), arrays.to_float64(w)


@pytest.mark.parametrize("dtype", harness.DTYPES)
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_cores_match_oracle(mask_kind, kv_heads, dtype):
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, kv_heads, dtype)
    mask = MASKS[mask_kind](rng)
    if mask is not None and mask.dtype.kind == "f":
        mask = arrays.rounded(mask, dtype)
    want_out, want_w, _ = oracle.attention(q, k, v, oracle.Attention(mask=mask, is_causal=True))
    tol = harness.TOLERANCES[dtype][0]
    got = {
        "jax": _jax(q, k, v, dtype, mask, is_causal=True),
        "torch": _torch(q, k, v, dtype, mask, is_causal=True),
    }
    for name, (out, w) in got.items():
        assert max(harness.errors(out, want_out)) <= tol, name
        assert max(harness.errors(w, want_w)) <= tol, name
    assert max(harness.errors(got["jax"][0], got["torch"][0])) <= tol


@pytest.mark.parametrize("scale", [None, 0.5, 1 / np.sqrt(H * D)])
def test_scale(scale):
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, 3, "float64")
    want, _, _ = oracle.attention(q, k, v, oracle.Attention(scale=scale))
    for out, _ in (_jax(q, k, v, "float64", scale=scale), _torch(q, k, v, "float64", scale=scale)):
        assert max(harness.errors(out, want)) <= 1e-13
    if scale is not None:  # the argument is really used
        default, _, _ = oracle.attention(q, k, v, oracle.Attention())
        assert max(harness.errors(default, want)) > 1e-3


@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_fully_masked_rows_are_exactly_zero_with_finite_gradients(dtype):
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 2, dtype)
    mask = rng.random((B, H, Q, K)) < 0.5
    mask[:, :, 1] = False
    mask[0] = False
    float_mask = np.where(mask, 0.0, -np.inf)
    for m in (mask, float_mask):
        for out, w in (_jax(q, k, v, dtype, m), _torch(q, k, v, dtype, m)):
            assert np.all(out[:, :, 1] == 0) and np.all(out[0] == 0)
            assert np.all(w[:, :, 1] == 0) and np.all(w[0] == 0)
            assert np.all(np.isfinite(out))

    def loss_jax(q, k, v):
        return jnp.sum(mha_jax.dot_product_attention(q, k, v, mask=jnp.asarray(mask)) ** 2)

    tq, tk, tv = (jnp.asarray(arrays.cast(x, dtype).transpose(0, 2, 1, 3)) for x in (q, k, v))
    for g in jax.grad(loss_jax, argnums=(0, 1, 2))(tq, tk, tv):
        assert np.all(np.isfinite(arrays.to_float64(g)))
    xs = [torch.from_numpy(x).to(getattr(torch, dtype)).requires_grad_(True) for x in (q, k, v)]
    mha_torch.dot_product_attention(*xs, mask=torch.from_numpy(mask)).pow(2).sum().backward()
    for x in xs:
        assert torch.isfinite(x.grad).all()
    assert np.all(arrays.to_float64(xs[0].grad)[0] == 0)  # a query that sees nothing learns nothing


def test_weights_are_the_ones_applied_to_value_after_dropout():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 6, "float64")
    keep = rng.random((B, H, Q, K)) > 0.3
    for out, w in (
        _jax(q, k, v, "float64", dropout_rate=0.3, dropout_mask=jnp.asarray(keep)),
        _torch(q, k, v, "float64", dropout_p=0.3, dropout_mask=torch.from_numpy(keep)),
    ):
        np.testing.assert_allclose(out, w @ v, rtol=0, atol=1e-14)
        assert np.all(w[~keep] == 0)
        want, want_w, _ = oracle.attention(q, k, v, oracle.Attention(keep=keep, dropout_rate=0.3))
        assert max(harness.errors(w, want_w)) <= 1e-13


def test_jax_dropout_rng_is_reproducible_and_drops_at_the_rate():
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(x.transpose(0, 2, 1, 3)) for x in _inputs(rng, 6, "float64"))
    run = lambda key: mha_jax.dot_product_attention(  # noqa: E731
        q, k, v, dropout_rate=0.4, dropout_rng=key, return_weights=True)[1]
    a, b, c = run(jax.random.key(0)), run(jax.random.key(0)), run(jax.random.key(1))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(float(jnp.mean(a == 0)) - 0.4) < 0.08


def test_torch_dropout_uses_torch_rng():
    rng = np.random.default_rng(6)
    q, k, v = (torch.from_numpy(x) for x in _inputs(rng, 6, "float64"))
    torch.manual_seed(0)
    a = mha_torch.dot_product_attention(q, k, v, dropout_p=0.4, need_weights=True)[1]
    torch.manual_seed(0)
    b = mha_torch.dot_product_attention(q, k, v, dropout_p=0.4, need_weights=True)[1]
    assert torch.equal(a, b) and abs(float((a == 0).double().mean()) - 0.4) < 0.08


@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_jit_matches_eager(dtype):
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(arrays.cast(x, dtype).transpose(0, 2, 1, 3)) for x in _inputs(rng, 2, dtype))
    mask = jnp.asarray(rng.random((B, 1, Q, K)) < 0.6)
    f = lambda q, k, v: mha_jax.dot_product_attention(q, k, v, mask=mask, is_causal=True)  # noqa: E731
    eager, jitted = arrays.to_float64(f(q, k, v)), arrays.to_float64(jax.jit(f)(q, k, v))
    assert max(harness.errors(jitted, eager)) <= harness.TOLERANCES[dtype][0]


def test_float_mask_is_added_not_filled():
    """A float mask is a bias: -1e9 over a whole row shifts it and leaves its softmax as it was
    (unlike the tutorials' masked_fill(-1e9), which gives a uniform row); -inf on a whole row gives 0."""
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 6, "float64")
    mask = np.zeros((B, H, Q, K))
    mask[:, :, 0] = -1e9
    mask[:, :, 1] = -np.inf
    for call in (_jax, _torch):
        _, w = call(q, k, v, "float64", mask)
        _, plain = call(q, k, v, "float64")
        np.testing.assert_allclose(w[:, :, 0], plain[:, :, 0], rtol=0, atol=1e-6)  # -1e9 eats digits
        assert np.all(w[:, :, 1] == 0)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_nan_and_inf_in_padded_keys_do_not_leak(poison):
    """Garbage at keys that every query excludes reaches neither outputs nor gradients."""
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, 2, "float64")
    valid = np.arange(K)[None, :] < np.array([K, 4])[:, None]
    k[1, :, 4:] = poison
    v[1, :, 4:] = poison
    clean_k, clean_v = np.where(np.isfinite(k), k, 0.0), np.where(np.isfinite(v), v, 0.0)
    want, _, cache = oracle.attention(q, clean_k, clean_v, oracle.Attention(mask=valid[:, None, None, :]))
    d_out = rng.normal(size=want.shape)
    want_grads = oracle.attention_grad(cache, d_out)
    for mask in (valid[:, None, None, :], np.where(valid, 0.0, -np.inf)[:, None, None, :]):
        tq, tk, tv = (jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
        masking = _jax_masking(mask)
        out, vjp = jax.vjp(lambda *a, masking=masking: mha_jax.dot_product_attention(*a, **masking), tq, tk, tv)
        grads = [np.asarray(g).transpose(0, 2, 1, 3) for g in vjp(jnp.asarray(d_out.transpose(0, 2, 1, 3)))]
        xs = [torch.from_numpy(x).requires_grad_(True) for x in (q, k, v)]
        t_out = mha_torch.dot_product_attention(*xs, mask=torch.from_numpy(mask))
        t_out.backward(torch.from_numpy(d_out))
        for name, got, got_grads in (
            ("jax", np.asarray(out).transpose(0, 2, 1, 3), grads),
            ("torch", t_out.detach().numpy(), [x.grad.numpy() for x in xs]),
        ):
            assert max(harness.errors(got, want)) <= 1e-13, name
            for g, w in zip(got_grads, want_grads):
                assert np.all(np.isfinite(g)) and max(harness.errors(g, w)) <= 1e-12, name


@pytest.mark.parametrize("kv_heads", [6, 2, 1])
@pytest.mark.parametrize("rows_over_heads", [0, 10**9], ids=["per-head", "over-all-heads"])
def test_xla_products_per_head_and_over_all_heads_match_oracle(rows_over_heads, kv_heads):
    """Both ways the ``xla`` core forms its two products (per key/value head, or one product over
    every head keeping each head's own block, which few queries over many keys take) give the
    oracle's outputs, weights and gradients, with a mask, a bias, causality, sinks, a soft cap and
    dropout at once; a NaN in one key/value head's values reaches only that head's queries."""
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, kv_heads, "float64")
    att = oracle.Attention(
        mask=rng.random((B, 1, Q, K)) < 0.8, bias=rng.normal(size=(1, H, Q, K)), is_causal=True,
        keep=rng.random((B, H, Q, K)) < 0.7, dropout_rate=0.3, soft_cap=2.0, sinks=rng.normal(size=H),
    )
    want, want_w, cache = oracle.attention(q, k, v, att)
    d_out = rng.normal(size=want.shape)
    want_grads = oracle.attention_grad(cache, d_out)
    t = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3))  # noqa: E731

    def f(q, k, v):
        return mha_jax.dot_product_attention(
            q, k, v, mask=jnp.asarray(att.mask), bias=jnp.asarray(att.bias), is_causal=True, dropout_rate=0.3,
            dropout_mask=jnp.asarray(att.keep), logit_soft_cap=2.0, sinks=jnp.asarray(att.sinks),
            implementation="xla", return_weights=True,
        )

    with testing.tuned(rows_over_heads=rows_over_heads, many_keys=1):
        (out, w), vjp = jax.vjp(f, t(q), t(k), t(v))
        grads = vjp((t(d_out), jnp.zeros_like(w)))
    assert max(harness.errors(np.asarray(out).transpose(0, 2, 1, 3), want)) <= 1e-13
    assert max(harness.errors(np.asarray(w), want_w)) <= 1e-13
    for got, want_grad in zip(grads, want_grads):
        assert max(harness.errors(np.asarray(got).transpose(0, 2, 1, 3), want_grad)) <= 1e-12
    if kv_heads == 1:
        return
    v[:, 1] = np.nan
    with testing.tuned(rows_over_heads=rows_over_heads, many_keys=1):
        poisoned = np.asarray(mha_jax.dot_product_attention(t(q), t(k), t(v), is_causal=True)).transpose(0, 2, 1, 3)
    heads_of = np.arange(H) // (H // kv_heads)
    clean, _, _ = oracle.attention(q, k, np.where(np.isnan(v), 0.0, v), oracle.Attention(is_causal=True))
    assert np.isnan(poisoned[:, heads_of == 1]).all()
    assert max(harness.errors(poisoned[:, heads_of != 1], clean[:, heads_of != 1])) <= 1e-13


def test_xla_products_over_all_heads_only_for_few_query_rows():
    """A one-token step over a long cache takes the product over all heads, with grouped,
    multi-query and multi-head attention alike; a prompt's queries, and a step over few keys,
    take the per-head products."""
    x = lambda q_len, heads: jnp.ones((1, q_len, heads, 16))  # noqa: E731
    for kv_heads in (2, 1, 8):
        with testing.observed() as seen:
            mha_jax.dot_product_attention(x(1, 8), x(512, kv_heads), x(512, kv_heads))
        assert [event for event, _ in seen].count("own_blocks") == 2  # the logits and the outputs
    for q_len, kv_len, kv_heads in ((512, 512, 2), (512, 512, 1), (64, 512, 8), (1, 64, 2)):
        with testing.observed() as seen:
            mha_jax.dot_product_attention(x(q_len, 8), x(kv_len, kv_heads), x(kv_len, kv_heads))
        assert "own_blocks" not in [event for event, _ in seen]


def test_torch_reports_the_implementation_each_call_ran():
    """``mha_torch.testing.observed()`` gets ``("kernel", name)`` of the implementation each call ran: SDPA by
    default, the explicit formulation where weights, an explicit dropout mask or a soft cap ask for it, or the one
    named; nothing outside the calls."""
    q = torch.ones(1, 2, 3, 4)
    calls = {"sdpa": [{}, {"implementation": "sdpa"}, {"is_causal": True}],
             "math": [{"need_weights": True}, {"logit_soft_cap": 5.0}, {"implementation": "math"},
                      {"dropout_mask": torch.ones(3, 3, dtype=torch.bool)}]}
    with torch_testing.observed() as every:
        for name, options in calls.items():
            for option in options:
                with torch_testing.observed() as seen:
                    mha_torch.dot_product_attention(q, q, q, **option)
                assert seen == [("kernel", name)], option
    mha_torch.dot_product_attention(q, q, q)
    assert len(every) == sum(map(len, calls.values()))
