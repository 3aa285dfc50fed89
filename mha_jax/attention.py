"""Scaled dot-product attention, the functional core.

Twin of ``mha_torch/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``jax.nn.dot_product_attention``: query ``(batch, q_len, heads, head_dim)``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mha_jax import _checks, _dispatch, _ring, _tiles, masks
from mha_jax.masks import MASK_LAYOUT
from mha_spec import arguments, batch_axes, docstrings

IMPLEMENTATIONS = _dispatch.IMPLEMENTATIONS


@docstrings.fill
def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    query_positions: jax.Array | None = None,
    key_positions: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_segment_ids: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: jax.Array | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    dropout_mask: jax.Array | None = None,
    return_weights: bool = False,
    precision: jax.lax.PrecisionLike = None,
    sequence_axis: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Multi-head scaled dot-product attention, a drop-in for ``jax.nn.dot_product_attention``.

    Its arguments in its order and with its meaning (``docs/drop-in.md`` lists the differences), then this
    package's terms, keywords only. Every masking term combines with the others (logical and; the bias is added).

    Args:
      query: ``(batch, q_len, heads, head_dim)``, or ``(q_len, heads, head_dim)``: one example (key, value,
        output and residual then without the batch axis too; masks and biases broadcast to
        ``(1, heads, q_len, kv_len)``, lengths have shape ``(1,)`` or ``()``).
      key: ``(batch, kv_len, kv_heads, head_dim)``; ``kv_heads`` divides ``heads``, and query head
        ``h`` reads key/value head ``h // (heads // kv_heads)``.
      value: ``(batch, kv_len, kv_heads, v_head_dim)``, ``v_head_dim`` may differ from ``head_dim``
        (as in multi-head latent attention); the output has it.
      bias: real floating, broadcasting to ``(batch, heads, q_len, kv_len)``; added to the
        scaled logits (``-inf`` excludes a key; a finite value below ``-0.1 x`` the compute dtype's largest
        counts as that value, so that only a mask or ``-inf`` excludes).
      mask: broadcasts to ``(batch, heads, q_len, kv_len)``; bool (as jax.nn's), or any dtype with
        nonzero = attend (as in flax: its ``make_attention_mask``/``make_causal_mask`` float32 0/1 masks
        work as they are).
      {masking_terms}
      query_seq_lengths: integer ``(batch,)``: queries at index ``>=`` the length are padding: their
        output (and weights) 0, their residual that of a row with no key, no gradient through them.
      {logit_terms}
      implementation: ``"xla"`` (the plain formulation), ``"blockwise"`` (online softmax over blocks, memory
        linear in length, empty blocks skipped), ``"cudnn"`` (NVIDIA GPUs, through ``jax.nn.dot_product_attention``;
        bfloat16/float16; no ``logit_soft_cap``, ``sinks`` or dropout), ``"splash"`` (JAX's Pallas TPU kernel; no
        ``mask``, ``bias``, ``alibi_slopes``, dropout, ``return_residual`` or position arrays with causality/windows;
        float32 at most; off a TPU, slow Pallas interpret mode), ``"flash"`` (``"cudnn"`` on an NVIDIA GPU,
        ``"splash"`` on a TPU, else or where that kernel cannot express the call ``"blockwise"``), or None:
        ``"xla"``. The platform is the one the program is lowered for, not the host's. Every implementation but
        ``"xla"`` has first-order reverse-mode derivatives only.
      return_residual: also return the logsumexp of each query's scores (natural log; the scaled, capped,
        biased logits, with the sink's): ``(batch, q_len, heads)`` in the input dtype, without gradient,
        as ``jax.nn``'s; a query with no key gets ``-0.7 x`` float32's largest value (jax.nn's; float16: its
        lowest finite). Not with ``return_weights``, ``"splash"`` or ``sequence_axis``.
      dropout_rate: probability of dropping an attention weight; kept weights are scaled by
        ``1 / (1 - dropout_rate)``.
      dropout_rng: PRNG key drawing the dropout mask when ``dropout_rate > 0`` (each implementation
        draws its own).
      dropout_mask: explicit keep-mask (True = keep) broadcasting to
        ``(batch, heads, q_len, kv_len)``; when given it is used instead of ``dropout_rng``.
      return_weights: also return the attention weights actually applied to ``value``
        (``"xla"`` only: the other implementations never form them); with ``sinks`` the
        sink's share is not among them.
      precision: passed to the matrix products.
      sequence_axis: a mesh axis (of ``jax.set_mesh``'s mesh) sharding the query and key/value lengths as
        ``P(None, sequence_axis)``: ring attention (key/value blocks passed round in a zig-zag order). Both lengths
        must be multiples of twice the axis's size. No ``return_weights``; first-order reverse-mode derivatives only.
    Returns:
      ``(batch, q_len, heads, v_head_dim)`` in the input dtype; with ``return_weights``, ``(output, weights)``,
      weights ``(batch, heads, q_len, kv_len)``; with ``return_residual``, ``(output, residual)``. A query that
      may attend to no key gets an output row of 0 and weights 0 (jax.nn: the mean of the values). No inf or NaN
      is formed inside (``jax.debug_infs``, ``jax.debug_nans``) but from a user's ``-inf``. bfloat16/float16 inputs
      are computed in float32, float64 in float64 (jax.nn: its softmax in float32).
    """
    unbatched = _checks.check_unbatched(query, key, value)
    if unbatched:  # one example: a batch axis of 1, dropped again from the results
        query, key, value = (jnp.asarray(x)[None] for x in (query, key, value))
    batch, q_len, heads, _, kv_len, _ = _checks.check_attention_inputs(query, key, value)
    masking = batch_axes.Masking(
        mask=mask, bias=bias, is_causal=is_causal, query_positions=query_positions, key_positions=key_positions,
        local_window_size=local_window_size, query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
        key_value_seq_lengths=key_value_seq_lengths, attention_chunk_size=attention_chunk_size,
        alibi_slopes=alibi_slopes)
    spec = masks.parse((batch, heads, q_len, kv_len), **masking._asdict(), query_seq_lengths=query_seq_lengths)
    result = spec_attention(
        query, key, value, spec, scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, dropout_rate=dropout_rate,
        dropout_rng=dropout_rng, dropout_mask=dropout_mask, return_weights=return_weights, precision=precision,
        implementation=implementation, sequence_axis=sequence_axis, return_residual=return_residual,
    )
    if unbatched:
        return tuple(x[0] for x in result) if isinstance(result, tuple) else result[0]
    return result


