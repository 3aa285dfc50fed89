"""A port written as another team would write it: transformers' Qwen3 in Flax NNX without ``mha_jax``.

Its names are its own (``model.embed``, ``model.layers.N.attn.q``, ``model.layers.N.mlp.up``,
``model.final_norm``); its attention is called ``attn(x, cache, segment_ids)``: it computes each
token's position from the segment ids (0: padding) and the tokens its cache already holds, rotates
queries and keys by its own sine and cosine tables, and appends its keys and values to the cache
(an ``nnx.Variable``) on every call. The model builds an empty cache per layer on each call,
so a whole-model call is a prefill of ``tokens`` ``(batch, length)`` with ``segment_ids`` (1 for
a token, 0 for padding, as transformers' ``attention_mask``).

``build(torch_model, defect=None)`` loads the port from a PyTorch ``state_dict``; ``defect`` plants
one of ``DEFECTS`` (``WHERE`` names the PyTorch module that holds it). ``MAPPING`` pairs the names
by hand; ``ADAPTED`` also gives the attention and decoder layers ``adapter``, which turns
transformers' recorded call into the port's. A fixture of the tests, not a test file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from parity_tests.porting import record

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False, attention_bias=False,
              rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0))
CACHE_LENGTH = 64  # key/value slots of each layer's cache: a call appends after what the cache holds

DEFECTS = ("rms epsilon", "mlp activation", "rope theta", "skipped k-norm", "attention scale")
# the PyTorch module whose JAX twin holds each defect
WHERE = {"rms epsilon": "model.layers.1.post_attention_layernorm", "mlp activation": "model.layers.0.mlp",
         "rope theta": "model.layers.1.self_attn", "skipped k-norm": "model.layers.1.self_attn",
         "attention scale": "model.layers.1.self_attn"}

MAPPING = {
    r"model\.embed_tokens": "model.embed",
    r"model\.layers\.(\d+)\.input_layernorm": r"model.layers.\1.attn_norm",
    r"model\.layers\.(\d+)\.post_attention_layernorm": r"model.layers.\1.mlp_norm",
    r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj": r"model.layers.\1.attn.\2",
    r"model\.layers\.(\d+)\.self_attn": r"model.layers.\1.attn",
    r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)": r"model.layers.\1.attn.\2",
    r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj": r"model.layers.\1.mlp.\2",
    r"model\.norm": "model.final_norm",
}


class KVCache(nnx.Variable):
    """One layer's cache: ``k``, ``v`` ``(batch, slots, kv_heads, head_dim)``, each slot's ``segments``
    and ``positions`` ``(batch, slots)``, ``end`` (slots filled) and ``count`` ``(batch,)`` (tokens per row)."""


def new_cache(batch: int, dtype=jnp.float32, c: Mapping = CONFIG, slots: int = CACHE_LENGTH) -> KVCache:
    """An empty cache for ``batch`` rows."""
    kv = jnp.zeros((batch, slots, c["num_key_value_heads"], c["head_dim"]), dtype)
    index = jnp.zeros((batch, slots), jnp.int32)
    return KVCache(dict(k=kv, v=kv, segments=index, positions=index, end=jnp.int32(0),
                        count=jnp.zeros((batch,), jnp.int32)))


class Table(nnx.Variable):
    """A constant table (the rotary sines and cosines), not a parameter."""


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float):
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32))
        self.eps = eps
        self.axis = -1  # the axis whose root mean square it divides by (a planted defect moves it)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` ``(..., size)`` over its root mean square, times the weight."""
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=self.axis, keepdims=True) + self.eps) * self.weight[...]


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x`` ``(batch, length, heads, dim)`` rotated by ``cos``, ``sin`` ``(batch, length, dim // 2)``:
    the first half of the features paired with the second."""
    first, second = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs, theta: float | None = None):
        h, d = c["hidden_size"], c["head_dim"]
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], d
        self.q = nnx.Linear(h, self.heads * d, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(h, self.kv_heads * d, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(h, self.kv_heads * d, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(self.heads * d, h, use_bias=False, rngs=rngs)
        self.q_norm = RMSNorm(d, c["rms_norm_eps"])
        self.k_norm = RMSNorm(d, c["rms_norm_eps"])
        theta = c["rope_parameters"]["rope_theta"] if theta is None else theta
        angles = np.arange(c["max_position_embeddings"])[:, None] * theta ** (-np.arange(0, d, 2) / d)
        self.cos = Table(jnp.asarray(np.cos(angles), jnp.float32))
        self.sin = Table(jnp.asarray(np.sin(angles), jnp.float32))
        self.scale = 1 / math.sqrt(d)
        self.use_k_norm = True
        self.count_padding = False  # a planted defect: a token's position counts the padding before it

    def __call__(self, x: jax.Array, cache: KVCache, segment_ids: jax.Array) -> jax.Array:
        """``x`` ``(batch, length, hidden)`` -> ``(batch, length, hidden)``; appends to ``cache``."""
        b, n, _ = x.shape
        q = self.q_norm(self.q(x).reshape(b, n, self.heads, self.head_dim))
        k = self.k(x).reshape(b, n, self.kv_heads, self.head_dim)
        k = self.k_norm(k) if self.use_k_norm else k
        v = self.v(x).reshape(b, n, self.kv_heads, self.head_dim)
        state = cache.get_value()
        real = (segment_ids != 0).astype(jnp.int32)
        counted = jnp.ones_like(real) if self.count_padding else real
        positions = jnp.maximum(state["count"][:, None] + jnp.cumsum(counted, axis=1, dtype=jnp.int32) - 1, 0)
        cos, sin = self.cos[...][positions], self.sin[...][positions]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        state = _append(state, k, v, segment_ids.astype(jnp.int32), positions, real)
        cache.set_value(state)
        return self.o(self._attend(q, state, segment_ids, positions).reshape(b, n, -1))

    def _attend(self, q, state, segment_ids, positions) -> jax.Array:
        """Queries ``(batch, length, heads, dim)`` over the cache's keys of their own segment at
        positions up to theirs."""
        groups = self.heads // self.kv_heads
        k, v = jnp.repeat(state["k"], groups, axis=2), jnp.repeat(state["v"], groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        segments, key_positions = state["segments"][:, None, :], state["positions"][:, None, :]
        filled = jnp.arange(segments.shape[-1]) < state["end"]
        visible = (segments == segment_ids[:, :, None]) & (segments != 0) & filled
        visible &= key_positions <= positions[:, :, None]
        scores = jnp.where(visible[:, None], scores, jnp.finfo(scores.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _append(state: dict, k, v, segments, positions, real) -> dict:
    """The cache with ``length`` new slots written at its end."""
    at = state["end"]
    zero = jnp.zeros_like(at)
    return dict(k=jax.lax.dynamic_update_slice(state["k"], k.astype(state["k"].dtype), (zero, at, zero, zero)),
                v=jax.lax.dynamic_update_slice(state["v"], v.astype(state["v"].dtype), (zero, at, zero, zero)),
                segments=jax.lax.dynamic_update_slice(state["segments"], segments, (zero, at)),
                positions=jax.lax.dynamic_update_slice(state["positions"], positions, (zero, at)),
                end=at + k.shape[1], count=state["count"] + real.sum(axis=1, dtype=jnp.int32))


class MLP(nnx.Module):
    """The gated MLP: ``down(activation(gate(x)) * up(x))``."""

    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        sizes = {"gate": (c["hidden_size"], c["intermediate_size"]), "up": (c["hidden_size"], c["intermediate_size"]),
                 "down": (c["intermediate_size"], c["hidden_size"])}
        for name, (n_in, n_out) in sizes.items():
            setattr(self, name, nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs))
        self.activation = jax.nn.silu

    def __call__(self, x: jax.Array) -> jax.Array:
        gated = self.activation(self.gate(x)) * self.up(x)
        return self.down(gated)


class Block(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.attn = Attention(c, rngs)
        self.mlp_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c, rngs)

    def __call__(self, x: jax.Array, cache: KVCache, segment_ids: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cache, segment_ids)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c["vocab_size"], c["hidden_size"], rngs=rngs)
        self.layers = nnx.List([Block(c, rngs) for _ in range(c["num_hidden_layers"])])
        self.final_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, new_cache(tokens.shape[0], x.dtype), segment_ids)
        return self.final_norm(x)


class Qwen3(nnx.Module):
    """``tokens`` ``(batch, length)`` and ``segment_ids`` (default all 1) -> logits ``(batch, length, vocab)``."""

    def __init__(self, c: Mapping = CONFIG, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.model = Decoder(c, rngs)
        self.lm_head = nnx.Linear(c["hidden_size"], c["vocab_size"], use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        segment_ids = jnp.ones(tokens.shape, jnp.int32) if segment_ids is None else segment_ids
        return self.lm_head(self.model(tokens, segment_ids))


# the port's parameter -> (transformers' name, transposed)
def _names(c: Mapping) -> dict[str, tuple[str, bool]]:
    out = {"model.embed.embedding": ("model.embed_tokens.weight", False),
           "model.final_norm.weight": ("model.norm.weight", False), "lm_head.kernel": ("lm_head.weight", True)}
    renames = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    for i in range(c["num_hidden_layers"]):
        theirs, ours = f"model.layers.{i}", f"model.layers.{i}"
        for name, torch_name in renames.items():
            out[f"{ours}.{name}.weight"] = (f"{theirs}.{torch_name}.weight", False)
        for p in "qkvo":
            out[f"{ours}.attn.{p}.kernel"] = (f"{theirs}.self_attn.{p}_proj.weight", True)
        for norm in ("q_norm", "k_norm"):
            out[f"{ours}.attn.{norm}.weight"] = (f"{theirs}.self_attn.{norm}.weight", False)
        for p in ("gate", "up", "down"):
            out[f"{ours}.mlp.{p}.kernel"] = (f"{theirs}.mlp.{p}_proj.weight", True)
    return out


def load(port: Qwen3, state_dict: Mapping, c: Mapping = CONFIG) -> Qwen3:
    """The PyTorch ``state_dict``'s arrays (copied) into ``port``: a Linear's kernel is the weight transposed."""
    params = dict(nnx.to_flat_state(nnx.state(port, nnx.Param)))
    for ours, (theirs, transposed) in _names(c).items():
        weight = np.array(state_dict[theirs].detach().cpu().numpy(), copy=True)
        params[tuple(int(p) if p.isdigit() else p for p in ours.split("."))].set_value(
            jnp.asarray(weight.T if transposed else weight))
    return port


def plant(port: Qwen3, defect: str | None) -> Qwen3:
    """``port`` with ``defect`` (one of ``DEFECTS``, or None) planted where ``WHERE`` says."""
    layers = port.model.layers
    if defect == "rms epsilon":
        layers[1].mlp_norm.eps = 1e-5
    elif defect == "mlp activation":
        layers[0].mlp.activation = jax.nn.gelu
    elif defect == "rope theta":
        fresh = Attention(CONFIG, nnx.Rngs(0), theta=10_000.0)
        layers[1].attn.cos, layers[1].attn.sin = fresh.cos, fresh.sin
    elif defect == "skipped k-norm":
        layers[1].attn.use_k_norm = False
    elif defect == "attention scale":
        layers[1].attn.scale = 1 / layers[1].attn.head_dim
    elif defect is not None:
        raise ValueError(f"defect must be one of {DEFECTS} or None, got {defect!r}")
    return port


def build(torch_model, defect: str | None = None) -> Qwen3:
    """The port of ``torch_model`` (its ``state_dict``), with ``defect`` planted."""
    return plant(load(Qwen3(CONFIG), torch_model.state_dict()), defect)


def transformers_model(seed: int = 0):
    """transformers' ``Qwen3ForCausalLM`` of ``CONFIG``, float32, eager attention, random weights
    (norm weights too, so that a norm loaded from the wrong place shows)."""
    import transformers

    return random_model(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, CONFIG, seed)


def random_model(model_class, config_class, c: Mapping, seed: int = 0):
    """transformers' ``model_class`` of config ``c`` (a ``config_class``), float32, eager attention,
    random weights, its norms' weights moved off 1 by ``0.1 * N(0, 1)``."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config_class(**c, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs(rows: int = 2, length: int = 12, seed: int = 0, c: Mapping = CONFIG) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (of config ``c``'s vocabulary) and the attention mask (the port's segment ids): the
    second row left-padded by 3."""
    ids = np.random.default_rng(seed).integers(3, c["vocab_size"], (rows, length))
    mask = np.ones((rows, length), np.int64)
    mask[1:, :3] = 0
    return ids, mask


def adapter(call: Mapping[str, np.ndarray], c: Mapping = CONFIG) -> tuple[tuple, dict]:
    """transformers' recorded attention (or decoder layer) call -> the port's ``(x, cache, segment_ids)``:
    ``hidden_states``, an empty cache (of config ``c``), and each key's segment (1 where any query may
    attend to it) read from the 4-d ``attention_mask`` (bool, or additive with 0 where attended; absent: all 1)."""
    x = call["hidden_states"]
    mask = call.get("attention_mask")
    if mask is None:
        segments = np.ones(x.shape[:2], np.int32)
    else:
        attended = mask if mask.dtype == bool else mask == 0
        segments = np.broadcast_to(attended, (x.shape[0], *attended.shape[1:]))[:, 0].any(axis=1).astype(np.int32)
    return (jnp.asarray(x), new_cache(x.shape[0], jnp.asarray(x).dtype, c), jnp.asarray(segments)), {}


ADAPTED = {
    **MAPPING,
    r"model\.layers\.(\d+)\.self_attn": (r"model.layers.\1.attn", adapter),
    r"model\.layers\.(\d+)": (r"model.layers.\1", adapter),
}


def fixtures(port) -> tuple:
    """The tests' module-scoped fixtures of a foreign port module ``port``: ``torch_model`` (its
    transformers model), ``batch`` (its ``inputs()``: two rows, the second left-padded by 3) and
    ``reference`` (PyTorch's recording of the batch); assign them to names in a test module."""

    @pytest.fixture(scope="module", name="torch_model")
    def torch_model():
        return port.transformers_model()

    @pytest.fixture(scope="module", name="batch")
    def batch():
        return port.inputs()

    @pytest.fixture(scope="module", name="reference")
    def reference(torch_model, batch):
        return record(torch_model, *batch)

    return torch_model, batch, reference
