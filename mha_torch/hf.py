"""A Hugging Face model's attention layer as an ``mha_torch.MultiHeadAttention``; twin of ``mha_jax/hf.py``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from mha_spec import checkpoint, docstrings, families, latent
from mha_torch.convert import load_weights, read_state
from mha_torch.module import MultiHeadAttention
from mha_torch.rope import RotaryEmbedding


@docstrings.fill
def from_hf(config: Mapping[str, Any] | str | os.PathLike, weights: Mapping[str, Any] | str | os.PathLike | None = None,
            *, layer: int = 0, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
            implementation: str | None = None) -> MultiHeadAttention:
    """Layer ``layer``'s self-attention of a transformers model, as our module.

    Args:
      {from_hf_config}
      weights: the whole model's checkpoint, or None (freshly initialised parameters): a state
        dict (name -> tensor or array), a ``.safetensors`` file, or a sharded checkpoint's
        {from_hf_keys}
      layer: the layer index.
      dtype, device: of the parameters.
      implementation: see ``mha_torch.dot_product_attention``.

    Returns:
      An ``mha_torch.MultiHeadAttention`` in training mode, as ``torch.nn`` makes its modules.
      {from_hf_call}
    """
    options = families.layer_options(families.read_config(config), layer)
    rotary = latent.layer_rotary(options)  # None without one; a latent layer's over its rope part
    module = MultiHeadAttention(
        options.input_size or options.hidden_size, options.num_heads, num_kv_heads=options.num_kv_heads,
        out_dim=options.hidden_size, qkv_dim=options.num_heads * options.head_dim, bias=options.qkv_bias,
        out_bias=options.out_bias,
        normalize_qk=options.qk_norm or False, scale=options.scale, logit_soft_cap=options.logit_soft_cap,
        use_sinks=options.use_sinks, rotary=None if rotary is None else RotaryEmbedding(**rotary),
        local_window_size=options.window, attention_chunk_size=options.attention_chunk_size, latent=options.latent,
        alibi_slopes=options.alibi_slopes, clip_qkv=options.clip_qkv, output_gate=options.output_gate,
        query_scale=options.query_scale, dtype=dtype, device=device, implementation=implementation,
    )
    if weights is not None:
        state, keywords = checkpoint.load_arguments(options, weights, read_state, "pt", torch.cat)
        load_weights(module, state, **keywords)
    return module
