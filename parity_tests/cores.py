"""Both functional cores, forward and backward, called alike from NumPy.

``run_core("jax" | "torch", q, k, v, d_out, ...)`` takes PyTorch's layout ``(batch, heads,
length, head_dim)`` for every framework (the JAX call is transposed on the way in and out) and
returns float64 NumPy arrays, so that tests compare the two frameworks, and the oracle, on one
footing. The JAX side is jitted once per shape, dtype and static option, so properties that
draw from a moderate set of shapes compile each only once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

import mha_jax
import mha_torch
from parity_tests.tool import arrays

IMPLEMENTATIONS = {"jax": ("xla", "blockwise"), "torch": ("math", "sdpa")}
WITH_WEIGHTS = ("xla", "math")  # the implementations that form the weights


def run_core(framework: str, q, k, v, d_out, *, dtype: str = "float64", mask=None,
             implementation: str | None = None, is_causal: bool = False, scale: float | None = None) -> dict:
    """``{"out", "weights" (None unless formed), "grads": (dq, dk, dv)}``, float64, torch layout.

    Floating inputs and a floating mask are cast to ``dtype``; bool/int masks pass as they are.
    ``mask`` reads as PyTorch's (floating = added): the JAX core gets a floating one as ``bias``.
    """
    implementation = implementation or IMPLEMENTATIONS[framework][0]
    run = _run_jax if framework == "jax" else _run_torch
    out, weights, grads = run(
        [arrays.cast(np.asarray(x), dtype) for x in (q, k, v, d_out)],
        None if mask is None else arrays.cast(np.asarray(mask), dtype),
        implementation, is_causal, scale,
    )
    return {"out": arrays.to_float64(out), "weights": None if weights is None else arrays.to_float64(weights),
            "grads": tuple(arrays.to_float64(g) for g in grads)}


def _run_jax(inputs, mask, implementation, is_causal, scale):
    q, k, v, d_out = (jnp.asarray(x).transpose(0, 2, 1, 3) for x in inputs)
    additive = mask is not None and arrays.is_floating(mask)  # JAX's masks are nonzero = attend
    mask = None if mask is None else jnp.asarray(mask)
    out, weights, grads = _jax_vjp(q, k, v, None if additive else mask, mask if additive else None, d_out,
                                   implementation=implementation, is_causal=is_causal, scale=scale)
    return out.transpose(0, 2, 1, 3), weights, [g.transpose(0, 2, 1, 3) for g in grads]


@functools.partial(jax.jit, static_argnames=("implementation", "is_causal", "scale"))
def _jax_vjp(q, k, v, mask, bias, d_out, *, implementation, is_causal, scale):
    with_weights = implementation in WITH_WEIGHTS

    def f(q, k, v):
        return mha_jax.dot_product_attention(
            q, k, v, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
            implementation=implementation, return_weights=with_weights)

    result, back = jax.vjp(f, q, k, v)
    if with_weights:
        return result[0], result[1], back((d_out, jnp.zeros_like(result[1])))
    return result, None, back(d_out)


def _run_torch(inputs, mask, implementation, is_causal, scale):
    q, k, v, d_out = (_torch_tensor(x) for x in inputs)
    for x in (q, k, v):
        x.requires_grad_(True)
    result = mha_torch.dot_product_attention(
        q, k, v, mask=None if mask is None else _torch_tensor(mask), is_causal=is_causal,
        scale=scale, implementation=implementation, need_weights=implementation in WITH_WEIGHTS)
    out, weights = result if implementation in WITH_WEIGHTS else (result, None)
    out.backward(d_out)
    return out, weights, [x.grad for x in (q, k, v)]


def _torch_tensor(x: np.ndarray) -> torch.Tensor:
    """A tensor of the same values and dtype (bfloat16 NumPy arrays included)."""
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(x))
