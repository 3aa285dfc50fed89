"""Multi-head attention for JAX and Flax, the twin of ``mha_torch``; never imports torch."""

# flax's mask helpers, re-exported: their masks mean here what they mean in flax
from flax.nnx import combine_masks, make_attention_mask, make_causal_mask

from mha_jax import linen
from mha_jax.attention import dot_product_attention
from mha_jax.convert import from_torch, load_weights, to_torch
from mha_jax.hf import from_hf
from mha_jax.masks import causal_mask, mask_from_torch_mha, mask_to_torch_mha, padding_mask
from mha_jax.module import MultiHeadAttention
from mha_jax.rope import RotaryEmbedding
from mha_spec.latent import Latent
from mha_spec.qk_norm import QKNorm

__all__ = [
    "Latent", "MultiHeadAttention", "QKNorm", "RotaryEmbedding", "causal_mask", "combine_masks",
    "dot_product_attention", "from_hf", "from_torch", "linen", "load_weights", "make_attention_mask",
    "make_causal_mask", "mask_from_torch_mha", "mask_to_torch_mha", "padding_mask", "to_torch",
]