def spec_attention(query, key, value, spec: masks.Spec, *, scale=None, logit_soft_cap=None, sinks=None,
                   dropout_rate=0.0, dropout_rng=None, dropout_mask=None, return_weights=False, precision=None,
                   implementation=None, zero_unused=True, sequence_axis=None, return_residual=False):
    """``dot_product_attention`` on checked inputs and a parsed ``spec`` (the modules' entry).
    ``zero_unused=False`` skips zeroing the keys no query sees (a decoding cache's slots are finite)."""
    batch, heads, q_len, kv_len = shape = spec.shape
    kv_heads, head_dim, v_dim = key.shape[2], query.shape[3], value.shape[3]
    scale, soft_cap = _checks.CHECKS.check_logit_terms(scale, logit_soft_cap, sinks, heads, head_dim)
    if return_residual and return_weights:
        raise ValueError("return_weights=True and return_residual=True cannot both be given; ask for one")
    keep, rng, keep_scale = _dropout_keep(dropout_rate, dropout_rng, dropout_mask, shape)
    asked = _dispatch.record(implementation)
    ring = None if sequence_axis is None else _ring.check(
        sequence_axis, q_len, kv_len, dropout_rng=rng, return_weights=return_weights, implementation=implementation,
        takes_ring=asked.ring, return_residual=return_residual,
    )
    dtype = query.dtype
    compute = jnp.promote_types(dtype, jnp.float32)
    rows = masks.query_rows(spec)  # (batch, 1, q_len, 1) or None
    rows = None if rows is None else rows[:, 0, :, :, None]  # (batch, q_len, 1, 1): as the query
    if rows is not None:  # padding queries hold zeros: whatever they held (NaN) reaches nothing
        query = jnp.where(rows, query, 0)
    if kv_len == 0:
        return _no_keys(query, key, value, sinks, shape, return_weights, return_residual)
    kernel = _dispatch.choose(
        implementation, return_weights, keep is not None or rng is not None, query.dtype,
        soft_cap is not None, sinks is not None, v_dim != head_dim, spec.alibi_slopes is not None, return_residual,
    )
    _dispatch.check_derivatives(kernel, query, key, value, spec.bias, sinks)
    _check_head_sharding(query, heads, kv_heads)
    if spec.alibi_slopes is not None:  # the ALiBi term in the compute dtype, on every path
        spec = dataclasses.replace(spec, alibi_slopes=spec.alibi_slopes.astype(compute))
    if spec.bias is not None:  # its finite values above every masked score (no inf: see _tiles)
        spec = dataclasses.replace(spec, bias=_tiles.floored_bias(spec.bias, compute))
    call = dict(spec=spec, scale=scale, soft_cap=soft_cap, sinks=sinks, keep=keep, rng=rng, dropout_rate=dropout_rate,
                keep_scale=keep_scale, precision=precision, compute=compute, residual=return_residual)
    if ring is not None:  # zeroes its own padding (and masked) keys, block by block
        return _results(_ring.run(query, key, value, axis=sequence_axis, size=ring, **call), rows, dtype)
    unused = masks.unused_keys(spec, kv_heads) if zero_unused else None
    if unused is not None:  # per key/value head, in the key layout (batch, kv_len, kv_heads, 1)
        unused = unused.transpose(0, 2, 1)[..., None]
        key, value = jnp.where(unused, 0, key), jnp.where(unused, 0, value)
    return _results(_dispatch.run(kernel, query, key, value, call), rows, dtype, return_weights, return_residual)


