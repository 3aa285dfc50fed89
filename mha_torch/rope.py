"""Rotary position embeddings, as transformers computes them; twin of ``mha_jax/rope.py``.

The frequencies follow ``transformers.modeling_rope_utils`` (5.x) operation for operation in
float32, for ``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope`` and ``llama3``; how
``dynamic`` and ``longrope`` read the sequence length (from each call's own ``positions``, with
no state kept) is told in ``mha_spec.rotary``. The length is computed on the positions' device.
"""

from __future__ import annotations

import math

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
        inv_freq = _INIT_INV_FREQ[self.rope_type](self)
        threshold = self.seq_len_threshold()
        if seq_len is None or threshold is None:
            return inv_freq
        seq_len = torch.as_tensor(seq_len)
        if self.rope_type == "dynamic":
            longer = _dynamic_inv_freq(self, seq_len)
        else:
            longer = _longrope_inv_freq(self, "long_factor").to(seq_len.device)
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


# --- the frequencies, one function per rope_type, as transformers.modeling_rope_utils -------
# The one block written alike in both twins, on purpose: each must round as transformers does,
# operation for operation, in its own framework's float32 operations.


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


def _exponents(dim: int) -> torch.Tensor:
    """``arange(0, dim, 2) / dim`` in float32, the exponents of every init function."""
    return _div(torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32), dim)


def _default_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    """``compute_default_rope_parameters``: ``1 / theta ** (2i / dim)``."""
    return _rdiv(1.0, theta ** _exponents(dim))


def _linear_inv_freq(rope: RotaryEmbedding) -> torch.Tensor:
    """``_compute_linear_scaling_rope_parameters``: every frequency divided by ``factor``."""
    return _div(_default_inv_freq(rope.theta, rope.rotary_dim), rope.scaling["factor"])


def _dynamic_init_inv_freq(rope: RotaryEmbedding) -> torch.Tensor:
    """``_compute_dynamic_ntk_parameters`` at construction: the base computed in Python floats at
    ``max_position_embeddings`` (where it barely changes)."""
    max_pos = rope.max_position_embeddings
    theta = rotary.dynamic_theta(rope.theta, rope.scaling["factor"], max_pos, max_pos, rope.rotary_dim)
    return _default_inv_freq(theta, rope.rotary_dim)


def _dynamic_inv_freq(rope: RotaryEmbedding, seq_len: torch.Tensor) -> torch.Tensor:
    """``_compute_dynamic_ntk_parameters`` as ``dynamic_rope_update`` calls it, with ``seq_len`` a
    tensor: the grown base in float32."""
    factor, max_pos, dim = rope.scaling["factor"], rope.max_position_embeddings, rope.rotary_dim
    seq_len = torch.clamp(seq_len, min=max_pos).to(torch.float32)
    theta = rope.theta * _pow(((factor * seq_len / max_pos) - (factor - 1)), dim / (dim - 2))
    # _default_inv_freq on seq_len's device: no copy of it to the host.
    return _rdiv(1.0, theta ** _exponents(dim).to(seq_len.device))


def _yarn_inv_freq(rope: RotaryEmbedding) -> torch.Tensor:
    """``_compute_yarn_parameters``: interpolated (divided by ``factor``) below the ramp,
    extrapolated (unchanged) above it, blended linearly along it."""
    factor = rotary.scaling_factor(rope.scaling, rope.max_position_embeddings)
    pos_freqs = rope.theta ** _exponents(rope.rotary_dim)
    extrapolation = _rdiv(1.0, pos_freqs)
    interpolation = _rdiv(1.0, factor * pos_freqs)
    low, high = rotary.yarn_ramp_bounds(rope.scaling, rope.rotary_dim, rope.theta)
    ramp = torch.clamp(_div(torch.arange(rope.rotary_dim // 2, dtype=torch.float32) - low, high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _longrope_inv_freq(rope: RotaryEmbedding, which: str = "short_factor") -> torch.Tensor:
    """``_compute_longrope_parameters``: each frequency divided by its own factor, ``short_factor``
    up to ``original_max_position_embeddings``, ``long_factor`` past it."""
    ext_factors = torch.tensor(rope.scaling[which], dtype=torch.float32)
    return _rdiv(1.0, ext_factors * rope.theta ** _exponents(rope.rotary_dim))


def _llama3_inv_freq(rope: RotaryEmbedding) -> torch.Tensor:
    """``_compute_llama3_parameters``: wavelengths beyond ``omax / low_freq_factor`` divided by
    ``factor``, below ``omax / high_freq_factor`` kept, between them smoothly blended."""
    scaling = rope.scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    omax = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = omax / low, omax / high
    inv_freq = _default_inv_freq(rope.theta, rope.rotary_dim)
    wavelen = _rdiv(2 * math.pi, inv_freq)
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, _div(inv_freq, factor), inv_freq)
    smooth_factor = _div(_rdiv(omax, wavelen) - low, high - low)
    smoothed = _div((1 - smooth_factor) * inv_freq_llama, factor) + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


_INIT_INV_FREQ = {
    "default": lambda rope: _default_inv_freq(rope.theta, rope.rotary_dim),
    "linear": _linear_inv_freq,
    "dynamic": _dynamic_init_inv_freq,
    "yarn": _yarn_inv_freq,
    "longrope": _longrope_inv_freq,
    "llama3": _llama3_inv_freq,
}
