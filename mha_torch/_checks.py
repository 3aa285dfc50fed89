"""Argument checks of the functional core and the module: ``mha_spec.arguments.ArrayChecks`` over tensors."""

from __future__ import annotations

import torch

from mha_spec import arguments


def dtype_kind(x) -> str:
    """'float', 'complex', 'int', 'bool' or 'other' for a tensor's dtype."""
    dtype = x.dtype
    if dtype.is_floating_point:
        return "float"
    if dtype.is_complex:
        return "complex"
    if dtype == torch.bool:
        return "bool"
    try:
        torch.iinfo(dtype)
    except TypeError:
        return "other"
    return "int"


def dtype_name(x) -> str:
    """A tensor's dtype as JAX and NumPy print it (``int32``, not ``torch.int32``)."""
    return str(x.dtype).removeprefix("torch.")


CHECKS = arguments.ArrayChecks(
    array="a torch.Tensor", is_array=lambda x: isinstance(x, torch.Tensor), kind=dtype_kind, dtype=dtype_name,
    values=lambda x: x.detach().cpu().numpy(), heads_first=True,
)
require_array, require_float, require_int = CHECKS.require_array, CHECKS.require_float, CHECKS.require_int
check_attention_inputs, check_sequence, check_lengths, check_dropout_mask = (
    CHECKS.check_attention_inputs, CHECKS.check_sequence, CHECKS.check_lengths, CHECKS.check_dropout_mask)
