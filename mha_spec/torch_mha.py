"""``torch.nn.MultiheadAttention``'s masks (bool True = ignore; float = our ``bias``) to ours and back, for both
twins."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from mha_spec.arguments import ArrayChecks
from mha_spec.terms import Spec


def from_torch_mha(attn_mask, key_padding_mask, num_heads, checks: ArrayChecks,
                   asarray: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``mask_from_torch_mha``: ``checks`` reads the twin's arrays, ``asarray`` makes one of its framework."""
    parts = []
    if attn_mask is not None:
        _check_kind("attn_mask", attn_mask, checks)
        parts.append(asarray(attn_mask).reshape(_attn_shape(attn_mask.shape, num_heads)))
    if key_padding_mask is not None:
        _check_kind("key_padding_mask", key_padding_mask, checks)
        padding_shape = tuple(key_padding_mask.shape)
        if len(padding_shape) != 2:
            raise ValueError(f"key_padding_mask must have rank 2 (batch, kv_len), got shape {padding_shape}")
        if attn_mask is not None and attn_mask.shape[-1] != padding_shape[-1]:
            raise ValueError(f"attn_mask and key_padding_mask disagree on kv_len: shapes {tuple(attn_mask.shape)} "
                             f"and {padding_shape}")
        parts.append(asarray(key_padding_mask)[:, None, None, :])
    # its bool masks negated and and-ed, its float ones summed
    bools = [str(p.dtype).removeprefix("torch.") == "bool" for p in parts]
    allowed = [~p for p, is_bool in zip(parts, bools) if is_bool]
    added = [p for p, is_bool in zip(parts, bools) if not is_bool]
    return (functools.reduce(operator.and_, allowed) if allowed else None,
            functools.reduce(operator.add, added) if added else None)


def to_torch_mha(spec: Spec, shape: Sequence[int], where: Callable, broadcast_to: Callable) -> Any:
    """``mask_to_torch_mha`` of a parsed ``spec`` with ``shape``; ``where`` and ``broadcast_to`` (a copy) are the
    framework's."""
    if spec.bias is not None:  # the form torch uses for a bool mask beside a float one
        theirs = spec.bias if spec.allowed is None else where(spec.allowed, spec.bias, float("-inf"))
    elif spec.allowed is not None:
        theirs = ~spec.allowed
    else:
        return None
    batch, heads, q_len, kv_len = shape
    theirs = theirs.reshape((1,) * (4 - theirs.ndim) + tuple(theirs.shape))
    if theirs.shape[0] == theirs.shape[1] == 1:  # the same for every batch element and head
        return broadcast_to(theirs[0, 0], (q_len, kv_len))
    return broadcast_to(theirs, tuple(shape)).reshape(batch * heads, q_len, kv_len)


def _attn_shape(shape: Sequence[int], num_heads) -> tuple[int, ...]:
    """The shape broadcasting to ``(batch, num_heads, q_len, kv_len)`` to reshape its ``attn_mask`` to."""
    shape = tuple(shape)
    if len(shape) == 3:
        if not isinstance(num_heads, int) or num_heads < 1 or shape[0] % num_heads:
            raise ValueError(f"a 3-d attn_mask (batch * num_heads, q_len, kv_len) needs num_heads dividing "
                             f"its first axis; got shape {shape} and num_heads={num_heads!r}")
        return (shape[0] // num_heads, num_heads, *shape[1:])
    if len(shape) != 2:
        raise ValueError(f"attn_mask must have rank 2 (q_len, kv_len) or 3 (batch * num_heads, q_len, kv_len), got "
                         f"shape {shape}")
    return shape


def _check_kind(name: str, mask, checks: ArrayChecks) -> None:
    """It takes bool and float masks only (it rejects integers)."""
    checks.require_array(name, mask)
    if checks.kind(mask) not in ("bool", "float"):
        raise TypeError(f"{name} must be bool or floating, got dtype {checks.dtype(mask)} with shape "
                        f"{tuple(mask.shape)}")
