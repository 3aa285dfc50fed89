"""The plain formulation (``implementation="xla"``): every score formed, one softmax; the weights returned."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import _tiles, _tuning, masks
from mha_jax._tuning import Tuning


def run(query, key, value, *, spec, scale, soft_cap, sinks, keep, rng, dropout_rate, keep_scale, precision, compute,
        residual=False):
    """(output ``(batch, q_len, heads, v_head_dim)``, weights ``(batch, heads, q_len, kv_len)``, lse ``(batch,
    q_len, heads)``): the weights' softmax read once for all three."""
    batch, heads, q_len, kv_len = spec.shape
    kv_heads = key.shape[2]
    q = query.astype(compute).reshape(batch, q_len, kv_heads, heads // kv_heads, query.shape[3])
    k, v = key.astype(compute), value.astype(compute)
    if rng is not None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, spec.shape)
    tuning = _tuning.current()
    logits = _scores(q, k, precision, tuning).reshape(spec.shape)
    logits = _tiles.scores(logits, spec.shape, scale=scale, soft_cap=soft_cap, bias=masks.biases(spec),
                           masks=(masks.dense(spec),))[0]
    weights, lse = _tiles.softmax(logits, None if sinks is None else sinks.astype(compute).reshape(1, -1, 1, 1))
    if keep is not None:
        weights = jnp.where(keep, weights * keep_scale, 0.0)
    out = _mix(weights.reshape(batch, kv_heads, heads // kv_heads, q_len, kv_len), v, precision, tuning)
    return out.reshape(batch, q_len, heads, v.shape[3]), weights, lse.transpose(0, 2, 1)


def _over_all_heads(x, q_len, kv_len, groups: int, kv_heads: int, tuning: Tuning) -> bool:
    """Few query rows over many keys: one product over every head's keys reads the cache in place (no head-major
    copy)."""
    if not (isinstance(q_len, int) and isinstance(kv_len, int)):  # symbolic (jax.export): per head
        return False
    # per head on an Explicit mesh, whose sharding each reshape merging heads into rows would have to state
    if any(axis is not None for axis in getattr(jax.typeof(x).sharding, "spec", ())):
        return False
    return kv_len >= tuning.many_keys and q_len * groups * kv_heads * kv_heads <= tuning.rows_over_heads


def own_blocks(x, axis1: int, axis2: int):
    """The diagonal of two kv_heads axes, moved to ``axis1``."""
    return jnp.moveaxis(jnp.diagonal(x, axis1=axis1, axis2=axis2), -1, axis1)


def _scores(q, k, precision, tuning: Tuning):
    """Logits ``(b, kv_heads, groups, q, k)`` of q ``(b, q, kv_heads, groups, d)`` against k ``(b, k, kv_heads, d)``."""
    batch, q_len, kv_heads, groups, head_dim = q.shape
    kv_len = k.shape[1]
    rows = q.transpose(0, 2, 3, 1, 4)  # each key/value head's queries as rows
    if not _over_all_heads(k, q_len, kv_len, groups, kv_heads, tuning):
        logits = jnp.einsum("bhmd,bhkd->bhmk", rows.reshape(batch, kv_heads, groups * q_len, head_dim),
                            k.transpose(0, 2, 1, 3), precision=precision)
        return logits.reshape(batch, kv_heads, groups, q_len, kv_len)
    every = jnp.einsum("bmd,bcd->bmc", rows.reshape(batch, -1, head_dim), k.reshape(batch, kv_len * kv_heads, head_dim),
                       precision=precision)
    _tuning.observe("own_blocks", every.shape)
    return own_blocks(every.reshape(batch, kv_heads, groups, q_len, kv_len, kv_heads), 1, 5)


def _mix(weights, v, precision, tuning: Tuning):
    """Outputs ``(b, q, kv_heads, groups, dv)`` of weights ``(b, kv_heads, groups, q, k)`` over v ``(b, k, h, dv)``."""
    batch, kv_heads, groups, q_len, kv_len = weights.shape
    if not _over_all_heads(v, q_len, kv_len, groups, kv_heads, tuning):
        out = jnp.einsum("bhmk,bhkd->bhmd", weights.reshape(batch, kv_heads, groups * q_len, kv_len),
                         v.transpose(0, 2, 1, 3), precision=precision)
        out = out.reshape(batch, kv_heads, groups, q_len, -1)
    else:
        every = jnp.einsum("bmk,bkc->bmc", weights.reshape(batch, -1, kv_len), v.reshape(batch, kv_len, -1),
                           precision=precision)
        _tuning.observe("own_blocks", every.shape)
        out = own_blocks(every.reshape(batch, kv_heads, groups, q_len, kv_heads, v.shape[-1]), 1, 4)
    return out.transpose(0, 3, 1, 2, 4)
