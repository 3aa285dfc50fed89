"""A Llama-family decoder in Flax (nnx) on ``mha_jax``, and its check against transformers.

The port mirrors transformers' ``LlamaForCausalLM`` name for name, except inside the attention:
each layer's ``self_attn`` is one ``mha_jax.MultiHeadAttention`` (built by ``mha_jax.from_hf``:
rotary embedding, grouped heads and the scale read from the config), whose projections are
``query``/``key``/``value``/``out`` where transformers has ``q_proj``/``k_proj``/``v_proj``/``o_proj``;
``MAPPING`` pairs them; with tied embeddings (``tie_word_embeddings``) the port has no
``lm_head``: the logits are computed with the token embedding. It reads a ``save_pretrained``
folder (``config.json`` and ``model.safetensors``) without PyTorch, and decodes greedily with the
attention's key/value cache: ``init_cache(batch, max_length)``, then calls with ``decode=True``
and each token's position (``-1``: padding, not cached), so that a row gives the same tokens
alone as in a left- or right-padded batch. Run ``python examples/llama.py`` to compare a small random model with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hf_weights import load_modules

import mha_jax

MAPPING = {
    r"(.*)\.self_attn\.q_proj": r"\1.self_attn.query",
    r"(.*)\.self_attn\.k_proj": r"\1.self_attn.key",
    r"(.*)\.self_attn\.v_proj": r"\1.self_attn.value",
    r"(.*)\.self_attn\.o_proj": r"\1.self_attn.out",
    r"model\.rotary_emb": None,  # the port's rotary embedding is inside each attention
}

# a small Llama 3: 2 layers, 4 query and 2 key/value heads of 16 features
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
              # Llama 3's rotary frequency scaling; an original length of 8 makes it change most frequencies
              rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8))


class MLP(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs, **c["dtypes"])
        self.up_proj = nnx.Linear(h, i, use_bias=False, rngs=rngs, **c["dtypes"])
        self.down_proj = nnx.Linear(i, h, use_bias=False, rngs=rngs, **c["dtypes"])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, c: Mapping, layer: int, state: Mapping | None, rngs: nnx.Rngs):
        self.input_layernorm = nnx.RMSNorm(c["hidden_size"], epsilon=c["rms_norm_eps"], rngs=rngs, **c["dtypes"])
        self.self_attn = mha_jax.from_hf(c, state, layer=layer, rngs=rngs,
                                         param_dtype=c["dtypes"].get("param_dtype", jnp.float32))
        self.post_attention_layernorm = nnx.RMSNorm(c["hidden_size"], epsilon=c["rms_norm_eps"], rngs=rngs,
                                                    **c["dtypes"])
        self.mlp = MLP(c, rngs)

    def __call__(self, hidden_states: jax.Array, *, mask, positions, decode: bool = False) -> jax.Array:
        attended = self.self_attn(self.input_layernorm(hidden_states), mask=mask, is_causal=True,
                                  query_positions=positions, decode=decode)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Model(nnx.Module):
    def __init__(self, c: Mapping, state: Mapping | None, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(c["vocab_size"], c["hidden_size"], rngs=rngs, **c["dtypes"])
        self.layers = nnx.List([DecoderLayer(c, i, state, rngs) for i in range(c["num_hidden_layers"])])
        self.norm = nnx.RMSNorm(c["hidden_size"], epsilon=c["rms_norm_eps"], rngs=rngs, **c["dtypes"])

    def __call__(self, input_ids, *, mask, positions, decode: bool = False) -> jax.Array:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask=mask, positions=positions, decode=decode)
        return self.norm(hidden_states)


class LlamaForCausalLM(nnx.Module):
    """``input_ids`` ``(batch, length)`` -> logits ``(batch, length, vocab)``. ``param_dtype``: the
    parameters' and computations' dtype (default: flax's, the parameters as the checkpoint holds them)."""

    def __init__(self, config: Mapping, state: Mapping | None = None, *, rngs: nnx.Rngs | None = None,
                 param_dtype=None):
        dtypes = {} if param_dtype is None else {"param_dtype": param_dtype, "dtype": param_dtype}
        # a Mistral's config (its sliding window) reads as its own
        c = {"model_type": "llama", **config, "dtypes": dtypes}
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.model = Model(c, state, rngs)
        # tied embeddings (transformers' tie_word_embeddings, no lm_head.weight saved): the logits
        # are the hidden states against the token embedding, one parameter for both
        tied = c.get("tie_word_embeddings", False)
        self.lm_head = None if tied else nnx.Linear(c["hidden_size"], c["vocab_size"], use_bias=False, rngs=rngs,
                                                    **dtypes)
        if state is not None:
            load(self, state, param_dtype)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                 position_ids: jax.Array | None = None, *, decode: bool = False) -> jax.Array:
        """A forward pass: ``attention_mask`` (1 = token, 0 = padding) and ``position_ids``, each
        ``(batch, length)``, as transformers takes them. ``decode=True``: append to the cache
        (``init_cache``) and attend over it, ``position_ids`` then each token's position
        (``-1``: padding, left out of the cache)."""
        mask = None if attention_mask is None or decode else attention_mask[:, None, None, :].astype(bool)
        hidden_states = self.model(input_ids, mask=mask, positions=position_ids, decode=decode)
        if self.lm_head is None:
            return self.model.embed_tokens.attend(hidden_states)
        return self.lm_head(hidden_states)

    def init_cache(self, batch: int, max_length: int) -> None:
        """An empty key/value cache in every layer's attention, for ``batch`` rows of up to ``max_length`` tokens."""
        for layer in self.model.layers:
            layer.self_attn.init_cache((batch, max_length, layer.self_attn.in_features))


