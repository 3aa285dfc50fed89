"""Module-level behaviour: parameter trees, nnx vs linen, jit vs eager, dropout and modes."""

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from parity_tests.tool import harness

SHAPES = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)  # noqa: E731


@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_tree_is_flax_nnx_tree(use_bias):
    kw = dict(qkv_features=24, out_features=12, in_kv_features=10, use_bias=use_bias, rngs=nnx.Rngs(0))
    ours = nnx.state(mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, **kw), nnx.Param)
    theirs = nnx.state(nnx.MultiHeadAttention(4, 16, num_kv_heads=2, decode=False, **kw), nnx.Param)
    assert SHAPES(nnx.to_pure_dict(ours)) == SHAPES(nnx.to_pure_dict(theirs))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)


@pytest.mark.parametrize("use_bias", [True, False])
def test_linen_tree_is_flax_linen_tree(use_bias):
    x, y = jnp.ones((2, 5, 16)), jnp.ones((2, 7, 10))
    kw = dict(qkv_features=24, out_features=12, use_bias=use_bias)
    ours = mha_jax.linen.MultiHeadDotProductAttention(4, **kw).init(jax.random.key(0), x, y)
    theirs = flax.linen.MultiHeadDotProductAttention(4, **kw).init(jax.random.key(0), x, y)
    assert SHAPES(ours) == SHAPES(theirs)


@pytest.mark.parametrize("mask", ["padding+causal", "dropout"])
@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_nnx_and_linen_agree_exactly(mask, dtype):
    case = harness.Case(harness.CONFIGS["cross-gqa"], mask, dtype)
    data = harness.make_data(case)
    nnx_result = harness.run_jax(case, data)
    linen_result = harness.run_jax(case, data, module="linen")
    for key in ("out", "weights"):
        np.testing.assert_array_equal(nnx_result[key], linen_result[key])
    for name, g in nnx_result["grads"].items():
        np.testing.assert_array_equal(g, linen_result["grads"][name], err_msg=name)


@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_module_jit_matches_eager(dtype):
    case = harness.Case(harness.CONFIGS["self"], "padding+causal", dtype)
    data = harness.make_data(case)
    eager, jitted = harness.run_jax(case, data), harness.run_jax(case, data, jit=True)
    tol, grad_tol = harness.TOLERANCES[dtype]
    assert max(harness.errors(jitted["out"], eager["out"])) <= tol
    for name in eager["grads"]:
        assert max(harness.grad_errors(name, jitted["grads"][name], eager["grads"])) <= grad_tol, name


def test_jit_grid_passes_parity():
    """One case per dtype through the whole comparison with the JAX side jitted."""
    for dtype in harness.DTYPES:
        result = harness.run_case(harness.Case(harness.CONFIGS["cross-gqa"], "fully-masked", dtype), jit=True)
        assert result.passed, dtype


def test_nnx_dropout_follows_mode_and_rngs():
    model = mha_jax.MultiHeadAttention(4, 16, dropout_rate=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    with pytest.raises(ValueError, match="deterministic"):
        model(x)
    model.eval()  # no dropout: the output of the same weights built without dropout
    plain = mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(x), plain(x))
    model.train()
    a, b = model(x, return_weights=True)[1], model(x, return_weights=True)[1]
    assert not np.array_equal(a, b)  # the stream advances
    c = model(x, rngs=nnx.Rngs(dropout=7), return_weights=True)[1]
    d = model(x, rngs=nnx.Rngs(dropout=7), return_weights=True)[1]
    np.testing.assert_array_equal(c, d)
    assert 0.3 < float(jnp.mean(c == 0)) < 0.7


def test_linen_dropout_uses_the_dropout_collection():
    model = mha_jax.linen.MultiHeadDotProductAttention(4, dropout_rate=0.5)
    x = jnp.ones((2, 6, 16))
    params = model.init(jax.random.key(0), x, deterministic=True)
    run = lambda key: model.apply(params, x, deterministic=False, rngs={"dropout": key}, return_weights=True)[1]  # noqa: E731
    np.testing.assert_array_equal(run(jax.random.key(3)), run(jax.random.key(3)))
    assert not np.array_equal(run(jax.random.key(3)), run(jax.random.key(4)))


def test_torch_dropout_follows_training_mode():
    model = mha_torch.MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    w_train = model(x, need_weights=True)[1]
    assert float((w_train == 0).double().mean()) > 0.3
    model.eval()  # no dropout: the output of the same weights built without dropout
    plain = mha_torch.MultiHeadAttention(16, 4).eval()
    plain.load_state_dict(model.state_dict())
    assert torch.equal(model(x), plain(x))


def test_modules_default_self_attention_and_value_from_key():
    """inputs_k defaults to inputs_q and inputs_v to inputs_k, in both frameworks."""
    jm = mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
    tm = mha_torch.MultiHeadAttention(16, 4).double()
    mha_torch.load_weights(tm, mha_jax.to_torch(jm))
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(2, 3, 16)).astype(np.float32)
    jx, jy = jnp.asarray(x), jnp.asarray(y)
    np.testing.assert_array_equal(jm(jx), jm(jx, jx, jx))
    np.testing.assert_array_equal(jm(jx, jy), jm(jx, jy, jy))
    tm = tm.float()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    assert torch.equal(tm(tx), tm(tx, tx, tx)) and torch.equal(tm(tx, ty), tm(tx, ty, ty))
    np.testing.assert_allclose(np.asarray(jm(jx, jy)), tm(tx, ty).detach().numpy(), rtol=0, atol=1e-5)
