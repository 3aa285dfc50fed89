"""Tiles of queries and keys: the block layout that ``_blockwise`` and ``_band`` both read.

A query block holds ``block_q`` rows of every query head of a key/value head's group, so one
product serves the group; the last block of each is zero-padded.
"""

from __future__ import annotations

import jax.numpy as jnp


def _pad(x, axis, size, broadcast=False):
    """Zero-pad ``axis`` to ``size``; with ``broadcast``, an axis of 1 (a mask broadcast along
    it) stays as it is."""
    if x is None or x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _query_rows(cfg, x):
    """``(b, h, g, q_len, *rest)`` -> query blocks ``(n_q, b, h, g*block_q, *rest)``."""
    b, h, g = x.shape[:3]
    x = _pad(x, 3, cfg.n_q * cfg.block_q)
    x = x.reshape((b, h, g, cfg.n_q, cfg.block_q) + x.shape[4:])
    return jnp.moveaxis(x, 3, 0).reshape((cfg.n_q, b, h, g * cfg.block_q) + x.shape[5:])


def _from_query_rows(cfg, x, b, h, g):
    """The inverse of ``_query_rows``, with the padding of the last block dropped."""
    x = x.reshape((cfg.n_q, b, h, g, cfg.block_q) + x.shape[4:])
    x = jnp.moveaxis(x, 0, 3).reshape((b, h, g, cfg.n_q * cfg.block_q) + x.shape[5:])
    return x[:, :, :, : cfg.q_len]


def _key_rows(cfg, x):
    """``(b, h, kv_len, d)`` -> key blocks ``(n_k, b, h, block_k, d)``."""
    b, h, _, d = x.shape
    x = _pad(x, 2, cfg.n_k * cfg.block_k).reshape(b, h, cfg.n_k, cfg.block_k, d)
    return jnp.moveaxis(x, 2, 0)
