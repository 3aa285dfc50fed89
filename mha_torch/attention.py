"""Scaled dot-product attention, the functional core.

Twin of ``mha_jax/attention.py``: the same steps in the same order. Only the layout differs;
here it is that of ``F.scaled_dot_product_attention``: query ``(batch, heads, q_len, head_dim)``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from mha_spec import arguments, batch_axes, docstrings, terms
from mha_torch import _checks, masks
from mha_torch.masks import MASK_LAYOUT


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What one implementation takes; the choice and its error messages are read from these."""

    name: str
    weights: bool = False  # need_weights (only a kernel that forms the weights)
    dropout_mask: bool = True  # an explicit keep-mask
    soft_cap: bool = True


_KERNELS = {k.name: k for k in (
    _Kernel("math", weights=True),
    _Kernel("sdpa", dropout_mask=False, soft_cap=False),  # F.scaled_dot_product_attention
)}
IMPLEMENTATIONS = tuple(_KERNELS)
_DEFAULT_ORDER = ("sdpa", "math")  # the default: the first that takes the call
# PyTorch's own, held from import: a program that puts ``dot_product_attention`` in its place as
# ``F.scaled_dot_product_attention`` still reaches PyTorch's here, not itself again.
_torch_sdpa = F.scaled_dot_product_attention


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
    spec = masks.parse((batch, heads, q_len, kv_len), device=query.device, mask_name=mask_name,
                       **batch_axes.masking(locals()))
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
    scale = arguments.check_scale(scale)
    soft_cap = arguments.check_logit_soft_cap(logit_soft_cap)
    if sinks is not None:
        _checks.require_float("sinks", sinks)
        arguments.check_sinks_shape(sinks.shape, heads)
    keep, keep_scale = _dropout_keep(dropout_p, dropout_mask, shape)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if kv_len == 0:
        return _no_keys(query, key, value, sinks, shape, need_weights)
    implementation = _choose(implementation, need_weights, keep is not None, soft_cap is not None)
    dtype = query.dtype
    # SDPA's fused GPU kernels take half precision as it is (in float32 they would fall back to math)
    fused = implementation == "sdpa" and query.is_cuda and dtype in (torch.bfloat16, torch.float16)
    compute = dtype if fused else torch.promote_types(dtype, torch.float32)
    unused = masks.unused_keys(spec, kv_heads) if zero_unused else None
    if unused is not None:  # per key/value head, in the key layout (batch, kv_heads, kv_len, 1)
        unused = unused[..., None]
        key, value = key.masked_fill(unused, 0), value.masked_fill(unused, 0)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    sinks = None if sinks is None else sinks.to(compute)
    if spec.alibi_slopes is not None:  # the ALiBi term in the compute dtype
        spec = dataclasses.replace(spec, alibi_slopes=spec.alibi_slopes.to(compute))
    if spec.bias is not None:  # its finite values above every masked score (no inf: see _masked_softmax)
        spec = dataclasses.replace(spec, bias=_floored_bias(spec.bias, compute))
    if implementation == "math":
        if keep is None and dropout_p > 0:
            keep = torch.rand(shape, device=query.device) >= dropout_p
        out, weights = _math(q, k, v, masks.dense(spec), masks.biases(spec), keep, keep_scale, scale, soft_cap, sinks)
    else:
        out, weights = _sdpa(q, k, v, spec, scale, dropout_p, sinks), None
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


def _choose(implementation, need_weights, explicit_dropout, soft_cap=False) -> str:
    options = (need_weights, explicit_dropout, soft_cap)
    if implementation is None:  # the first of the default order that takes the call
        return next(n for n in _DEFAULT_ORDER if _refusal(_KERNELS[n], *options) is None)
    arguments.check_implementation(implementation, IMPLEMENTATIONS)
    refused = _refusal(_KERNELS[implementation], *options)
    if refused is not None:
        raise ValueError(refused)
    return implementation


def _refusal(kernel: _Kernel, need_weights, explicit_dropout, soft_cap) -> str | None:
    """The message when ``kernel`` cannot take a call of these options, else None."""
    if (need_weights and not kernel.weights) or (explicit_dropout and not kernel.dropout_mask):
        return f"need_weights=True and dropout_mask need implementation='math', got {kernel.name!r}"
    if soft_cap and not kernel.soft_cap:
        return (f"logit_soft_cap needs implementation='math' (F.scaled_dot_product_attention cannot apply "
                f"tanh to the logits), got {kernel.name!r}")
    return None


