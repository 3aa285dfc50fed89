"""Rotary position embeddings, as transformers computes them; twin of ``mha_torch/rope.py``.

The frequencies follow ``transformers.modeling_rope_utils`` (5.x) operation for operation in
float32, for ``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope`` and ``llama3``; how
``dynamic`` and ``longrope`` read the sequence length (from each call's own ``positions``, with
no state kept) is told in ``mha_spec.rotary``. Under ``jax.jit`` the length may be traced.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_spec import arguments, docstrings, rotary

LAYOUT = "(*batch, len, heads, head_dim)"


@docstrings.fill
class RotaryEmbedding(rotary.RotaryParameters):
    """Rotary position embedding of queries or keys ``(*batch, len, heads, head_dim)``.

    ``RotaryEmbedding(head_dim, *, rotary_dim=None, theta=10000.0, interleaved=False,
    scaling=None, max_position_embeddings=None)``, or ``RotaryEmbedding.from_config(config)``
    from a transformers ``config.json`` dict.

    {rotary_embedding}

    Immutable and hashable (a static argument to ``jax.jit``). Besides the call: ``inv_freq``, ``frequencies(seq_len)``,
    ``attention_factor``, ``rope_type`` and ``seq_len_threshold()``.
    """

    @property
    def inv_freq(self) -> jax.Array:
        """float32 ``(rotary_dim // 2,)``: the frequencies before any sequence length is seen,
        which a transformers rotary module holds after construction."""
        return self.frequencies()

    def frequencies(self, seq_len: int | jax.Array | None = None) -> jax.Array:
        """float32 ``(rotary_dim // 2,)``: the frequencies for sequences of length ``seq_len``
        (an integer, or a scalar integer array, traced or not), as transformers' forward pass
        computes them after ``dynamic_rope_update``: they differ from ``inv_freq`` only for
        ``dynamic`` and ``longrope`` past their threshold length."""
        # Constants even under jit, so that jitted and eager calls use the same frequencies.
        with jax.ensure_compile_time_eval():
            inv_freq = _INIT_INV_FREQ[self.rope_type](self)
        threshold = self.seq_len_threshold()
        if seq_len is None or threshold is None:
            return inv_freq
        seq_len = jnp.asarray(seq_len)
        if self.rope_type == "dynamic":
            longer = _dynamic_inv_freq(self, seq_len)
        else:
            with jax.ensure_compile_time_eval():
                longer = _longrope_inv_freq(self, "long_factor")
        # transformers: recompute once max(position_ids) + 1 passes the threshold.
        return jnp.where(seq_len > threshold, longer, inv_freq)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``x`` ``(*batch, len, heads, head_dim)`` rotated; ``positions`` integer ``(len,)`` or
        ``(*batch, len)`` (default ``arange(len)``). Returns ``x``'s shape and dtype."""
        _checks.require_float("x", x)
        x = jnp.asarray(x)
        if x.ndim < 4 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape {LAYOUT} with head_dim = {self.head_dim}, got {tuple(x.shape)}"
            )
        length = x.shape[-3]
        if positions is None:
            positions = jnp.arange(length)
        _checks.require_int("positions", positions)
        arguments.check_positions_shape(positions.shape, x.shape[:-3], length)
        dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
        cos, sin = self._cos_sin(jnp.asarray(positions), dtype)
        # (*batch, len, half) -> (*batch, len, 1, half): the same angle for every head.
        return _rotate(x, cos[..., None, :], sin[..., None, :], self.rotary_dim, self.interleaved)

    def _cos_sin(self, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """cos and sin ``(*batch, len, rotary_dim // 2)`` in ``dtype``, times the attention factor,
        as ``LlamaRotaryEmbedding.forward`` (which repeats them to ``rotary_dim``)."""
        seq_len = jnp.max(positions) + 1 if self.seq_len_threshold() is not None else None
        inv_freq = self.frequencies(seq_len)
        angles = positions[..., None].astype(dtype) * inv_freq.astype(dtype)
        factor = self.attention_factor
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, rotary_dim: int, interleaved: bool) -> jax.Array:
    """``x * cos + rotate(x) * sin`` on the first ``rotary_dim`` features, in ``cos``'s dtype;
    the rest of ``x`` unchanged. ``cos``, ``sin`` broadcast to ``x[..., :rotary_dim // 2]``."""
    rot = x[..., :rotary_dim].astype(cos.dtype)
    y1, y2 = rotary.rotated_halves(rot, cos, sin, interleaved)
    rotated = jnp.stack([y1, y2], axis=-1).reshape(rot.shape) if interleaved else jnp.concatenate([y1, y2], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


# --- the frequencies, one function per rope_type, as transformers.modeling_rope_utils -------
# The one block written alike in both twins, on purpose: each must round as transformers does,
# operation for operation, in its own framework's float32 operations.


def _rdiv(a: float, x: jax.Array) -> jax.Array:
    """``a / x`` as torch evaluates a Python number over a tensor: ``reciprocal(x) * a``."""
    return jnp.reciprocal(x) * a


def _div(x: jax.Array, a: float) -> jax.Array:
    """``x / a`` correctly rounded, as torch divides a tensor by a number: XLA would multiply by
    ``1 / a`` where ``a`` is one number broadcast."""
    return x / jnp.full_like(x, a)


def _pow(x: jax.Array, p: float) -> jax.Array:
    """``x ** p`` for a float32 scalar ``x``, as torch computes it: in float64, rounded to float32.
    Without x64, JAX has no float64 and XLA's float32 power is less precise: the frequencies it
    gives then differ from torch's by up to about 10 ulp (2e-6 relative)."""
    return (x.astype(jax.dtypes.canonicalize_dtype(jnp.float64)) ** p).astype(jnp.float32)


def _exponents(dim: int) -> jax.Array:
    """``arange(0, dim, 2) / dim`` in float32, the exponents of every init function."""
    with jax.ensure_compile_time_eval():
        return _div(jnp.arange(0, dim, 2, dtype=jnp.float32), dim)


def _default_inv_freq(theta: float | jax.Array, dim: int) -> jax.Array:
    """``compute_default_rope_parameters``: ``1 / theta ** (2i / dim)``."""
    return _rdiv(1.0, theta ** _exponents(dim))


def _linear_inv_freq(rope: RotaryEmbedding) -> jax.Array:
    """``_compute_linear_scaling_rope_parameters``: every frequency divided by ``factor``."""
    return _div(_default_inv_freq(rope.theta, rope.rotary_dim), rope.scaling["factor"])


def _dynamic_init_inv_freq(rope: RotaryEmbedding) -> jax.Array:
    """``_compute_dynamic_ntk_parameters`` at construction: the base computed in Python floats at
    ``max_position_embeddings`` (where it barely changes)."""
    max_pos = rope.max_position_embeddings
    theta = rotary.dynamic_theta(rope.theta, rope.scaling["factor"], max_pos, max_pos, rope.rotary_dim)
    return _default_inv_freq(theta, rope.rotary_dim)


def _dynamic_inv_freq(rope: RotaryEmbedding, seq_len: jax.Array) -> jax.Array:
    """``_compute_dynamic_ntk_parameters`` as ``dynamic_rope_update`` calls it, with ``seq_len`` a
    tensor: the grown base in float32."""
    factor, max_pos, dim = rope.scaling["factor"], rope.max_position_embeddings, rope.rotary_dim
    seq_len = jnp.maximum(seq_len, max_pos).astype(jnp.float32)
    theta = rope.theta * _pow(((factor * seq_len / max_pos) - (factor - 1)), dim / (dim - 2))
    return _default_inv_freq(theta, dim)


def _yarn_inv_freq(rope: RotaryEmbedding) -> jax.Array:
    """``_compute_yarn_parameters``: interpolated (divided by ``factor``) below the ramp,
    extrapolated (unchanged) above it, blended linearly along it."""
    factor = rotary.scaling_factor(rope.scaling, rope.max_position_embeddings)
    pos_freqs = rope.theta ** _exponents(rope.rotary_dim)
    extrapolation = _rdiv(1.0, pos_freqs)
    interpolation = _rdiv(1.0, factor * pos_freqs)
    low, high = rotary.yarn_ramp_bounds(rope.scaling, rope.rotary_dim, rope.theta)
    ramp = jnp.clip(_div(jnp.arange(rope.rotary_dim // 2, dtype=jnp.float32) - low, high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _longrope_inv_freq(rope: RotaryEmbedding, which: str = "short_factor") -> jax.Array:
    """``_compute_longrope_parameters``: each frequency divided by its own factor, ``short_factor``
    up to ``original_max_position_embeddings``, ``long_factor`` past it."""
    ext_factors = jnp.asarray(rope.scaling[which], dtype=jnp.float32)
    return _rdiv(1.0, ext_factors * rope.theta ** _exponents(rope.rotary_dim))


def _llama3_inv_freq(rope: RotaryEmbedding) -> jax.Array:
    """``_compute_llama3_parameters``: wavelengths beyond ``omax / low_freq_factor`` divided by
    ``factor``, below ``omax / high_freq_factor`` kept, between them smoothly blended."""
    scaling = rope.scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    omax = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = omax / low, omax / high
    inv_freq = _default_inv_freq(rope.theta, rope.rotary_dim)
    wavelen = _rdiv(2 * math.pi, inv_freq)
    inv_freq_llama = jnp.where(wavelen > low_freq_wavelen, _div(inv_freq, factor), inv_freq)
    smooth_factor = _div(_rdiv(omax, wavelen) - low, high - low)
    smoothed = _div((1 - smooth_factor) * inv_freq_llama, factor) + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(is_medium_freq, smoothed, inv_freq_llama)


_INIT_INV_FREQ = {
    "default": lambda rope: _default_inv_freq(rope.theta, rope.rotary_dim),
    "linear": _linear_inv_freq,
    "dynamic": _dynamic_init_inv_freq,
    "yarn": _yarn_inv_freq,
    "longrope": _longrope_inv_freq,
    "llama3": _llama3_inv_freq,
}
