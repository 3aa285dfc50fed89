"""Ragged attention reading a paged cache where it lies (``mha_spec.paged``), in JAX; twin of ``mha_torch/_paged.py``.

Per sequence (a ``lax.fori_loop`` to ``num_seqs``), an online softmax (``_tiles.init``, ``forward``, ``finish``) over
its pages (a ``lax.fori_loop`` over ``mha_spec.paged.page_range``: none past its length or wholly outside its
queries' window or chunk), each page read from the pool by its id, a key block: no copy of the cache. Static
shapes, jittable; a sequence's queries padded to ``max_q``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mha_jax import _tiles
from mha_spec import paged, terms
from mha_spec.terms import Where


@functools.partial(jax.jit, static_argnames=("max_q", "scale", "logit_soft_cap", "local_window_size",
                                             "attention_chunk_size"))
def attend(queries: jax.Array, cache: Any, max_q: int, *, scale: float, logit_soft_cap: float | None = None,
           local_window_size: tuple[int, int] | None = None, attention_chunk_size: int | None = None,
           sinks: jax.Array | None = None, alibi_slopes: jax.Array | None = None) -> jax.Array:
    """Packed ``queries`` ``(total_q, heads, head_dim)`` over ``cache`` (a ``PagedKVCache``), terms checked
    (``mha_spec.paged.checked_terms``); ``(total_q, heads, head_dim)`` in the queries' dtype, 0 past
    ``cu_q_lens[num_seqs]``."""
    queries, (total_q, heads, head_dim) = jnp.asarray(queries), queries.shape
    page_size, kv_heads = cache.kv_pages.shape[1], cache.kv_pages.shape[2] // 2
    groups, compute = heads // kv_heads, jnp.promote_types(queries.dtype, jnp.float32)
    conjunction = terms.of(True, local_window_size, attention_chunk_size, False, True)
    rows, keys = jnp.arange(max_q), jnp.arange(page_size)
    sink_rows = None if sinks is None else jnp.repeat(sinks.astype(compute).reshape(kv_heads, groups), max_q, axis=1)
    slopes = None if alibi_slopes is None else alibi_slopes.astype(compute).reshape(-1, kv_heads, groups, 1, 1)

    def sequence(b, out):
        start, q_len, kv_len = cache.cu_q_lens[b], cache.cu_q_lens[b + 1] - cache.cu_q_lens[b], cache.kv_lens[b]
        q = queries[(start + rows).clip(max=total_q - 1)].astype(compute)  # (max_q, heads, head_dim)
        q = q.reshape(max_q, kv_heads, groups, head_dim).transpose(1, 2, 0, 3).reshape(kv_heads, -1, head_dim)
        at = Where(position=(kv_len - q_len + rows).reshape(1, 1, max_q, 1))
        alibi = None if slopes is None else slopes[b % slopes.shape[0]]  # (heads,) or (max_seqs, heads)

        def page(j, state):
            kv = lax.dynamic_index_in_dim(cache.kv_pages, cache.page_indices[b, j], keepdims=False).astype(compute)
            position = j * page_size + keys  # (page_size,): the page's keys' positions
            seen = Where(position=position, index=position, length=kv_len)
            s = jnp.einsum("hmd,khd->hmk", q, kv[:, 0::2])  # (kv_heads, groups * max_q, page_size)
            s, _ = _tiles.scores(s, (kv_heads, groups, max_q, page_size), scale=scale, soft_cap=logit_soft_cap,
                                 terms=conjunction, q=at, k=seen, alibi=alibi)
            v = jnp.where((position < kv_len)[:, None, None], kv[:, 1::2], 0)  # slots past the length: any value
            return _tiles.forward(state, s, lambda p: jnp.einsum("hmk,khd->hmd", p, v))

        first, end = paged.page_range(kv_len, q_len, page_size, local_window_size, attention_chunk_size, jnp.maximum)
        state = _tiles.init(_tiles.accumulator(q, head_dim), sink_rows)
        o, _ = _tiles.finish(lax.fori_loop(first, end, page, state))
        o = o.reshape(kv_heads, groups, max_q, head_dim).transpose(2, 0, 1, 3).reshape(max_q, heads, head_dim)
        return out.at[jnp.where(rows < q_len, start + rows, total_q)].set(o.astype(out.dtype), mode="drop")

    return lax.fori_loop(0, cache.num_seqs[0], sequence, jnp.zeros_like(queries))
