"""Greedy generation with a key/value cache, the same tiny decoder in Flax and in PyTorch.

A one-block decoder (embedding, causal self-attention with 4 query and 2 key/value heads, an
MLP, an output head) is built in Flax on ``mha_jax.MultiHeadAttention``, its weights are
converted to the PyTorch twin built on ``mha_torch.MultiHeadAttention``, and both generate 16
tokens greedily from the same ragged batch of prompts: the prompts in one call each, then one
token a step, each framework with its own cache. Run: ``python examples/generate.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

import mha_jax
import mha_torch

VOCAB, DIM, HEADS, KV_HEADS, MAX_LENGTH = 64, 32, 4, 2, 32


class FlaxDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.attention = mha_jax.MultiHeadAttention(HEADS, DIM, num_kv_heads=KV_HEADS, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits ``(batch, n, vocab)`` of ``n`` new tokens, appended to the attention's cache."""
        h = self.embed(tokens)
        h = h + self.attention(h, decode=True, is_causal=True, query_positions=positions)
        h = h + self.down(jax.nn.gelu(self.up(h), approximate=True))
        return self.head(h)


class TorchDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.attention = mha_torch.MultiHeadAttention(DIM, HEADS, num_kv_heads=KV_HEADS)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, cache: mha_torch.KVCache,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.attention(h, cache=cache, is_causal=True, query_positions=positions)
        h = h + self.down(torch.nn.functional.gelu(self.up(h), approximate="tanh"))
        return self.head(h)


def convert(flax_model: FlaxDecoder) -> TorchDecoder:
    """The PyTorch decoder with the Flax decoder's weights (attention through ``mha_jax.to_torch``)."""
    model = TorchDecoder().eval()
    state = {f"attention.{k}": v for k, v in mha_jax.to_torch(flax_model.attention).items()}
    state["embed.weight"] = np.asarray(flax_model.embed.embedding[...])
    for name in ("up", "down", "head"):
        layer = getattr(flax_model, name)
        state[f"{name}.weight"], state[f"{name}.bias"] = np.asarray(layer.kernel[...]).T, np.asarray(layer.bias[...])
    model.load_state_dict({k: torch.from_numpy(np.array(v, copy=True)) for k, v in state.items()})
    return model


def generate(prompts: np.ndarray, positions: np.ndarray, steps: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens ``(batch, steps)`` from each framework, for left-padded ``prompts`` whose
    padding has position -1."""
    flax_model = FlaxDecoder(nnx.Rngs(0))
    torch_model = convert(flax_model)
    batch = prompts.shape[0]
    flax_model.attention.init_cache((batch, MAX_LENGTH, DIM))
    cache = mha_torch.KVCache(batch, MAX_LENGTH, KV_HEADS, DIM // HEADS)

    step = nnx.jit(lambda model, tokens: model(tokens))  # one compiled step for every position
    logits = flax_model(jnp.asarray(prompts), jnp.asarray(positions))
    token = jnp.argmax(logits[:, -1], axis=-1)
    flax_tokens = [token]
    for _ in range(steps - 1):
        token = jnp.argmax(step(flax_model, token[:, None])[:, -1], axis=-1)
        flax_tokens.append(token)

    with torch.no_grad():
        logits = torch_model(torch.from_numpy(prompts), cache, torch.from_numpy(positions))
        token = logits[:, -1].argmax(-1)
        torch_tokens = [token]
        for _ in range(steps - 1):
            token = torch_model(token[:, None], cache)[:, -1].argmax(-1)
            torch_tokens.append(token)
    return np.stack([np.asarray(t) for t in flax_tokens], 1), torch.stack(torch_tokens, 1).numpy()


def main() -> None:
    prompts = np.array([[5, 9, 13, 2, 7], [0, 0, 11, 3, 8]])  # the second prompt is left-padded
    positions = np.array([[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2]])
    flax_tokens, torch_tokens = generate(prompts, positions)
    print("flax:   ", flax_tokens.tolist())
    print("pytorch:", torch_tokens.tolist())
    print("same tokens" if np.array_equal(flax_tokens, torch_tokens) else "DIFFERENT TOKENS")


if __name__ == "__main__":
    main()
