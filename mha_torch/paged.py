"""A paged key/value cache and ragged attention over it (``mha_spec.paged``), in PyTorch; twin of ``mha_jax/paged.py``.

The pool is ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``'s: ``kv_pages`` ``(num_pages, page_size,
2 * kv_heads, head_dim)``, key head ``h`` at ``2 h``, value head ``h`` at ``2 h + 1``, so a cache moves between the
twins as it is. ``write`` updates the pool in place and returns the cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from mha_spec import docstrings, paged
from mha_spec.paged import PageTable
from mha_torch import _checks, _paged
from mha_torch.attention import dot_product_attention


class PagedKVCache(NamedTuple):
    """``kv_pages`` ``(num_pages, page_size, 2 * kv_heads, head_dim)``; the current step's int32 ``kv_lens``
    ``(max_seqs,)``, ``page_indices`` ``(max_seqs, pages_per_seq)``, ``cu_q_lens`` ``(max_seqs + 1,)``,
    ``num_seqs`` ``(1,)`` (``mha_spec.paged``)."""

    kv_pages: torch.Tensor
    kv_lens: torch.Tensor
    page_indices: torch.Tensor
    cu_q_lens: torch.Tensor
    num_seqs: torch.Tensor


def init_cache(table: PageTable, kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device | str | None = None) -> PagedKVCache:
    """An empty pool of ``table``'s pages; the step arrays of ``table`` as it stands, no queries."""
    pages = torch.zeros((table.num_pages, table.page_size, 2 * kv_heads, head_dim), dtype=dtype, device=device)
    return schedule(PagedKVCache(pages, *(None,) * 4), table.arrays())


def schedule(cache: PagedKVCache, step: dict[str, Any]) -> PagedKVCache:
    """``cache`` with a step's arrays (``PageTable.append``'s); the pool as it is."""
    device = cache.kv_pages.device
    arrays = {name: torch.as_tensor(np.asarray(step[name]), dtype=torch.int32, device=device) for name in paged.STEP}
    paged.check_cache(cache.kv_pages.shape, {name: a.shape for name, a in arrays.items()})
    return cache._replace(**arrays)


def _known(array: torch.Tensor) -> np.ndarray | None:
    """A step array's values, None under ``torch.compile``."""
    return None if torch.compiler.is_compiling() else array.cpu().numpy()


def write(cache: PagedKVCache, keys: torch.Tensor, values: torch.Tensor) -> PagedKVCache:
    """Writes the step's packed ``keys``/``values`` ``(total_q, kv_heads, head_dim)`` at their positions
    (``mha_spec.paged``) into ``cache.kv_pages``, in place; returns ``cache``."""
    num_pages, page_size, heads2, head_dim = cache.kv_pages.shape
    for name, array in (("keys", keys), ("values", values)):
        paged.check_queries(name, array.shape, heads2 // 2, cache.kv_pages.shape)
    paged.check_step(cache, keys.shape[0], keys.shape[0], known=_known)
    pool = num_pages * page_size
    tokens = torch.arange(keys.shape[0], device=keys.device)
    _, _, slot, valid = paged.token_places(paged.step_arrays(cache), tokens, page_size, pool, torch)
    new = torch.stack([keys, values], dim=2).reshape(keys.shape[0], heads2, head_dim).to(cache.kv_pages.dtype)
    cache.kv_pages.view(pool, heads2, head_dim)[slot[valid]] = new[valid]
    return cache


@docstrings.fill
def ragged_attention(queries: torch.Tensor, cache: PagedKVCache, *, max_q_len: int | None = None,
                     **terms: Any) -> torch.Tensor:
    """{ragged_attention}

    Tensors on the pool's device.
    """
    return paged.ragged(queries, cache, max_q_len, terms, require_float=_checks.require_float, known=_known,
                        gathered=_gathered, attend=_paged.attend)


def _gathered(queries: torch.Tensor, cache: PagedKVCache, max_q: int, terms: dict) -> torch.Tensor:
    """``ragged_attention`` as one ``mha_torch.dot_product_attention`` call over the pages gathered, padded."""
    step, (num_pages, page_size, heads2, head_dim) = paged.step_arrays(cache), cache.kv_pages.shape
    total_q, max_seqs, device = queries.shape[0], cache.kv_lens.shape[0], queries.device
    token, kv_lens, positions = paged.row_queries(
        step, torch.arange(max_seqs, device=device), torch.arange(max_q, device=device), total_q, torch)
    kv = cache.kv_pages[cache.page_indices].reshape(max_seqs, -1, heads2, head_dim).transpose(1, 2)
    out = dot_product_attention(queries[token].transpose(1, 2), kv[:, 0::2], kv[:, 1::2], is_causal=True,
                                query_positions=positions, key_value_seq_lengths=kv_lens, **terms).transpose(1, 2)
    tokens = torch.arange(total_q, device=device)
    seq, index, _, valid = paged.token_places(step, tokens, page_size, num_pages * page_size, torch)
    return torch.where(valid[:, None, None], out[seq, index.clip(max=max_q - 1)], 0).to(queries.dtype)


def from_contiguous(key: torch.Tensor, value: torch.Tensor, lengths: Any, table: PageTable) -> PagedKVCache:
    """Our contiguous cache (``KVCache.key``/``value`` ``(batch, max_length, kv_heads, head_dim)``, each
    row's ``index`` ``lengths``, not rolled over) as pages of the fresh ``table`` (its rows ``0..batch-1``)."""
    lengths = np.asarray(lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths)
    paged.check_contiguous(tuple(key.shape), tuple(value.shape), lengths, table)
    cache = schedule(init_cache(table, key.shape[2], key.shape[3], key.dtype, key.device), table.append(lengths))
    total, pool = int(lengths.sum()), table.num_pages * table.page_size
    seq, index, _, _ = paged.token_places(paged.step_arrays(cache), torch.arange(total, device=key.device),
                                          table.page_size, pool, torch)
    return write(cache, key[seq, index], value[seq, index])


def convert(cache: Any) -> PagedKVCache:
    """The other twin's cache (or any object with these fields, e.g. NumPy arrays) as this twin's, bitwise."""
    return PagedKVCache(*(torch.from_numpy(np.array(getattr(cache, name))) for name in PagedKVCache._fields))


def split_pages(cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's layout: ``(k_pages, v_pages)``, each ``(kv_heads, num_pages, page_size, head_dim)``."""
    return cache.kv_pages[:, :, 0::2].permute(2, 0, 1, 3), cache.kv_pages[:, :, 1::2].permute(2, 0, 1, 3)
