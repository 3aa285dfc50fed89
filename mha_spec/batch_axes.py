"""A call's masking arguments gathered by name; merging the modules' batch axes into one and restoring them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


class Masking(NamedTuple):
    """The masking arguments of the public cores, gathered by name once per call (every one given: None if absent);
    ``mha_jax``'s ``query_seq_lengths`` marks padding queries and goes beside it."""

    mask: Any
    bias: Any
    is_causal: Any
    query_positions: Any
    key_positions: Any
    local_window_size: Any
    query_segment_ids: Any
    key_segment_ids: Any
    key_value_seq_lengths: Any
    attention_chunk_size: Any
    alibi_slopes: Any


# Every masking argument of a public call's signature; ``query_seq_lengths``: ``mha_jax``'s core alone.
MASKING = (*Masking._fields, "query_seq_lengths")
# A module call's arguments that carry batch axes, in the order they are merged (and checked).
BATCHED = ("dropout_mask", "mask", "bias", "query_positions", "key_positions", "query_segment_ids", "key_segment_ids",
           "key_value_seq_lengths")
# Those that a decoding cache sets (the keys' positions and lengths): refused while decoding.
SET_BY_CACHE = ("key_positions", "query_segment_ids", "key_segment_ids", "key_value_seq_lengths", "dropout_mask")


@dataclasses.dataclass(frozen=True)
class Call:
    """A checked module call, batch axes merged (``batch_shape``: the inputs' own); ``inputs`` ``(batch, len,
    features)``, ``spec`` the parsed masking; while decoding, ``query_positions`` holds the new tokens' as given."""

    batch_shape: tuple[int, ...]
    inputs: tuple
    spec: Any
    dropout_mask: Any = None
    query_positions: Any = None


def call_masking(layer_window: Any, attention_chunk_size: int | None, alibi_slopes: Any, positions: Mapping[str, Any],
                 *, mask: Any, bias: Any, is_causal: Any, dropout_mask: Any) -> dict:
    """A module call's masking arguments and ``dropout_mask`` for ``merged_call``: ``positions`` (those of
    ``arguments.PositionMasking``, each named) and the call's own, with the layer's window (the default), chunk size
    and ALiBi slopes ``(num_heads,)``."""
    window = layer_window if positions["local_window_size"] is None else positions["local_window_size"]
    return dict(positions, mask=mask, bias=bias, is_causal=is_causal, dropout_mask=dropout_mask,
                local_window_size=window, attention_chunk_size=attention_chunk_size, alibi_slopes=alibi_slopes)


# Axes after the batch axes per argument (1 otherwise: positions and segment ids).
_TRAILING = {"mask": 3, "bias": 3, "dropout_mask": 3, "key_value_seq_lengths": 0}


def merged_call(inputs: tuple, self_attention: bool, masking: Mapping[str, Any], broadcast: Callable, parse: Callable,
                zero_unused: Callable, num_heads: int, max_length: int | None = None) -> Call:
    """``inputs`` ``(*batch, len, features)`` and ``masking`` with batch axes merged and the masking parsed;
    in self-attention key positions and segment ids default to the query's; not decoding (``max_length`` None),
    ``zero_unused`` zeroes the keys no query may attend to."""
    given = [name for name in SET_BY_CACHE if masking.get(name) is not None]
    if max_length is not None and given:
        raise ValueError(f"{', '.join(given)} cannot be given while decoding: the cache sets the keys' "
                         "positions and lengths")
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
    """``x`` of ``(*batch_shape, *rest)`` (``trailing`` = len(rest)) as ``(prod(batch)|1, *rest)``."""
    if x is None or not hasattr(x, "shape") or 0 < trailing and x.ndim <= trailing:
        return x
    full = len(batch_shape) + trailing
    lead = tuple(x.shape[:x.ndim - trailing])
    if x.ndim > full or any(a not in (1, b) for a, b in zip(reversed(lead), reversed(batch_shape))):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, whose batch axes {lead} do not broadcast to the "
                         f"inputs' batch axes {batch_shape}")
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
