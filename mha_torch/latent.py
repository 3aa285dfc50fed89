"""Multi-head latent attention (``mha_spec.latent``) of ``mha_torch.MultiHeadAttention``, heads first; twin of
``mha_jax/latent.py``."""

from __future__ import annotations

import functools

import torch
from torch import nn

from mha_spec.latent import Latent, RopePart
from mha_spec.rotary import rotate_at
from mha_torch import masks
from mha_torch._cache import KVCache


class RMSNorm(nn.Module):
    """transformers' ``DeepseekV3RMSNorm`` over the last axis: ``weight`` ``(features,)``, ones at first."""

    def __init__(self, features: int, latent: Latent, device=None, dtype=None):
        super().__init__()
        self.latent = latent
        self.weight = nn.Parameter(torch.ones(features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.latent.rms_norm(x, self.weight, _mean_last, torch.rsqrt, _cast)


def _mean_last(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=-1, keepdim=True)


def _cast(x: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """``x`` in float32 or wider (``like`` None), else in ``like``'s dtype."""
    return x.to(torch.promote_types(x.dtype, torch.float32) if like is None else like.dtype)


def make_projections(module: nn.Module, latent: Latent, features: tuple[int, int, int], num_heads: int,
                     biases: tuple[bool, bool], factory: dict) -> None:
    """The latent module's parameters, transformers' names. ``features``: (``embed_dim``, ``kdim``, ``out_dim``);
    ``biases``: (on ``q_a_proj`` and ``kv_a_proj_with_mqa``; on ``out_proj``)."""
    embed_dim, kdim, out_dim = features
    queries = num_heads * latent.qk_head_dim
    if latent.q_lora_rank is None:
        module.q_proj = nn.Linear(embed_dim, queries, bias=False, **factory)
    else:
        module.q_a_proj = nn.Linear(embed_dim, latent.q_lora_rank, bias=biases[0], **factory)
        module.q_a_layernorm = RMSNorm(latent.q_lora_rank, latent, **factory)
        module.q_b_proj = nn.Linear(latent.q_lora_rank, queries, bias=False, **factory)
    module.kv_a_proj_with_mqa = nn.Linear(kdim, latent.cache_dim, bias=biases[0], **factory)
    module.kv_a_layernorm = RMSNorm(latent.kv_lora_rank, latent, **factory)
    module.kv_b_proj = nn.Linear(latent.kv_lora_rank, num_heads * latent.kv_b_features, bias=False, **factory)
    module.out_proj = nn.Linear(num_heads * latent.v_head_dim, out_dim, bias=biases[1], **factory)


def rope_part(rotary, latent: Latent) -> RopePart | None:
    """``rotary`` on the rope part of each head (``mha_spec.latent.RopePart``), None without one."""
    return None if rotary is None else RopePart(rotary, latent, functools.partial(torch.cat, dim=-1))


def project_query(module: nn.Module, x: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Queries ``(batch, heads, q_len, qk_head_dim)`` of ``x`` ``(batch, q_len, embed_dim)``."""
    if module.latent.q_lora_rank is None:
        q = module.q_proj(x)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
    return q.view(batch, x.shape[1], heads, -1).transpose(1, 2)


def project_latent(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Cache entries ``(batch, 1, kv_len, cache_dim)`` of ``x``: the normed latent, then the unrotated rope key."""
    rank = module.latent.kv_lora_rank
    compressed = module.kv_a_proj_with_mqa(x)
    entries = torch.cat([module.kv_a_layernorm(compressed[..., :rank]), compressed[..., rank:]], dim=-1)
    return entries.unsqueeze(1)


def expand(module: nn.Module, entries: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``(batch, heads, kv_len, qk_head_dim)`` and values ``(batch, heads, kv_len, v_head_dim)`` of the
    rotated entries ``(batch, 1, kv_len, cache_dim)``."""
    latent = module.latent
    batch, _, kv_len, _ = entries.shape
    lifted = module.kv_b_proj(entries[:, 0, :, :latent.kv_lora_rank])
    lifted = lifted.view(batch, kv_len, heads, latent.kv_b_features).transpose(1, 2)
    k_nope, values = lifted.split([latent.qk_nope_head_dim, latent.v_head_dim], dim=-1)
    k_rope = entries[..., latent.kv_lora_rank:].expand(batch, heads, kv_len, latent.qk_rope_head_dim)
    return torch.cat([k_nope, k_rope], dim=-1), values


def attention_inputs(module: nn.Module, q: torch.Tensor, entries: torch.Tensor, spec: masks.Spec):
    """Queries, keys and values (``expand``) with their rope parts rotated at ``spec``'s positions."""
    q, entries = rotate_at(rope_part(module.rotary, module.latent), q, entries, *masks.positions(spec))
    return (q, *expand(module, entries, q.shape[1]))


def _kv_b_heads(module: nn.Module, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj``'s key half ``(heads, qk_nope_head_dim, kv_lora_rank)`` and value half
    ``(heads, v_head_dim, kv_lora_rank)``."""
    latent = module.latent
    weight = module.kv_b_proj.weight.view(heads, latent.kv_b_features, latent.kv_lora_rank)
    return weight.split([latent.qk_nope_head_dim, latent.v_head_dim], dim=1)


def absorb_query(module: nn.Module, q: torch.Tensor) -> torch.Tensor:
    """Rotated queries ``(batch, heads, n, qk_head_dim)`` as the absorbed step's ``(batch, heads, n, cache_dim)``."""
    w_key = _kv_b_heads(module, q.shape[1])[0].to(q.dtype)
    nope = module.latent.qk_nope_head_dim
    return torch.cat([torch.einsum("bhnd,hdr->bhnr", q[..., :nope], w_key), q[..., nope:]], dim=-1)


def lift_output(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """The absorbed step's outputs ``(batch, heads, n, kv_lora_rank)`` as ``(batch, heads, n, v_head_dim)``."""
    w_value = _kv_b_heads(module, out.shape[1])[1].to(out.dtype)
    return torch.einsum("bhnr,hvr->bhnv", out, w_value)


def cached_keys(cache: KVCache, latent: Latent, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed step's keys ``(batch, 1, max_length, cache_dim)`` and values (their first ``kv_lora_rank``)."""
    keys = cache.key_storage.to(dtype)
    return keys, keys[..., :latent.kv_lora_rank]


class LatentCache(KVCache):
    """The decoding cache of a module with a ``Latent``: per token the normed latent and the rotated rope key.

    Attributes: ``key`` ``(*batch, max_length, 1, cache_dim)``, a view of ``key_storage`` ``(*batch, 1,
    max_length, cache_dim)``; ``value`` and ``value_storage`` None; ``index``, ``overflow`` as ``KVCache``'s.

    Args:
      batch: the batch size, or the batch axes ``(*batch,)``.
      max_length: slots per row.
      latent: the module's ``Latent``.
      dtype, device: of ``key``.
    """

    def __init__(self, batch: int | tuple[int, ...], max_length: int, latent: Latent, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        if not isinstance(latent, Latent):
            raise TypeError(f"latent must be an mha_spec Latent, got {type(latent).__name__}")
        super().__init__(batch, max_length, 1, latent.cache_dim, dtype=dtype, device=device, values=False)
