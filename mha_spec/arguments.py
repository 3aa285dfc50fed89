"""Argument checks written once for both twins; ``ArrayChecks`` checks array arguments."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
from typing_extensions import TypedDict

from mha_spec.alibi import check_slopes_shape
from mha_spec.qk_norm import QKNorm
from mha_spec.terms import check_chunk_size


def _is_int(n: Any) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool)


def _require_positive(*counts: tuple[str, Any]) -> None:
    """ValueError naming the first ``(name, n)`` whose ``n`` is not a positive integer."""
    for name, n in counts:
        if not _is_int(n) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (right-aligned, NumPy's rules)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(shape[::-1], target[::-1]))


def _real(x: Any, message: str) -> float:
    """``float(x)``, or TypeError ``message`` where ``x`` is no real number."""
    try:
        return float(x)
    except (TypeError, ValueError):
        raise TypeError(message) from None


A = TypeVar("A")


class PositionMasking(TypedDict, Generic[A], total=False):
    """The masking keywords a module's call takes beside flax's (``**masking``), with the inputs' batch axes."""

    query_positions: A
    key_positions: A
    local_window_size: int | tuple[int, int] | None
    query_segment_ids: A
    key_segment_ids: A
    key_value_seq_lengths: A


def position_masking(call: str, masking: Mapping[str, Any]) -> dict[str, Any]:
    """Each name of ``PositionMasking`` in ``masking``, None where not given; TypeError for any other."""
    names = PositionMasking.__annotations__
    for name in masking:
        if name not in names:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")
    return {name: masking.get(name) for name in names}


def check_head_counts(num_heads: int, num_kv_heads: int) -> None:
    """Both counts positive integers, the key/value heads dividing the query heads."""
    _require_positive(("num_heads", num_heads), ("num_kv_heads", num_kv_heads))
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")


def check_heads(num_heads: int, num_kv_heads: int, features: int, features_name: str) -> int:
    """Validate head counts against a feature size; return head_dim."""
    _require_positive(("num_heads", num_heads), ("num_kv_heads", num_kv_heads), (features_name, features))
    if features % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide {features_name} ({features})")
    check_head_counts(num_heads, num_kv_heads)
    return features // num_heads


def check_rank(name: str, shape: Sequence[int], layout: str) -> bool:
    """ValueError unless ``shape`` has rank 4 (``layout``) or 3 (one example, the batch axis left out);
    whether it has rank 3."""
    if len(shape) not in (3, 4):
        raise ValueError(f"{name} must have rank 3 (one example) or 4 {layout}, got shape {tuple(shape)}")
    return len(shape) == 3


def check_broadcast(name: str, shape: Sequence[int], target: Sequence[int], target_names: str) -> None:
    """ValueError unless ``shape`` broadcasts to ``target`` (right-aligned, numpy rules)."""
    shape, target = tuple(shape), tuple(target)
    if not _broadcasts(shape, target):
        raise ValueError(f"{name} of shape {shape} does not broadcast to {target_names} = {target}")


def check_dropout_rate(name: str, rate: float) -> float:
    """A number in ``[0, 1)``, as a float."""
    rate = _real(rate, f"{name} must be a number in [0, 1), got {rate!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate}")
    return rate


def resolve_deterministic(call: bool | None, default: bool | None) -> bool:
    """The call's ``deterministic``, else the module's; an error when dropout needs one and neither is set."""
    for value in (call, default):
        if value is not None:
            return bool(value)
    raise ValueError("dropout_rate > 0 needs deterministic=True or False, in the constructor or the call "
                     "(nnx: module.eval() / module.train())")


def check_scale(scale) -> float | None:
    """None, or a finite real number."""
    if scale is None:
        return None
    value = _real(scale, f"scale must be a real number, got {scale!r}")
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_logit_soft_cap(cap) -> float | None:
    """None, or a positive finite real number (a Python or NumPy scalar: it is static under ``jit``)."""
    if cap is None:
        return None
    message = f"logit_soft_cap must be a positive finite number, got {cap!r}"
    if isinstance(cap, (bool, np.bool_, str, bytes)):  # float() would read True or '50'
        raise TypeError(message)
    value = _real(cap, message)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"logit_soft_cap must be a positive finite number, got {value}")
    return value


def check_sinks_shape(shape: Sequence[int], heads: int) -> None:
    """ValueError unless ``shape`` is ``(heads,)``: one sink logit per query head."""
    if tuple(shape) != (heads,):
        raise ValueError(f"sinks must have shape (heads,) = ({heads},), one logit per query head, got {tuple(shape)}")


