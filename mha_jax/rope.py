"""Rotary position embeddings, as transformers computes them; twin of ``mha_torch/rope.py``.

The frequencies follow ``transformers.modeling_rope_utils`` (5.x) operation for operation in
float32, for ``default``, ``linear``, ``dynamic``, ``yarn``, ``longrope`` and ``llama3``; how
``dynamic`` and ``longrope`` read the sequence length (from each call's own ``positions``, with
no state kept) is told in ``mha_spec.rotary``. Under ``jax.jit`` the length may be traced.
"""

from __future__ import annotations

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
            inv_freq = rotary.inv_freq(self, _OPS)
        threshold = self.seq_len_threshold()
        if seq_len is None or threshold is None:
            return inv_freq
        seq_len = jnp.asarray(seq_len)
        if self.rope_type == "dynamic":
            longer = rotary.dynamic_inv_freq(self, seq_len, _OPS)
        else:
            with jax.ensure_compile_time_eval():
                longer = rotary.longrope_inv_freq(self, _OPS, "long_factor")
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


# --- the float32 operations of the frequencies (mha_spec.rotary.inv_freq), rounding as torch's


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


def _exponents(dim: int, like=None) -> jax.Array:
    """``arange(0, dim, 2) / dim`` in float32, the exponents of every init function."""
    with jax.ensure_compile_time_eval():
        return _div(jnp.arange(0, dim, 2, dtype=jnp.float32), dim)


_OPS = rotary.FrequencyOps(
    rdiv=_rdiv, div=_div, pow=_pow, exponents=_exponents, arange=lambda n: jnp.arange(n, dtype=jnp.float32),
    array=lambda values: jnp.asarray(values, dtype=jnp.float32), where=jnp.where, clip=jnp.clip,
    at_least=lambda n, m: jnp.maximum(n, m).astype(jnp.float32),
)
