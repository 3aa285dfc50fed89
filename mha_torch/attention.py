"""Scaled dot-product attention, the functional core.

Twin of ``mha_jax/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``F.scaled_dot_product_attention``: query ``(batch, heads, q_len, head_dim)``.
"""

from __future__ import annotations

import dataclasses

import torch

from mha_spec import arguments, batch_axes, docstrings
from mha_torch import _checks, _dispatch, _tiles, masks
from mha_torch.masks import MASK_LAYOUT

IMPLEMENTATIONS = _dispatch.IMPLEMENTATIONS


@docstrings.fill
def dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: torch.Tensor | None = None,
    key_segment_ids: torch.Tensor | None = None,
    key_value_seq_lengths: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    logit_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    need_weights: bool = False,
    implementation: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Multi-head scaled dot-product attention.

    Takes ``F.scaled_dot_product_attention``'s call as it is (``query, key, value, attn_mask,
    dropout_p, is_causal`` by position, ``scale`` and ``enable_gqa`` by name); the other
    arguments are keywords. Every masking term below combines with the others (logical and;
    the bias is added), ``attn_mask`` with ``is_causal`` too. At the default positions
    ``is_causal`` aligns query ``i`` with key ``i`` (top-left, as SDPA's); queries that end at
    the last key take ``query_positions``.

    Args:
      query: ``(batch, heads, q_len, head_dim)``, or ``(heads, q_len, head_dim)``: one example
        (key and value then lack the batch axis too, and so do the output and the weights).
      key: ``(batch, kv_heads, kv_len, head_dim)``; ``kv_heads`` divides ``heads``, and query head
        ``h`` reads key/value head ``h // (heads // kv_heads)``.
      value: ``(batch, kv_heads, kv_len, v_head_dim)``, ``v_head_dim`` may differ from ``head_dim``
        (as in multi-head latent attention); the output has it.
      attn_mask: ``F.scaled_dot_product_attention``'s name for ``mask``; pass one of the two.
      dropout_p: probability of dropping an attention weight; kept weights are scaled by
        ``1 / (1 - dropout_p)``. Without ``dropout_mask`` the mask is drawn from torch's RNG.
      enable_gqa: None or True: ``kv_heads`` may be fewer than ``heads``; False: they must be
        equal, as ``F.scaled_dot_product_attention`` asks by default.
      mask: broadcasts to ``(batch, heads, q_len, kv_len)`` (one example: ``(heads, q_len,
        kv_len)``); as in ``F.scaled_dot_product_attention``: bool True = attend, floating =
        added to the logits (with ``bias``); integer nonzero = attend (SDPA refuses integers).
        ``mha_jax``'s mask differs here: any dtype, nonzero = attend.
      bias: real floating, broadcasting to ``(batch, heads, q_len, kv_len)``; added to the
        scaled logits (``-inf`` excludes a key).
      {masking_terms}
      {logit_terms}
      dropout_mask: explicit keep-mask (True = keep) broadcasting to
        ``(batch, heads, q_len, kv_len)`` (``"math"`` only).
      need_weights: also return the attention weights actually applied to ``value``
        (``"math"`` only); with ``sinks`` the sink's share is not among them.
      implementation: ``"math"`` (the explicit formulation), ``"sdpa"`` (``F.scaled_dot_product_attention``;
        any term but causality at default positions as one materialised ``attn_mask``), or None: ``"sdpa"``
        unless weights, an explicit dropout mask or ``logit_soft_cap`` are asked for, then ``"math"``.
    Returns:
      ``(batch, heads, q_len, v_head_dim)`` in the input dtype, or ``(output, weights)`` with
      weights ``(batch, heads, q_len, kv_len)``. A query that may attend to no key gets an
      output row of 0 and weights 0. ``"math"`` forms no inf or NaN inside (``torch.autograd.detect_anomaly``)
      but from a user's ``-inf``: an excluded key's logit is finite, and a finite bias below ``-0.1 *
      finfo(dtype).max`` counts as that value. bfloat16/float16 inputs are computed in float32 (on a CUDA
      device, ``"sdpa"`` gives them to the fused kernels as they are, which accumulate in float32).
    """
    one_example = _checks.check_unbatched(query, key, value)
    mask_name, mask = _checks.either_mask(attn_mask, mask)
    if one_example:  # as a batch of one
        _checks.check_one_example((query.shape[0], query.shape[1], key.shape[1]),
                                  **{mask_name: mask, "bias": bias, "dropout_mask": dropout_mask})
        query, key, value = query[None], key[None], value[None]
    batch, q_len, heads, _, kv_len, kv_heads = _checks.check_attention_inputs(query, key, value)
    _checks.check_enable_gqa(enable_gqa, heads, kv_heads)
    masking = batch_axes.Masking(
        mask=mask, bias=bias, is_causal=is_causal, query_positions=query_positions, key_positions=key_positions,
        local_window_size=local_window_size, query_segment_ids=query_segment_ids, key_segment_ids=key_segment_ids,
        key_value_seq_lengths=key_value_seq_lengths, attention_chunk_size=attention_chunk_size,
        alibi_slopes=alibi_slopes)
    spec = masks.parse((batch, heads, q_len, kv_len), device=query.device, mask_name=mask_name, **masking._asdict())
    result = spec_attention(
        query, key, value, spec, scale=scale, logit_soft_cap=logit_soft_cap, sinks=sinks, dropout_p=dropout_p,
        dropout_mask=dropout_mask, need_weights=need_weights, implementation=implementation,
    )
    if not one_example:
        return result
    return (result[0][0], result[1][0]) if need_weights else result[0]


def spec_attention(query, key, value, spec: masks.Spec, *, scale=None, logit_soft_cap=None, sinks=None,
                   dropout_p=0.0, dropout_mask=None, need_weights=False, implementation=None, zero_unused=True):
    """``dot_product_attention`` on checked inputs and a parsed ``spec`` (the module's entry).
    ``zero_unused=False`` skips zeroing the keys no query sees (a decoding cache's slots are finite)."""
    batch, heads, q_len, kv_len = shape = spec.shape
    kv_heads, head_dim = key.shape[1], query.shape[3]
    scale, soft_cap = _checks.CHECKS.check_logit_terms(scale, logit_soft_cap, sinks, heads, head_dim)
    keep, keep_scale = _dropout_keep(dropout_p, dropout_mask, shape)
    if kv_len == 0:
        return _no_keys(query, key, value, sinks, shape, need_weights)
    kernel = _dispatch.choose(implementation, need_weights, keep is not None, soft_cap is not None)
    dtype = query.dtype
    compute = dtype if kernel.takes_half(query) else torch.promote_types(dtype, torch.float32)
    unused = masks.unused_keys(spec, kv_heads) if zero_unused else None
    if unused is not None:  # per key/value head, in the key layout (batch, kv_heads, kv_len, 1)
        unused = unused[..., None]
        key, value = key.masked_fill(unused, 0), value.masked_fill(unused, 0)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    sinks = None if sinks is None else sinks.to(compute)
    if spec.alibi_slopes is not None:  # the ALiBi term in the compute dtype
        spec = dataclasses.replace(spec, alibi_slopes=spec.alibi_slopes.to(compute))
    if spec.bias is not None:  # its finite values above every masked score (no inf: see _tiles)
        spec = dataclasses.replace(spec, bias=_tiles.floored_bias(spec.bias, compute))
    out, weights = kernel.run(q, k, v, spec, scale=scale, soft_cap=soft_cap, sinks=sinks, keep=keep,
                              keep_scale=keep_scale, dropout_p=dropout_p)
    out = out.to(dtype)
    if need_weights:
        return out, weights.to(dtype)
    return out


def _no_keys(query, key, value, sinks, shape, need_weights):
    """Zeros ``(batch, heads, q_len, v_head_dim)`` (and weights ``(batch, heads, q_len, 0)``), kept in the graph."""
    batch, heads, q_len, _ = shape
    kv_heads, head_dim, groups = key.shape[1], query.shape[3], heads // key.shape[1]
    empty = query.reshape(batch, kv_heads, groups, q_len, head_dim) @ key.unsqueeze(2).transpose(-1, -2)
    if sinks is not None:
        empty = empty + sinks.reshape(1, kv_heads, groups, 1, 1).to(empty.dtype)
    out = (empty @ value.unsqueeze(2)).reshape(batch, heads, q_len, value.shape[3])
    return (out, empty.reshape(shape)) if need_weights else out


def _dropout_keep(rate, dropout_mask, shape):
    """(explicit keep-mask or None, scale of kept weights)."""
    rate = arguments.check_dropout_rate("dropout_p", rate)
    if dropout_mask is not None:
        _checks.check_dropout_mask(dropout_mask, shape, MASK_LAYOUT)
        return dropout_mask != 0, 1.0 / (1.0 - rate)
    return None, 1.0 / (1.0 - rate)  # without a mask, each implementation draws its own
