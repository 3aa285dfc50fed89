"""A Hugging Face model's attention layer as an ``mha_jax.MultiHeadAttention``; twin of ``mha_torch/hf.py``.

No transformers import: the model's ``config.json`` (a dict or its path) says what the layer
computes, ``mha_spec.families`` reads it as transformers' own classes do, and the weights come from the
whole model's checkpoint under the layer's names (``model.layers.N.self_attn.*``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax.convert import _read_state, load_weights
from mha_jax.module import MultiHeadAttention
from mha_jax.rope import RotaryEmbedding
from mha_spec import families


def from_hf(
    config: Mapping[str, Any] | str | os.PathLike,
    weights: Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    layer: int = 0,
    rngs: nnx.Rngs | None = None,
    param_dtype: Any = jnp.float32,
    implementation: str | None = None,
) -> MultiHeadAttention:
    """Layer ``layer``'s self-attention of a transformers model, as our module.

    Args:
      config: the model's ``config.json`` (dict or path); families: ``families.FAMILIES``
        (Llama, Llama 4 text, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, gpt-oss, OLMo 2, Phi-3, StableLM,
        Cohere, GPT-NeoX, GPT-J, GPT-2, BERT). Rotary embedding, scale, soft-cap, QK-norm, sinks,
        biases and the layer's sliding window or chunks are
        read from it; an unsupported family or option raises, naming it.
      weights: the whole model's checkpoint, or None (parameters from ``rngs``): a state dict
        (name -> array), a ``.safetensors`` file, or a sharded checkpoint's
        ``model.safetensors.index.json`` (only the shards holding the layer are read). The
        layer's keys are read under ``model.layers.{layer}.self_attn.`` (GPT-NeoX:
        ``gpt_neox.layers.{layer}.attention.``; GPT-2 and GPT-J: ``transformer.h.{layer}.attn.``; BERT:
        ``bert.encoder.layer.{layer}.attention.``, its ``output.LayerNorm`` left unread).
      layer: the layer index.
      rngs: initialises the parameters (default ``nnx.Rngs(0)``); overwritten by ``weights``.
      param_dtype: the parameters' dtype.
      implementation: see ``mha_jax.dot_product_attention``.

    Returns:
      An ``mha_jax.MultiHeadAttention`` taking ``(*batch, length, hidden_size)``: call it with
      ``is_causal=True`` (a decoder's mask; BERT's encoder takes none) and ``query_positions`` for the rotary embedding
      (default ``arange``); the layer's window is its default ``local_window_size``.
    """
    config = families.read_config(config)
    options = families.layer_options(config, layer)
    module = MultiHeadAttention(
        options.num_heads, options.hidden_size, options.num_heads * options.head_dim, options.hidden_size,
        options.num_kv_heads, use_bias=options.qkv_bias, use_out_bias=options.out_bias, normalize_qk=options.qk_norm or False,
        scale=options.scale, logit_soft_cap=options.logit_soft_cap, use_sinks=options.use_sinks,
        rotary=None if options.rope is None else RotaryEmbedding.from_config(options.rope, head_dim=options.head_dim),
        local_window_size=options.window, param_dtype=param_dtype, implementation=implementation,
        rngs=nnx.Rngs(0) if rngs is None else rngs, attention_chunk_size=options.attention_chunk_size,
    )
    if weights is not None:
        state = _layer_state(weights, options.prefix)
        if options.layout in ("gpt_neox", "gpt2"):  # fusions no loader layout reads: split here
            load_weights(module, families.layer_state(options, state))
        else:  # buffers left out, per-head QK-norm scales joined
            state = families.layer_keys(options, _read_state(state), np.concatenate)
            load_weights(module, state, layout=options.layout, prefix=options.prefix, ignore=options.ignore)
    return module


def _layer_state(weights: Any, prefix: str) -> Mapping[str, Any]:
    """The checkpoint's keys under ``prefix``, read from as few files as hold them (all of them
    when none is, so that ``load_weights`` names the keys it found)."""
    if not isinstance(weights, (str, os.PathLike)):
        if not isinstance(weights, Mapping):
            return _read_state(weights)  # its TypeError names what a checkpoint may be
        return {k: v for k, v in weights.items() if str(k).startswith(prefix)} or weights
    from safetensors import safe_open

    state = {}
    for path in families.layer_files(weights, prefix):
        if not os.path.exists(path):
            raise FileNotFoundError(f"weights {path!r} does not exist")
        with safe_open(path, framework="flax") as f:  # "flax": bfloat16 too, which NumPy's reader refuses
            state.update({k: np.array(f.get_tensor(k)) for k in f.keys() if k.startswith(prefix)})
    return state or _read_state(weights)
