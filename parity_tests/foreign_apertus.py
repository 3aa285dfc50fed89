"""A port of transformers' Apertus in Flax NNX without ``mha_jax``, whose attention keeps ``(batch,
length, heads, head_dim)`` where transformers keeps ``(batch, heads, length, head_dim)``: a fixture
of the tests, not a test file.

transformers' ``ApertusAttention`` transposes its projections to ``(batch, heads, length,
head_dim)`` before its per-head ``q_norm`` and ``k_norm``; this port normalises them in ``(batch,
length, heads, head_dim)`` (``foreign_port.Attention``, the same numbers in another layout), so
that its norms' outputs hold the same numbers as transformers' in another order: ``compare`` must
read them in their layout, never reshape them. Its names are its own (``model.embed``,
``model.layers.N.attn_norm``, ``...attn.q_norm``, ``...ffn.up``). ``build(torch_model, defect)``
loads it from a ``state_dict`` and plants one of ``DEFECTS`` where ``WHERE`` says.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity_tests import foreign_port as fp

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu",
              tie_word_embeddings=False, attention_bias=False,
              rope_parameters=dict(rope_type="default", rope_theta=10000.0))
PORT_CONFIG = {**CONFIG, "head_dim": CONFIG["hidden_size"] // CONFIG["num_attention_heads"]}

adapter = functools.partial(fp.adapter, c=PORT_CONFIG)  # transformers' attention call -> the port's

DEFECTS = ("q-norm over the heads axis", "mlp activation")
# a defect only a padded batch shows: a token's position counts the left padding before it
PADDING_DEFECT = "positions counting the padding"
WHERE = {"q-norm over the heads axis": "model.layers.1.self_attn.q_norm", "mlp activation": "model.layers.0.mlp",
         PADDING_DEFECT: "model.layers.0.self_attn"}

MAPPING = {
    r"model\.embed_tokens": "model.embed",
    r"model\.layers\.(\d+)\.attention_layernorm": r"model.layers.\1.attn_norm",
    r"model\.layers\.(\d+)\.feedforward_layernorm": r"model.layers.\1.ffn_norm",
    r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj": r"model.layers.\1.attn.\2",
    r"model\.layers\.(\d+)\.self_attn": (r"model.layers.\1.attn", adapter),
    r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)": r"model.layers.\1.attn.\2",
    r"model\.layers\.(\d+)\.mlp\.(up|down)_proj": r"model.layers.\1.ffn.\2",
    r"model\.layers\.(\d+)\.mlp": r"model.layers.\1.ffn",
    r"model\.layers\.(\d+)": (r"model.layers.\1", adapter),
    r"model\.norm": "model.final_norm",
}


class FFN(nnx.Module):
    """Apertus' MLP: ``down(activation(up(x)))``."""

    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.up = nnx.Linear(c["hidden_size"], c["intermediate_size"], use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c["intermediate_size"], c["hidden_size"], use_bias=False, rngs=rngs)
        self.activation = jax.nn.silu

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.activation(self.up(x)))


class Block(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.attn_norm = fp.RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.attn = fp.Attention(c, rngs)
        self.ffn_norm = fp.RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.ffn = FFN(c, rngs)

    def __call__(self, x: jax.Array, cache: fp.KVCache, segment_ids: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), cache, segment_ids)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c["vocab_size"], c["hidden_size"], rngs=rngs)
        self.layers = nnx.List([Block(c, rngs) for _ in range(c["num_hidden_layers"])])
        self.final_norm = fp.RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.caches = nnx.List([])  # decoding's caches (``Apertus.init_cache``); a forward pass makes its own

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array, decode: bool = False) -> jax.Array:
        x = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            cache = self.caches[i] if decode else fp.new_cache(tokens.shape[0], x.dtype, PORT_CONFIG)
            x = layer(x, cache, segment_ids)
        return self.final_norm(x)


class Apertus(nnx.Module):
    """``tokens`` ``(batch, length)`` and ``segment_ids`` (default all 1) -> logits ``(batch, length, vocab)``;
    ``decode=True``: appended to the caches ``init_cache`` made, ``position_ids`` -1 for padding (each
    token's position is the number of tokens its row's cache holds before it)."""

    def __init__(self, c: Mapping = PORT_CONFIG):
        rngs = nnx.Rngs(0)
        self.model = Decoder(c, rngs)
        self.lm_head = nnx.Linear(c["hidden_size"], c["vocab_size"], use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None, position_ids=None, *,
                 decode: bool = False) -> jax.Array:
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32) if position_ids is None else (position_ids >= 0)
        return self.lm_head(self.model(tokens, jnp.asarray(segment_ids, jnp.int32), decode))

    def init_cache(self, batch: int, max_length: int) -> None:
        """Empty caches for ``batch`` rows of up to ``max_length`` tokens (``compare_decoding``'s protocol)."""
        self.model.caches = nnx.List([fp.new_cache(batch, jnp.float32, PORT_CONFIG, max_length)
                                      for _ in self.model.layers])


def _names(c: Mapping) -> dict[str, tuple[str, bool]]:
    """The port's parameter -> (transformers' name, transposed)."""
    out = {"model.embed.embedding": ("model.embed_tokens.weight", False),
           "model.final_norm.weight": ("model.norm.weight", False), "lm_head.kernel": ("lm_head.weight", True)}
    for i in range(c["num_hidden_layers"]):
        at = f"model.layers.{i}"
        out[f"{at}.attn_norm.weight"] = (f"{at}.attention_layernorm.weight", False)
        out[f"{at}.ffn_norm.weight"] = (f"{at}.feedforward_layernorm.weight", False)
        out.update({f"{at}.attn.{p}.kernel": (f"{at}.self_attn.{p}_proj.weight", True) for p in "qkvo"})
        out.update({f"{at}.attn.{n}.weight": (f"{at}.self_attn.{n}.weight", False) for n in ("q_norm", "k_norm")})
        out.update({f"{at}.ffn.{p}.kernel": (f"{at}.mlp.{p}_proj.weight", True) for p in ("up", "down")})
    return out


def build(torch_model, defect: str | None = None) -> Apertus:
    """The port of ``torch_model`` (its ``state_dict``, copied), with ``defect`` (one of ``DEFECTS``) planted."""
    port = Apertus()
    params = dict(nnx.to_flat_state(nnx.state(port, nnx.Param)))
    state = torch_model.state_dict()
    for ours, (theirs, transposed) in _names(PORT_CONFIG).items():
        weight = np.array(state[theirs].detach().cpu().numpy(), copy=True)
        params[tuple(int(p) if p.isdigit() else p for p in ours.split("."))].set_value(
            jnp.asarray(weight.T if transposed else weight))
    if defect == "q-norm over the heads axis":
        port.model.layers[1].attn.q_norm.axis = -2
    elif defect == "mlp activation":
        port.model.layers[0].ffn.activation = jax.nn.gelu
    elif defect == PADDING_DEFECT:
        port.model.layers[0].attn.count_padding = True
    elif defect is not None:
        raise ValueError(f"defect must be one of {(*DEFECTS, PADDING_DEFECT)} or None, got {defect!r}")
    return port


def transformers_model(seed: int = 0):
    """transformers' ``ApertusForCausalLM`` of ``CONFIG``, float32, eager attention, random weights
    (its norms' too, so that a norm loaded from the wrong place shows)."""
    import transformers

    return fp.random_model(transformers.ApertusForCausalLM, transformers.ApertusConfig, CONFIG, seed)


inputs = functools.partial(fp.inputs, c=CONFIG)  # two rows of 12 tokens, the second left-padded by 3
