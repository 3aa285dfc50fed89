"""Rotary position embeddings, as transformers computes them; twin of ``mha_jax/rope.py``.

The frequencies follow ``transformers.modeling_rope_utils`` (5.x) operation for operation in
float32, for ``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope`` and ``llama3``; how
``dynamic`` and ``longrope`` read the sequence length (from each call's own ``positions``, with
no state kept) is told in ``mha_spec.rotary``. The length is computed on the positions' device.
"""

from __future__ import annotations

import torch

from mha_spec import arguments, docstrings, rotary
from mha_torch import _checks

LAYOUT = "(*batch, heads, len, head_dim)"


@docstrings.fill
class RotaryEmbedding(rotary.RotaryParameters):
    """Rotary position embedding of queries or keys ``(*batch, heads, len, head_dim)``.

    ``RotaryEmbedding(head_dim, *, rotary_dim=None, theta=10000.0, interleaved=False,
    scaling=None, max_position_embeddings=None)``, or ``RotaryEmbedding.from_config(config)``
    from a transformers ``config.json`` dict.

    {rotary_embedding}

    Immutable and hashable. Besides the call: ``inv_freq``, ``frequencies(seq_len)``,
    ``attention_factor``, ``rope_type`` and ``seq_len_threshold()``.
    """

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 ``(rotary_dim // 2,)``: the frequencies before any sequence length is seen,
        which a transformers rotary module holds after construction."""
        return self.frequencies()

    def frequencies(self, seq_len: int | torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``(rotary_dim // 2,)``: the frequencies for sequences of length ``seq_len``
        (an integer, or a scalar integer tensor), as transformers' forward pass
        computes them after ``dynamic_rope_update``: they differ from ``inv_freq`` only for
        ``dynamic`` and ``longrope`` past their threshold length."""
        inv_freq = rotary.inv_freq(self, _OPS)
        threshold = self.seq_len_threshold()
        if seq_len is None or threshold is None:
            return inv_freq
        seq_len = torch.as_tensor(seq_len)
        if self.rope_type == "dynamic":
            longer = rotary.dynamic_inv_freq(self, seq_len, _OPS)
        else:
            longer = rotary.longrope_inv_freq(self, _OPS, "long_factor").to(seq_len.device)
        # transformers: recompute once max(position_ids) + 1 passes the threshold.
        return torch.where(seq_len > threshold, longer, inv_freq.to(seq_len.device))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``(*batch, heads, len, head_dim)`` rotated; ``positions`` integer ``(len,)`` or
        ``(*batch, len)`` (default ``arange(len)``). Returns ``x``'s shape and dtype."""
        _checks.require_float("x", x)
        if x.ndim < 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape {LAYOUT} with head_dim = {self.head_dim}, got {tuple(x.shape)}"
            )
        length = x.shape[-2]
        if positions is None:
            positions = torch.arange(length, device=x.device)
        _checks.require_int("positions", positions)
        arguments.check_positions_shape(positions.shape, x.shape[:-3], length)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self._cos_sin(positions.to(x.device), dtype)
        # (*batch, len, half) -> (*batch, 1, len, half): the same angle for every head.
        return _rotate(x, cos.unsqueeze(-3), sin.unsqueeze(-3), self.rotary_dim, self.interleaved)

    def _cos_sin(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(*batch, len, rotary_dim // 2)`` in ``dtype``, times the attention factor,
        as ``LlamaRotaryEmbedding.forward`` (which repeats them to ``rotary_dim``)."""
        seq_len = positions.max() + 1 if self.seq_len_threshold() is not None else None
        inv_freq = self.frequencies(seq_len).to(positions.device)
        angles = positions[..., None].to(dtype) * inv_freq.to(dtype)
        factor = self.attention_factor
        return torch.cos(angles) * factor, torch.sin(angles) * factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """``x * cos + rotate(x) * sin`` on the first ``rotary_dim`` features, in ``cos``'s dtype;
    the rest of ``x`` unchanged. ``cos``, ``sin`` broadcast to ``x[..., :rotary_dim // 2]``."""
    rot = x[..., :rotary_dim].to(cos.dtype)
    y1, y2 = rotary.rotated_halves(rot, cos, sin, interleaved)
    rotated = torch.stack([y1, y2], dim=-1).reshape(rot.shape) if interleaved else torch.cat([y1, y2], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], dim=-1)


# --- the float32 operations of the frequencies (mha_spec.rotary.inv_freq), as transformers' own


def _rdiv(a: float, x: torch.Tensor) -> torch.Tensor:
    """``a / x`` as torch evaluates a Python number over a tensor: ``reciprocal(x) * a``."""
    return torch.reciprocal(x) * a


def _div(x: torch.Tensor, a: float) -> torch.Tensor:
    """``x / a``, correctly rounded (the twin's XLA needs help to divide so)."""
    return x / a


def _pow(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x ** p`` for a float32 scalar ``x``: for a 0-d tensor torch's CPU kernel computes it in
    float64, rounded to float32 (the twin does so explicitly)."""
    return x**p


def _exponents(dim: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """``arange(0, dim, 2) / dim`` in float32, the exponents of every init function; on ``like``'s
    device (a length on the GPU: no copy of it to the host)."""
    exponents = _div(torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32), dim)
    return exponents if like is None else exponents.to(like.device)


_OPS = rotary.FrequencyOps(
    rdiv=_rdiv, div=_div, pow=_pow, exponents=_exponents, arange=lambda n: torch.arange(n, dtype=torch.float32),
    array=lambda values: torch.tensor(values, dtype=torch.float32), where=torch.where, clip=torch.clamp,
    at_least=lambda n, m: torch.clamp(n, min=m).to(torch.float32),
)
