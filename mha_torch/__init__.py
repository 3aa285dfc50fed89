"""Multi-head attention for PyTorch, the twin of ``mha_jax``.

Never imports jax or flax.
"""

from mha_torch.attention import dot_product_attention
from mha_torch.convert import load_weights
from mha_torch.masks import causal_mask, padding_mask
from mha_torch.module import MultiHeadAttention

__all__ = [
    "MultiHeadAttention",
    "causal_mask",
    "dot_product_attention",
    "load_weights",
    "padding_mask",
]