def check_padding_valid(shape: tuple[int, ...], kind: str, dtype) -> None:
    """``padding_mask``'s ``valid``: bool or integer ``(batch, kv_len)``."""
    if len(shape) != 2:
        raise ValueError(f"valid must have rank 2 (batch, kv_len), got shape {tuple(shape)}")
    if kind not in ("bool", "int"):
        raise TypeError(f"valid must be bool or integer, got dtype {dtype}")


def check_mask_sizes(q_len, kv_len) -> int:
    """``causal_mask``'s sizes, positive integers; ``kv_len`` (``q_len`` when None)."""
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")
    return kv_len


def check_segments_given(query_given: bool, key_given: bool) -> None:
    """Segment ids come in pairs: the queries' and the keys'."""
    if query_given != key_given:
        given, missing = ("query_segment_ids", "key_segment_ids")[:: 1 if query_given else -1]
        raise ValueError(f"{given} needs {missing} too (in self-attention through a module, it defaults to the "
                         "query's)")


def check_options(implementation, known: tuple[str, ...], scale, local_window_size, attention_chunk_size
                  ) -> tuple[str | None, float | None, tuple[int, int] | None, int | None]:
    """``(implementation, scale, (left, right) window, chunk size)``, checked as the functional cores do."""
    return (check_implementation(implementation, known), check_scale(scale), check_window(local_window_size),
            check_chunk_size(attention_chunk_size))


def default_inputs(query: Any, key: Any, value: Any, names: Sequence[str], array: str) -> tuple[bool, Any, Any, Any]:
    """``(self_attention, query, key, value)`` with flax's defaults for absent key (the query) and value (the key)."""
    if key is None and value is not None:
        raise ValueError(f"`{names[1]}` cannot be None if `{names[2]}` is not None. To use one {array} for both, "
                         f"pass it as {names[1]} and leave {names[2]} as None")
    self_attention = key is None or key is query
    key = query if key is None else key
    return self_attention, query, key, key if value is None else value


def check_input_features(name: str, shape: Sequence[int], features: int, features_name: str) -> None:
    """A module's input ``(*batch, len, features)`` with the module's ``features``."""
    if len(shape) < 2:
        raise ValueError(f"{name} must have rank 2 or more (*batch, length, features), got shape {tuple(shape)}")
    if shape[-1] != features:
        raise ValueError(f"{name} has {shape[-1]} features (shape {tuple(shape)}), "
                         f"but the module's {features_name} is {features}")


def check_inputs_agree(names: Sequence[str], shapes: Sequence[Sequence[int]], dtypes: Sequence[Any]) -> None:
    """Query, key and value inputs share one dtype and the batch axes; key and value share the length."""
    q, k, v = names
    if not dtypes[0] == dtypes[1] == dtypes[2]:
        raise TypeError(f"{q}, {k} and {v} must share one dtype, got {dtypes[0]}, {dtypes[1]}, {dtypes[2]}")
    shapes = [tuple(s) for s in shapes]
    if not shapes[0][:-2] == shapes[1][:-2] == shapes[2][:-2]:
        raise ValueError(f"{q}, {k} and {v} must share the batch axes, got shapes {shapes[0]}, {shapes[1]}, "
                         f"{shapes[2]}")
    if shapes[1][-2] != shapes[2][-2]:
        raise ValueError(f"{k} and {v} must share kv_len, got shapes {shapes[1]} and {shapes[2]}")


def check_is_causal(is_causal) -> bool:
    """A Python or NumPy bool, as a bool."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return bool(is_causal)


def check_implementation(implementation, known: tuple[str, ...]) -> str | None:
    """None (the default choice) or one of ``known``."""
    if implementation is not None and implementation not in known:
        raise ValueError(f"implementation must be one of {known} or None, got {implementation!r}")
    return implementation


def check_window(window) -> tuple[int, int] | None:
    """None, an integer ``w`` (the window ``(w, w)``) or ``(left, right)``, each >= 0."""
    if window is None:
        return None
    pair = (window, window) if _is_int(window) else window
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(map(_is_int, pair))):
        raise TypeError(f"local_window_size must be an integer or a pair (left, right) of integers, got {window!r}")
    if min(pair) < 0:
        raise ValueError(f"local_window_size must be >= 0 on both sides, got {window!r}")
    return int(pair[0]), int(pair[1])


def check_qk_norm(normalize_qk) -> QKNorm | None:
    """``normalize_qk`` as a ``QKNorm``: False/None -> None, True -> flax's (LayerNorm per head, eps 1e-6)."""
    if normalize_qk is None or normalize_qk is False:
        return None
    if normalize_qk is True:
        return QKNorm()
    if isinstance(normalize_qk, QKNorm):
        return normalize_qk
    raise TypeError(f"normalize_qk must be a bool or a QKNorm, got {type(normalize_qk).__name__}")


