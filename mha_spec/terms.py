"""Which keys a query may see: masking terms (``Term``), their conjunction (``Terms``), a call's masking (``Spec``)."""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np

from mha_spec import alibi as _alibi


class Where(NamedTuple):
    """What the terms read of queries or keys, laid out to broadcast (None: not given); ``index``, ``length``: keys'."""

    position: Any = None
    segment: Any = None
    index: Any = None
    length: Any = None


# No inf inside any path (jax.debug_infs, torch's anomaly mode): finite stand-ins, as fractions of the compute
# dtype's largest finite value. A masked score (jax.nn's -0.7); the running max at or below which a row has met no
# key; the floor of a finite bias (real scores stay above that line); an empty row's logsumexp (every weight
# recomputed from it is 0).
MASKED, NO_KEY, BIAS_FLOOR, EMPTY_LSE = -0.7, -0.35, -0.1, 0.25


def conjoin(a, b):
    """``a & b``, either of which may be None (nothing excluded)."""
    return b if a is None else a if b is None else a & b


class Term:
    """One masking term, holding no array; what it reads comes as ``Where``.

    ``visible(q, k)``: bool, which keys each query may see. ``block(q_lo, q_hi, k_lo, k_hi)``: ``(whole, live)``
    from a block's extremes: ``live`` False when no query may see a key, ``whole`` True when every query sees
    every key. ``reads``: the ``Where`` fields read; ``shift_invariant``: reads positions only relative to each
    other. Both methods use operators alone (NumPy, JAX, PyTorch, traced or not); None: no restriction."""

    reads: ClassVar[frozenset[str]] = frozenset({"position"})
    shift_invariant: ClassVar[bool] = True

    @property
    def members(self) -> tuple[Term, ...]:
        return (self,)

    def __and__(self, other: Term) -> Terms:
        return Terms(self.members + other.members)


@dataclass(frozen=True)
class Causal(Term):
    """A query sees the keys at positions ``<=`` its own (``is_causal``)."""

    def visible(self, q: Where, k: Where):
        return k.position <= q.position

    def block(self, q_lo: Where, q_hi: Where, k_lo: Where, k_hi: Where):
        return k_hi.position <= q_lo.position, k_lo.position <= q_hi.position


@dataclass(frozen=True)
class Window(Term):
    """A query at position ``p`` sees the keys at positions ``p - left .. p + right`` (``local_window_size``)."""

    left: int
    right: int

    def visible(self, q: Where, k: Where):
        return (k.position >= q.position - self.left) & (k.position <= q.position + self.right)

    def block(self, q_lo: Where, q_hi: Where, k_lo: Where, k_hi: Where):
        whole = (k_lo.position >= q_hi.position - self.left) & (k_hi.position <= q_lo.position + self.right)
        live = (k_hi.position >= q_lo.position - self.left) & (k_lo.position <= q_hi.position + self.right)
        return whole, live


def _same(q_lo, q_hi, k_lo, k_hi):
    """(whole, live) of "equal ids" over id ranges: whole where all four are one id, live where they meet."""
    return (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo), (k_hi >= q_lo) & (k_lo <= q_hi)


@dataclass(frozen=True)
class Segments(Term):
    """A query sees the keys of its own segment (equal ``query_segment_ids``, ``key_segment_ids``)."""

    reads: ClassVar[frozenset[str]] = frozenset({"segment"})

    def visible(self, q: Where, k: Where):
        return q.segment == k.segment

    def block(self, q_lo: Where, q_hi: Where, k_lo: Where, k_hi: Where):
        return _same(q_lo.segment, q_hi.segment, k_lo.segment, k_hi.segment)


@dataclass(frozen=True)
class Lengths(Term):
    """Keys at index ``>=`` the example's length (``key_value_seq_lengths``) are padding, seen by no query."""

    reads: ClassVar[frozenset[str]] = frozenset({"index", "length"})

    def visible(self, q: Where, k: Where):
        return k.index < k.length

    def block(self, q_lo: Where, q_hi: Where, k_lo: Where, k_hi: Where):
        return k_hi.index < k_hi.length, k_lo.index < k_lo.length


