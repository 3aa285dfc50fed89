"""``torch.nn.MultiheadAttention``'s masks: what they mean in ours, and their shape rules.

Its boolean masks mean the opposite of ours (True = ignore): ``mask = ~attn_mask``, a 3-d
``(batch * heads, q_len, kv_len)`` one read as ``(batch, heads, q_len, kv_len)``, and
``mask = ~key_padding_mask[:, None, None, :]``. Its float masks are added to the logits: our
``bias``. Our own float ``mask`` means attend where nonzero in ``mha_jax`` but is added in
``mha_torch``, so each part keeps its kind. The table of every case is in ``docs/masks.md``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any


def torch_mha_attn_shape(shape: Sequence[int], num_heads) -> tuple[int, ...]:
    """Its ``attn_mask`` ``(q_len, kv_len)`` or ``(batch * num_heads, q_len, kv_len)`` as ours:
    the shape to reshape it to, broadcasting to ``(batch, num_heads, q_len, kv_len)``."""
    shape = tuple(shape)
    if len(shape) == 3:
        if not isinstance(num_heads, int) or num_heads < 1 or shape[0] % num_heads:
            raise ValueError(
                f"a 3-d attn_mask (batch * num_heads, q_len, kv_len) needs num_heads dividing "
                f"its first axis; got shape {shape} and num_heads={num_heads!r}"
            )
        return (shape[0] // num_heads, num_heads, *shape[1:])
    if len(shape) != 2:
        raise ValueError(
            "attn_mask must have rank 2 (q_len, kv_len) or 3 (batch * num_heads, q_len, kv_len), "
            f"got shape {shape}"
        )
    return shape


def check_torch_mha_padding(attn_shape: Sequence[int] | None, padding_shape: Sequence[int]) -> None:
    """Its ``key_padding_mask`` is ``(batch, kv_len)``, with ``attn_mask``'s kv_len."""
    if len(padding_shape) != 2:
        raise ValueError(f"key_padding_mask must have rank 2 (batch, kv_len), got shape {tuple(padding_shape)}")
    if attn_shape is not None and attn_shape[-1] != padding_shape[-1]:
        raise ValueError(
            f"attn_mask and key_padding_mask disagree on kv_len: shapes {tuple(attn_shape)} "
            f"and {tuple(padding_shape)}"
        )


def torch_mha_layout(mask_shape: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """The ``attn_mask`` shape ``torch.nn.MultiheadAttention`` takes for one of ours broadcasting to
    ``shape`` = (batch, heads, q_len, kv_len): ``(q_len, kv_len)`` when it is the same for every
    batch element and head, else ``(batch * heads, q_len, kv_len)``."""
    batch, heads, q_len, kv_len = shape
    lead = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    return (q_len, kv_len) if lead[0] == lead[1] == 1 else (batch * heads, q_len, kv_len)


def check_mask_kind(name: str, kind: str, dtype, shape) -> None:
    """It takes bool and float masks only (it rejects integers)."""
    if kind not in ("bool", "float"):
        raise TypeError(f"{name} must be bool or floating, got dtype {dtype} with shape {tuple(shape)}")


def combine(parts: list) -> tuple[Any, Any]:
    """Our ``(mask, bias)`` from its masks, as arrays of one framework broadcasting to
    ``(batch, heads, q_len, kv_len)``: the bool ones (True = ignore) negated and and-ed, the
    float ones summed (in their promoted dtype). Each part stays in its own kind: a float 0/-inf
    "mask" would read as nonzero = attend in ``mha_jax``."""
    bools = [str(p.dtype).removeprefix("torch.") == "bool" for p in parts]
    allowed = [~p for p, is_bool in zip(parts, bools) if is_bool]
    added = [p for p, is_bool in zip(parts, bools) if not is_bool]
    return (functools.reduce(operator.and_, allowed) if allowed else None,
            functools.reduce(operator.add, added) if added else None)
