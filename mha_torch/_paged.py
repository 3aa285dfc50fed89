"""Ragged attention reading a paged cache where it lies (``mha_spec.paged``), in PyTorch; twin of ``mha_jax/_paged.py``.

Per sequence, an online softmax (``init``, ``forward``, ``finish``: ``mha_jax._tiles``'s, with the same finite
stand-ins for inf) over its pages (``mha_spec.paged.page_range``: none past its length or wholly outside its
queries' window or chunk), ``testing.Tuning.paged_block_pages`` of them read from the pool at a time as one key
block (a block's copy, never the cache's) into one buffer each call reuses, its last cut at the length. A
sequence's queries padded to ``max_q``.
"""

from __future__ import annotations

from typing import Any

import torch

from mha_spec import alibi, paged, terms
from mha_spec.terms import MASKED, NO_KEY, Where
from mha_torch import _tiles, testing


def init(acc: torch.Tensor, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(running max, sum, ``acc``) before any page (max ``MASKED``); a sink starts a row at max = sink, sum = 1."""
    zeros = torch.zeros_like(acc[..., 0])
    masked = _tiles.of_max(zeros.dtype, MASKED)
    if sinks is None:
        return torch.full_like(zeros, masked), zeros, acc
    return (zeros + sinks).clamp_min(masked), zeros + (~torch.isneginf(sinks)).to(zeros.dtype), acc


def forward(state: tuple[torch.Tensor, ...], s: torch.Tensor, mix) -> tuple[torch.Tensor, ...]:
    """The state after a page's scores ``s`` ``(..., rows, keys)``; ``mix(p)`` is ``p V``."""
    m, norm, acc = state
    m_new = torch.maximum(m, s.amax(dim=-1))
    shift = torch.where(m_new > _tiles.of_max(m.dtype, NO_KEY), m_new, 0.0)  # no key yet: exp(masked) is 0
    p = torch.exp(s - shift[..., None])
    alpha = torch.exp(m - shift)
    return m_new, alpha * norm + p.sum(dim=-1), alpha[..., None] * acc + mix(p)


def finish(state: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The output ``(..., rows, d)``; a row with no key gets 0."""
    _, norm, acc = state
    return acc / torch.where(norm == 0.0, 1.0, norm)[..., None]


def _gather(pool: torch.Tensor, ids: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """The pool's pages ``ids`` ``(len(ids), page_size, 2 * kv_heads, head_dim)``, written into ``buffer``'s first
    rows (a fresh block of megabytes each time pays its page faults: half the loop's time), or a new tensor without
    one (autograd keeps a block for the backward pass, which the next block would overwrite)."""
    if buffer is None:
        return pool.index_select(0, ids)
    return torch.index_select(pool, 0, ids, out=buffer[:len(ids)])


def _buffer(pool: torch.Tensor, block_pages: int, *inputs: torch.Tensor | None) -> torch.Tensor | None:
    """One block's buffer ``(block_pages, page_size, 2 * kv_heads, head_dim)``; None where autograd records the
    call (the pool or an input requiring gradients)."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (pool, *inputs)):
        return None
    return pool.new_empty((block_pages, *pool.shape[1:]))


def attend(queries: torch.Tensor, cache: Any, max_q: int, *, scale: float, logit_soft_cap: float | None = None,
           local_window_size: tuple[int, int] | None = None, attention_chunk_size: int | None = None,
           sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Packed ``queries`` ``(total_q, heads, head_dim)`` over ``cache`` (a ``PagedKVCache``), terms checked
    (``mha_spec.paged.checked_terms``); ``(total_q, heads, head_dim)`` in the queries' dtype, 0 past
    ``cu_q_lens[num_seqs]``."""
    total_q, heads, head_dim = queries.shape
    page_size, kv_heads = cache.kv_pages.shape[1], cache.kv_pages.shape[2] // 2
    groups, compute = heads // kv_heads, torch.promote_types(queries.dtype, torch.float32)
    conjunction = terms.of(True, local_window_size, attention_chunk_size, False, True)
    rows = torch.arange(max_q, device=queries.device)
    block_pages = testing.current().paged_block_pages
    keys = torch.arange(block_pages * page_size, device=queries.device)
    sink_rows = None if sinks is None else sinks.to(compute).reshape(kv_heads, groups).repeat_interleave(max_q, 1)
    slopes = None if alibi_slopes is None else alibi_slopes.to(compute).reshape(-1, kv_heads, groups, 1, 1)
    cu, kv_lens = cache.cu_q_lens.tolist(), cache.kv_lens.tolist()
    page_ids = cache.page_indices.to(torch.long)
    buffer = _buffer(cache.kv_pages, block_pages, queries, sinks, alibi_slopes)
    def sequence(b, out):
        start, q_len, kv_len = cu[b], cu[b + 1] - cu[b], kv_lens[b]
        q = queries[(start + rows).clamp(max=total_q - 1)].to(compute)  # (max_q, heads, head_dim)
        q = q.reshape(max_q, kv_heads, groups, head_dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, head_dim)
        at = Where(position=(kv_len - q_len + rows).reshape(1, 1, max_q, 1))
        first_q, last_q = Where(position=kv_len - q_len), Where(position=kv_len - 1)
        bias = None if slopes is None else slopes[b % slopes.shape[0]]  # (heads,) or (max_seqs, heads)

        def block(j, k, state):
            """The state after page slots ``j .. k - 1``: their pages read from the pool as one key block, cut at
            the length (the slots past it hold any value)."""
            lo = j * page_size
            n = min((k - j) * page_size, kv_len - lo)  # keys in the block
            kv = _gather(cache.kv_pages, page_ids[b, j:k], buffer).to(compute).reshape(-1, kv_heads, 2, head_dim)[:n]
            position = lo + keys[:n]  # the block's keys' positions
            seen = Where(position=position, index=position, length=kv_len)
            # a block every real query sees whole needs no mask (the padded rows are dropped)
            whole, _ = conjunction.block(first_q, last_q, *(Where(position=i, index=i, length=kv_len)
                                                            for i in (lo, lo + n - 1)))
            s = torch.bmm(q, kv[:, :, 0].permute(1, 2, 0))  # (kv_heads, groups * max_q, keys)
            s = _tiles.scores(s.reshape(kv_heads, groups, max_q, -1), scale=scale, soft_cap=logit_soft_cap,
                              bias=None if bias is None else alibi.bias(bias, at.position, seen.position),
                              allowed=None if whole else conjunction.visible(at, seen))
            v = kv[:, :, 1].transpose(0, 1)  # (kv_heads, keys, head_dim), read in place by the product
            return forward(state, s.reshape(kv_heads, groups * max_q, -1), lambda p: torch.bmm(p, v))

        first, end = paged.page_range(kv_len, q_len, page_size, local_window_size, attention_chunk_size, max)
        state = init(torch.zeros(kv_heads, groups * max_q, head_dim, dtype=compute, device=q.device), sink_rows)
        for j in range(first, end, block_pages):
            state = block(j, min(j + block_pages, end), state)
        o = finish(state).reshape(kv_heads, groups, max_q, head_dim).permute(2, 0, 1, 3).reshape(max_q, heads, -1)
        out[start:start + q_len] = o[:q_len].to(out.dtype)
        return out

    out = torch.zeros_like(queries)
    for b in range(int(cache.num_seqs[0])):
        out = sequence(b, out)
    return out
