"""QK-norm: the one description of a normalisation of queries and keys, read by both twins."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class QKNorm:
    """Normalisation of queries and keys before the logits (QK-norm).

    ``kind``: ``"layer"`` (mean and variance, no bias: flax's ``normalize_qk``, StableLM) or ``"rms"`` (Qwen3,
    Gemma 3, OLMo 2). ``per_head``: over each head's ``head_dim`` features (scale ``(head_dim,)``), else over the
    whole projection (scale ``(heads * head_dim,)``, OLMo 2). ``eps`` is added to the variance. ``offset``: the
    features are multiplied by ``offset + scale`` (Gemma: ``1 + weight``). ``per_head_scale``: with ``per_head``,
    each head its own scale ``(heads, head_dim)`` (StableLM, Cohere). ``weight``: False for a norm without a scale
(Llama 4's ``L2Norm``: an RMS norm per head). ``after_rotary``: applied to the rotated queries and keys (HunYuan's;
per head, one scale). ``value_norm``: the values too, RMS-normed per head without a scale (Gemma 3n's ``v_norm``).
    Computed in float32 at least.
    """

    kind: str = "layer"
    per_head: bool = True
    eps: float = 1e-6
    offset: float = 0.0
    per_head_scale: bool = False
    weight: bool = True
    after_rotary: bool = False
    value_norm: bool = False

    def normalize(self, y: Any, scale: Any, mean: Callable[[Any, tuple[int, ...]], Any], rsqrt: Callable) -> Any:
        """``y`` ``(..., heads, head_dim)`` (float32 or wider) normalised per head or over the last two axes, times
        ``offset + scale``; ``mean(y, axes)`` keeps the axes, ``rsqrt`` is ``1 / sqrt``."""
        axes = (-1,) if self.per_head else (-2, -1)
        if self.kind == "layer":
            y = y - mean(y, axes)
        y = y * rsqrt(mean(y * y, axes) + self.eps)
        return y * (self.offset + scale)

    @property
    def of_values(self) -> QKNorm | None:
        """The values' norm with ``value_norm`` (RMS per head, no scale, this ``eps``), else None."""
        return QKNorm("rms", eps=self.eps, weight=False) if self.value_norm else None

    @property
    def shared_scale(self) -> bool:
        """One scale ``(head_dim,)`` for every head, else one per head (``(heads, head_dim)``)."""
        return self.per_head and not self.per_head_scale

    def __post_init__(self):
        if self.kind not in ("layer", "rms"):
            raise ValueError(f"QKNorm kind must be 'layer' or 'rms', got {self.kind!r}")
        for name in ("per_head", "per_head_scale", "weight", "after_rotary", "value_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QKNorm {name} must be a bool, got {getattr(self, name)!r}")
        if self.per_head_scale and not self.per_head:
            raise ValueError("QKNorm per_head_scale=True needs per_head=True (a norm over the whole projection has a "
                             "scale per head already)")
        for name in ("eps", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
                raise ValueError(f"QKNorm {name} must be a finite number, got {value!r}")
        if not self.weight and (self.offset or self.per_head_scale):
            raise ValueError("QKNorm weight=False (no scale) takes neither offset nor per_head_scale")
        if self.after_rotary and not self.shared_scale:
            raise ValueError("QKNorm after_rotary=True needs per_head=True and per_head_scale=False (one scale)")
        if self.eps <= 0:
            raise ValueError(f"QKNorm eps must be > 0, got {self.eps!r}")
