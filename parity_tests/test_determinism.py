"""Determinism: repeated (jitted) calls give the same bits, the same seed gives the same
dropout within a framework (and another seed another), and loading the same file twice gives
the same parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

import mha_jax
import mha_torch

B, H, HK, Q, K, D = 2, 4, 2, 6, 9, 8


def _qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, Q, H, D), (B, K, HK, D), (B, K, HK, D))]


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_jitted_core_is_bitwise_repeatable(implementation):
    """Forward and gradients of the jitted JAX core, with a mask, causality and dropout drawn
    from a key: three calls give identical bits."""
    q, k, v = _qkv()
    mask = jnp.asarray(np.random.default_rng(1).random((B, 1, Q, K)) < 0.7)

    def loss(q, k, v):
        out = mha_jax.dot_product_attention(q, k, v, mask=mask, is_causal=True, dropout_rate=0.3,
                                            dropout_rng=jax.random.key(3), implementation=implementation)
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    first = _bits(step(q, k, v))
    for _ in range(2):
        assert _bits(step(q, k, v)) == first


def test_jitted_modules_are_bitwise_repeatable():
    """``nnx.jit`` of the nnx module and ``jax.jit`` of the linen module's ``apply``: repeated
    calls give identical bits."""
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, Q, 16)), jnp.float32)
    module = mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, x: m(x, is_causal=True))
    first = _bits(call(module, x))
    assert _bits(call(module, x)) == first and _bits(call(module, x)) == first
    linen = mha_jax.linen.MultiHeadDotProductAttention(4, num_kv_heads=2)
    params = linen.init(jax.random.key(0), x)
    apply = jax.jit(lambda p, x: linen.apply(p, x, is_causal=True))
    first = _bits(apply(params, x))
    assert _bits(apply(params, x)) == first and _bits(apply(params, x)) == first


@pytest.mark.parametrize("implementation", ["math", "sdpa"])
def test_torch_calls_are_bitwise_repeatable(implementation):
    """Forward and backward of the PyTorch module (no dropout), repeated: identical bits."""
    torch.manual_seed(0)
    module = mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, implementation=implementation)
    x = torch.randn(B, Q, 16)

    def run():
        inputs = x.clone().requires_grad_(True)
        module.zero_grad()
        module(inputs, is_causal=True).pow(2).sum().backward()
        return [inputs.grad.clone()] + [p.grad.clone() for p in module.parameters()]

    first = run()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(run(), first))


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_jax_same_key_same_dropout(implementation):
    """The JAX core, jitted: the same ``dropout_rng`` drops the same weights, another key
    others."""
    q, k, v = _qkv()
    run = jax.jit(lambda key: mha_jax.dot_product_attention(
        q, k, v, dropout_rate=0.5, dropout_rng=key, implementation=implementation))
    a, b, c = run(jax.random.key(7)), run(jax.random.key(7)), run(jax.random.key(8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_nnx_modules_built_from_one_seed_drop_alike():
    """Two nnx modules built with the same ``nnx.Rngs`` seeds draw the same dropout, call after
    call (their streams advance alike); a third with another dropout seed draws other masks."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, Q, 16)), jnp.float32)
    build = lambda seed: mha_jax.MultiHeadAttention(  # noqa: E731
        4, 16, dropout_rate=0.5, deterministic=False, rngs=nnx.Rngs(params=0, dropout=seed))
    a, b, c = build(1), build(1), build(2)
    for _ in range(2):
        wa, wb, wc = (m(x, return_weights=True)[1] for m in (a, b, c))
        assert np.array_equal(wa, wb) and not np.array_equal(wa, wc)


@pytest.mark.parametrize("implementation", ["math", "sdpa"])
def test_torch_same_seed_same_dropout(implementation):
    """The PyTorch module in training mode: after ``torch.manual_seed(s)`` the same seed gives
    the same output and gradients, another seed another output."""
    torch.manual_seed(0)
    module = mha_torch.MultiHeadAttention(16, 4, dropout=0.5, implementation=implementation).train()
    x = torch.randn(B, Q, 16)

    def run(seed):
        torch.manual_seed(seed)
        inputs = x.clone().requires_grad_(True)
        out = module(inputs)
        out.sum().backward()
        return out.detach(), inputs.grad

    (a, ga), (b, gb), (c, _) = run(1), run(1), run(2)
    assert torch.equal(a, b) and torch.equal(ga, gb) and not torch.equal(a, c)


def test_loading_one_file_twice_gives_identical_parameters(tmp_path):
    """One ``.safetensors`` file (bfloat16 weights) read twice by ``from_torch``, loaded into two
    fresh nnx modules and into two PyTorch modules: identical bits every time, equal to the file's."""
    torch.manual_seed(0)
    source = mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.bfloat16)
    path = tmp_path / "weights.safetensors"
    save_file(source.state_dict(), path)
    first, second = (mha_jax.from_torch(path, num_heads=4, num_kv_heads=2) for _ in range(2))
    assert _bits(first) == _bits(second)

    def flax_module(seed):
        module = mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
        mha_jax.load_weights(module, path)
        return module

    loaded = [_bits(nnx.to_pure_dict(nnx.state(flax_module(seed), nnx.Param))) for seed in (1, 2)]
    assert loaded[0] == loaded[1] == _bits(first)
    torch_modules = [mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.bfloat16) for _ in range(2)]
    for module in torch_modules:
        mha_torch.load_weights(module, path)
    for name, tensor in source.state_dict().items():
        assert torch.equal(torch_modules[0].state_dict()[name], tensor), name
        assert torch.equal(torch_modules[1].state_dict()[name], tensor), name
