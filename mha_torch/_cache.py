"""The ``KVCache`` of the call and ``mha_spec.kv_cache`` over tensors; twin of ``mha_jax/_cache.py``."""

from __future__ import annotations

import torch

from mha_spec import kv_cache
from mha_torch import _checks


class KVCache:
    """A pre-allocated key/value cache for ``mha_torch.MultiHeadAttention(..., cache=cache)``.

    Attributes (plain tensors, the layout of flax's cache, so that one filled in either framework
    continues in the other as arrays):
      key, value: ``(*batch, max_length, num_kv_heads, head_dim)``, views of storage laid out as
        ``F.scaled_dot_product_attention`` reads it, ``(*batch, num_kv_heads, max_length,
        head_dim)`` (writing into the views writes the cache). A step updates them in place, or,
        under autograd (grad mode on and the new keys requiring gradients), replaces them with
        new tensors, so that gradients flow through the cache from step to step.
      key_storage, value_storage: ``(*batch, num_kv_heads, max_length, head_dim)``, what ``key`` and
        ``value`` view.
      index: int32 ``(*batch,)``, each row's next position.
      overflow: bool ``(*batch,)``; True once a step under ``torch.compile`` overwrote a position a
        query could still see (outside compilation that step raises instead).

    Args:
      batch: the batch size, or the batch axes ``(*batch,)``.
      max_length: slots per row.
      num_kv_heads, head_dim: as the module's.
      dtype, device: of ``key`` and ``value``.
      values: False for a cache of keys alone (``value`` None): the latent cache.
    """

    def __init__(self, batch: int | tuple[int, ...], max_length: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, values: bool = True):
        batch_shape = (batch,) if isinstance(batch, int) else tuple(batch)
        for name, n in (("max_length", max_length), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        if not all(isinstance(n, int) and n >= 0 for n in batch_shape):
            raise ValueError(f"batch must be a non-negative integer or a tuple of them, got {batch!r}")
        shape = (*batch_shape, num_kv_heads, max_length, head_dim)
        self.key_storage = torch.zeros(shape, dtype=dtype, device=device)
        self.value_storage = torch.zeros(shape, dtype=dtype, device=device) if values else None
        self.index = torch.zeros(batch_shape, dtype=torch.int32, device=device)
        self.overflow = torch.zeros(batch_shape, dtype=torch.bool, device=device)

    @property
    def key(self) -> torch.Tensor:
        return self.key_storage.transpose(-3, -2)

    @property
    def value(self) -> torch.Tensor | None:
        return None if self.value_storage is None else self.value_storage.transpose(-3, -2)

    @property
    def max_length(self) -> int:
        return self.key_storage.shape[-2]

    def merged(self, batch: int) -> KVCache:
        """Views of this cache with its batch axes merged into ``batch`` rows."""
        flat = KVCache.__new__(type(self))
        axes = self.index.dim()
        flat.key_storage, flat.value_storage = (None if x is None else x.view((batch,) + tuple(x.shape[axes:]))
                                                for x in (self.key_storage, self.value_storage))
        flat.index, flat.overflow = self.index.view(batch), self.overflow.view(batch)
        return flat

    def __repr__(self) -> str:
        return f"KVCache(key={tuple(self.key.shape)}, dtype={self.key.dtype}, index={self.index.tolist()})"


def positions(end: torch.Tensor, n: int, query_positions) -> torch.Tensor:
    """int32 ``(batch, n)``: the new tokens' positions, default ``end + arange(n)`` (``-1``: padding)."""
    if query_positions is None:
        return end[:, None] + torch.arange(n, dtype=torch.int32, device=end.device)[None]
    _checks.require_array("query_positions", query_positions)
    kv_cache.check_step_positions(query_positions.shape, _checks.dtype_kind(query_positions),
                                  _checks.dtype_name(query_positions), end.shape[0], n)
    return query_positions.to(device=end.device, dtype=torch.int32).expand(end.shape[0], n)


def write(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, padded: bool) -> None:
    """Write ``new`` ``(batch, n, ...)`` into ``cache`` ``(batch, max_length, ...)`` at slots ``pos % max_length``; a
    padding token (``pos < 0``) rewrites slot ``start - 1`` with what it holds (fixed shapes for ``torch.compile``)."""
    max_length = cache.shape[1]
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None]
    if not padded:
        cache[rows, (pos % max_length).long()] = new.to(cache.dtype)
        return
    valid = pos >= 0
    slots = torch.where(valid, pos % max_length, ((start - 1) % max_length)[:, None]).long()
    keep = cache[rows, slots]
    shape = valid.shape + (1,) * (new.dim() - 2)
    cache[rows, slots] = torch.where(valid.reshape(shape), new.to(cache.dtype), keep)


def advance(end: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Each row's new end: one past the last position written."""
    return kv_cache.advance(end, pos.amax(dim=1), torch.maximum)


def slot_positions(end: torch.Tensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mha_spec.kv_cache.slot_positions``."""
    slots = torch.arange(max_length, dtype=torch.int32, device=end.device)[None]
    return kv_cache.slot_positions(end, max_length, slots, lambda x, m: torch.clamp(x, max=m))