@dataclass(frozen=True)
class Chunked(Term):
    """A query sees the keys of its own chunk of ``size`` positions (``attention_chunk_size``, Llama 4's)."""

    size: int
    shift_invariant: ClassVar[bool] = False

    def visible(self, q: Where, k: Where):
        return q.position // self.size == k.position // self.size

    def block(self, q_lo: Where, q_hi: Where, k_lo: Where, k_hi: Where):
        n = self.size
        return _same(q_lo.position // n, q_hi.position // n, k_lo.position // n, k_hi.position // n)


@dataclass(frozen=True)
class Terms(Term):
    """A conjunction of terms (empty: every key visible, ``visible`` and ``block`` give None)."""

    terms: tuple[Term, ...] = ()

    @property
    def members(self) -> tuple[Term, ...]:
        return self.terms

    @property
    def reads(self) -> frozenset[str]:  # type: ignore[override]
        return frozenset().union(*(t.reads for t in self.terms))

    def __bool__(self) -> bool:
        return bool(self.terms)

    def __iter__(self):
        return iter(self.terms)

    def only(self, fields) -> Terms:
        """The members that read nothing but ``fields``."""
        return Terms(tuple(t for t in self.terms if t.reads <= frozenset(fields)))

    def visible(self, q: Where, k: Where):
        return functools.reduce(conjoin, (term.visible(q, k) for term in self.terms), None)

    def block(self, q_lo: Where, q_hi: Where, k_lo: Where, k_hi: Where):
        wholes, lives = zip(*(term.block(q_lo, q_hi, k_lo, k_hi) for term in self.terms)) if self.terms else ((), ())
        return functools.reduce(conjoin, wholes, None), functools.reduce(conjoin, lives, None)


def of(is_causal: bool, window: tuple[int, int] | None, chunk_size: int | None, segments: bool, lengths: bool) -> Terms:
    """The conjunction of a call's checked terms: causality, window, chunks, segments, lengths."""
    members = (Causal(),) if is_causal else ()
    members += () if window is None else (Window(*window),)
    members += () if chunk_size is None else (Chunked(chunk_size),)
    members += (Segments(),) if segments else ()
    return Terms(members + ((Lengths(),) if lengths else ()))


def check_chunk_size(size) -> int | None:
    """``attention_chunk_size``: None or a positive integer."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise TypeError(f"attention_chunk_size must be a positive integer or None, got {size!r}")
    if size < 1:
        raise ValueError(f"attention_chunk_size must be a positive integer or None, got {size!r}")
    return int(size)


def cache_overflows(start: Any, end: Any, max_length: int, terms: Terms) -> Any:
    """bool ``(batch,)``: the step overwrote position ``end - max_length - 1`` (or older), which a query at
    ``start .. end - 1`` may still see unless a chunk or a backward window (any window, if causal) rules it out."""
    wrapped = end > max_length
    causal = any(isinstance(t, Causal) for t in terms)
    bounds = Terms(tuple(t for t in terms.only({"position"}) if not isinstance(t, Window) or causal or t.right == 0))
    newest = Where(position=end - max_length - 1)
    live = bounds.block(Where(position=start), Where(position=end - 1), newest, newest)[1]
    return wrapped if live is None else wrapped & live


@dataclass(frozen=True)
class Spec:
    """One call's masking, checked. ``allowed`` (bool) and ``bias`` (float) broadcast to ``shape`` = ``(batch,
    heads, q_len, kv_len)``; positions and segment ids integer ``(batch|1, len)``; ``lengths`` ``(batch,)``;
    ``window`` ``(left, right)``; ``alibi_slopes`` float ``(batch|1, heads)``, a constant; ``query_lengths``
    ``(batch,)``: queries at index ``>=`` the length are padding, seeing no key (their output 0). None: absent
    (positions: ``arange``). ``device``: PyTorch's device; None in JAX."""

    shape: tuple[int, int, int, int]
    allowed: Any = None
    bias: Any = None
    is_causal: bool = False
    query_positions: Any = None
    key_positions: Any = None
    window: tuple[int, int] | None = None
    query_segment_ids: Any = None
    key_segment_ids: Any = None
    lengths: Any = None
    chunk_size: int | None = None
    device: Any = field(default=None, compare=False)
    alibi_slopes: Any = None
    query_lengths: Any = None

    @property
    def default_positions(self) -> bool:
        return self.query_positions is None and self.key_positions is None

    @property
    def terms(self) -> Terms:
        """The structured terms' conjunction."""
        segments, lengths = self.query_segment_ids is not None, self.lengths is not None
        return of(self.is_causal, self.window, self.chunk_size, segments, lengths)

    def positions(self, arange) -> tuple[Any, Any]:
        """(query ``(batch|1, q_len)``, key ``(batch|1, kv_len)``) positions, ``arange(n)`` by default."""
        _, _, q_len, kv_len = self.shape
        qp = arange(q_len)[None] if self.query_positions is None else self.query_positions
        kp = arange(kv_len)[None] if self.key_positions is None else self.key_positions
        return qp, kp

    def biases(self, arange) -> Any:
        """float broadcasting to ``(batch, heads, q_len, kv_len)``: the bias plus the ALiBi term; None if neither."""
        if self.alibi_slopes is None:
            return self.bias
        qp, kp = self.positions(arange)
        term = _alibi.bias(self.alibi_slopes[:, :, None, None], qp[:, None, :, None], kp[:, None, None, :])
        return term if self.bias is None else self.bias + term

    def dense(self, arange) -> Any:
        """bool ``(batch|1, heads|1, q_len, kv_len)``: every term but the bias, or None if none restricts."""
        visible = None  # positions alone restrict nothing
        if self.terms:
            qp, kp = self.positions(arange)
            qs, ks, lengths = self.query_segment_ids, self.key_segment_ids, self.lengths
            visible = self.terms.visible(
                Where(qp[:, :, None], None if qs is None else qs[:, :, None]),
                Where(kp[:, None, :], None if ks is None else ks[:, None, :], arange(self.shape[3])[None, None, :],
                      None if lengths is None else lengths[:, None, None]),
            )[:, None]
        return conjoin(conjoin(self.allowed, visible), self.query_rows(arange))

    def query_rows(self, arange) -> Any:
        """bool ``(batch, 1, q_len, 1)``: the queries within ``query_lengths`` (None: every query)."""
        if self.query_lengths is None:
            return None
        return (arange(self.shape[2])[None, :] < self.query_lengths[:, None])[:, None, :, None]

    def excluded_keys(self, kv_heads: int, arange, extremes, present, below_all=None) -> Any:
        """bool ``(batch|1, kv_heads|1, kv_len)``: keys no query of a key/value head's group may see, each term read
        alone; None if none. ``extremes(positions)``: min and max along axis 1, kept; ``present(query_ids,
        key_ids)``: bool ``(batch|1, kv_len)``, whether each key's segment id occurs among the queries' (or None);
        ``below_all(x)``: bool, where ``x`` is ``-inf`` (default ``x == -inf``)."""
        below_all = below_all or (lambda x: x == -math.inf)
        excluded = []
        dense = (None if self.allowed is None else ~self.allowed, None if self.bias is None else below_all(self.bias))
        for ex in dense:
            if ex is not None:  # the dense mask's and the bias's exclusions, over queries: (batch?, heads?, kv?)
                ex = ex.reshape((1,) * (4 - ex.ndim) + tuple(ex.shape)).all(axis=2)
                if ex.shape[1] != 1:  # over the query heads of each key/value head
                    ex = ex.reshape(ex.shape[0], kv_heads, ex.shape[1] // kv_heads, ex.shape[2]).all(axis=2)
                excluded.append(ex)
        # lengths, causality, windows, chunks: read from the queries' extreme positions (lengths alone without queries)
        ranged = self.terms.only({"index", "length", "position"} if self.shape[2] > 0 else {"index", "length"})
        if ranged:
            qp, kp = self.positions(arange) if "position" in ranged.reads else (None, None)
            lo, hi = (Where(), Where()) if qp is None else (Where(x) for x in extremes(qp))
            lengths = None if self.lengths is None else self.lengths[:, None]
            key = Where(kp, index=arange(self.shape[3])[None], length=lengths)
            excluded.append(~ranged.block(lo, hi, key, key)[1][:, None, :])
        if present is not None and self.query_segment_ids is not None and self.shape[2] > 0:
            excluded.append(~present(self.query_segment_ids, self.key_segment_ids)[:, None, :])
        return functools.reduce(operator.or_, excluded) if excluded else None
