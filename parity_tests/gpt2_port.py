"""A port of transformers' GPT-2 in Flax NNX built on our attention: a fixture of the tests, not a test file.

Its names are transformers' (``transformer.wte``, ``transformer.h.N.ln_1``, ``...mlp.c_fc``,
``transformer.ln_f``) but for the attention: each ``transformer.h.N.attn`` is one
``mha_jax.MultiHeadAttention`` built by ``mha_jax.from_hf``, which splits GPT-2's fused ``c_attn``
(a ``Conv1D``, weights ``(in, out)``) into ``query``, ``key`` and ``value`` kernels ``(in, heads,
head_dim)`` and reads ``c_proj`` as ``out`` ``(heads, head_dim, out)``. The MLP keeps GPT-2's
``Conv1D`` weights as they are (a kernel is ``(in, out)`` too), and the logits are the hidden states
against ``wte`` (tied, as transformers ties ``lm_head`` to it): one parameter. Its LayerNorms take
the variance as PyTorch does (``use_fast_variance=False``): flax's default ``E[x^2] - E[x]^2``
rounds worse: 30 training steps on two batches carry ``ln_f.bias`` 11.5 times as far from PyTorch's
as PyTorch's own float32 run is from its float64 one (6.8 times with the variance PyTorch's way).
``MAPPING`` pairs the attention's output projection; every parameter pairs without a mapping.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mha_jax

CONFIG = dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
MAPPING = {r"(.*)\.attn\.c_proj": r"\1.attn.out"}


class MLP(nnx.Module):
    def __init__(self, n: int, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(n, 4 * n, rngs=rngs)
        self.c_proj = nnx.Linear(4 * n, n, rngs=rngs)
        self.frozen_bias = False  # a planted defect: c_fc's bias takes no gradient (the forward pass unchanged)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.frozen_bias:
            hidden = x @ self.c_fc.kernel[...] + jax.lax.stop_gradient(self.c_fc.bias[...])
        else:
            hidden = self.c_fc(x)
        return self.c_proj(jax.nn.gelu(hidden, approximate=True))  # GPT-2's gelu_new: the tanh form


class Block(nnx.Module):
    def __init__(self, config: Mapping, state: Mapping, layer: int, rngs: nnx.Rngs):
        n = config["n_embd"]
        eps = config.get("layer_norm_epsilon", 1e-5)
        self.ln_1 = nnx.LayerNorm(n, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.attn = mha_jax.from_hf(config, state, layer=layer, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(n, epsilon=eps, use_fast_variance=False, rngs=rngs)
        self.mlp = MLP(n, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x), is_causal=True)
        return x + self.mlp(self.ln_2(x))


class Transformer(nnx.Module):
    def __init__(self, config: Mapping, state: Mapping, rngs: nnx.Rngs):
        n = config["n_embd"]
        self.wte = nnx.Embed(config["vocab_size"], n, rngs=rngs)
        self.wpe = nnx.Embed(config["n_positions"], n, rngs=rngs)
        self.h = nnx.List([Block(config, state, i, rngs) for i in range(config["n_layer"])])
        self.ln_f = nnx.LayerNorm(n, epsilon=config.get("layer_norm_epsilon", 1e-5), use_fast_variance=False,
                                  rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))[None]
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nnx.Module):
    """``input_ids`` ``(batch, length)`` -> logits ``(batch, length, vocab)``."""

    def __init__(self, config: Mapping, state: Mapping):
        rngs = nnx.Rngs(0)
        self.transformer = Transformer(config, state, rngs)
        load(self, state)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return self.transformer.wte.attend(self.transformer(input_ids))


def load(port: GPT2LMHeadModel, state: Mapping) -> None:
    """Everything but the attention (``from_hf`` read it) from transformers' names, each copied:
    a Conv1D's weight is already a kernel's ``(in, out)``, a LayerNorm's weight is its scale."""
    leaves = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
    for path, variable in nnx.to_flat_state(nnx.state(port, nnx.Param)):
        name = ".".join(str(p) for p in path)
        if ".attn." in name:
            continue
        module, _, leaf = name.rpartition(".")
        variable.set_value(jnp.asarray(np.array(state[f"{module}.{leaves[leaf]}"], copy=True)))


def transformers_model(seed: int = 0):
    """transformers' ``GPT2LMHeadModel`` of ``CONFIG``, float32, eager attention, random weights
    (its LayerNorms' too, so that one loaded from the wrong place shows)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def build(torch_model) -> GPT2LMHeadModel:
    """The port of ``torch_model``, from its ``state_dict`` (as NumPy) and config."""
    state = {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}
    return GPT2LMHeadModel(torch_model.config.to_dict(), state)


def inputs(rows: int = 2, length: int = 12, seed: int = 0) -> np.ndarray:
    """Token ids ``(rows, length)``, no padding."""
    return np.random.default_rng(seed).integers(1, CONFIG["vocab_size"], (rows, length))


# factories for ``mha-parity compare`` (``parity_tests.gpt2_port:NAME``)

def torch_model() -> object:
    return transformers_model()


def port() -> GPT2LMHeadModel:
    return build(transformers_model())


def port_with_a_frozen_bias() -> GPT2LMHeadModel:
    """The port whose layer 1 MLP's ``c_fc`` bias takes no gradient: its forward pass is right, its training not."""
    model = port()
    model.transformer.h[1].mlp.frozen_bias = True
    return model


def batch() -> tuple[np.ndarray]:
    return (inputs(),)
