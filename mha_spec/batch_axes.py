"""The batch axes of the modules' inputs, merged into one and restored."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

# Axes after the batch axes, per module argument: masks and biases (heads, q_len, kv_len),
# positions and segment ids (len,), lengths none.
_TRAILING = {"mask": 3, "bias": 3, "dropout_mask": 3, "key_value_seq_lengths": 0}


def flatten_batch(inputs: tuple, broadcast: Callable, **terms: Any) -> tuple[tuple[int, ...], tuple, dict]:
    """Inputs ``(*batch, len, features)`` as ``(prod(batch), len, features)`` and each term with
    its batch axes merged likewise: ``(batch_shape, inputs, terms)``. ``broadcast(x, shape)`` is
    the framework's broadcast; one batch axis is left as it is."""
    batch_shape = tuple(inputs[0].shape[:-2])
    if len(batch_shape) == 1:
        return batch_shape, inputs, terms
    inputs = tuple(x.reshape((math.prod(batch_shape),) + tuple(x.shape[-2:])) for x in inputs)
    return batch_shape, inputs, {
        name: _merge_batch(name, x, batch_shape, _TRAILING.get(name, 1), broadcast) for name, x in terms.items()
    }


def _merge_batch(name: str, x: Any, batch_shape: tuple[int, ...], trailing: int, broadcast: Callable) -> Any:
    """``x`` broadcasting to ``(*batch_shape, *rest)`` with ``trailing`` = len(rest), as
    ``(prod(batch)|1, *rest)``; an ``x`` without batch axes unchanged."""
    if x is None or not hasattr(x, "shape") or 0 < trailing and x.ndim <= trailing:
        return x
    full = len(batch_shape) + trailing
    lead = tuple(x.shape[:x.ndim - trailing])
    if x.ndim > full or any(a not in (1, b) for a, b in zip(reversed(lead), reversed(batch_shape))):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, whose batch axes {lead} do not broadcast to the "
            f"inputs' batch axes {batch_shape}"
        )
    rest = tuple(x.shape[x.ndim - trailing:])
    if trailing > 0 and all(a == 1 for a in lead):
        return x.reshape((1,) + rest)
    expanded = broadcast(x.reshape((1,) * (full - x.ndim) + tuple(x.shape)), batch_shape + rest)
    return expanded.reshape((math.prod(batch_shape),) + rest)


def unflatten_batch(x: Any, batch_shape: tuple[int, ...]) -> Any:
    """``(prod(batch)|1, ...)`` back to ``(*batch_shape, ...)``, a broadcast axis as ones."""
    if len(batch_shape) == 1:
        return x
    lead = batch_shape if x.shape[0] == math.prod(batch_shape) else (1,) * len(batch_shape)
    return x.reshape(lead + tuple(x.shape[1:]))
