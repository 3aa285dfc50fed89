"""Both functional cores, forward and backward, called alike from NumPy.

``run_core("jax" | "torch", q, k, v, d_out, ...)`` takes PyTorch's layout ``(batch, heads,
length, head_dim)`` for every framework (the JAX call is transposed on the way in and out) and
returns float64 NumPy arrays, so that tests compare the two frameworks, and the oracle, on one
footing. The JAX side is jitted once per shape, dtype and static option, so properties that
draw from a moderate set of shapes compile each only once.

A learned ``bias``, ``sinks``, ``logit_soft_cap``, an explicit dropout mask and the structured
``terms`` (by the cores' own argument names) are optional; the bias and sinks are differentiated.
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
             implementation: str | None = None, is_causal: bool = False, scale: float | None = None,
             bias=None, sinks=None, logit_soft_cap: float | None = None, terms: dict | None = None,
             dropout_mask=None, dropout_rate: float = 0.0) -> dict:
    """``{"out", "weights" (None unless formed), "grads": (dq, dk, dv), "d_bias", "d_sinks"}``
    (the last two None unless ``bias``/``sinks`` are given), float64, torch layout.

    Floating inputs, masks, ``bias`` and ``sinks`` are cast to ``dtype``; bool/int masks and
    ``terms`` (positions, segment ids, lengths as integer arrays, ``local_window_size``,
    ``attention_chunk_size``) pass as they are. ``mask`` reads as PyTorch's (floating = added):
    the JAX core gets a floating one as ``bias``, so it is not given with ``bias``. ``dropout_mask`` (bool, True = keep)
    applies with ``dropout_rate``.
    """
    implementation = implementation or IMPLEMENTATIONS[framework][0]
    run = _run_jax if framework == "jax" else _run_torch
    optional = [None if x is None else arrays.cast(np.asarray(x), dtype) for x in (mask, bias, sinks, dropout_mask)]
    out, weights, grads = run(
        [arrays.cast(np.asarray(x), dtype) for x in (q, k, v, d_out)], *optional,
        implementation, is_causal, scale, logit_soft_cap, dict(terms or {}), dropout_rate,
    )
    grads = [None if g is None else arrays.to_float64(g) for g in grads]
    return {"out": arrays.to_float64(out), "weights": None if weights is None else arrays.to_float64(weights),
            "grads": tuple(grads[:3]), "d_bias": grads[3], "d_sinks": grads[4]}


def _run_jax(inputs, mask, bias, sinks, keep, implementation, is_causal, scale, soft_cap, terms, rate):
    q, k, v, d_out = (jnp.asarray(x).transpose(0, 2, 1, 3) for x in inputs)
    additive = mask is not None and arrays.is_floating(mask)  # JAX's masks are nonzero = attend
    if additive and bias is not None:
        raise ValueError("give a floating mask or a bias, not both")
    mask = None if mask is None else jnp.asarray(mask)
    window, chunk = terms.pop("local_window_size", None), terms.pop("attention_chunk_size", None)
    out, weights, grads = _jax_vjp(
        q, k, v, None if additive else mask, mask if additive else None, d_out,
        None if bias is None else jnp.asarray(bias), None if sinks is None else jnp.asarray(sinks),
        {name: jnp.asarray(x) for name, x in terms.items()}, None if keep is None else jnp.asarray(keep),
        implementation=implementation, is_causal=is_causal, scale=scale, soft_cap=soft_cap, window=window, chunk=chunk,
        rate=rate,
    )
    return out.transpose(0, 2, 1, 3), weights, [g.transpose(0, 2, 1, 3) for g in grads[:3]] + list(grads[3:])


@functools.partial(jax.jit, static_argnames=("implementation", "is_causal", "scale", "soft_cap", "window", "chunk",
                                              "rate"))
def _jax_vjp(q, k, v, mask, fixed_bias, d_out, bias=None, sinks=None, terms=None, keep=None, *, implementation,
             is_causal, scale, soft_cap=None, window=None, chunk=None, rate=0.0):
    """Outputs and the gradients of q, k, v, ``bias`` and ``sinks`` (None where not given);
    ``fixed_bias`` (a floating mask) is not differentiated."""
    with_weights = implementation in WITH_WEIGHTS

    def f(q, k, v, bias, sinks):
        return mha_jax.dot_product_attention(
            q, k, v, mask=mask, bias=fixed_bias if bias is None else bias, is_causal=is_causal, scale=scale,
            logit_soft_cap=soft_cap, sinks=sinks, local_window_size=window, attention_chunk_size=chunk, **(terms or {}),
            dropout_rate=rate, dropout_mask=keep, implementation=implementation, return_weights=with_weights)

    result, back = jax.vjp(f, q, k, v, bias, sinks)
    if with_weights:
        return result[0], result[1], back((d_out, jnp.zeros_like(result[1])))
    return result, None, back(d_out)


def _run_torch(inputs, mask, bias, sinks, keep, implementation, is_causal, scale, soft_cap, terms, rate):
    q, k, v, d_out = (_torch_tensor(x) for x in inputs)
    learned = [None if x is None else _torch_tensor(x) for x in (bias, sinks)]
    for x in (q, k, v, *learned):
        if x is not None:
            x.requires_grad_(True)
    static = ("local_window_size", "attention_chunk_size")
    terms = {name: x if name in static else torch.from_numpy(np.array(x)) for name, x in terms.items()}
    result = mha_torch.dot_product_attention(
        q, k, v, mask=None if mask is None else _torch_tensor(mask), bias=learned[0], is_causal=is_causal,
        scale=scale, logit_soft_cap=soft_cap, sinks=learned[1], **terms, implementation=implementation,
        dropout_p=rate, dropout_mask=None if keep is None else torch.from_numpy(np.array(keep)),
        need_weights=implementation in WITH_WEIGHTS)
    out, weights = result if implementation in WITH_WEIGHTS else (result, None)
    out.backward(d_out)
    return out, weights, [None if x is None else x.grad for x in (q, k, v, *learned)]


def _torch_tensor(x: np.ndarray) -> torch.Tensor:
    """A tensor of the same values and dtype (bfloat16 NumPy arrays included)."""
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(x))
