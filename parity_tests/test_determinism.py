"""Determinism: two separately started processes, each building its own modules and compiling
its own programs, give the same bits for the same inputs and seeds (and other seeds give other
dropout); modules built apart from one seed draw alike; loading a file gives its bits."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

import mha_jax
import mha_torch
from parity_tests.tool.arrays import same_bits

ROOT = pathlib.Path(__file__).resolve().parent.parent
B, H, HK, Q, K, D = 2, 4, 2, 6, 9, 8

# Run in a fresh process: every module built and every program compiled there, from seeds; prints
# the SHA-256 of each result's bytes. ``ORDER`` reverses the order in which they are built.
PROGRAM = r'''
import hashlib, json, os, sys
import numpy as np, jax, jax.numpy as jnp, torch
from flax import nnx
import mha_jax, mha_torch
jax.config.update("jax_enable_x64", True)
B, H, HK, Q, K, D = 2, 4, 2, 6, 9, 8
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, Q, H, D), (B, K, HK, D), (B, K, HK, D)))
mask = jnp.asarray(rng.random((B, 1, Q, K)) < 0.7)
x = rng.normal(size=(B, Q, 16)).astype(np.float32)

def digest(tree):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()

def core(implementation, key):
    def loss(q, k, v):
        out = mha_jax.dot_product_attention(q, k, v, mask=mask, is_causal=True, dropout_rate=0.3,
                                            dropout_rng=jax.random.key(key), implementation=implementation)
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)), out
    return digest(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v))

def modules():
    module = mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, rngs=nnx.Rngs(0))
    linen = mha_jax.linen.MultiHeadDotProductAttention(4, num_kv_heads=2)
    params = linen.init(jax.random.key(0), jnp.asarray(x))
    return digest([nnx.jit(lambda m, x: m(x, is_causal=True))(module, jnp.asarray(x)),
                   jax.jit(lambda p, x: linen.apply(p, x, is_causal=True))(params, jnp.asarray(x))])

def torch_module(implementation, dropout_seed=None):
    torch.manual_seed(0)
    module = mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, dropout=0.5 if dropout_seed else 0.0,
                                          implementation=implementation).train(bool(dropout_seed))
    inputs = torch.from_numpy(x).requires_grad_(True)
    if dropout_seed:
        torch.manual_seed(dropout_seed)
    out = module(inputs, is_causal=True)
    out.pow(2).sum().backward()
    return digest([out.detach().numpy(), inputs.grad.numpy()] + [p.grad.numpy() for p in module.parameters()])

jobs = {
    **{f"jax core {i} key {key}": (lambda i=i, key=key: core(i, key)) for i in ("xla", "blockwise") for key in (3, 4)},
    "jax nnx and linen modules": modules,
    **{f"torch {i} seed {s}": (lambda i=i, s=s: torch_module(i, s)) for i in ("math", "sdpa") for s in (None, 1, 2)},
}
names = list(jobs)[::-1] if os.environ["ORDER"] == "reversed" else list(jobs)
print(json.dumps({name: jobs[name]() for name in names}))
'''


def _fresh_process(order: str) -> subprocess.Popen:
    env = dict(os.environ, ORDER=order, PYTHONHASHSEED=str(len(order)))
    return subprocess.Popen([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_compute_the_same_bits():
    """Forward and gradients of both JAX cores (mask, causality, dropout from a key), the jitted
    nnx and linen modules, and the PyTorch module (both implementations, with and without
    dropout from ``torch.manual_seed``): two processes, building and compiling everything in
    opposite orders, agree bit for bit; another dropout key or seed gives other bits."""
    runs = [_fresh_process(order) for order in ("forward", "reversed")]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    first, second = results
    assert first.keys() == second.keys()
    differ = [name for name in first if first[name] != second[name]]
    assert not differ, f"differ between processes: {differ}"
    for implementation in ("xla", "blockwise"):
        assert first[f"jax core {implementation} key 3"] != first[f"jax core {implementation} key 4"], implementation
    for implementation in ("math", "sdpa"):
        assert first[f"torch {implementation} seed 1"] != first[f"torch {implementation} seed 2"], implementation
        assert first[f"torch {implementation} seed 1"] != first[f"torch {implementation} seed None"], implementation


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_two_compiled_programs_drop_alike_from_one_key(implementation):
    """Two separately jitted programs (different functions, compiled apart) given the same
    ``dropout_rng`` drop the same weights; the same program with another key drops others."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, Q, H, D), (B, K, HK, D), (B, K, HK, D)))

    def program(scale):
        return jax.jit(lambda key: scale * mha_jax.dot_product_attention(
            q, k, v, dropout_rate=0.5, dropout_rng=key, implementation=implementation))

    one, other = program(1.0), program(jnp.float32(1.0))
    a, b, c = one(jax.random.key(7)), other(jax.random.key(7)), one(jax.random.key(8))
    assert same_bits(a, b) and not same_bits(a, c)


def test_nnx_modules_built_from_one_seed_drop_alike():
    """Two nnx modules built with the same ``nnx.Rngs`` seeds draw the same dropout, call after
    call (their streams advance alike); a third with another dropout seed draws other masks."""
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, Q, 16)), jnp.float32)
    build = lambda seed: mha_jax.MultiHeadAttention(  # noqa: E731
        4, 16, dropout_rate=0.5, deterministic=False, rngs=nnx.Rngs(params=0, dropout=seed))
    a, b, c = build(1), build(1), build(2)
    for _ in range(2):
        wa, wb, wc = (m(x, return_weights=True)[1] for m in (a, b, c))
        assert same_bits(wa, wb) and not same_bits(wa, wc)


def test_loading_one_file_gives_its_bits(tmp_path):
    """One ``.safetensors`` file (bfloat16 weights) read by ``from_torch``, loaded into two
    fresh nnx modules built from different seeds and into two PyTorch modules: every tensor
    holds the file's bits."""
    torch.manual_seed(0)
    source = mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.bfloat16)
    path = tmp_path / "weights.safetensors"
    save_file(source.state_dict(), path)
    expected = source.state_dict()
    read = mha_jax.to_torch(mha_jax.from_torch(path, num_heads=4, num_kv_heads=2))
    assert all(same_bits(read[name], tensor) for name, tensor in expected.items())
    for seed in (1, 2):
        module = mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
        mha_jax.load_weights(module, path)
        loaded = mha_jax.to_torch(module)
        assert all(same_bits(loaded[name], tensor) for name, tensor in expected.items()), seed
    for _ in range(2):
        module = mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=torch.bfloat16)
        mha_torch.load_weights(module, path)
        assert all(same_bits(module.state_dict()[name], tensor) for name, tensor in expected.items())