def load(model: LlamaForCausalLM, state: Mapping, param_dtype=None) -> None:
    """Everything but the attention (which ``mha_jax.from_hf`` loaded) from transformers' names
    (in ``param_dtype`` when given)."""
    load_modules(model, state, param_dtype)


def from_pretrained(folder: str | os.PathLike) -> LlamaForCausalLM:
    """The port of a ``save_pretrained`` folder (``config.json``, ``model.safetensors``), read without PyTorch."""
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return LlamaForCausalLM(config, load_file(os.path.join(folder, "model.safetensors")))


def save_random(folder: str | os.PathLike, seed: int = 0, **config) -> None:
    """A small random transformers Llama, saved with ``save_pretrained`` (eager attention);
    ``config``: settings other than ``CONFIG``'s (``tie_word_embeddings=True``: no ``lm_head.weight``)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**CONFIG, **config}, attn_implementation="eager")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def random_pair(folder: str | os.PathLike, seed: int = 0, **config):
    """``save_random`` into ``folder``, then that model as transformers builds it and its port."""
    save_random(folder, seed, **config)
    return transformers_model(folder), from_pretrained(folder)


def save_random_mistral(folder: str | os.PathLike, sliding_window: int = 4, seed: int = 0) -> None:
    """A small random transformers Mistral (a Llama whose layers attend over a sliding window)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.MistralConfig(**CONFIG, sliding_window=sliding_window, attn_implementation="eager")
    transformers.MistralForCausalLM(config).save_pretrained(folder)


def transformers_model(folder: str | os.PathLike):
    """The saved model as transformers builds it (``LlamaForCausalLM`` or ``MistralForCausalLM``, eager attention)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def inputs(batch: int = 2, length: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, an attention mask whose second row is left-padded by 3, and each token's position."""
    ids = np.random.default_rng(seed).integers(3, CONFIG["vocab_size"], (batch, length))
    mask = np.ones((batch, length), np.int64)
    mask[1, :3] = 0
    return ids, mask, np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def main() -> None:
    import tempfile

    from parity_tests.porting import compare, compare_decoding, compare_gradients, compare_step

    with tempfile.TemporaryDirectory() as folder:
        save_random(folder)
        torch_model, port = transformers_model(folder), from_pretrained(folder)
    batch = inputs()
    valid = batch[1].astype(bool)
    print(compare(torch_model, port, *batch, mapping=MAPPING, valid=valid).table(), end="\n\n")
    for check in (compare_gradients, compare_step):
        print(check(torch_model, port, *batch, mapping=MAPPING, valid=valid).table(), end="\n\n")
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, CONFIG["vocab_size"], n) for n in (5, 9, 3)]
    print(compare_decoding(torch_model, port, prompts, steps=16).table())


if __name__ == "__main__":
    main()
