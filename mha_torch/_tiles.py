"""The score terms and the softmax of the explicit formulation, with finite stand-ins for inf (``mha_spec.terms``).

Twin of ``mha_jax/_tiles.py`` (whose tiles also serve the blockwise kernels).
"""

from __future__ import annotations

import torch

from mha_spec.terms import BIAS_FLOOR, MASKED, NO_KEY


def of_max(dtype: torch.dtype, fraction: float) -> float:
    """``fraction`` x the largest finite value of ``dtype``."""
    return fraction * torch.finfo(dtype).max


def floored_bias(bias: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """``bias`` with finite values below ``BIAS_FLOOR`` x max of ``compute`` raised to it, ``-inf`` kept: every
    score a finite bias leaves stays above the masked ones' (a key excluded only by a mask or ``-inf``)."""
    floor = of_max(compute, BIAS_FLOOR)
    if torch.finfo(bias.dtype).min >= floor:
        return bias
    return torch.where(torch.isneginf(bias), bias, bias.clamp_min(floor))


def scores(s: torch.Tensor, *, scale: float, soft_cap=None, bias=None, allowed=None) -> torch.Tensor:
    """Products ``s`` scaled, capped, plus ``bias``, ``MASKED`` where ``allowed`` is False (finite: no inf)."""
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    return s if allowed is None else s.masked_fill(~allowed, of_max(s.dtype, MASKED))


def softmax(s: torch.Tensor, sinks=None) -> torch.Tensor:
    """Softmax over the last axis of scores ``s`` from ``scores``, 0 on rows with no key; ``sinks`` broadcasting to
    ``s`` without its last axis (kept as 1): each row's extra logit."""
    row_max = s.amax(dim=-1, keepdim=True)
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks)
    row_max = row_max.detach()
    row_max = torch.where(row_max > of_max(s.dtype, NO_KEY), row_max, 0.0)  # no key: exp(masked) is 0
    exp = torch.exp(s - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks - row_max)
    return exp / torch.where(total == 0.0, 1.0, total)
