"""A paged key/value cache and ragged attention over it (``mha_spec.paged``), in JAX; twin of ``mha_torch/paged.py``.

The pool is ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``'s: ``kv_pages`` ``(num_pages, page_size,
2 * kv_heads, head_dim)``, key head ``h`` at ``2 h``, value head ``h`` at ``2 h + 1``; a cache's fields are that
function's arguments, so its reference and its TPU kernel take them as they are. Functional: every step returns a
new cache, with static shapes (one compilation per step shape under ``jax.jit``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as tpu_kernel

from mha_jax import _checks, _paged
from mha_jax.attention import dot_product_attention
from mha_spec import docstrings, paged
from mha_spec.paged import PageTable


class PagedKVCache(NamedTuple):
    """``kv_pages`` ``(num_pages, page_size, 2 * kv_heads, head_dim)``; the current step's int32 ``kv_lens``
    ``(max_seqs,)``, ``page_indices`` ``(max_seqs, pages_per_seq)``, ``cu_q_lens`` ``(max_seqs + 1,)``,
    ``num_seqs`` ``(1,)`` (``mha_spec.paged``)."""

    kv_pages: jax.Array
    kv_lens: jax.Array
    page_indices: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


def init_cache(table: PageTable, kv_heads: int, head_dim: int, dtype: Any) -> PagedKVCache:
    """An empty pool of ``table``'s pages; the step arrays of ``table`` as it stands, no queries."""
    pages = jnp.zeros((table.num_pages, table.page_size, 2 * kv_heads, head_dim), dtype)
    return schedule(PagedKVCache(pages, *(None,) * 4), table.arrays())


def schedule(cache: PagedKVCache, step: dict[str, Any]) -> PagedKVCache:
    """``cache`` with a step's arrays (``PageTable.append``'s); the pool as it is."""
    arrays = {name: jnp.asarray(step[name], jnp.int32) for name in paged.STEP}
    paged.check_cache(cache.kv_pages.shape, {name: a.shape for name, a in arrays.items()})
    return cache._replace(**arrays)


def _known(array: jax.Array) -> np.ndarray | None:
    """A step array's values, None under ``jit``."""
    return None if isinstance(array, jax.core.Tracer) else np.asarray(array)