def _results(result: tuple, rows, dtype, return_weights=False, return_residual=False):
    """The call's results in ``dtype`` from a path's (output, weights, lse), the padding queries' rows 0 (``rows``
    ``(batch, q_len, 1, 1)``; None: every row kept) and their residual that of a row with no key."""
    out, weights, lse = result
    out = out.astype(dtype) if rows is None else jnp.where(rows, out.astype(dtype), 0)
    if return_weights:
        return out, weights.astype(dtype)
    if return_residual:
        lse = jax.lax.stop_gradient(lse)
        no_key = _tiles.no_key_residual(dtype)
        lse = lse if rows is None else jnp.where(rows[..., 0], lse, no_key)
        return out, jnp.maximum(lse, no_key).astype(dtype)
    return out


def _no_keys(query, key, value, sinks, shape, return_weights, return_residual=False):
    """Zeros ``(batch, q_len, heads, v_head_dim)`` (and weights ``(batch, heads, q_len, 0)``, or the residual of
    queries with no key), kept in the graph."""
    batch, heads, q_len, _ = shape
    kv_heads, head_dim, groups = key.shape[2], query.shape[3], heads // key.shape[2]
    empty = jnp.einsum("bqhgd,bkhd->bhgqk", query.reshape(batch, q_len, kv_heads, groups, head_dim), key)
    if sinks is not None:
        empty = empty + sinks.reshape(1, kv_heads, groups, 1, 1).astype(empty.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", empty, value).reshape(batch, q_len, heads, value.shape[3])
    if return_residual:
        return out, jnp.full(out.shape[:3], _tiles.no_key_residual(out.dtype), out.dtype)
    return (out, empty.reshape(shape)) if return_weights else out


def _check_head_sharding(query, heads, kv_heads):
    """Refuse query heads sharded over Explicit axes whose size does not divide ``kv_heads``."""
    sharding = getattr(jax.typeof(query), "sharding", None)
    axes = (tuple(getattr(sharding, "spec", ())) + (None,) * 3)[2]
    if axes is None:
        return
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(sharding.mesh.shape[a] for a in axes)
    if kv_heads % shards:
        raise ValueError(
            f"query's {heads} heads are sharded over mesh axes {axes} ({shards} shards), which does not divide "
            f"its {kv_heads} key/value heads: each group of {heads // kv_heads} query heads must stay with its "
            f"key/value head; shard the heads over axes of a size that divides {kv_heads}, or not at all"
        )


def _dropout_keep(rate, rng, dropout_mask, shape):
    """(bool keep-mask or None, PRNG key to draw one or None, scale of kept weights)."""
    rate = arguments.check_dropout_rate("dropout_rate", rate)
    if dropout_mask is not None:
        _checks.check_dropout_mask(dropout_mask, shape, MASK_LAYOUT)
        return jnp.asarray(dropout_mask) != 0, None, 1.0 / (1.0 - rate)
    if rate == 0.0:
        return None, None, 1.0
    if rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng or dropout_mask")
    return None, rng, 1.0 / (1.0 - rate)  # each implementation draws its own mask from the key
