"""Rotary position embeddings as transformers computes them (``mha_spec.rotary``); twin of ``mha_jax/rope.py``."""

from __future__ import annotations

import torch

from mha_spec import arguments, docstrings, rotary
from mha_torch import _checks

LAYOUT = "(*batch, heads, len, head_dim)"


def _exponents(dim: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """``arange(0, dim, 2) / dim`` in float32; on ``like``'s device (a length on the GPU stays there)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return exponents if like is None else exponents.to(like.device)


_OPS = rotary.FrequencyOps(
    rdiv=lambda a, x: torch.reciprocal(x) * a, div=lambda x, a: x / a, pow=lambda x, p: x**p, exponents=_exponents,
    arange=lambda n: torch.arange(n, dtype=torch.float32), array=lambda v: torch.tensor(v, dtype=torch.float32),
    where=torch.where, clip=torch.clamp, at_least=lambda n, m: torch.clamp(n, min=m).to(torch.float32),
    constant=lambda f: f(), asarray=torch.as_tensor, on=lambda x, like: x.to(like.device),
    cast=lambda x, dtype: x.to(dtype), cos=torch.cos, sin=torch.sin, stack=lambda xs: torch.stack(xs, dim=-1),
    concat=lambda xs: torch.cat(xs, dim=-1),
)


@docstrings.fill
class RotaryEmbedding(rotary.RotaryParameters):
    """Rotary position embedding of queries or keys ``(*batch, heads, len, head_dim)``.

    {rotary_embedding}
    """

    array_ops = _OPS

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(*batch, heads, len, head_dim)`` rotated at integer ``positions`` ``(len,)`` or ``(*batch, len)``
        (default ``arange(len)``); ``x``'s shape and dtype."""
        _checks.require_float("x", x)
        if x.ndim < 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape {LAYOUT} with head_dim = {self.head_dim}, got {tuple(x.shape)}")
        length = x.shape[-2]
        if positions is None:
            positions = torch.arange(length, device=x.device)
        _checks.require_int("positions", positions)
        arguments.check_positions_shape(positions.shape, x.shape[:-3], length)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(positions.to(x.device), dtype)
        return self.rotate(x, cos.unsqueeze(-3), sin.unsqueeze(-3))
