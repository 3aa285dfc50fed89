"""The implementations' table and the choice: each record says what its kernel takes and runs.

Twin of ``mha_jax/_dispatch.py``: one lookup (``choose``) picks a record, whose ``run`` computes the call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from mha_spec import arguments
from mha_torch import _math, _sdpa, testing


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What one implementation takes; the choice and its error messages are read from these."""

    name: str
    weights: bool = False  # need_weights (only a kernel that forms the weights)
    dropout_mask: bool = True  # an explicit keep-mask
    soft_cap: bool = True
    half_on_cuda: bool = False  # bfloat16/float16 on a CUDA device reach it as they are (fused kernels)
    # (q, k, v, spec, *, scale, soft_cap, sinks, keep, keep_scale, dropout_p) -> (output, weights or None)
    run: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

    def takes_half(self, query: torch.Tensor) -> bool:
        """Whether ``query``'s half precision is given to the kernel as it is (else computed in float32)."""
        return self.half_on_cuda and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


KERNELS = {k.name: k for k in (
    Kernel("math", weights=True, run=_math.run),
    # SDPA's fused GPU kernels take half precision as it is (in float32 they would fall back to math)
    Kernel("sdpa", dropout_mask=False, soft_cap=False, half_on_cuda=True, run=_sdpa.run),
)}
IMPLEMENTATIONS = tuple(KERNELS)
_DEFAULT_ORDER = ("sdpa", "math")  # the default: the first that takes the call


def record(implementation: str | None) -> Kernel | None:
    """The record of ``implementation``, its name checked; None for the default (chosen per call)."""
    return None if implementation is None else KERNELS[arguments.check_implementation(implementation, IMPLEMENTATIONS)]


def choose(implementation, need_weights, explicit_dropout, soft_cap=False) -> Kernel:
    """The record of the implementation asked for (None: the first of the default order that takes the call)."""
    options = (need_weights, explicit_dropout, soft_cap)
    kernel = record(implementation)
    if kernel is None:
        kernel = next(KERNELS[n] for n in _DEFAULT_ORDER if _refusal(KERNELS[n], *options) is None)
    refused = _refusal(kernel, *options)
    if refused is not None:
        raise ValueError(refused)
    testing.observe("kernel", kernel.name)
    return kernel


def _refusal(kernel: Kernel, need_weights, explicit_dropout, soft_cap) -> str | None:
    """The message when ``kernel`` cannot take a call of these options, else None."""
    if (need_weights and not kernel.weights) or (explicit_dropout and not kernel.dropout_mask):
        return f"need_weights=True and dropout_mask need implementation='math', got {kernel.name!r}"
    if soft_cap and not kernel.soft_cap:
        return (f"logit_soft_cap needs implementation='math' (F.scaled_dot_product_attention cannot apply "
                f"tanh to the logits), got {kernel.name!r}")
    return None