def _math(q, k, v, allowed, bias, keep, keep_scale, scale, soft_cap=None, sinks=None):
    """(out, weights) of q ``(b, heads, q, d)``, k ``(b, kv_heads, k, d)``, v ``(b, kv_heads, k, dv)``."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    logits = q.reshape(batch, kv_heads, groups, q_len, head_dim) @ k.unsqueeze(2).transpose(-1, -2)
    logits = logits.reshape(batch, heads, q_len, kv_len) * scale
    if soft_cap is not None:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    weights = _masked_softmax(logits, allowed, bias, sinks)
    if keep is not None:
        weights = torch.where(keep, weights * keep_scale, 0.0)
    out = weights.reshape(batch, kv_heads, groups, q_len, kv_len) @ v.unsqueeze(2)
    return out.reshape(batch, heads, q_len, v.shape[3]), weights


def _sdpa(q, k, v, spec: masks.Spec, scale, dropout_p, sinks=None):
    """``F.scaled_dot_product_attention`` with our semantics: default-position causality alone as its
    ``is_causal``, anything else as one ``attn_mask``; ``sinks`` ``(heads,)`` as ``_with_sink_key``."""
    native_causal = (
        spec.terms.members == (terms.Causal(),) and spec.default_positions
        and spec.allowed is None and spec.bias is None and spec.alibi_slopes is None and sinks is None
    )
    attn_mask, bias = None, masks.biases(spec)
    if not native_causal:
        attn_mask = masks.dense(spec)
        if bias is not None:
            attn_mask = bias.to(q.dtype) if attn_mask is None else torch.where(attn_mask, bias.to(q.dtype), -math.inf)
    if attn_mask is not None and attn_mask.ndim < 4:  # SDPA wants at least (q_len, kv_len)
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    if sinks is not None:
        q, k, v, attn_mask = _with_sink_key(q, k, v, attn_mask, sinks)
    batch, heads, q_len, head_dim = q.shape
    groups = heads // k.shape[1]
    if groups > 1 and attn_mask is None and not native_causal and dropout_p == 0:
        # a group's query heads as rows of one head: each key/value head read once (enable_gqa: once per query head)
        out = _torch_sdpa(q.reshape(batch, k.shape[1], groups * q_len, head_dim), k, v, scale=scale)
        return out.view(batch, heads, q_len, v.shape[3])
    return _torch_sdpa(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=native_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def _with_sink_key(q, k, v, attn_mask, sinks):
    """(q, k, v, attn_mask) with one more key and value of zeros and a float mask ``(batch|1, heads, q_len,
    kv_len + 1)`` whose last column is ``sinks``: that key's score is the sink logit exactly."""
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len, head_dim = k.shape[1], k.shape[2], k.shape[3]
    k = torch.cat([k, k.new_zeros(batch, kv_heads, 1, head_dim)], dim=2)
    v = torch.cat([v, v.new_zeros(batch, kv_heads, 1, v.shape[3])], dim=2)
    if attn_mask is None:
        attn_mask = q.new_zeros(1, 1, 1, 1)
    elif attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask, q.new_zeros(()), -math.inf)
    lead = attn_mask.shape[0]
    attn_mask = attn_mask.expand(lead, heads, q_len, kv_len)
    sink = sinks.reshape(1, heads, 1, 1).expand(lead, heads, q_len, 1)
    return q, k, v, torch.cat([attn_mask, sink], dim=-1)


def _masked_softmax(logits: torch.Tensor, allowed: torch.Tensor | None, bias: torch.Tensor | None,
                    sinks=None) -> torch.Tensor:
    """Softmax over the last axis of ``(batch, heads, q_len, kv_len)``; 0 on rows with no key; sinks ``(heads,)``.
    Masked scores are finite (``terms.MASKED``): no inf is formed, whatever is masked."""
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, _of_max(logits.dtype, terms.MASKED))
    row_max = logits.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = row_max.detach()
    row_max = torch.where(row_max > _of_max(logits.dtype, terms.NO_KEY), row_max, 0.0)  # no key: exp(masked) is 0
    exp = torch.exp(logits - row_max)
    total = exp.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sink - row_max)
    return exp / torch.where(total == 0.0, 1.0, total)


def _of_max(dtype: torch.dtype, fraction: float) -> float:
    """``fraction`` x the largest finite value of ``dtype``."""
    return fraction * torch.finfo(dtype).max


def _floored_bias(bias: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """``bias`` with finite values below ``terms.BIAS_FLOOR`` x max of ``compute`` raised to it, ``-inf`` kept: every
    score a finite bias leaves stays above the masked ones' (a key excluded only by a mask or ``-inf``)."""
    floor = _of_max(compute, terms.BIAS_FLOOR)
    if torch.finfo(bias.dtype).min >= floor:
        return bias
    return torch.where(torch.isneginf(bias), bias, bias.clamp_min(floor))


def _dropout_keep(rate, dropout_mask, shape):
    """(explicit keep-mask or None, scale of kept weights)."""
    rate = arguments.check_dropout_rate("dropout_p", rate)
    if dropout_mask is not None:
        _checks.check_dropout_mask(dropout_mask, shape, MASK_LAYOUT)
        return dropout_mask != 0, 1.0 / (1.0 - rate)
    return None, 1.0 / (1.0 - rate)  # without a mask, each implementation draws its own
