"""Multi-head latent attention (MLA, DeepSeek-V2/V3): the one description both twins read.

Every head's key ``[k_nope, k_rope]`` and value come from one RMS-normed latent ``c`` per token plus one
shared rotary key ``k_rope``. Decoding caches ``[c, rotated k_rope]`` and absorbs ``kv_b_proj`` into the
query and the output (``q_nope . (W_k c) = (q_nope W_k) . c``): the same logits and outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mha_spec.rotary import rope_from_config


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Latent {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Latent:
    """The dimensions of multi-head latent attention.

    ``kv_lora_rank``: the latent's size; ``qk_rope_head_dim``: the rotated part of each query and key head;
    ``qk_nope_head_dim``: the part without rotary; ``v_head_dim``: each value head; ``q_lora_rank``: the query's
    low rank (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), None for one ``q_proj``; ``eps``: the RMSNorms'
    epsilon. A module's ``rotary`` has ``head_dim = qk_rope_head_dim``; its default scale is
    ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _check_positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _check_positive("q_lora_rank", self.q_lora_rank)
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating)) or not math.isfinite(eps) \
                or eps <= 0:
            raise ValueError(f"Latent eps must be a finite number > 0, got {eps!r}")

    @property
    def qk_head_dim(self) -> int:
        """Each query and key head's features, ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Numbers the decoding cache holds per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_b_features(self) -> int:
        """Each head's output features of ``kv_b_proj``: ``qk_nope_head_dim + v_head_dim``."""
        return self.qk_nope_head_dim + self.v_head_dim

    def rms_norm(self, x: Any, weight: Any, mean: Callable[[Any], Any], rsqrt: Callable, cast: Callable) -> Any:
        """transformers' ``DeepseekV3RMSNorm`` of ``x`` ``(..., features)`` in float32 or wider (``cast(x, None)``
        widens, ``cast(y, x)`` casts back), times ``weight`` ``(features,)``; ``mean`` keeps the last axis."""
        y = cast(x, None)
        y = y * rsqrt(mean(y * y) + self.eps)
        return cast(weight, x) * cast(y, x)


def check_latent(latent: Any, num_heads: int, num_kv_heads: int | None, qkv_features: int | None,
                 names: tuple[str, str]) -> Latent:
    """``latent`` checked against the module's heads and ``qkv_features`` (``names``: the twin's names of them)."""
    if not isinstance(latent, Latent):
        raise TypeError(f"latent must be an mha_spec Latent or None, got {type(latent).__name__}")
    if num_kv_heads is not None and num_kv_heads != num_heads:
        raise ValueError(f"latent attention lifts the latent to every head: {names[0]} must be None or num_heads = "
                         f"{num_heads}, got {num_kv_heads}")
    if qkv_features is not None and qkv_features != num_heads * latent.qk_head_dim:
        raise ValueError(f"with latent, {names[1]} must be None or num_heads * (qk_nope_head_dim + qk_rope_head_dim) = "
                         f"{num_heads * latent.qk_head_dim}, got {qkv_features}")
    return latent


def check_inputs(key: Any, value: Any, name: str) -> None:
    """``value`` (the twin's ``name`` of it) must be None or ``key`` itself."""
    if value is not None and value is not key:
        raise ValueError(f"with latent, keys and values both come from the key input's latent: pass no {name}")


def check_options(latent: Latent, qk_norm: Any, rotary: Any, scale: float | None) -> float:
    """The scale (default ``1 / sqrt(qk_head_dim)``), after checking no QK-norm and a rope-part ``rotary``."""
    if qk_norm is not None:
        raise ValueError("normalize_qk does not apply with latent: its keys come from the RMS-normed latent")
    head_dim = getattr(rotary, "head_dim", None)
    if rotary is not None and head_dim is not None and head_dim != latent.qk_rope_head_dim:
        raise ValueError(f"with latent, rotary rotates the rope part of each head: its head_dim must be "
                         f"qk_rope_head_dim = {latent.qk_rope_head_dim}, got {head_dim}")
    return latent.qk_head_dim ** -0.5 if scale is None else scale


class RopePart:
    """``rotary`` (a twin's ``RotaryEmbedding``) acting on the last ``qk_rope_head_dim`` features of each
    head, the rest kept; ``concat`` joins a list of arrays along the last axis."""

    def __init__(self, rotary: Any, latent: Latent, concat: Callable[[list], Any]):
        self.rotary, self.rope, self.concat = rotary, latent.qk_rope_head_dim, concat

    def __call__(self, x: Any, positions: Any) -> Any:
        rope = x.shape[-1] - self.rope
        return self.concat([x[..., :rope], self.rotary(x[..., rope:], positions)])


def layer_rotary(options: Any) -> dict[str, Any] | None:
    """A layer's ``RotaryEmbedding`` arguments from its ``families.LayerOptions``, None without rotary; a latent
    layer's over its ``qk_rope_head_dim`` features, interleaved as its ``rope_interleave`` says."""
    if options.rope is None:
        return None
    if options.latent is None:
        return rope_from_config(options.rope, options.head_dim)
    arguments = rope_from_config(options.rope, options.latent.qk_rope_head_dim)
    return None if arguments is None else dict(arguments, interleaved=bool(options.rope_interleaved))
