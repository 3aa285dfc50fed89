"""Multi-head attention for JAX and Flax, the twin of ``mha_torch``.

Never imports torch: weights from PyTorch arrive as arrays or ``.safetensors`` files.
"""

from mha_jax import linen
from mha_jax._torch_mha_masks import mask_from_torch_mha, mask_to_torch_mha
from mha_jax.attention import dot_product_attention
from mha_jax.convert import from_torch, load_weights, to_torch
from mha_jax.masks import causal_mask, padding_mask
from mha_jax.module import MultiHeadAttention

__all__ = [
    "MultiHeadAttention",
    "causal_mask",
    "dot_product_attention",
    "from_torch",
    "linen",
    "load_weights",
    "mask_from_torch_mha",
    "mask_to_torch_mha",
    "padding_mask",
    "to_torch",
]
