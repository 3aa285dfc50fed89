"""The masking arguments of a call, picked by name; the batch axes of the modules' inputs, merged into one and
restored; a module call so merged."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

# The masking arguments of the public calls, in their signatures' order. A call's body picks them
# from its ``locals()`` (``masking``) instead of naming each a second time.
MASKING = ("mask", "bias", "is_causal", "query_positions", "key_positions", "local_window_size", "query_segment_ids",
           "key_segment_ids", "key_value_seq_lengths", "attention_chunk_size", "alibi_slopes")
# A module call's arguments that carry batch axes, in the order they are merged (and checked).
BATCHED = ("dropout_mask", "mask", "bias", "query_positions", "key_positions", "query_segment_ids", "key_segment_ids",
           "key_value_seq_lengths")
# Those that a decoding cache sets (the keys' positions and lengths): refused while decoding.
SET_BY_CACHE = ("key_positions", "query_segment_ids", "key_segment_ids", "key_value_seq_lengths", "dropout_mask")


@dataclasses.dataclass(frozen=True)
class Call:
    """A module call, checked, with its batch axes merged into one (``batch_shape``: the inputs'
    own). ``inputs``: query, key and value inputs ``(batch, len, features)``; ``spec``: the parsed
    masking of ``(batch, num_heads, q_len, kv_len)``; while decoding ``kv_len`` is the cache's
    ``max_length`` and the positions and lengths are left for the step to set from the cache,
    ``query_positions`` holding the new tokens' as given (``(batch, n)``, ``(n,)`` or None)."""

    batch_shape: tuple[int, ...]
    inputs: tuple
    spec: Any
    dropout_mask: Any = None
    query_positions: Any = None


def masking(arguments: Mapping[str, Any], *extra: str) -> dict:
    """The arguments named in ``MASKING`` (then ``extra``) among a call's ``arguments`` (its
    ``locals()`` on entry), by name."""
    return {name: arguments[name] for name in MASKING + extra if name in arguments}


def call_masking(layer_window: Any, attention_chunk_size: int | None, arguments: Mapping[str, Any],
                 alibi_slopes: Any = None) -> dict:
    """A module call's masking arguments and ``dropout_mask`` from ``arguments`` (its ``locals()``),
    as ``merged_call`` takes them: ``local_window_size`` default the layer's ``layer_window``, and the
    layer's ``attention_chunk_size`` and ``alibi_slopes`` (an array ``(num_heads,)`` or None)."""
    picked = masking(arguments, "dropout_mask")
    window = layer_window if picked["local_window_size"] is None else picked["local_window_size"]
    return dict(picked, local_window_size=window, attention_chunk_size=attention_chunk_size, alibi_slopes=alibi_slopes)


# Axes after the batch axes, per module argument: masks and biases (heads, q_len, kv_len),
# positions and segment ids (len,), lengths none.
_TRAILING = {"mask": 3, "bias": 3, "dropout_mask": 3, "key_value_seq_lengths": 0}


def merged_call(inputs: tuple, self_attention: bool, masking: Mapping[str, Any], broadcast: Callable, parse: Callable,
                zero_unused: Callable, num_heads: int, max_length: int | None = None) -> Call:
    """A module call of checked ``inputs`` (query, key, value ``(*batch, len, features)``) and
    ``masking`` (its masking arguments and ``dropout_mask``, by name), the batch axes of both merged
    into one (``broadcast(x, shape)``: the framework's), the masking parsed (``parse``: its
    ``masks.parse``) for ``num_heads``; in self-attention the key positions and segment ids default
    to the query's. Not decoding (``max_length``: the cache's), ``zero_unused(key, value, spec)``
    zeroes the keys no query may attend to."""
    given = [name for name in SET_BY_CACHE if masking.get(name) is not None]
    if max_length is not None and given:
        raise ValueError(
            f"{', '.join(given)} cannot be given while decoding: the cache sets the keys' positions and lengths"
        )
    batch_shape, arrays = tuple(inputs[0].shape[:-2]), {name: masking.get(name) for name in BATCHED}
    if len(batch_shape) != 1:
        inputs = tuple(x.reshape((math.prod(batch_shape),) + tuple(x.shape[-2:])) for x in inputs)
        arrays = {name: _merge_batch(name, x, batch_shape, _TRAILING.get(name, 1), broadcast)
                  for name, x in arrays.items()}
    query, key, value = inputs
    dropout_mask, query_positions = arrays.pop("dropout_mask"), None
    if max_length is not None:  # checked against the cache's positions by the decoding step
        query_positions = arrays.pop("query_positions")
    for name in ("positions", "segment_ids"):
        if self_attention and arrays[f"key_{name}"] is None:
            arrays[f"key_{name}"] = arrays.get(f"query_{name}")
    shape = (query.shape[0], num_heads, query.shape[1], key.shape[1] if max_length is None else max_length)
    spec = parse(shape, is_causal=masking.get("is_causal", False), local_window_size=masking.get("local_window_size"),
                 attention_chunk_size=masking.get("attention_chunk_size"), alibi_slopes=masking.get("alibi_slopes"),
                 **arrays)
    if max_length is None:
        key, value = zero_unused(key, value, spec)
    return Call(batch_shape, (query, key, value), spec, dropout_mask, query_positions)


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
