"""``output_gate``: each head's output times the sigmoid (or softplus, Laguna's) of a learned projection of the
query's input, before the output projection (``"head"``: one gate per head, LFM3's; ``"feature"``: one per output
feature, Qwen3-Next's).

Both twins (PyTorch, nnx, linen) against a float64 NumPy oracle, outputs and the gate's gradient, with the same
weights; the weights converted PyTorch -> Flax -> PyTorch unchanged; a decoding step with a cache; bad values
refused alike. Shapes: batch 2, 5 tokens, 32 features, 4 heads over 2 key/value heads, head_dim 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from mha_jax import linen

B, S, E, H, KV, D = 2, 5, 32, 4, 2, 8


def _oracle(x: np.ndarray, state: dict, gate: str) -> np.ndarray:
    """Causal grouped attention in float64, each head's output gated: ``(B, S, E)``."""
    q = (x @ state["q_proj.weight"].T).reshape(B, S, H, D)
    k = np.repeat((x @ state["k_proj.weight"].T).reshape(B, S, KV, D), H // KV, axis=2)
    v = np.repeat((x @ state["v_proj.weight"].T).reshape(B, S, KV, D), H // KV, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    logits = np.where(np.tril(np.ones((S, S), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights, v)
    raw = x @ state["gate_proj.weight"].T
    g = np.log1p(np.exp(raw)) if gate.endswith("_softplus") else 1.0 / (1.0 + np.exp(-raw))
    out = out * (g[..., None] if gate.startswith("head") else g.reshape(B, S, H, D))
    return out.reshape(B, S, H * D) @ state["out_proj.weight"].T


def _torch_module(gate: str) -> mha_torch.MultiHeadAttention:
    torch.manual_seed(0)
    module = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV, bias=False, output_gate=gate, dtype=torch.float64)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return module


def _x() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(B, S, E))


@pytest.mark.parametrize("gate", ["head", "feature", "head_softplus", "feature_softplus"])
def test_gated_output_equals_the_oracle_in_every_twin(gate):
    """PyTorch's, nnx's and linen's outputs, from the same weights, against the oracle; the gate's gradient of
    PyTorch's and nnx's against each other (the twins' chain rule through the gate)."""
    module = _torch_module(gate)
    state = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    assert state["gate_proj.weight"].shape == ((H,) if gate.startswith("head") else (H * D,)) + (E,)
    expected = _oracle(_x(), state, gate)
    x = torch.tensor(_x(), requires_grad=True)
    ours = module(x, is_causal=True)
    ours.sum().backward()
    assert np.abs(ours.detach().numpy() - expected).max() < 1e-12
    with jax.enable_x64(True):
        flax_module = mha_jax.MultiHeadAttention(H, E, E, E, KV, use_bias=False, output_gate=gate,
                                                 param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        mha_jax.load_weights(flax_module, state)
        assert np.abs(np.asarray(flax_module(jnp.asarray(_x()), is_causal=True)) - expected).max() < 1e-12
        grads = nnx.grad(lambda m: m(jnp.asarray(_x()), is_causal=True).sum())(flax_module)
        gate_grad = mha_jax.to_torch(grads)["gate_proj.weight"]
        assert np.abs(gate_grad - module.gate_proj.weight.grad.numpy()).max() < 1e-12
        layer = linen.MultiHeadDotProductAttention(H, num_kv_heads=KV, use_bias=False, output_gate=gate,
                                                   param_dtype=jnp.float64)
        params = mha_jax.from_torch(state, num_heads=H, num_kv_heads=KV)
        out = layer.apply({"params": params}, jnp.asarray(_x()), is_causal=True)
        assert np.abs(np.asarray(out) - expected).max() < 1e-12


@pytest.mark.parametrize("gate", ["head", "feature"])
def test_gate_weights_convert_between_twins_unchanged_and_decode(gate):
    """PyTorch -> Flax -> PyTorch gives every weight back bit for bit; a prompt then one token decoded with a cache
    equals the whole sequence's last row (PyTorch's twin)."""
    module = _torch_module(gate)
    state = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    with jax.enable_x64(True):
        flax_module = mha_jax.MultiHeadAttention(H, E, E, E, KV, use_bias=False, output_gate=gate,
                                                 param_dtype=jnp.float64, rngs=nnx.Rngs(1))
        mha_jax.load_weights(flax_module, state)
        back = mha_jax.to_torch(flax_module)
    assert sorted(back) == sorted(state) and all(np.array_equal(back[k], state[k]) for k in state)
    x = torch.tensor(_x())
    cache = mha_torch.KVCache(B, S, KV, D, dtype=torch.float64)
    with torch.no_grad():
        module(x[:, :-1], cache=cache, is_causal=True)
        step = module(x[:, -1:], cache=cache, is_causal=True)
        whole = module(x, is_causal=True)
    assert np.abs(step.numpy()[:, 0] - whole.numpy()[:, -1]).max() < 1e-12


_REFUSED = r"output_gate must be None or one of \('head', 'feature', 'head_softplus', 'feature_softplus'\), got 'all'"


def test_a_bad_output_gate_is_refused_alike():
    with pytest.raises(ValueError, match=_REFUSED):
        mha_torch.MultiHeadAttention(E, H, output_gate="all")
    with pytest.raises(ValueError, match=_REFUSED):
        mha_jax.MultiHeadAttention(H, E, output_gate="all", rngs=nnx.Rngs(0))