def check_positions_shape(shape: Sequence[int], batch_shape: Sequence[int], length: int) -> None:
    """ValueError unless ``shape`` is ``(len,)`` or ``(*batch, len)`` broadcasting to the input's batch axes."""
    shape, batch_shape = tuple(shape), tuple(batch_shape)
    if not (len(shape) >= 1 and shape[-1] == length and _broadcasts(shape[:-1], batch_shape)):
        raise ValueError(f"positions must have shape (len,) = ({length},) or (*batch, len) with batch axes "
                         f"broadcasting to {batch_shape}, got {shape}")


_KINDS = {"float": "a real floating-point array", "int": "an integer array"}


@dataclass(frozen=True)
class ArrayChecks:
    """The checks of array arguments, given how one framework reads an array (each twin's ``_checks`` makes one).
    ``array``: what messages call an array; ``kind(x)``: ``'float'``, ``'complex'``, ``'int'``, ``'bool'`` or
    ``'other'``; ``dtype(x)`` as NumPy prints it; ``values(x)``: NumPy values, or None under ``jit``;
    ``heads_first``: the core's layout is ``(batch, heads, len, head_dim)``."""

    array: str
    is_array: Callable[[Any], bool]
    kind: Callable[[Any], str]
    dtype: Callable[[Any], str]
    values: Callable[[Any], np.ndarray | None]
    heads_first: bool

    def require_array(self, name: str, x) -> None:
        """TypeError unless ``x`` is an array."""
        if not self.is_array(x):
            raise TypeError(f"{name} must be {self.array}, got {type(x).__name__}")

    def require_kind(self, name: str, x, want: str) -> None:
        """TypeError unless ``x`` is an array of dtype kind ``want``: ``'float'`` (real) or ``'int'``."""
        self.require_array(name, x)
        if self.kind(x) != want:
            raise TypeError(f"{name} must be {_KINDS[want]}, got dtype {self.dtype(x)} with shape {tuple(x.shape)}")

    require_float = functools.partialmethod(require_kind, want="float")
    require_int = functools.partialmethod(require_kind, want="int")

    def check_logit_terms(self, scale, logit_soft_cap, sinks, heads: int, head_dim: int) -> tuple[float, float | None]:
        """(scale, default ``1 / sqrt(head_dim)``; soft cap or None), checked; ``sinks`` real floating ``(heads,)``."""
        scale, soft_cap = check_scale(scale), check_logit_soft_cap(logit_soft_cap)
        if sinks is not None:
            self.require_float("sinks", sinks)
            check_sinks_shape(sinks.shape, heads)
        return 1.0 / math.sqrt(head_dim) if scale is None else scale, soft_cap

    def _inputs(self, query, key, value) -> tuple[tuple[str, Any, str], ...]:
        """``(name, array, layout)`` of the query, key and value."""
        layout = "(batch, {}, {}, {})" if self.heads_first else "(batch, {1}, {0}, {2})"
        q_layout, kv_layout = (layout.format(h, n, "head_dim") for h, n in (("heads", "q_len"), ("kv_heads", "kv_len")))
        v_layout = layout.format("kv_heads", "kv_len", "v_head_dim")
        return ("query", query, q_layout), ("key", key, kv_layout), ("value", value, v_layout)

    def check_unbatched(self, query, key, value) -> bool:
        """Real floating inputs, all of rank 4 or all of rank 3 (one example: the batch axis left out, as
        ``jax.nn.dot_product_attention`` and ``scaled_dot_product_attention`` take it); whether of rank 3."""
        inputs = self._inputs(query, key, value)
        for name, x, _ in inputs:
            self.require_float(name, x)
        ranks = {check_rank(name, x.shape, layout) for name, x, layout in inputs}
        if len(ranks) > 1:
            raise ValueError(f"query, key and value must all have rank 4 or all rank 3 (one example), got shapes "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        return ranks.pop()

    def check_attention_inputs(self, query, key, value) -> tuple[int, int, int, int, int, int]:
        """Real floating ``(batch, len, heads, head_dim)`` inputs (``heads_first``: heads before len), the value's
        head dim free. Returns (batch, q_len, heads, head_dim, kv_len, kv_heads)."""
        order = (0, 2, 1, 3) if self.heads_first else (0, 1, 2, 3)  # to (batch, len, heads, head_dim)
        inputs = self._inputs(query, key, value)
        for name, x, _ in inputs:
            self.require_float(name, x)
        for name, x, axes in inputs:
            if len(x.shape) != 4:
                raise ValueError(f"{name} must have rank 4 {axes}, got shape {tuple(x.shape)}")
        if not (query.dtype == key.dtype == value.dtype):
            raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
        query, key, value = tuple(query.shape), tuple(key.shape), tuple(value.shape)
        batch, q_len, heads, head_dim = (query[i] for i in order)
        if key[:3] != value[:3]:
            raise ValueError(f"key and value must have the same shape but for the last axis: batch, kv_len and "
                             f"kv_heads must agree (only the head dim may differ), got key {key} and value {value}")
        k_batch, kv_len, kv_heads, k_dim = (key[i] for i in order)
        if k_batch != batch or k_dim != head_dim:
            raise ValueError(f"key {key} and value {value} must match query {query} in batch, and key in head_dim")
        if head_dim == 0:
            raise ValueError(f"query, key and value need head_dim >= 1, got query {query}, key {key}")
        if value[3] == 0:
            raise ValueError(f"value needs a head dim >= 1 (its last axis), got value {value}")
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"key/value heads ({kv_heads}) must divide query heads ({heads}); query {query}, "
                             f"key {key}")
        return batch, q_len, heads, head_dim, kv_len, kv_heads

    def check_sequence(self, name: str, x, batch: int, length: int, length_name: str) -> None:
        """An integer array of shape ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
        self.require_int(name, x)
        shape = tuple(x.shape)
        if not (shape == (length,) or (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == length)):
            raise ValueError(f"{name} must have shape ({length_name},) = ({length},) or (batch, {length_name}) = "
                             f"({batch}, {length}), got {shape}")

    def check_lengths(self, name: str, lengths, batch: int, length: int, length_name: str = "kv_len") -> None:
        """An integer ``(batch,)`` (or scalar) array of lengths in ``[0, length]`` (where the values are known)."""
        self.require_int(name, lengths)
        if tuple(lengths.shape) not in ((), (1,), (batch,)):
            raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(lengths.shape)}")
        values = self.values(lengths)
        if values is not None and values.size and (values.min() < 0 or values.max() > length):
            raise ValueError(f"{name} must lie in [0, {length_name}] = [0, {length}], got {values.tolist()}")

    def sequence(self, name: str, x, batch: int, length: int, length_name: str, index: Callable):
        """Integer ``(length,)`` or ``(batch|1, length)`` as ``index(x)`` ``(batch|1, length)``; None stays None."""
        if x is None:
            return None
        self.check_sequence(name, x, batch, length, length_name)
        x = index(x)
        return x[None] if x.ndim == 1 else x

    def lengths(self, name: str, x, batch: int, length: int, length_name: str, index: Callable):
        """Lengths checked by ``check_lengths`` as ``index(x)`` ``(batch,)``; None stays None."""
        if x is None:
            return None
        self.check_lengths(name, x, batch, length, length_name)
        return index(x).reshape(-1)[[0] * batch] if x.ndim == 0 or x.shape[0] != batch else index(x)

    def position_terms(self, shape: tuple[int, int, int, int], index: Callable, constant: Callable, *, is_causal=False,
                       query_positions=None, key_positions=None, local_window_size=None, query_segment_ids=None,
                       key_segment_ids=None, key_value_seq_lengths=None, attention_chunk_size=None,
                       alibi_slopes=None) -> dict[str, Any]:
        """The ``Spec`` fields of every masking term but the mask and bias, checked in the order of the names;
        ``index``: integers as the framework's index array, ``constant``: a float array with no gradient."""
        batch, heads, q_len, kv_len = shape
        fields = dict(is_causal=check_is_causal(is_causal),
                      query_positions=self.sequence("query_positions", query_positions, batch, q_len, "q_len", index),
                      key_positions=self.sequence("key_positions", key_positions, batch, kv_len, "kv_len", index),
                      window=check_window(local_window_size))
        check_segments_given(query_segment_ids is not None, key_segment_ids is not None)
        fields.update(
            query_segment_ids=self.sequence("query_segment_ids", query_segment_ids, batch, q_len, "q_len", index),
            key_segment_ids=self.sequence("key_segment_ids", key_segment_ids, batch, kv_len, "kv_len", index),
            lengths=self.lengths("key_value_seq_lengths", key_value_seq_lengths, batch, kv_len, "kv_len", index),
            chunk_size=check_chunk_size(attention_chunk_size))
        if alibi_slopes is not None:  # a constant (no gradient), (batch|1, heads)
            self.require_float("alibi_slopes", alibi_slopes)
            check_slopes_shape(alibi_slopes.shape, batch, heads)
            fields["alibi_slopes"] = constant(alibi_slopes)[None] if alibi_slopes.ndim == 1 else constant(alibi_slopes)
        return fields

    def check_dropout_mask(self, x, shape: tuple[int, ...], layout: str) -> None:
        """A bool (True = keep) or 0/1 integer keep-mask broadcasting to ``shape``."""
        self.require_array("dropout_mask", x)
        check_broadcast("dropout_mask", x.shape, shape, layout)
        if self.kind(x) not in ("bool", "int"):
            raise TypeError(f"dropout_mask must be bool (True = keep) or 0/1 integer, got dtype {self.dtype(x)} "
                            f"with shape {tuple(x.shape)}")