def write(cache: PagedKVCache, keys: jax.Array, values: jax.Array) -> PagedKVCache:
    """``cache`` with the step's packed ``keys``/``values`` ``(total_q, kv_heads, head_dim)`` at their positions
    (``mha_spec.paged``): a new cache (functional, jittable)."""
    num_pages, page_size, heads2, head_dim = cache.kv_pages.shape
    for name, array in (("keys", keys), ("values", values)):
        paged.check_queries(name, array.shape, heads2 // 2, cache.kv_pages.shape)
    paged.check_step(cache, keys.shape[0], keys.shape[0], known=_known)
    pool = num_pages * page_size
    _, _, slot, _ = paged.token_places(paged.step_arrays(cache), jnp.arange(keys.shape[0]), page_size, pool, jnp)
    new = jnp.stack([keys, values], axis=2).reshape(keys.shape[0], heads2, head_dim).astype(cache.kv_pages.dtype)
    flat = cache.kv_pages.reshape(pool, heads2, head_dim).at[slot].set(new, mode="drop")
    return cache._replace(kv_pages=flat.reshape(cache.kv_pages.shape))


@docstrings.fill
def ragged_attention(queries: jax.Array, cache: PagedKVCache, *, max_q_len: int | None = None,
                     **terms: Any) -> jax.Array:
    """{ragged_attention}

    JAX arrays, jittable (``max_q_len`` static).
    """
    return paged.ragged(queries, cache, max_q_len, terms, require_float=_checks.require_float, known=_known,
                        gathered=_gathered, attend=_attend)


def _kernel_takes(queries: jax.Array, terms: dict) -> bool:
    """Whether JAX's TPU kernel ``ragged_paged_attention`` computes the call: a scale, a soft cap, a causal window
    ``(left, 0)`` (its ``sliding_window=left + 1``); heads of a multiple of the TPU's 128 lanes; no sinks, ALiBi
    or chunks."""
    window = terms["local_window_size"]
    return (queries.shape[-1] % 128 == 0 and (window is None or window[1] == 0)
            and all(terms[name] is None for name in ("sinks", "alibi_slopes", "attention_chunk_size")))


def _attend(queries: jax.Array, cache: PagedKVCache, max_q: int, **terms: Any) -> jax.Array:
    """The page loop (``mha_jax._paged``); on a TPU, JAX's Pallas kernel where ``_kernel_takes`` the call."""
    def loop(queries, cache):
        return _paged.attend(queries, cache, max_q, **terms)

    if not _kernel_takes(queries, terms):
        return loop(queries, cache)

    def kernel(queries, cache):
        window = terms["local_window_size"]
        # off a TPU (a program compiled for a TPU topology) the kernel's tuned table cannot read the chip
        blocks = {} if jax.default_backend() == "tpu" else dict(
            num_kv_pages_per_block=min(cache.page_indices.shape[1], 32), num_queries_per_block=min(len(queries), 32))
        out = tpu_kernel.ragged_paged_attention(
            queries, *cache, sm_scale=terms["scale"], sliding_window=None if window is None else window[0] + 1,
            soft_cap=terms["logit_soft_cap"], **blocks)
        held = jnp.arange(len(queries)) < cache.cu_q_lens[cache.num_seqs[0]]
        return jnp.where(held[:, None, None], out, 0).astype(queries.dtype)

    return jax.lax.platform_dependent(queries, cache, default=loop, tpu=kernel)


def _gathered(queries: jax.Array, cache: PagedKVCache, max_q: int, terms: dict) -> jax.Array:
    """``ragged_attention`` as one ``mha_jax.dot_product_attention`` call over the pages gathered, padded."""
    step, (num_pages, page_size, heads2, head_dim) = paged.step_arrays(cache), cache.kv_pages.shape
    total_q, max_seqs = queries.shape[0], cache.kv_lens.shape[0]
    token, kv_lens, positions = paged.row_queries(step, jnp.arange(max_seqs), jnp.arange(max_q), total_q, jnp)
    kv = cache.kv_pages[cache.page_indices].reshape(max_seqs, -1, heads2, head_dim)
    out = dot_product_attention(queries[token], kv[:, :, 0::2], kv[:, :, 1::2], is_causal=True,
                                query_positions=positions, key_value_seq_lengths=kv_lens, **terms)
    seq, index, _, valid = paged.token_places(step, jnp.arange(total_q), page_size, num_pages * page_size, jnp)
    return jnp.where(valid[:, None, None], out[seq, index.clip(max=max_q - 1)], 0).astype(queries.dtype)


def from_contiguous(key: jax.Array, value: jax.Array, lengths: Any, table: PageTable) -> PagedKVCache:
    """Our contiguous cache (``cached_key``/``cached_value`` ``(batch, max_length, kv_heads, head_dim)``, each
    row's ``cache_index`` ``lengths``, not rolled over) as pages of the fresh ``table`` (its rows ``0..batch-1``)."""
    lengths = np.asarray(lengths)
    paged.check_contiguous(tuple(key.shape), tuple(value.shape), lengths, table)
    cache = schedule(init_cache(table, key.shape[2], key.shape[3], key.dtype), table.append(lengths))
    total, pool = int(lengths.sum()), table.num_pages * table.page_size
    seq, index, _, _ = paged.token_places(paged.step_arrays(cache), jnp.arange(total), table.page_size, pool, jnp)
    return write(cache, key[seq, index], value[seq, index])


def convert(cache: Any) -> PagedKVCache:
    """The other twin's cache (or any object with these fields, e.g. NumPy arrays) as this twin's, bitwise."""
    return PagedKVCache(*(jnp.asarray(np.asarray(getattr(cache, name))) for name in PagedKVCache._fields))


def split_pages(cache: PagedKVCache) -> tuple[jax.Array, jax.Array]:
    """vLLM's layout: ``(k_pages, v_pages)``, each ``(kv_heads, num_pages, page_size, head_dim)``."""
    return cache.kv_pages[:, :, 0::2].transpose(2, 0, 1, 3), cache.kv_pages[:, :, 1::2].transpose(2, 0, 1, 3)
