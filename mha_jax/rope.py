"""Rotary position embeddings as transformers computes them (``mha_spec.rotary``); twin of ``mha_torch/rope.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _checks
from mha_spec import arguments, docstrings, rotary

LAYOUT = "(*batch, len, heads, head_dim)"


def _div(x: jax.Array, a: float) -> jax.Array:
    """``x / a`` correctly rounded, as torch divides (XLA would multiply by ``1 / a``)."""
    return x / jnp.full_like(x, a)


def _pow(x: jax.Array, p: float) -> jax.Array:
    """``x ** p`` of a float32 scalar as torch computes it: in float64 (where enabled), rounded to float32."""
    return (x.astype(jax.dtypes.canonicalize_dtype(jnp.float64)) ** p).astype(jnp.float32)


def _constant(f):
    """``f()`` as a constant even under jit, so that jitted and eager calls use the same frequencies."""
    with jax.ensure_compile_time_eval():
        return f()


def _exponents(dim: int, like=None) -> jax.Array:
    """``arange(0, dim, 2) / dim`` in float32."""
    return _constant(lambda: _div(jnp.arange(0, dim, 2, dtype=jnp.float32), dim))


_OPS = rotary.FrequencyOps(
    rdiv=lambda a, x: jnp.reciprocal(x) * a, div=_div, pow=_pow, exponents=_exponents,
    arange=lambda n: jnp.arange(n, dtype=jnp.float32), array=lambda values: jnp.asarray(values, dtype=jnp.float32),
    where=jnp.where, clip=jnp.clip, at_least=lambda n, m: jnp.maximum(n, m).astype(jnp.float32), constant=_constant,
    asarray=jnp.asarray, on=lambda x, like: x, cast=lambda x, dtype: x.astype(dtype), cos=jnp.cos, sin=jnp.sin,
    stack=lambda xs: jnp.stack(xs, axis=-1), concat=lambda xs: jnp.concatenate(xs, axis=-1),
)


@docstrings.fill
class RotaryEmbedding(rotary.RotaryParameters):
    """Rotary position embedding of queries or keys ``(*batch, len, heads, head_dim)``.

    {rotary_embedding}

    A static argument to ``jax.jit``.
    """

    array_ops = _OPS

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``x`` ``(*batch, len, heads, head_dim)`` rotated at integer ``positions`` ``(len,)`` or ``(*batch, len)``
        (default ``arange(len)``); ``x``'s shape and dtype."""
        _checks.require_float("x", x)
        x = jnp.asarray(x)
        if x.ndim < 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape {LAYOUT} with head_dim = {self.head_dim}, got {tuple(x.shape)}")
        length = x.shape[-3]
        if positions is None:
            positions = jnp.arange(length)
        _checks.require_int("positions", positions)
        arguments.check_positions_shape(positions.shape, x.shape[:-3], length)
        dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
        cos, sin = self.cos_sin(jnp.asarray(positions), dtype)
        return self.rotate(x, cos[..., None, :], sin[..., None, :])
