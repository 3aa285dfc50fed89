"""Terms on the projections before the logits, read by both twins: ``clip_qkv`` (a clamp of the query, key and
value projections) and ``QueryScale`` (each query scaled by its position); and ``output_gate`` (each head's output
times a sigmoid of the input, before the output projection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_clip_qkv(clip_qkv: Any) -> float | None:
    """``clip_qkv`` (None, or the bound ``c`` of the projections' outputs, clamped to ``[-c, c]``) as a float."""
    return None if clip_qkv is None else _check_positive("clip_qkv", clip_qkv)


@dataclass(frozen=True)
class QueryScale:
    """Each query multiplied by ``1 + beta * log(1 + floor((position + offset) / floor_scale))``, computed
    in float32 or wider (the queries' dtype) and cast to it, after the rotary embedding: Llama 4's
    temperature tuning of its NoPE layers (``attn_scale``, ``floor_scale``, offset 1) and Ministral 3's
    ``llama_4_scaling_beta`` (over ``original_max_position_embeddings``, offset 0). Positions are the
    queries' (transformers: Llama 4 counts them from the sequence's start, padding included; Ministral 3
    reads ``position_ids``)."""

    beta: float
    floor_scale: float
    offset: float = 0.0

    def __post_init__(self):
        for name in ("beta", "offset"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"QueryScale {name} must be a finite number, got {value!r}")
        _check_positive("QueryScale floor_scale", self.floor_scale)

    def factor(self, positions: Any, floor: Any, log1p: Any) -> Any:
        """The factor at floating ``positions`` (any shape), in their dtype: ``floor`` and ``log1p`` the twin's."""
        return log1p(floor((positions + self.offset) / self.floor_scale)) * self.beta + 1.0


def check_query_scale(query_scale: Any) -> QueryScale | None:
    if query_scale is not None and not isinstance(query_scale, QueryScale):
        raise TypeError(f"query_scale must be an mha_spec.query_terms.QueryScale or None, got "
                        f"{type(query_scale).__name__}")
    return query_scale


def check_terms(clip_qkv: Any, query_scale: Any, latent: Any) -> tuple[float | None, QueryScale | None]:
    """A module's ``(clip_qkv, query_scale)`` checked; neither is taken with a ``latent``."""
    clip_qkv, query_scale = check_clip_qkv(clip_qkv), check_query_scale(query_scale)
    given = [name for name, value in (("clip_qkv", clip_qkv), ("query_scale", query_scale)) if value is not None]
    if latent is not None and given:
        raise ValueError(f"{', '.join(given)} is not taken with a latent (multi-head latent attention)")
    return clip_qkv, query_scale


# ``output_gate``: ``"head"``, one gate per head (``gate_proj`` ``(num_heads, in)``); ``"feature"``, one per output
# feature of each head (``gate_proj`` ``(num_heads * head_dim, in)``, Qwen3-Next's); a sigmoid of the projection,
# or with ``_softplus`` its softplus (Laguna's), computed in float32 or wider
OUTPUT_GATES = ("head", "feature", "head_softplus", "feature_softplus")


def check_output_gate(output_gate: Any, latent: Any) -> str | None:
    """A module's ``output_gate`` (None or one of ``OUTPUT_GATES``) checked; not taken with a ``latent``."""
    if output_gate is not None and output_gate not in OUTPUT_GATES:
        raise ValueError(f"output_gate must be None or one of {OUTPUT_GATES}, got {output_gate!r}")
    if output_gate is not None and latent is not None:
        raise ValueError("output_gate is not taken with a latent (multi-head latent attention)")
    return output_gate


def gate_features(output_gate: str, heads: int, head_dim: int) -> tuple[int, ...]:
    """The gate projection's output features per token: ``(heads,)`` or ``(heads, head_dim)``."""
    return (heads,) if output_gate.startswith("head") else (heads, head_dim)


def gate_softplus(output_gate: str) -> bool:
    """Whether the gate is its projection's softplus (else its sigmoid)."""
    return output_gate.endswith("_softplus")
