"""Multi-head attention for PyTorch, the twin of ``mha_jax``; never imports jax or flax."""

from mha_spec.latent import Latent
from mha_spec.qk_norm import QKNorm
from mha_torch._cache import KVCache
from mha_torch.attention import dot_product_attention
from mha_torch.convert import from_torch_mha, load_weights, to_torch_mha
from mha_torch.hf import from_hf
from mha_torch.latent import LatentCache
from mha_torch.masks import causal_mask, mask_from_torch_mha, mask_to_torch_mha, padding_mask
from mha_torch.module import MultiHeadAttention
from mha_torch.rope import RotaryEmbedding

__all__ = [
    "KVCache", "Latent", "LatentCache", "MultiHeadAttention", "QKNorm", "RotaryEmbedding", "causal_mask",
    "dot_product_attention", "from_hf", "from_torch_mha", "load_weights", "mask_from_torch_mha", "mask_to_torch_mha",
    "padding_mask", "to_torch_mha",
]
