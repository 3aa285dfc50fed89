"""Docstring sections both twins share: ``fill`` replaces a line ``{name}`` with ``SECTIONS[name]``,
indented as the placeholder (what ``help()`` and the API reference show)."""

from __future__ import annotations

import re
from typing import TypeVar

_T = TypeVar("_T")

SECTIONS = {
    "masking_terms": """\
is_causal: a query sees the keys at positions ``<=`` its own.
query_positions, key_positions: integer ``(q_len,)``/``(kv_len,)`` or ``(batch, len)``;
  default ``arange``. With a chunk of queries at positions ``t..t+n-1`` over keys
  ``0..t+n-1``, ``is_causal`` is what decoding needs.
local_window_size: ``w`` or ``(left, right)``: a query at position ``p`` sees keys at
  positions ``p - left .. p + right``.
query_segment_ids, key_segment_ids: integer ``(batch, q_len)``/``(batch, kv_len)`` (or
  one row for every batch element), given together: a query sees keys of its own segment.
key_value_seq_lengths: integer ``(batch,)``: keys at index ``>=`` the length are padding.
attention_chunk_size: ``size``: a query sees only the keys of its own chunk of positions,
  ``q_pos // size == k_pos // size`` (Llama 4's chunked attention, with ``is_causal``).
alibi_slopes: real floating ``(heads,)`` or ``(batch, heads)``: ALiBi, each head adds
  ``-slope * |q_pos - k_pos|`` to the logits, on the positions above (flash-attn's
  convention; ``mha_spec.alibi`` computes bloom's and MPT's slopes). A constant: no gradient.""",
    "logit_terms": """\
scale: multiplies the logits; default ``1 / sqrt(head_dim)``.
logit_soft_cap: a positive finite ``cap``: the scaled logits become
  ``cap * tanh(logits / cap)`` before the bias and masks apply (as Gemma 2); None: no cap.
sinks: real floating ``(heads,)``, one learned logit per query head that joins each
  query's softmax normaliser without a value (as gpt-oss): the weights on the keys sum to
  less than 1, and a query that may attend to no key still gets 0. Differentiable.""",
    "module_terms": """\
scale: multiplies the logits; default ``1 / sqrt(head_dim)``.
logit_soft_cap: logits become ``cap * tanh(logits / cap)`` before masking (Gemma 2).
rotary: a ``RotaryEmbedding`` applied to queries and keys (after ``normalize_qk``) at their positions
  (``query_positions``/``key_positions``, default ``arange``; while decoding, the cache's).
local_window_size: the call's default window (a sliding-window layer).
attention_chunk_size: the layer's chunks of positions (Llama 4's chunked attention); also while decoding.
alibi_slopes: ALiBi, ``num_heads`` static slopes (``mha_spec.alibi``'s ``bloom_slopes``, ``mpt_slopes``): each
  head adds ``-slope * |q_pos - k_pos|`` to its logits, at the positions rotary reads; None: none.
output_gate: each head's output times the sigmoid of a learned projection of the query's input (no bias),
  before the output projection: ``"head"``, one gate per head (LFM3); ``"feature"``, one per output feature
  (Qwen3-Next, Qwen3.5); ``"head_softplus"``, ``"feature_softplus"``: the projection's softplus instead of its
  sigmoid, in float32 or wider (Laguna); None: none. PyTorch's ``gate_proj.weight``
  ``(num_heads[ * head_dim], in)``, Flax's ``gate`` kernel ``(in, num_heads[, head_dim])``; not with a latent.""",
    "ragged_attention": """\
Attention of packed ``queries`` ``(total_q, heads, head_dim)`` over ``cache``'s pages where they lie, as
``mha_spec.paged`` says, each sequence's queries padded to ``max_q_len`` (static; default ``total_q``, 1 for a
decode step); ``terms``: ``dot_product_attention``'s keywords ``mha_spec.paged.TERMS`` (a named
``implementation``: the pages gathered into a padded batch for it). Returns ``(total_q, heads, head_dim)``, 0
past ``cu_q_lens[num_seqs]``.""",
    "paged_step": """\
Args:
  inputs: ``(total_q, in_features)``, the new tokens of the sequences ``cache``'s step schedules
    (``mha_spec.paged.PageTable.append``, then this package's ``paged.schedule``), sequence after sequence.
  cache: this package's ``paged.PagedKVCache``; the tokens' keys and values are written to its pages at their
    positions (each sequence's ``kv_lens`` minus its new tokens, onwards). With a latent, its pages hold one
    key/value head of ``cache_dim``: each token's latent entry (normed latent, rotated rope key) as both.
  max_q_len: the most new tokens of one sequence (static under ``jit``; default ``total_q``, 1 for decode
    steps).

Returns:
  ``(output (total_q, out_features), cache)``: each token attends causally to its sequence's keys
  (``paged.ragged_attention``, with the layer's rotary, QK-norm, window, chunks, ALiBi, soft-cap, sinks and
  gate; with a latent, the absorbed step over the latent entries), rows past ``cu_q_lens[num_seqs]`` 0 before
  the output projection. JAX: a new cache, jittable; PyTorch: the cache written in place.""",
    "rotary_embedding": """\
``RotaryEmbedding(head_dim, *, rotary_dim=None, theta=10000.0, interleaved=False,
scaling=None, max_position_embeddings=None)``, or ``RotaryEmbedding.from_config(config)``
from a transformers ``config.json`` dict.

- ``rotary_dim``: the first ``rotary_dim`` features of each head rotate, the rest pass through
  unchanged (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``, GPT-J ``rotary_dim``).
- ``interleaved``: rotate pairs ``(2i, 2i + 1)`` (GPT-J); else pairs ``(i, i + rotary_dim / 2)``
  (rotate-half: Llama, GPT-NeoX).
- ``scaling``: None, or a mapping with ``rope_type`` and the keys transformers reads for it
  (its ``rope_parameters`` without ``rope_theta``), optional ones in brackets: ``linear`` and
  ``dynamic`` factor; ``yarn`` factor, original_max_position_embeddings [attention_factor,
  beta_fast, beta_slow, mscale, mscale_all_dim, truncate]; ``longrope`` short_factor,
  long_factor, original_max_position_embeddings [factor, attention_factor]; ``llama3``
  factor, low_freq_factor, high_freq_factor, original_max_position_embeddings. Any other key
  is an error, as is a missing one.
- ``max_position_embeddings``: read by ``dynamic``, and by ``yarn``/``longrope`` without ``factor``.

Precision: ``inv_freq`` is float32, computed as transformers computes it. For float64 ``x``
the angles, cos and sin are computed in float64 from it, more precisely than transformers
(which computes them in float32 and casts); for other dtypes they are computed in float32 as
transformers does, and the rotation is applied in float32 (bfloat16 and float16 inputs
included, where transformers rotates in the input's dtype) before casting back to ``x``'s dtype.

Immutable and hashable. Besides the call: ``inv_freq``, ``frequencies(seq_len)``,
``attention_factor``, ``rope_type`` and ``seq_len_threshold()``.""",
    "from_hf_config": """\
config: the model's ``config.json`` (dict or path); families: ``families.FAMILIES``
  (Llama, Llama 4 text, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, gpt-oss, OLMo 2, Phi-3, StableLM,
  Cohere, GPT-NeoX, GPT-J, GPT-2, BERT). Rotary embedding, scale, soft-cap, QK-norm, sinks,
  biases and the layer's sliding window or chunks are read from it; an unsupported family or
  option raises, naming it. A multimodal model's (Gemma 3, Llama 4, Qwen3.5, ...: ``records.MULTIMODAL``)
  reads as its ``text_config``.""",
    "from_hf_keys": """\
``model.safetensors.index.json`` (only the shards holding the layer are read). The
layer's keys are read under ``model.layers.{layer}.self_attn.`` (GPT-NeoX:
``gpt_neox.layers.{layer}.attention.``; GPT-2 and GPT-J: ``transformer.h.{layer}.attn.``; BERT:
``bert.encoder.layer.{layer}.attention.``, its ``output.LayerNorm`` left unread); a multimodal
model's under its text model's (Gemma 3: ``model.language_model.layers.{layer}.self_attn.``, or
``language_model.model.`` in checkpoints saved in the older layout).""",
    "from_hf_call": """\
It takes ``(*batch, length, hidden_size)``: call it with ``is_causal=True`` (a decoder's mask;
BERT's encoder takes none) and ``query_positions`` for the rotary embedding (default
``arange``); the layer's window is its default ``local_window_size``.""",
    "unused_keys": """\
bool ``(batch, kv_heads, kv_len)``: True where no query of the heads sharing a key/value
head (with ``kv_heads=1``, of any head) may attend to the key; None when none is found.

Each term is read alone (a key that only their combination excludes stays in): the dense
mask and a ``-inf`` bias over all queries, and without forming a ``(q_len, kv_len)`` matrix,
lengths, causality, windows and chunks from the extreme query positions, and segments absent
from the queries. Zeroing those keys keeps whatever they hold (NaN in padding, say) out of
outputs and every gradient: 0 * NaN is NaN in the weights-times-values product and in a
projection's weight gradient.""",
    "from_torch_mha": """\
Args:
  attn_mask: ``(q_len, kv_len)`` or ``(batch * num_heads, q_len, kv_len)``; bool (True =
    ignore) or float (added to the logits).
  key_padding_mask: ``(batch, kv_len)``; bool (True = padding) or float (added).
  num_heads: needed for a 3-d ``attn_mask``.

Returns:
  ``(mask, bias)``, each broadcasting to ``(batch, num_heads, q_len, kv_len)`` or None:
  ``mask`` bool (True = attend) from the bool parts (both must allow), ``bias`` float from
  the float parts (their sum, in the promoted dtype). Pass them as ``mask=`` and ``bias=``
  in either framework; ``(None, None)`` if both are None.""",
    "to_torch_mha_shape": """\
shape: ``(batch, num_heads, q_len, kv_len)`` of the call it is for.
bias: real floating, broadcasting to ``shape``, added to the logits; or None.""",
    "to_torch_mha_returns": """\
None when both are None; else ``(q_len, kv_len)`` when the result is the same for every
batch element and head, or ``(batch * num_heads, q_len, kv_len)``: bool (True = ignore)""",
}

_PLACEHOLDER = re.compile(r"^( *)\{(\w+)\}$", re.MULTILINE)


def expand(text: str) -> str:
    """``text`` with each ``{name}`` line replaced by ``SECTIONS[name]``, indented as the line."""

    def section(match: re.Match) -> str:
        indent, name = match.groups()
        if name not in SECTIONS:
            raise KeyError(f"no docstring section {name!r}; the sections are {sorted(SECTIONS)}")
        return "\n".join(indent + line if line else line for line in SECTIONS[name].splitlines())
    return _PLACEHOLDER.sub(section, text)


def fill(obj: _T) -> _T:
    """Decorator: ``obj``'s docstring expanded."""
    if obj.__doc__:
        obj.__doc__ = expand(obj.__doc__)
    return obj
