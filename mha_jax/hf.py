"""A Hugging Face model's attention layer as an ``mha_jax.MultiHeadAttention``; twin of ``mha_torch/hf.py``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax.convert import load_weights, read_state
from mha_jax.module import MultiHeadAttention
from mha_jax.rope import RotaryEmbedding
from mha_spec import checkpoint, docstrings, families, latent


@docstrings.fill
def from_hf(config: Mapping[str, Any] | str | os.PathLike, weights: Mapping[str, Any] | str | os.PathLike | None = None,
            *, layer: int = 0, rngs: nnx.Rngs | None = None, param_dtype: Any = jnp.float32,
            implementation: str | None = None) -> MultiHeadAttention:
    """Layer ``layer``'s self-attention of a transformers model, as our module.

    Args:
      {from_hf_config}
      weights: the whole model's checkpoint, or None (parameters from ``rngs``): a state dict
        (name -> array), a ``.safetensors`` file, or a sharded checkpoint's
        {from_hf_keys}
      layer: the layer index.
      rngs: initialises the parameters (default ``nnx.Rngs(0)``); overwritten by ``weights``.
      param_dtype: the parameters' dtype.
      implementation: see ``mha_jax.dot_product_attention``.

    Returns:
      An ``mha_jax.MultiHeadAttention`` (a ``flax.nnx`` module; ``nnx.bridge`` serves linen models).
      {from_hf_call}
    """
    options = families.layer_options(families.read_config(config), layer)
    rotary = latent.layer_rotary(options)  # None without one; a latent layer's over its rope part
    module = MultiHeadAttention(
        options.num_heads, options.input_size or options.hidden_size, options.num_heads * options.head_dim,
        options.hidden_size,
        options.num_kv_heads, use_bias=options.qkv_bias, use_out_bias=options.out_bias,
        normalize_qk=options.qk_norm or False, scale=options.scale, logit_soft_cap=options.logit_soft_cap,
        use_sinks=options.use_sinks, rotary=None if rotary is None else RotaryEmbedding(**rotary),
        local_window_size=options.window, attention_chunk_size=options.attention_chunk_size, latent=options.latent,
        alibi_slopes=options.alibi_slopes, clip_qkv=options.clip_qkv, output_gate=options.output_gate,
        query_scale=options.query_scale, param_dtype=param_dtype, implementation=implementation,
        rngs=nnx.Rngs(0) if rngs is None else rngs,
    )
    if weights is not None:
        # "flax": bfloat16 too, which NumPy's reader refuses
        state, keywords = checkpoint.load_arguments(options, weights, read_state, "flax", np.concatenate)
        load_weights(module, state, **keywords)
    return module
