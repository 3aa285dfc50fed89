"""Argument checks of the functional core and the module: ``mha_spec.arguments.ArrayChecks`` over tensors."""

from __future__ import annotations

import numpy as np
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
check_attention_inputs, check_sequence, check_lengths, check_dropout_mask, check_unbatched = (
    CHECKS.check_attention_inputs, CHECKS.check_sequence, CHECKS.check_lengths, CHECKS.check_dropout_mask,
    CHECKS.check_unbatched)


def check_one_example(shape: tuple[int, int, int], **arrays) -> None:
    """Each tensor of ``arrays`` broadcasts to ``shape`` = ``(heads, q_len, kv_len)``: no batch axis to add."""
    for name, x in arrays.items():
        if isinstance(x, torch.Tensor):
            arguments.check_broadcast(name, x.shape, shape, "(heads, q_len, kv_len)")


def either_mask(attn_mask, mask) -> tuple[str, torch.Tensor | None]:
    """(the name given, the mask): ``attn_mask`` is ``F.scaled_dot_product_attention``'s name for ``mask``."""
    if attn_mask is not None and mask is not None:
        raise TypeError("attn_mask and mask are one argument (F.scaled_dot_product_attention's name and ours): "
                        "pass one of them, got both")
    return ("mask", mask) if attn_mask is None else ("attn_mask", attn_mask)


def check_enable_gqa(enable_gqa, heads: int, kv_heads: int) -> None:
    """None or True: key/value heads may be grouped; False: as many as the query heads (as SDPA's default)."""
    if enable_gqa is None:
        return
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool or None, got {type(enable_gqa).__name__}")
    if not enable_gqa and kv_heads != heads:
        raise ValueError(f"enable_gqa=False needs as many key/value heads as query heads (as "
                         f"F.scaled_dot_product_attention), got {kv_heads} key/value heads for {heads} query heads; "
                         f"enable_gqa=True or None shares each key/value head among a group of query heads")
