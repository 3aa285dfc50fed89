"""A paged key/value cache's bookkeeping (host side, NumPy) and the token arithmetic both twins share.

A pool of ``num_pages`` pages of ``page_size`` tokens serves up to ``max_seqs`` sequences; row ``s`` of the
page table lists, in order, the pages holding positions ``0, page_size, 2 * page_size, ...`` of sequence ``s``
(``-1``: none). A step appends ``q_lens[s]`` tokens to each sequence ``s`` and describes itself with
``jax.experimental.pallas.ops.tpu.ragged_paged_attention``'s arrays: ``cu_q_lens`` int32 ``(max_seqs + 1,)``,
``kv_lens`` int32 ``(max_seqs,)`` (the lengths after the step), ``page_indices`` int32 ``(max_seqs,
pages_per_seq)``, ``num_seqs`` int32 ``(1,)``; the ``i``-th new token of ``s`` is at position
``kv_lens[s] - q_len + i``.

The twins' ``ragged_attention`` attends bottom-right causally (query ``i`` of ``s`` at that position) over each
sequence's pages where they lie: per sequence, an online softmax over its pages (a page is a key block), only
those holding a key some query sees (``page_range``). Every term of ``dot_product_attention`` that reads positions
applies (``TERMS``; ``local_window_size=(left, 0)`` is ``ragged_paged_attention``'s ``sliding_window=left + 1``); a
named ``implementation`` instead gathers the pages into a padded batch for that implementation of the public
``dot_product_attention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mha_spec import alibi, arguments
from mha_spec.terms import check_chunk_size

STEP = ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")
# the keywords of ``dot_product_attention`` a ragged call passes on (every one reads the tokens' positions)
TERMS = ("scale", "local_window_size", "attention_chunk_size", "alibi_slopes", "logit_soft_cap", "sinks",
         "implementation")


class PageTable:
    """Which pages each sequence holds, and which are free; ``lengths`` int32 ``(max_seqs,)``."""

    def __init__(self, num_pages: int, page_size: int, max_seqs: int, pages_per_seq: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.pages = np.full((max_seqs, pages_per_seq), -1, np.int32)
        self.lengths = np.zeros(max_seqs, np.int32)
        self.free = list(range(num_pages - 1, -1, -1))

    def append(self, q_lens: Sequence[int]) -> dict[str, np.ndarray]:
        """Holds pages for ``q_lens[s]`` more tokens of sequence ``s`` (``len(q_lens) <= max_seqs``) and
        advances the lengths; the step's arrays (``STEP``), released pages read as page 0."""
        max_seqs, pages_per_seq = self.pages.shape
        q_lens = np.asarray(q_lens, np.int64)
        if q_lens.ndim != 1 or len(q_lens) > max_seqs or (q_lens < 0).any():
            raise ValueError(f"q_lens must be {max_seqs} or fewer counts >= 0, got {q_lens.tolist()}")
        ends = self.lengths[: len(q_lens)] + q_lens
        needed = -(-ends // self.page_size)
        if needed.max(initial=0) > pages_per_seq:
            raise ValueError(f"a sequence of length {int(ends.max())} needs {int(needed.max())} pages, but the "
                             f"page table holds {pages_per_seq} per sequence (page_size {self.page_size})")
        new = [(s, p) for s, n in enumerate(needed) for p in range(n) if self.pages[s, p] < 0
               and (p + 1) * self.page_size > self.lengths[s]]
        if len(new) > len(self.free):
            raise ValueError(f"the step needs {len(new)} new pages but {len(self.free)} of {self.num_pages} are free")
        for s, p in new:
            self.pages[s, p] = self.free.pop()
        self.lengths[: len(q_lens)] = ends
        return self.arrays(q_lens)

    def arrays(self, q_lens: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """The step's arrays (``STEP``) of the table as it stands: ``q_lens`` the queries of the rows just
        appended to, or None: no query, every row counted (an empty cache's)."""
        max_seqs = self.pages.shape[0]
        counts = np.zeros(max_seqs, np.int64) if q_lens is None else np.asarray(q_lens, np.int64)
        cu_q_lens = np.zeros(max_seqs + 1, np.int32)
        cu_q_lens[1:] = np.cumsum(np.pad(counts, (0, max_seqs - len(counts))))
        return dict(kv_lens=self.lengths.copy(), page_indices=np.maximum(self.pages, 0),
                    cu_q_lens=cu_q_lens, num_seqs=np.array([len(counts)], np.int32))

    def release_before(self, seq: int, position: int) -> int:
        """Frees sequence ``seq``'s pages wholly before ``position`` (keys no later query sees: a window of
        ``left`` keys after a step needs ``position = lengths[seq] - left``); how many were freed."""
        held = [p for p in range(min(position // self.page_size, self.pages.shape[1])) if self.pages[seq, p] >= 0]
        self.free += [int(self.pages[seq, p]) for p in held]
        self.pages[seq, held] = -1
        return len(held)

    def release(self, seq: int) -> None:
        """Frees every page of sequence ``seq``; its length becomes 0."""
        self.release_before(seq, self.pages.shape[1] * self.page_size)
        self.lengths[seq] = 0


def step_arrays(cache: Any) -> dict[str, Any]:
    """A twin's cache's step arrays (``STEP``) by name."""
    return {name: getattr(cache, name) for name in STEP}


def check_step(cache: Any, total_q: int, max_q_len: int, *, known: Any) -> None:
    """A twin's cache's step: its shapes, and its values where ``known(array)`` gives them as NumPy (None inside a
    trace: ``jit``, ``torch.compile``)."""
    step = step_arrays(cache)
    check_cache(cache.kv_pages.shape, {name: a.shape for name, a in step.items()})
    values = {name: known(a) for name, a in step.items()}
    if all(v is not None for v in values.values()):
        check_values(values, cache.kv_pages.shape[1], cache.kv_pages.shape[0], total_q, max_q_len)


def check_layer_inputs(shape: Sequence[int], features: int, kv_pages: Sequence[int], heads: int,
                       head_dim: int) -> None:
    """A layer's ``paged_step`` inputs: packed tokens ``(total_q, features)``, and pages holding the layer's
    ``heads`` key/value heads of ``head_dim`` (a latent's: 1 of ``cache_dim``)."""
    if len(shape) != 2 or shape[1] != features:
        raise ValueError(f"paged_step takes inputs (total_q, {features}), the packed tokens of the step's "
                         f"sequences, got {tuple(shape)}")
    if tuple(kv_pages[2:]) != (2 * heads, head_dim):
        raise ValueError(f"paged_step: this layer's pages hold {heads} key/value head{'s' * (heads != 1)} of "
                         f"{head_dim} (init_cache(table, {heads}, {head_dim}, dtype)), got kv_pages {tuple(kv_pages)}")


def check_cache(kv_pages: Sequence[int], step: dict[str, Sequence[int]]) -> None:
    """``kv_pages`` ``(num_pages, page_size, 2 * kv_heads, head_dim)`` and a step's arrays' shapes (``STEP``)."""
    max_seqs = step["page_indices"][0] if len(step["page_indices"]) == 2 else -1
    expected = dict(kv_lens=(max_seqs,), cu_q_lens=(max_seqs + 1,), num_seqs=(1,))
    if len(kv_pages) != 4 or kv_pages[2] % 2 or max_seqs < 0 or any(tuple(step[k]) != v for k, v in expected.items()):
        raise ValueError(
            f"a paged cache needs kv_pages (num_pages, page_size, 2 * kv_heads, head_dim), page_indices "
            f"(max_seqs, pages_per_seq), kv_lens (max_seqs,), cu_q_lens (max_seqs + 1,), num_seqs (1,); got "
            f"kv_pages {tuple(kv_pages)}, " + ", ".join(f"{k} {tuple(step[k])}" for k in STEP))


def check_queries(name: str, shape: Sequence[int], heads: int | None, kv_pages: Sequence[int]) -> None:
    """Packed ``name`` ``(total_q, heads, head_dim)``; ``heads`` None: a multiple of ``kv_heads``."""
    kv_heads, head_dim = kv_pages[2] // 2, kv_pages[3]
    if len(shape) != 3 or shape[2] != head_dim or (shape[1] != heads if heads else shape[1] % kv_heads):
        want = f"{heads}" if heads else f"a multiple of kv_heads {kv_heads}"
        raise ValueError(f"{name} must be packed (total_q, heads, head_dim) with heads {want} and head_dim "
                         f"{head_dim} (kv_pages {tuple(kv_pages)}), got {tuple(shape)}")


def check_contiguous(key: Sequence[int], value: Sequence[int], lengths: np.ndarray, table: PageTable) -> None:
    """``from_contiguous``'s inputs: key and value ``(batch, max_length, kv_heads, head_dim)``, ``lengths``
    ``(batch,)`` at most ``max_length``, and ``table``'s first ``batch`` rows empty."""
    if (len(key) != 4 or tuple(value) != tuple(key) or lengths.shape != tuple(key[:1]) or (lengths > key[1]).any()
            or table.lengths[: len(lengths)].any()):
        raise ValueError(f"from_contiguous needs key and value (batch, max_length, kv_heads, head_dim), lengths "
                         f"(batch,) <= max_length (a rolled-over cache has lost its first positions) and a table with "
                         f"those rows empty; got key {tuple(key)}, value {tuple(value)}, lengths {lengths.tolist()}, "
                         f"table lengths {table.lengths.tolist()}")


def check_values(step: dict[str, np.ndarray], page_size: int, num_pages: int, total_q: int, max_q_len: int) -> None:
    """A step's values (outside ``jit``/compilation): they describe tokens the pages and queries hold."""
    kv_lens, pages, cu = (np.asarray(step[k]) for k in ("kv_lens", "page_indices", "cu_q_lens"))
    n = int(np.asarray(step["num_seqs"])[0])
    q_lens = np.diff(cu)
    problems = [
        (not 0 <= n <= len(kv_lens), f"num_seqs {n} is not in [0, max_seqs {len(kv_lens)}]"),
        (cu[0] != 0 or (q_lens < 0).any() or cu[n] > total_q,
         f"cu_q_lens {cu.tolist()} must rise from 0 to at most total_q {total_q}"),
        ((kv_lens > pages.shape[1] * page_size).any(), f"kv_lens {kv_lens.tolist()} go beyond the pages held: "
         f"page_indices {pages.shape} of page_size {page_size} hold {pages.shape[1] * page_size} per sequence"),
        ((q_lens[:n] > kv_lens[:n]).any(), f"a sequence has more queries (cu_q_lens {cu.tolist()}) than keys "
         f"(kv_lens {kv_lens.tolist()})"),
        (q_lens[:n].max(initial=0) > max_q_len, f"a sequence has {q_lens[:n].max(initial=0)} queries, more than "
         f"max_q_len {max_q_len}"),
        (((pages < 0) | (pages >= num_pages)).any(), f"page_indices must be in [0, num_pages {num_pages})"),
    ]
    for bad, message in problems:
        if bad:
            raise ValueError(message)


def token_positions(step: dict[str, Any], tokens: Any, xp: Any) -> tuple[Any, Any, Any, Any]:
    """Each packed token's ``(sequence, index among its queries, position in its sequence, valid)``; ``tokens``:
    ``arange(total_q)``; 0 for the tokens past ``cu_q_lens[num_seqs]`` (not valid)."""
    cu, max_seqs = step["cu_q_lens"], step["kv_lens"].shape[0]
    valid = tokens < cu[step["num_seqs"][0]]
    seq = ((tokens[:, None] >= cu[None, 1:]) * 1).sum(-1).clip(max=max_seqs - 1)
    index = xp.where(valid, tokens - cu[seq], 0)
    return seq, index, xp.where(valid, step["kv_lens"][seq] - (cu[seq + 1] - cu[seq]) + index, 0), valid


def token_places(step: dict[str, Any], tokens: Any, page_size: int, pool: int, xp: Any) -> tuple[Any, Any, Any, Any]:
    """Each packed token's ``(sequence, index among its queries, slot in the flattened pool, valid)``;
    ``tokens``: ``arange(total_q)``; ``xp``: ``jax.numpy`` or ``torch``. Invalid tokens (past
    ``cu_q_lens[num_seqs]``) get slot ``pool`` (``num_pages * page_size``), past the pool."""
    seq, index, position, valid = token_positions(step, tokens, xp)
    page = step["page_indices"][seq, position // page_size]
    return seq, index, xp.where(valid, page * page_size + position % page_size, pool), valid


def row_queries(step: dict[str, Any], rows: Any, queries: Any, total_q: int, xp: Any) -> tuple[Any, ...]:
    """A padded batch of sequences: ``(token (max_seqs, max_q) into the packed queries, kv_lens (max_seqs,),
    query positions (max_seqs, max_q))``, lengths 0 past ``num_seqs``; ``rows``:
    ``arange(max_seqs)``, ``queries``: ``arange(max_q)``."""
    cu, live = step["cu_q_lens"], rows < step["num_seqs"][0]
    q_lens, kv_lens = xp.where(live, cu[1:] - cu[:-1], 0), xp.where(live, step["kv_lens"], 0)
    token = (cu[:-1, None] + queries[None]).clip(max=max(total_q - 1, 0))
    return token, kv_lens, (kv_lens - q_lens)[:, None] + queries[None]


def check_terms(terms: dict[str, Any]) -> None:
    """Only the keywords ``TERMS`` (positions, lengths and causality are the step's)."""
    unknown = sorted(set(terms) - set(TERMS))
    if unknown:
        raise TypeError(f"a ragged call takes the terms {TERMS} by keyword, not {unknown}")


def checked_call(queries: Any, cache: Any, max_q_len: int | None, terms: dict[str, Any], require_float: Any,
                 known: Any) -> tuple[int, dict[str, Any]]:
    """``(max_q, terms)`` of a ragged call: ``queries`` packed and of ``kv_pages``' dtype, ``max_q`` ``max_q_len`` or
    ``total_q``, ``terms`` checked as ``dot_product_attention`` checks them: every one of ``TERMS`` (None where not
    given), ``scale`` ``head_dim ** -0.5`` by default, ``local_window_size`` as ``(left, right)``, ``sinks``
    ``(heads,)`` and ``alibi_slopes`` ``(heads,)`` or ``(max_seqs, heads)`` floating (``require_float``: the twin's);
    the twin's ``cache``'s step as ``check_step`` checks it (``known``: the twin's)."""
    kv_pages, max_seqs = cache.kv_pages, cache.kv_lens.shape[0]
    check_queries("queries", queries.shape, None, kv_pages.shape)
    if queries.dtype != kv_pages.dtype:
        names = [str(x.dtype).removeprefix("torch.") for x in (queries, kv_pages)]
        raise TypeError(f"queries and kv_pages must have one dtype, got {names[0]} and {names[1]}")
    check_terms(terms)
    (total_q, heads, head_dim), scale = queries.shape, arguments.check_scale(terms.get("scale"))
    checked = {**dict.fromkeys(TERMS), **terms}
    checked.update(scale=head_dim ** -0.5 if scale is None else scale,
                   logit_soft_cap=arguments.check_logit_soft_cap(terms.get("logit_soft_cap")),
                   local_window_size=arguments.check_window(terms.get("local_window_size")),
                   attention_chunk_size=check_chunk_size(terms.get("attention_chunk_size")))
    if checked["sinks"] is not None:
        require_float("sinks", checked["sinks"])
        arguments.check_sinks_shape(checked["sinks"].shape, heads)
    if checked["alibi_slopes"] is not None:
        require_float("alibi_slopes", checked["alibi_slopes"])
        alibi.check_slopes_shape(checked["alibi_slopes"].shape, max_seqs, heads)
    check_step(cache, total_q, max_q_len or total_q, known=known)
    return max_q_len or total_q, checked


def ragged(queries: Any, cache: Any, max_q_len: int | None, terms: dict[str, Any], *, require_float: Any,
           known: Any, gathered: Any, attend: Any) -> Any:
    """A twin's ``ragged_attention``: the call checked (``checked_call``), then the pages gathered into a padded
    batch for a named ``implementation`` (``gathered(queries, cache, max_q, terms)``), else the twin's page loop
    (``attend(queries, cache, max_q, **terms)``)."""
    max_q, terms = checked_call(queries, cache, max_q_len, terms, require_float, known)
    implementation = terms.pop("implementation")
    if implementation is not None:
        return gathered(queries, cache, max_q, dict(terms, implementation=implementation))
    return attend(queries, cache, max_q, **terms)


def page_range(kv_len: Any, q_len: Any, page_size: int, window: tuple[int, int] | None, chunk: int | None,
               maximum: Any) -> tuple[Any, Any]:
    """``(first, end)``: the page slots a sequence of ``kv_len`` keys and ``q_len`` queries (the last ones) reads,
    exactly those holding a key some query sees (causal: none past its length; none wholly before its first query's
    window of ``left`` keys or its chunk); ``maximum``: ``jnp.maximum``, or ``max`` on Python ints."""
    lowest = kv_len - q_len
    start = 0 * lowest
    if window is not None:
        start = maximum(start, lowest - window[0])
    if chunk is not None:
        start = maximum(start, lowest // chunk * chunk)
    return start // page_size, (kv_len * (q_len > 0) + page_size - 1) // page_size  # no query: no page
