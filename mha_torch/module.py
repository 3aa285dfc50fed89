"""PyTorch multi-head attention, batch-first; twin of ``mha_jax/module.py``. State dict: ``q_proj``, ``k_proj``,
``v_proj``, ``out_proj`` (``.weight (out, in)``, ``.bias``), ``q_norm``/``k_norm`` with ``normalize_qk``, ``sinks``
with ``use_sinks``; with a ``latent``, transformers' names (``mha_torch.latent.make_projections``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Unpack

from mha_spec import alibi, arguments, batch_axes, docstrings, kv_cache, query_terms
from mha_spec import latent as latent_spec
from mha_spec import paged as paged_spec
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale
from mha_spec.rotary import rotate_at
from mha_torch import _cache, _checks, masks, paged, testing
from mha_torch import latent as mla
from mha_torch._cache import KVCache
from mha_torch.attention import IMPLEMENTATIONS, spec_attention


@docstrings.fill
class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) attention with input and output projections.

    Args:
      embed_dim: feature size of ``query``.
      num_heads: query heads.
      num_kv_heads: key/value heads, dividing ``num_heads``; default ``num_heads``.
      kdim, vdim: feature sizes of ``key`` and ``value``; default ``embed_dim``.
      qkv_dim: total query feature size ``num_heads * head_dim``; default ``embed_dim``.
      out_dim: output feature size; default ``embed_dim``.
      bias: biases on the four projections.
      dropout: dropout on the attention weights, active in training mode.
      broadcast_dropout: one dropout mask ``(q_len, kv_len)`` shared by the batch and heads (flax's default)
        instead of one per element (torch's, the default here).
      normalize_qk: True: LayerNorm (no bias, epsilon 1e-6) on each head's queries and keys, as flax's
        ``normalize_qk``: ``q_norm``, ``k_norm``; a ``QKNorm`` for another norm (RMS, over the whole
        projection, ``1 + weight``, its epsilon).
      implementation: attention implementation, see ``mha_torch.dot_product_attention`` (default:
        ``F.scaled_dot_product_attention`` unless weights are requested).
      use_sinks: a learned logit per query head, ``sinks`` ``(num_heads,)`` (zeros at first), joins each row's
        softmax normaliser without a value (gpt-oss).
      {module_terms}
      out_bias: a bias on the output projection; default ``bias`` (Qwen2: ``False``).
      device, dtype: of the parameters.
      latent: an ``mha_spec.latent.Latent``: multi-head latent attention (DeepSeek-V2/V3): keys and values of
        every head lifted from one low-rank latent per token, ``rotary`` on the rope part of each head, ``bias``
        on the low-rank input projections only; ``num_kv_heads`` and ``qkv_dim`` None, no ``normalize_qk``, the
        value input the key input; default scale ``1 / sqrt(qk_head_dim)``. Decoding takes an
        ``mha_torch.latent.LatentCache``.
      clip_qkv: the query, key and value projections' outputs clamped to ``[-clip_qkv, clip_qkv]``, after the
        QK-norm (OLMo, OLMoE; MPT's and DBRX's fused projection); None: not clamped.
      query_scale: an ``mha_spec.query_terms.QueryScale``: each query scaled by its position after the rotary
        embedding (Llama 4's temperature tuning, Ministral 3's ``llama_4_scaling_beta``); None: not scaled.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        qkv_dim: int | None = None,
        out_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        broadcast_dropout: bool = False,
        normalize_qk: bool = False,
        implementation: str | None = None,
        scale: float | None = None,
        logit_soft_cap: float | None = None,
        use_sinks: bool = False,
        rotary: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        local_window_size: int | tuple[int, int] | None = None,
        out_bias: bool | None = None,
        output_gate: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attention_chunk_size: int | None = None,
        alibi_slopes: Sequence[float] | None = None,
        latent: latent_spec.Latent | None = None,
        clip_qkv: float | None = None,
        query_scale: QueryScale | None = None,
    ):
        super().__init__()
        self.latent = None if latent is None else latent_spec.check_latent(
            latent, num_heads, num_kv_heads, qkv_dim, ("num_kv_heads", "qkv_dim"))
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.qkv_dim = embed_dim if qkv_dim is None else qkv_dim
        if self.latent is not None:
            self.qkv_dim = num_heads * self.latent.qk_head_dim
        self.out_dim = embed_dim if out_dim is None else out_dim
        for name in ("embed_dim", "kdim", "vdim", "out_dim"):
            arguments.check_heads(1, 1, getattr(self, name), name)
        self.head_dim = arguments.check_heads(num_heads, self.num_kv_heads, self.qkv_dim, "qkv_dim")
        self.dropout = arguments.check_dropout_rate("dropout", dropout)
        self.broadcast_dropout, self.normalize_qk = broadcast_dropout, normalize_qk
        self.implementation, self.scale, self.local_window_size, self.attention_chunk_size = arguments.check_options(
            implementation, IMPLEMENTATIONS, scale, local_window_size, attention_chunk_size)
        self.logit_soft_cap, self.rotary = logit_soft_cap, rotary
        self.alibi_slopes = alibi.check_module_slopes(alibi_slopes, num_heads)
        self.clip_qkv, self.query_scale = query_terms.check_terms(clip_qkv, query_scale, self.latent)
        qk_norm = arguments.check_qk_norm(normalize_qk)
        out_bias = bias if out_bias is None else out_bias
        if self.latent is not None:
            self._make_latent(qk_norm, out_bias, bias, device, dtype)
        else:
            self._make_projections(qk_norm, out_bias, bias, device, dtype)
        self.sinks = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) if use_sinks else None
        self.output_gate = query_terms.check_output_gate(output_gate, self.latent)
        self.gate_proj = None if output_gate is None else nn.Linear(
            self.embed_dim, math.prod(query_terms.gate_features(output_gate, num_heads, self.head_dim)), bias=False,
            device=device, dtype=dtype)

    def _make_projections(self, qk_norm: QKNorm | None, out_bias: bool, bias: bool, device, dtype) -> None:
        kv_dim = self.num_kv_heads * self.head_dim
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(self.embed_dim, self.qkv_dim, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_dim, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_dim, **factory)
        self.q_norm = self.k_norm = None
        if qk_norm is not None and qk_norm == QKNorm(eps=qk_norm.eps):  # flax's: torch's LayerNorm per head
            norm = {"eps": qk_norm.eps, "bias": False, "device": device, "dtype": dtype}
            self.q_norm = nn.LayerNorm(self.head_dim, **norm)
            self.k_norm = nn.LayerNorm(self.head_dim, **norm)
        elif qk_norm is not None:
            self.q_norm = _Norm(qk_norm, self.num_heads, self.head_dim, device=device, dtype=dtype)
            self.k_norm = _Norm(qk_norm, self.num_kv_heads, self.head_dim, device=device, dtype=dtype)
        self.out_proj = nn.Linear(self.qkv_dim, self.out_dim, **dict(factory, bias=out_bias))

    def _make_latent(self, qk_norm, out_bias: bool, bias: bool, device, dtype) -> None:
        """The parameters of multi-head latent attention (``mha_torch.latent.make_projections``)."""
        self.scale = latent_spec.check_options(self.latent, qk_norm, self.rotary, self.scale)
        self.k_proj = self.v_proj = self.q_norm = self.k_norm = None
        mla.make_projections(self, self.latent, (self.embed_dim, self.kdim, self.out_dim), self.num_heads,
                                (bias, out_bias), {"device": device, "dtype": dtype})

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        dropout_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        **masking: Unpack[arguments.PositionMasking[torch.Tensor]],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
          query: ``(*batch, q_len, embed_dim)``; any number of batch axes, none included.
          key: ``(*batch, kv_len, kdim)``; default ``query`` (self-attention).
          value: ``(*batch, kv_len, vdim)``; default ``key``.
          mask: broadcasts to ``(*batch, num_heads, q_len, kv_len)``; bool/integer nonzero = attend, floating =
            added to the logits (see ``dot_product_attention``).
          bias: added to the logits, broadcasting to ``(*batch, num_heads, q_len, kv_len)``.
          is_causal: as in ``mha_torch.dot_product_attention``.
          need_weights: also return the weights ``(*batch, num_heads, q_len, kv_len)``.
          dropout_mask: explicit keep-mask ``(*batch, num_heads, q_len, kv_len)``; always applied, kept weights
            scaled by ``1 / (1 - dropout)``.
          cache: a ``KVCache``: append the inputs' keys and values to it (in place) and attend over everything
            cached: any number of new tokens, at ``query_positions`` ``(batch, n)`` (default: each row's
            ``cache.index + arange(n)``; ``-1`` marks padding, not cached). Masks and biases then span the cache:
            ``(*batch, heads, n, max_length)``.
          **masking: ``query_positions``, ``key_positions``, ``local_window_size``, ``query_segment_ids``,
            ``key_segment_ids`` and ``key_value_seq_lengths``, by name: as in ``mha_torch.dot_product_attention``,
            with the inputs' batch axes; in self-attention (``key`` not given, or ``query`` itself) the key
            positions and segment ids default to the query's.

        Returns:
          ``(*batch, q_len, out_dim)``, or ``(output, weights)``.
        """
        masking = batch_axes.call_masking(
            self.local_window_size, self.attention_chunk_size, self._slopes(),
            arguments.position_masking("MultiHeadAttention.forward", masking), mask=mask, bias=bias,
            is_causal=is_causal, dropout_mask=dropout_mask)
        if self.latent is not None:
            latent_spec.check_inputs(key, value, "value")
        if cache is not None:
            return self._decode(query, key, value, cache, masking, need_weights)
        call, (q, k, v) = self._prepare((query, key, value), masking)
        if self.latent is not None:  # k: the latent entries
            q, k, v = mla.attention_inputs(self, q, k, call.spec)
        else:
            q_pos, k_pos = masks.positions(call.spec)
            q, k = self._rotated(self.rotary, q, k, q_pos, k_pos)
            q = _scale_queries(self.query_scale, q, q_pos)
        return self._attend(q, k, v, call.spec, call.batch_shape, need_weights, call.dropout_mask, zero_unused=True,
                            gate=self._gate(call.inputs[0]))

    def _prepare(self, inputs: tuple, masking: dict, max_length: int | None = None):
        """``(call, (q, k, v))``: the checked call (``batch_axes.merged_call``) and its projections (``_project``;
        with a latent, the latent entries ``(batch, kv_len, cache_dim)`` and None)."""
        heads, kv_heads = self._local_heads()
        self_attention, query, key, value = arguments.default_inputs(*inputs, ("query", "key", "value"), "tensor")
        _check_inputs(query, key, value, self.embed_dim, self.kdim, self.vdim)
        _check_parameter_dtype(query, self.out_proj.weight.dtype)
        parse = functools.partial(masks.parse, device=query.device)
        call = batch_axes.merged_call((query, key, value), self_attention, masking, torch.broadcast_to, parse,
                                      masks.zero_unused_inputs, heads, max_length)
        query, key, value = call.inputs
        if self.latent is not None:
            return call, (mla.project_query(self, query, query.shape[0], heads), mla.project_latent(self, key), None)
        return call, self._project(query, key, value, query.shape[0], heads, kv_heads)

    def _slopes(self) -> torch.Tensor | None:
        """The static ALiBi slopes, float64 ``(num_heads,)`` on the parameters' device, or None."""
        if self.alibi_slopes is None:
            return None
        if self._local_heads()[0] != self.num_heads:
            raise ValueError("alibi_slopes reaches all num_heads heads: it is not taken with projections sharded "
                             "over ranks (tensor parallelism)")
        return torch.tensor(self.alibi_slopes, dtype=torch.float64, device=self.out_proj.weight.device)

    def _logit_terms(self) -> dict:
        terms = dict(scale=self.scale, logit_soft_cap=self.logit_soft_cap, sinks=self.sinks)
        return {name: value for name, value in terms.items() if value is not None}

    def _local_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads) this process computes: all, or those of its shard of the projections."""
        if self.latent is not None:
            return self.num_heads, self.num_heads
        def rows(weight):
            return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]

        q_rows, kv_rows = rows(self.q_proj.weight), rows(self.k_proj.weight)
        heads, kv_heads = q_rows // self.head_dim, kv_rows // self.head_dim
        split = (q_rows % self.head_dim or kv_rows % self.head_dim
                 or heads * self.num_kv_heads != kv_heads * self.num_heads)
        if heads != self.num_heads and split:
            raise ValueError(
                f"the sharded projections hold {heads} query and {kv_heads} key/value heads, which splits a group of "
                f"{self.num_heads // self.num_kv_heads} query heads from its key/value head "
                f"(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}): shard over a number of ranks "
                "dividing num_kv_heads"
            )
        return heads, kv_heads

    @docstrings.fill
    def paged_step(self, inputs: torch.Tensor, cache: paged.PagedKVCache, *, max_q_len: int | None = None
                   ) -> tuple[torch.Tensor, paged.PagedKVCache]:
        """Self-attention of packed tokens over a paged cache: a serving step of many sequences at once.

        {paged_step}
        """
        x, latent = inputs[None], self.latent  # one row of packed tokens
        pages = (1, latent.cache_dim) if latent is not None else (self._local_heads()[1], self.head_dim)
        paged_spec.check_layer_inputs(inputs.shape, self.embed_dim, cache.kv_pages.shape, *pages)
        if latent is not None:  # the cache's entries for keys, no values
            q, k, v = mla.project_query(self, x, 1, self.num_heads), mla.project_latent(self, x), None
        else:
            q, k, v = self._project(x, x, x, 1, *self._local_heads())  # tensor-parallel: this rank's heads, cached
        positions = paged_spec.token_positions(paged_spec.step_arrays(cache), torch.arange(
            inputs.shape[0], device=inputs.device), torch)[2][None]
        q, k = self._rotated(self.rotary if latent is None else mla.rope_part(self.rotary, latent), q, k, positions,
                             positions)
        q = _scale_queries(self.query_scale, q, positions)
        if latent is not None:
            q, v = mla.absorb_query(self, q), k
        paged.write(cache, k[0].transpose(0, 1), v[0].transpose(0, 1))
        out = paged.ragged_attention(
            q[0].transpose(0, 1), cache, max_q_len=max_q_len, local_window_size=self.local_window_size,
            attention_chunk_size=self.attention_chunk_size, scale=self.scale, logit_soft_cap=self.logit_soft_cap,
            alibi_slopes=self._slopes(), sinks=self.sinks)
        if latent is not None:
            out = mla.lift_output(self, out[None, ..., :latent.kv_lora_rank].transpose(1, 2))[0].transpose(0, 1)
        gate = self._gate(x)
        out = out if gate is None else out * gate[0].transpose(0, 1)
        return self.out_proj(out.reshape(inputs.shape[0], -1)), cache

    def _decode(self, query, key, value, cache: KVCache, masking: dict, need_weights: bool):
        """One decoding step: ``_fast_step`` when it takes the call, else the cache written and attended over every
        slot (fixed shapes for torch.compile)."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an mha_torch.KVCache, got {type(cache).__name__}")
        if (key is None or key is query) and value is None and self.latent is None \
                and all(x is None for name, x in masking.items() if name != "is_causal"):
            out = self._fast_step(query, cache, masking["is_causal"], need_weights)
            if out is not None:
                return out
        call, (q, k, v) = self._prepare((query, key, value), masking, cache.max_length)
        # with a latent the cache holds one key head, the latent entries
        kv_heads, head_dim = (1, self.latent.cache_dim) if self.latent is not None else (k.shape[1], self.head_dim)
        kv_cache.check_cache(("key", "index"), "make the KVCache with the inputs' batch axes", cache.key.shape,
                             cache.index.shape, call.batch_shape, kv_heads, head_dim, call.inputs[1].shape[1])
        flat = cache if len(call.batch_shape) == 1 else cache.merged(q.shape[0])  # batch axes merged as the inputs'
        rotary = self.rotary if self.latent is None else mla.rope_part(self.rotary, self.latent)
        q, spec = _decode_step(flat, functools.partial(self._rotated, rotary), self.query_scale, q, k, v, call)
        if flat is not cache:  # the cache's own batch axes over the flat tensors (new ones if written out of place)
            shape = cache.key_storage.shape
            cache.key_storage = flat.key_storage.view(shape)
            cache.value_storage = None if flat.value_storage is None else flat.value_storage.view(shape)
        if self.latent is not None:
            q, (keys, values) = mla.absorb_query(self, q), mla.cached_keys(flat, self.latent, q.dtype)
        else:
            keys, values = flat.key_storage.to(q.dtype), flat.value_storage.to(q.dtype)
        return self._attend(q, keys, values, spec, call.batch_shape, need_weights, absorbed=self.latent is not None,
                            gate=self._gate(call.inputs[0]))

    def _fast_step(self, query, cache: KVCache, is_causal, need_weights):
        """Self-attention of ``query`` ``(*batch, n, embed_dim)`` (one token, or not causal) over ``cache`` when every
        row is at one position with room, outside torch.compile: written by slicing, attended unmasked. Else None."""
        keys, weight = cache.key_storage, self.q_proj.weight
        if not testing.current().fast_step or self.gate_proj is not None or not isinstance(query, torch.Tensor) \
                or torch.compiler.is_compiling() or query.ndim < 2 \
                or query.shape[-1] != self.embed_dim or query.dtype != weight.dtype:
            return None
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if hasattr(weight, "to_local") or hasattr(self.k_proj.weight, "to_local"):  # tensor-parallel: a shard's heads
            heads, kv_heads = self._local_heads()
        batch_shape, n = query.shape[:-2], query.shape[-2]
        if type(is_causal) not in (bool, np.bool_) or is_causal and n != 1 or cache.index.shape != batch_shape \
                or keys.shape != (*batch_shape, kv_heads, keys.shape[-2], head_dim) or keys.dtype != query.dtype \
                or keys.device != query.device:
            return None
        merged = len(batch_shape) != 1  # batch axes other than one, merged into one as the inputs'
        starts = (cache.index.flatten() if merged else cache.index).tolist()
        start = starts[0] if starts else -1
        if not (0 <= start <= cache.max_length - n and all(row == start for row in starts)):
            return None
        batch = len(starts)
        q, k, v = self._project(query, query, query, batch, heads, kv_heads)
        if k.dtype != keys.dtype:  # under autocast: the general path names the dtypes
            return None
        if self.rotary is not None or self.query_scale is not None or self._norms_after_rotary():  # rows at one start
            pos = torch.arange(start, start + n, dtype=torch.int32, device=query.device)
            q, k = self._rotated(self.rotary, q, k, pos, pos)
            q = _scale_queries(self.query_scale, q, pos[None])
        testing.observe("fast_step", n)
        _writable(cache, k, v)
        keys, values = cache.key_storage, cache.value_storage
        if merged:  # views: the writes reach the cache
            keys, values = keys.view(batch, kv_heads, -1, head_dim), values.view(batch, kv_heads, -1, head_dim)
        keys.narrow(2, start, n).copy_(k)
        values.narrow(2, start, n).copy_(v)
        cache.index.add_(n)
        keys, values = keys.narrow(2, 0, start + n), values.narrow(2, 0, start + n)
        if self.sinks is not None or self.logit_soft_cap is not None or need_weights \
                or self.implementation not in (None, "sdpa") or (self.training and self.dropout > 0):
            spec = masks.parse((batch, heads, n, start + n), device=query.device)
            return self._attend(q, keys, values, spec, batch_shape, need_weights)
        out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, -1, head_dim), keys, values, scale=self.scale)
        if n > 1:  # (batch, heads, n, head_dim) to (batch, n, heads, head_dim); for one token the same order
            out = out.view(batch, heads, n, head_dim).transpose(1, 2)
        return self.out_proj(out.reshape(*batch_shape, n, heads * head_dim))

    def _project(self, query, key, value, batch: int, heads: int, kv_heads: int):
        """QK-normed queries ``(batch, heads, q_len, head_dim)``, keys and values ``(batch, kv_heads, kv_len, dim)``."""
        q_len, kv_len, head_dim = query.shape[-2], key.shape[-2], self.head_dim
        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        if self.q_norm is not None and not self._norms_after_rotary():
            q = self.q_norm(q.view(batch, q_len, heads, head_dim))
            k = self.k_norm(k.view(batch, kv_len, kv_heads, head_dim))
        values = getattr(getattr(self.q_norm, "qk_norm", None), "of_values", None)
        if values is not None:
            compute = torch.promote_types(v.dtype, torch.float32)
            v = values.normalize(v.view(batch, kv_len, kv_heads, head_dim).to(compute), 1.0, _mean, torch.rsqrt).to(
                v.dtype)
        if self.clip_qkv is not None:
            q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        return (_split_heads(q, batch, q_len, heads, head_dim), _split_heads(k, batch, kv_len, kv_heads, head_dim),
                _split_heads(v, batch, kv_len, kv_heads, head_dim))

    def _norms_after_rotary(self) -> bool:
        """Whether the QK-norm is applied to the rotated queries and keys (``QKNorm.after_rotary``)."""
        return getattr(getattr(self.q_norm, "qk_norm", None), "after_rotary", False)

    def _rotated(self, rotary, q: torch.Tensor, k: torch.Tensor, q_pos, k_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotate_at``, then the QK-norm when it is applied after the rotary embedding."""
        q, k = rotate_at(rotary, q, k, q_pos, k_pos)
        return (self.q_norm(q), self.k_norm(k)) if self._norms_after_rotary() else (q, k)

    def _gate(self, query: torch.Tensor) -> torch.Tensor | None:
        """The output gate of the query's input ``(batch, q_len, embed_dim)``: ``(batch, heads, q_len, 1 | head_dim)``,
        None without ``output_gate``."""
        if self.gate_proj is None:
            return None
        width = 1 if self.output_gate.startswith("head") else self.head_dim
        raw = self.gate_proj(query)
        if query_terms.gate_softplus(self.output_gate):  # in float32 or wider, as transformers'
            gate = F.softplus(raw.to(torch.promote_types(raw.dtype, torch.float32))).to(raw.dtype)
        else:
            gate = torch.sigmoid(raw)
        return gate.view(*query.shape[:2], -1, width).transpose(1, 2)

    def _attend(self, q, keys, values, spec: masks.Spec, batch_shape, need_weights: bool, dropout_mask=None,
                zero_unused: bool = False, absorbed: bool = False, gate: torch.Tensor | None = None):
        """Attention of ``(batch, heads, len, head_dim)`` inputs, gated by ``gate`` (``_gate``'s), projected out:
        ``(*batch, q_len, out_dim)``, or ``(output, weights)``; ``absorbed``: a latent decoding step's, lifted to
        the value heads first."""
        batch, heads, n = spec.shape[:3]
        dropout_p = self.dropout if self.training or dropout_mask is not None else 0.0
        if dropout_mask is None and dropout_p > 0 and self.broadcast_dropout:
            dropout_mask = torch.rand((1, 1) + spec.shape[2:], device=q.device) >= dropout_p
        # the absorbed step's one key head under a mask: SDPA would copy it for every query head, "math" reads it once
        implementation = "math" if absorbed and self.implementation is None else self.implementation
        result = spec_attention(
            q, keys, values, spec, dropout_p=dropout_p, dropout_mask=dropout_mask, need_weights=need_weights,
            implementation=implementation, zero_unused=zero_unused, **self._logit_terms(),
        )
        out, weights = result if need_weights else (result, None)
        if absorbed:
            out = mla.lift_output(self, out)
        if gate is not None:
            out = out * gate
        out = self.out_proj(out.transpose(1, 2).reshape(batch, n, heads * out.shape[-1]))
        out = batch_axes.unflatten_batch(out, batch_shape)
        return (out, batch_axes.unflatten_batch(weights, batch_shape)) if need_weights else out


def _split_heads(x: torch.Tensor, batch: int, length: int, heads: int, head_dim: int) -> torch.Tensor:
    """``x`` ``(*batch, length, heads * head_dim)`` or ``(batch, length, heads, head_dim)`` as ``(batch, heads, length,
    head_dim)``."""
    if length == 1:
        return x.view(batch, heads, 1, head_dim)
    return x.view(batch, length, heads, head_dim).transpose(1, 2)


class _Norm(nn.Module):
    """A QK-norm other than flax's LayerNorm: ``weight`` ``(head_dim,)`` (shared) or ``(heads * head_dim,)``; none
    for a weightless norm."""

    def __init__(self, qk_norm: QKNorm, heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.qk_norm = qk_norm
        shape = (head_dim,) if qk_norm.shared_scale else (heads * head_dim,)
        init = torch.zeros if qk_norm.offset else torch.ones
        self.weight = nn.Parameter(init(shape, device=device, dtype=dtype)) if qk_norm.weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        if self.weight is None:
            return self.qk_norm.normalize(x.to(compute), 1.0, _mean, torch.rsqrt).to(x.dtype)
        weight = self.weight.to(compute).view(x.shape[-1:] if self.qk_norm.shared_scale else x.shape[-2:])
        return self.qk_norm.normalize(x.to(compute), weight, _mean, torch.rsqrt).to(x.dtype)


def _mean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return x.mean(dim=dims, keepdim=True)


def _scale_queries(query_scale: QueryScale | None, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``q`` ``(batch, heads, len, head_dim)`` times ``query_scale``'s factor at ``positions`` ``(batch|1, len)``."""
    if query_scale is None:
        return q
    compute = torch.promote_types(q.dtype, torch.float32)
    factor = query_scale.factor(positions.to(device=q.device, dtype=compute), torch.floor, torch.log1p)
    return q * factor[:, None, :, None].to(q.dtype)


def _decode_step(cache: KVCache, rotate: Callable, query_scale: QueryScale | None, q, k, v, call: batch_axes.Call):
    """Rotate (``rotate(q, k, positions, positions)``) ``q`` ``(batch, heads, n, head_dim)`` and ``k`` at the new
    positions (``q`` then scaled by
    ``query_scale``), append ``k``/``v`` (None: a latent cache) to ``cache``: ``(q, spec)``, ``spec`` over the new
    queries and the cache's slots."""
    start, max_length = cache.index.clone(), cache.max_length
    pos = _cache.positions(start, k.shape[2], call.query_positions)
    q, k = rotate(q, k, pos, pos)
    q = _scale_queries(query_scale, q, pos)
    kv_cache.check_dtype(_checks.dtype_name(cache.key), _checks.dtype_name(k), "the cache's key",
                         f"KVCache(..., dtype={k.dtype})")
    end = _cache.advance(start, pos)
    overflow = kv_cache.check_step(start, end, max_length, call.spec.terms,
                                   lambda x: None if torch.compiler.is_compiling() else x.cpu().numpy())
    key, value = k.transpose(1, 2), None if v is None else v.transpose(1, 2)
    _writable(cache, key, value)
    _cache.write(cache.key, key, pos, start, padded=call.query_positions is not None)
    if value is not None:
        _cache.write(cache.value, value, pos, start, padded=call.query_positions is not None)
    cache.index.copy_(end)
    cache.overflow.logical_or_(overflow)
    return q, masks.over_cache(call.spec, pos, *_cache.slot_positions(end, max_length))


def _writable(cache: KVCache, key: torch.Tensor, value: torch.Tensor) -> None:
    """Under autograd the cache takes copies to write into, the old ones left to the graph."""
    tensors = (key, value, cache.key_storage, cache.value_storage)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        cache.key_storage = cache.key_storage.clone()
        cache.value_storage = None if cache.value_storage is None else cache.value_storage.clone()


def _check_parameter_dtype(query: torch.Tensor, dtype: torch.dtype) -> None:
    """The inputs in the parameters' ``dtype`` (any under autocast)."""
    if query.dtype != dtype and not torch.is_autocast_enabled(query.device.type):
        raise TypeError(
            f"query (shape {tuple(query.shape)}) has dtype {query.dtype} but the module's parameters are {dtype}: pass "
            f"{dtype} inputs, or convert the module with .to({query.dtype})"
        )


def _check_inputs(query, key, value, embed_dim: int, kdim: int, vdim: int) -> None:
    """Ranks, dtypes, batch axes and feature sizes of the module's inputs, naming each."""
    for name, x, features, feat_name in (
        ("query", query, embed_dim, "embed_dim"),
        ("key", key, kdim, "kdim"),
        ("value", value, vdim, "vdim"),
    ):
        _checks.require_float(name, x)
        arguments.check_input_features(name, x.shape, features, feat_name)
    arguments.check_inputs_agree(("query", "key", "value"), (query.shape, key.shape, value.shape),
                                 (query.dtype, key.dtype, value.dtype))
