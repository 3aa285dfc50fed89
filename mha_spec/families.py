"""Hugging Face model families as ``Family`` records (``FAMILIES``, from transformers 5.x), and a layer's
attention options read from a ``config.json`` dict (``layer_options``); plain Python, no transformers import."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mha_spec import alibi
from mha_spec.latent import Latent
from mha_spec.layouts import GATE, renamed
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale
from mha_spec.rotary import rope_from_config, yarn_mscale

_PREFIX = "model.layers.{layer}.self_attn."
_CODEGEN_BLOCKS = 4  # CodeGenAttention's mp_num: its fused projection's blocks of heads


def _reading(*keys: str) -> Callable[[Callable], Callable]:
    """Marks a record's function with the config keys it reads (``config_keys.keys_read``)."""
    def mark(function: Callable) -> Callable:
        function.keys = keys
        return function
    return mark


@_reading("sliding_window")
def _layer_types_mistral(config: Mapping[str, Any], layers: int) -> list[str]:
    """Mistral's rule: every layer sliding when the config sets ``sliding_window``."""
    kind = "sliding_attention" if config.get("sliding_window") is not None else "full_attention"
    return [kind] * layers


def _layer_types_every(period: int, *keys: str, first: bool = False) -> Callable[[Mapping[str, Any], int], list[str]]:
    """A rule: every ``period``-th layer full (the first of ``keys`` set, else ``period``), the last of each
    period or with ``first`` the first; the others sliding."""
    def rule(config: Mapping[str, Any], layers: int) -> list[str]:
        every = next((config[key] for key in keys if key in config), period)
        shift = 0 if first else 1
        return ["sliding_attention" if (i + shift) % every else "full_attention" for i in range(layers)]
    rule.keys = keys
    return rule


@_reading("use_sliding_window", "sliding_window", "max_window_layers")
def _layer_types_qwen(config: Mapping[str, Any], layers: int) -> list[str]:
    """Qwen2's and Qwen3's rule: with ``use_sliding_window``, the layers from ``max_window_layers`` on slide."""
    sliding = config.get("use_sliding_window", False) and config.get("sliding_window") is not None
    first = config.get("max_window_layers", _QWEN_WINDOW["max_window_layers"])
    return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(layers)]


@_reading("use_sliding_window", "sliding_window", "max_window_layers")
def _layer_types_qwen2_moe(config: Mapping[str, Any], layers: int) -> list[str]:
    """Qwen2MoeConfig's rule: with ``use_sliding_window``, the even layers below ``max_window_layers`` slide."""
    sliding = config.get("use_sliding_window", False) and config.get("sliding_window") is not None
    last = config.get("max_window_layers", _QWEN_WINDOW["max_window_layers"])
    return ["sliding_attention" if sliding and i % 2 == 0 and i < last else "full_attention" for i in range(layers)]


@_reading("use_sliding_window", "sliding_window")
def _layer_types_qwen3_moe(config: Mapping[str, Any], layers: int) -> list[str]:
    """Qwen3MoeConfig's rule (no ``layer_types``, no ``max_window_layers``): with ``use_sliding_window``, every
    layer slides (its model reads ``sliding_window`` on each layer)."""
    sliding = config.get("use_sliding_window", False) and config.get("sliding_window") is not None
    return ["sliding_attention" if sliding else "full_attention"] * layers


@_reading("sliding_window", "max_window_layers")
def _layer_types_dots1(config: Mapping[str, Any], layers: int) -> list[str]:
    """Dots1Config's rule (no ``use_sliding_window``): with a ``sliding_window``, the layers from
    ``max_window_layers`` on slide."""
    first = config.get("max_window_layers")
    sliding = config.get("sliding_window") is not None and first is not None
    return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(layers)]


def _dense_prefix(config: Mapping[str, Any]) -> int:
    """Cohere2MoeConfig's dense first layers: ``first_k_dense_replace`` (a config.json's), else the leading "dense"
    entries of ``mlp_layer_types`` (which its config class saves)."""
    if "first_k_dense_replace" in config:
        return int(config["first_k_dense_replace"] or 0)
    kinds = config.get("mlp_layer_types") or []
    return next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))


@_reading("first_k_dense_replace", "mlp_layer_types", "prefix_dense_sliding_window_pattern", "sliding_window_pattern")
def _layer_types_cohere2_moe(config: Mapping[str, Any], layers: int) -> list[str]:
    """Cohere2MoeConfig's rule: the dense first layers every ``prefix_dense_sliding_window_pattern``-th full, the
    others every ``sliding_window_pattern``-th, counted from their first; the rest sliding."""
    prefix = _dense_prefix(config)
    periods = config["prefix_dense_sliding_window_pattern"], config["sliding_window_pattern"]
    return ["sliding_attention" if (j + 1) % period else "full_attention"
            for period, count in zip(periods, (prefix, layers - prefix)) for j in range(count)]


@_reading("first_k_dense_replace", "mlp_layer_types", "prefix_dense_sliding_window_pattern")
def _rope_forced_cohere2_moe(config: Mapping[str, Any], layer: int) -> bool:
    """Cohere2MoeAttention's ``force_rope``: a dense layer rotates, window or not, with a prefix pattern of 1."""
    kinds = config.get("mlp_layer_types")
    dense = kinds[layer] == "dense" if kinds else layer < _dense_prefix(config)
    return dense and config["prefix_dense_sliding_window_pattern"] == 1


@_reading("no_rope_layers")
def _layer_types_chunked(config: Mapping[str, Any], layers: int) -> list[str]:
    """Llama4TextConfig's rule: the layers that rotate are chunked."""
    return ["chunked_attention" if rope else "full_attention" for rope in config["no_rope_layers"]]


@_reading("use_sliding_window", "sliding_window", "no_rope_layers")
def _layer_types_smollm3(config: Mapping[str, Any], layers: int) -> list[str]:
    """SmolLM3Config's rule: with ``use_sliding_window``, the layers without rotary slide."""
    sliding = config.get("use_sliding_window", False) and config.get("sliding_window") is not None
    return ["sliding_attention" if sliding and not rope else "full_attention" for rope in config["no_rope_layers"]]


@_reading("attention_layers", "attention_types")
def _layer_types_gpt_neo(config: Mapping[str, Any], layers: int) -> list[str]:
    """GPTNeoConfig's ``attention_layers`` (else expanded from ``attention_types``): ``"local"`` layers slide."""
    kinds = config.get("attention_layers") or [
        kind for pattern, repeats in config.get("attention_types", [[["global", "local"], 12]])
        for _ in range(repeats) for kind in pattern]
    return ["sliding_attention" if kind == "local" else "full_attention" for kind in kinds]


@_reading("sliding_window", "local_attention", "rope_parameters", "rope_scaling", "global_rope_theta",
          "local_rope_theta")
def _standardize_modernbert(config: dict) -> dict:
    """ModernBertDecoderConfig's derived keys: the window ``local_attention // 2``, rope parameters per layer type."""
    if "sliding_window" not in config:
        local = config.get("local_attention", 128)
        config["sliding_window"] = local // 2 if local else None
    if isinstance(config["sliding_window"], int) and config["sliding_window"] < 1:  # its -1: no window
        config["sliding_window"] = None
    parameters = config.get("rope_parameters")
    if not (isinstance(parameters, Mapping) and isinstance(parameters.get("full_attention"), Mapping)):
        scaling = dict(config.pop("rope_scaling", None) or {})
        config["rope_parameters"] = {
            kind: {"rope_type": "default", **scaling, "rope_theta": config.get(key, theta)}
            for kind, key, theta in (("full_attention", "global_rope_theta", 160000.0),
                                     ("sliding_attention", "local_rope_theta", 10000.0))}
    return config


_standardize_modernbert.derives = ("sliding_window", "rope_parameters")  # not filled by a class default first


@_reading()
def _layer_types_flint(config: Mapping[str, Any], layers: int) -> list[str]:
    """FlintConfig's rule: full attention on layers 0 and 1, every 4th from 1 and the last; sliding elsewhere."""
    return ["full_attention" if i < 2 or i % 4 == 1 or i == layers - 1 else "sliding_attention" for i in range(layers)]


@_reading("attn_layer_period", "attn_layer_offset")
def _layer_types_jamba(config: Mapping[str, Any], layers: int) -> list[str]:
    """JambaConfig's (and Zamba's) rule: layer i attends when ``i % attn_layer_period == attn_layer_offset``."""
    period, offset = config["attn_layer_period"], config["attn_layer_offset"]
    return ["full_attention" if i % period == offset else "linear_attention" for i in range(layers)]


@_reading("attn_layer_indices")
def _layer_types_bamba(config: Mapping[str, Any], layers: int) -> list[str]:
    """BambaConfig's rule: the layers of ``attn_layer_indices`` attend, the others are Mamba layers."""
    indices = config.get("attn_layer_indices") or ()
    return ["full_attention" if i in indices else "linear_attention" for i in range(layers)]


_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


@_reading("layers_block_type", "hybrid_override_pattern")
def _layer_types_nemotron_h(config: Mapping[str, Any], layers: int) -> list[str]:
    """NemotronHConfig's ``layers_block_type``, else its older ``hybrid_override_pattern`` (one letter a layer)."""
    kinds = config.get("layers_block_type")
    return list(kinds) if kinds else [_NEMOTRON_PATTERN[c] for c in config["hybrid_override_pattern"]]


@_reading("block_types")
def _layer_types_recurrent_gemma(config: Mapping[str, Any], layers: int) -> list[str]:
    """RecurrentGemmaConfig's ``block_types`` repeated over the layers: its attention blocks slide."""
    kinds = (list(config["block_types"]) * layers)[:layers]
    return ["sliding_attention" if kind == "attention" else "linear_attention" for kind in kinds]


@_reading("full_attn_idxs")
def _layer_types_lfm2(config: Mapping[str, Any], layers: int) -> list[str]:
    """Lfm2Config's rule: the layers of ``full_attn_idxs`` (default: all) attend, the others convolve."""
    indices = config.get("full_attn_idxs")
    return ["full_attention" if indices is None or i in indices else "conv" for i in range(layers)]


@_reading()
def _layer_types_lfm2_moe(config: Mapping[str, Any], layers: int) -> list[str]:
    """Lfm2MoeConfig derives no layer types: its model needs the config's."""
    raise ValueError(f"config ({config.get('model_type')}) needs its layer_types (its config class derives none)")


@_reading()
def _layer_types_lfm3(config: Mapping[str, Any], layers: int) -> list[str]:
    """Lfm3Config's rule: of each 4 layers the third full, the first sliding (not layer 0), the others convolve."""
    return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i else "conv"
            for i in range(layers)]


@_reading()
def _layer_types_mamba(config: Mapping[str, Any], layers: int) -> list[str]:
    """GraniteMoeHybridConfig's default: every layer a Mamba layer."""
    return ["linear_attention"] * layers


@_reading("linear_attn_config")
def _layer_types_kimi_linear(config: Mapping[str, Any], layers: int) -> list[str]:
    """KimiLinearConfig's rule: ``linear_attn_config``'s ``full_attn_layers`` (counted from 1) attend, else every 4th
    layer from layer 4 (counted from 0); the others are delta attention."""
    full = (config.get("linear_attn_config") or {}).get("full_attn_layers")
    return ["full_attention" if (i + 1 in full if full is not None else i and i % 4 == 0) else "linear_attention"
            for i in range(layers)]


@_reading()
def _layer_types_olmo_hybrid(config: Mapping[str, Any], layers: int) -> list[str]:
    """OlmoHybridConfig's rule: every 4th layer attends (the last at least), the others are linear attention."""
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    return kinds if "full_attention" in kinds else kinds[:-1] + ["full_attention"]


@_reading("layer_types", "sliding_window")
def _standardize_minimax(config: dict) -> dict:
    """MiniMaxConfig's layer types (every 2nd layer linear attention); its model's one mask slides every attention
    layer when the config sets ``sliding_window``."""
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention"
                                          for i in range(config["num_hidden_layers"])]
    sliding = config.get("sliding_window") is not None
    config["layer_types"] = ["sliding_attention" if sliding and kind in ATTENTION_TYPES else kind for kind in kinds]
    return config


_standardize_minimax.derives = ("layer_types",)


@_reading("position_embedding_type")
def _rope_granitemoehybrid(config: Mapping[str, Any]) -> bool:
    """GraniteMoeHybridModel's rotary embedding: only with ``position_embedding_type="rope"``."""
    return config.get("position_embedding_type") == "rope"


@_reading("rope_parameters")
def _rope_olmo_hybrid(config: Mapping[str, Any]) -> bool:
    """OlmoHybridModel's rotary embedding: only with rope parameters that hold a ``rope_theta``."""
    parameters = config.get("rope_parameters")
    return isinstance(parameters, Mapping) and parameters.get("rope_theta") is not None


@_reading("layers_block_type", "attn_layer_period", "attn_layer_offset", "attention_hidden_size", "attention_head_dim")
def _standardize_zamba(config: dict) -> dict:
    """ZambaConfig's derived keys: its block's input width (default ``2 * hidden_size``) and head_dim (default
    ``2 * hidden_size // heads``); the layer types ``layers_block_type``, else its rule (layer 2 and each layer
    ``3 + i`` with ``i % attn_layer_period == attn_layer_offset``), its "hybrid" layers (the shared block beside a
    Mamba layer) attending."""
    config["attention_hidden_size"] = config.get("attention_hidden_size") or 2 * config["hidden_size"]
    config["head_dim"] = config.get("attention_head_dim") or config["attention_hidden_size"] // config[
        "num_attention_heads"]
    kinds = config.get("layers_block_type") or ["linear_attention", "linear_attention", "hybrid"] + [
        "hybrid" if i % config["attn_layer_period"] == config["attn_layer_offset"] else "linear_attention"
        for i in range(config["num_hidden_layers"] - 3)]
    config["layer_types"] = ["full_attention" if kind == "hybrid" else _LEGACY_TYPES.get(kind, kind) for kind in kinds]
    return config


_standardize_zamba.derives = ("layer_types", "attention_hidden_size", "head_dim")


@_reading("full_attention_interval")
def _layer_types_qwen3_next(config: Mapping[str, Any], layers: int) -> list[str]:
    """Qwen3NextConfig's (and Qwen3.5's) rule: every ``full_attention_interval``-th layer (default 4) attends, the
    others are gated delta nets."""
    interval = config.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]


@_reading("query_pre_attn_scalar")
def _scale_gemma(config: Mapping[str, Any], head_dim: int, layer: int) -> float:
    return config.get("query_pre_attn_scalar", head_dim) ** -0.5


@_reading("scale_attn_weights", "scale_attn_by_inverse_layer_idx")
def _scale_gpt2(config: Mapping[str, Any], head_dim: int, layer: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if config.get("scale_attn_weights", True) else 1.0
    return scale / (layer + 1) if config.get("scale_attn_by_inverse_layer_idx", False) else scale


@_reading("attention_multiplier")
def _scale_granite(config: Mapping[str, Any], head_dim: int, layer: int) -> float:
    return float(config.get("attention_multiplier", 1.0))  # GraniteAttention: the scale itself


@_reading("key_multiplier")
def _scale_falcon_h1(config: Mapping[str, Any], head_dim: int, layer: int) -> float:
    """FalconH1Attention's keys times ``key_multiplier``: the logits' scale times it."""
    return float(config.get("key_multiplier") or 1.0) / math.sqrt(head_dim)


@_reading("new_decoder_architecture", "num_kv_heads", "multi_query")
def _multi_query_kv_heads(config: Mapping[str, Any]) -> int | None:
    """GPT-BigCode's and Falcon's key heads: ``num_kv_heads`` (new_decoder_architecture), 1 (multi_query) or None."""
    if config.get("new_decoder_architecture"):
        return config.get("num_kv_heads")
    return 1 if config.get("multi_query", True) else None


@_reading("softmax_scale")
def _scale_mpt(config: Mapping[str, Any], head_dim: int, layer: int) -> float:
    scale = config.get("softmax_scale")  # MptAttention: attn_config's softmax_scale, else 1 / sqrt(head_dim)
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


@_reading("alibi", "alibi_bias_max")
def _alibi_mpt(config: Mapping[str, Any], heads: int, head_dim: int) -> tuple[float, ...] | None:
    """MPT's slopes (``alibi_bias_max``), added to the scaled logits; None when ``alibi`` is off."""
    return alibi.mpt_slopes(heads, config.get("alibi_bias_max", 8)) if config.get("alibi", True) else None


@_reading("alibi")
def _alibi_falcon(config: Mapping[str, Any], heads: int, head_dim: int) -> tuple[float, ...] | None:
    """Falcon's ALiBi slopes (None without ``alibi``): bloom's in bfloat16, over ``sqrt(head_dim)``."""
    slopes = alibi.bloom_slopes(heads) if config.get("alibi") else None
    return None if slopes is None else tuple(_bfloat16(slope) / math.sqrt(head_dim) for slope in slopes)


def _bfloat16(x: float) -> float:
    """``x`` rounded to bfloat16 (nearest, ties to even) as torch rounds a float32."""
    bits = int(struct.unpack("<I", struct.pack("<f", x))[0])
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@_reading("position_embedding_type")
def _check_bert(config: Mapping[str, Any], layer: int) -> None:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"config ({config.get('model_type')}) sets "
                         f"position_embedding_type={config['position_embedding_type']!r}, "
                         "which this attention does not compute (only 'absolute' embeddings, added before it)")


@_reading("rope_parameters", "rope_scaling")
def _check_norm_after_rotation(config: Mapping[str, Any], layer: int) -> None:
    """NanoChat's weightless norm after the rotation: it undoes a rotary's attention factor (yarn's, longrope's),
    which this attention, normalizing before the rotation, keeps."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind in ("yarn", "longrope"):
        raise ValueError(f"config ({config.get('model_type')}) sets rope_parameters rope_type={kind!r}, which this "
                         "attention does not compute: its norm after the rotation undoes the rotary's attention factor")


@_reading("no_rope_layers", "attn_temperature_tuning", "attn_scale", "floor_scale")
def _query_scale_llama4(config: Mapping[str, Any], layer: int) -> QueryScale | None:
    """Llama 4's temperature tuning: its NoPE layers' queries scaled by ``attn_scale``, ``floor_scale``."""
    if config["no_rope_layers"][layer] or not config.get("attn_temperature_tuning"):
        return None
    return QueryScale(float(config["attn_scale"]), float(config["floor_scale"]), 1.0)


@_reading("rope_parameters")
def _query_scale_ministral3(config: Mapping[str, Any], layer: int) -> QueryScale | None:
    """Ministral 3's queries scaled by the rope parameters' ``llama_4_scaling_beta`` over their
    ``original_max_position_embeddings``."""
    parameters = config.get("rope_parameters") or {}
    beta = parameters.get("llama_4_scaling_beta")
    if not beta:
        return None
    return QueryScale(float(beta), float(parameters["original_max_position_embeddings"]), 0.0)


@dataclass(frozen=True)
class Family:
    """How transformers' attention of one ``model_type`` reads its config and saves its weights. A bias, head
    count or flag given as a string is the config key that holds it; ``refuses``: ``(config key, feature)`` pairs,
    a key set (in the config or its rope parameters) naming a feature this attention does not compute."""

    prefix: str = _PREFIX  # layer N's attention in the checkpoint, ``{layer}`` for N
    layout: str = "hf"  # the loaders' layout; "gpt_neox", "gpt2", "falcon": fused weights split here
    qkv_bias: bool | str = "attention_bias"
    out_bias: bool | str | Callable[[Mapping[str, Any], int], bool] = "attention_bias"  # or (config, layer) -> it
    bias_default: bool = False  # a bias key's value where the config leaves it out
    kv_heads: str | Callable[[Mapping[str, Any]], int] | None = "num_key_value_heads"  # None: as many as heads
    reads_head_dim: bool = True  # False: head_dim is hidden_size // heads whatever the config says
    scale: float | Callable[[Mapping[str, Any], int, int], float] | None = None  # or (config, head_dim, layer) -> it
    soft_cap: str | None = None  # the key of the logits' soft-cap
    sinks: bool = False
    alibi: Callable[[Mapping[str, Any], int, int], tuple[float, ...] | None] | None = None  # (config, heads, head_dim)
    qk_norm: QKNorm | None = None  # with its default eps
    qk_norm_flag: str | None = None  # the key that switches ``qk_norm`` on; None: always on
    qk_norm_eps: str = "rms_norm_eps"
    layer_types: Callable[[Mapping[str, Any], int], list[str]] | None = None  # where no layer_types; None: all full
    window_flag: str | None = None  # a key that must be set for sliding layers to slide
    window_key: str = "sliding_window"  # the key of the sliding layers' window (keys a query sees, itself included)
    rope: bool | Callable[[Mapping[str, Any]], bool] = True  # or (config) -> whether its model rotates
    rope_interleaved: bool = False  # rotates pairs (2i, 2i + 1), not the halves (i, i + rotary_dim / 2)
    rope_default: tuple[tuple[str, ...], str, Any] | None = None  # (keys, any of which gives it; key set; value)
    no_rope_layers: bool = False  # reads ``no_rope_layers`` (default: every ``no_rope_layer_interval``-th)
    rope_sliding_only: bool = False  # with a ``sliding_window``, only the sliding layers rotate
    rope_windowed_only: bool = False  # only the layers with a window rotate (none without a ``sliding_window``)
    layer_rope_theta: str | None = None  # the key of each layer's rotary base (0: the layer does not rotate)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the config class's, where config.json is silent
    reads: tuple[str, ...] = ()  # keys of ``_REFUSED`` that it computes
    refuses: tuple[tuple[str, str], ...] = ()
    check: Callable[[Mapping[str, Any], int], None] | None = None  # raises on what it cannot build
    causal: bool | str = True  # or the key that makes an encoder a decoder
    ignore: tuple[str, ...] = ()  # keys under the prefix that belong to the block, not the attention
    buffers: tuple[str, ...] = ()  # keys under the prefix that hold no weight (older files' buffers)
    fused: tuple[str, str] | None = None  # the fused q/k/v and output projections' names
    per_head_norms: Mapping[str, str] | None = None  # norm -> the key start of its per-head weights
    head_norm_matrix: bool = False  # a per-head norm saved as a (heads, head_dim) matrix
    renames: Mapping[str, str] = field(default_factory=dict)  # a key's start under the prefix -> the layout's
    aliases: Mapping[str, str] = field(default_factory=dict)  # our size names -> the config's (XGLM's)
    nested: str | None = None  # a sub-config whose keys are read as the config's own (MPT's attn_config)
    standardize: Callable[[dict], dict] | None = None  # fills in keys its config class derives (a copy)
    latent: bool = False  # multi-head latent attention (DeepSeek-V3's), read by _with_latent
    latent_interleave: bool | str = False  # a latent layer's rotary pairs (2i, 2i + 1), or the key that says so
    clip_qkv: str | None = None  # the key of the projections' clamp (its value falsy: none)
    query_scale: Callable[[Mapping[str, Any], int], QueryScale | None] | None = None  # (config, layer) -> it
    qk_norm_rope_only: bool = False  # the QK-norm only on the layers that rotate
    rope_forced: Callable[[Mapping[str, Any], int], bool] | None = None  # (config, layer): it rotates whatever else
    rope_ignore: tuple[str, ...] = ()  # keys of the rope parameters that are not the rotary's (read elsewhere)
    rope_fixed: Mapping[str, Any] | None = None  # rope parameters its model uses whatever the config says
    layer_count: Callable[[Mapping[str, Any]], int] | None = None  # where the model's is not num_hidden_layers
    rope_reversed: bool = False  # its rotate_half is (x2, -x1): pairs turn by -angle (read by ``layer_keys``)
    output_gate: str | None = None  # "head" or "feature": a sigmoid gate on each head's output (``output_gate``)
    output_gate_flag: str | None = None  # the key that switches ``output_gate`` on; None: always on
    query_gate: bool = False  # the gate's rows after each head's query rows in q_proj (Qwen3-Next's)
    rope_types: tuple[str, ...] | None = None  # only the layers of these types rotate (AFMoE's sliding ones)
    input_size: str | None = None  # the key of the projections' input width, where not hidden_size
    tied_layers: bool = False  # every attention layer holds the first's weights (tied: saved once, under its prefix)


def _mha(prefix: str, **fields: Any) -> Family:
    """An older family's record: one key head per query head, head_dim ``hidden_size // heads``."""
    return Family(prefix=prefix, reads_head_dim=False, **{"kv_heads": None, **fields})


def _bert_like(model: str) -> Family:
    """BERT's self-attention and output projection in a model whose base is saved as ``model``."""
    return _mha(model + ".encoder.layer.{layer}.attention.", layout="bert", qkv_bias=True, out_bias=True, rope=False,
                causal="is_decoder", check=_check_bert, ignore=("output.LayerNorm",))


def _learned_positions(prefix: str, bias: bool | str = True) -> Family:
    """BART's and OPT's self-attention: positions added before it, ``out_proj`` for the output."""
    return _mha(prefix, qkv_bias=bias, out_bias=bias, bias_default=True, rope=False, renames={"out_proj.": "o_proj."})


def _latent_family(kv_lora_rank: int, q_lora_rank: int | None, dims: tuple[int, int, int | None],
                   rope_interleave: bool | str) -> Family:
    """A latent attention record with its config's defaults; ``dims``: rope, nope and v head dims."""
    defaults = dict(kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_rope_head_dim=dims[0],
                    qk_nope_head_dim=dims[1], v_head_dim=dims[2])
    return Family(layout="mla", latent=True, latent_interleave=rope_interleave, defaults=defaults)


# Qwen2Config's (and Qwen3's, Qwen2-MoE's, Qwen3-MoE's) window defaults, where a config leaves them out
_QWEN_WINDOW = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
# Llama4TextConfig's defaults, where a config leaves them out
_LLAMA4 = dict(use_qk_norm=True, attention_chunk_size=8192, no_rope_layer_interval=4, attn_temperature_tuning=True,
               attn_scale=0.1, floor_scale=8192)
# Ministral3Config's rope parameters, where a config leaves them out
_MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
                        beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)
_QK_LAYERNORM = (("qk_layernorm", "QK LayerNorm with bias"),)
_HALF_ROTARY = (("partial_rotary_factor",), "partial_rotary_factor", 0.5)  # GLM's default: half of each head rotates
_ROTARY_DIM = (("rotary_dim",), "rotary_dim", 64)
# GPT-J's and CodeGen's create_sinusoidal_positions: base 10000, no scaling, whatever rope_parameters say
_SINUSOIDAL = dict(rope_type="default", rope_theta=10000.0)
_RMS_PER_HEAD = QKNorm("rms", True, 1e-6)
_RMS = QKNorm("rms", False, 1e-6)  # over the whole projection
_GPT2_PREFIX = "transformer.h.{layer}.attn."
_FALCON_PREFIX = "transformer.h.{layer}.self_attention."
_GPT_BUFFERS = ("bias", "masked_bias")
_NEOX_FUSED = ("query_key_value", "dense")
_PATTERN_KEYS = ("sliding_window_pattern", "_sliding_window_pattern")  # Gemma 3's and Cohere 2's period

# model_type -> its record (model types with the same layer share one)
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(("llama", "gemma", "arcee", "internlm3", "iquestcoder", "jais2"), Family()),
    **dict.fromkeys(("mistral", "mixtral", "ministral", "phimoe"), Family(layer_types=_layer_types_mistral)),
    "cwm": Family(layer_types=_layer_types_every(4, first=True)),  # CwmConfig: every 4th layer from 0 full
    "qwen3": Family(qk_norm=_RMS_PER_HEAD, layer_types=_layer_types_qwen, defaults=_QWEN_WINDOW),
    "qwen3_moe": Family(qk_norm=_RMS_PER_HEAD, layer_types=_layer_types_qwen3_moe, defaults=_QWEN_WINDOW),
    "dots1": Family(qk_norm=_RMS_PER_HEAD, layer_types=_layer_types_dots1,
                    defaults=dict(sliding_window=4096, max_window_layers=62)),
    **dict.fromkeys(("gemma2", "vaultgemma"), Family(scale=_scale_gemma, soft_cap="attn_logit_softcapping",
                                                     layer_types=_layer_types_every(2))),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "hyperclovax"), Family(scale=_scale_granite)),
    **dict.fromkeys(("glm", "glm4"), Family(rope_interleaved=True, out_bias=False, rope_default=_HALF_ROTARY)),
    **dict.fromkeys(("ernie4_5", "ernie4_5_moe"),
                    Family(rope_interleaved=True, qkv_bias="use_bias", out_bias="use_bias")),
    **dict.fromkeys(("exaone4", "exaone_moe"), Family(
        qkv_bias=False, out_bias=False, qk_norm=_RMS_PER_HEAD, layer_types=_layer_types_every(4, *_PATTERN_KEYS),
        rope_sliding_only=True)),
    # Kolibri1Config: every 5th layer full
    "kolibri1": Family(qkv_bias=False, out_bias=False, qk_norm=_RMS_PER_HEAD, layer_types=_layer_types_every(5),
                       rope_sliding_only=True),
    "cohere2": Family(rope_interleaved=True, layer_types=_layer_types_every(4, *_PATTERN_KEYS), rope_sliding_only=True,
                      rope_default=(("rope_theta",), "rope_theta", 10000.0)),
    # its first layers (a dense MLP) in a pattern of their own, rotating whatever their window with a pattern of 1
    "cohere2_moe": Family(rope_interleaved=True, layer_types=_layer_types_cohere2_moe, rope_sliding_only=True,
                          rope_forced=_rope_forced_cohere2_moe, rope_default=(("rope_theta",), "rope_theta", 10000.0),
                          defaults=dict(sliding_window_pattern=4, prefix_dense_sliding_window_pattern=1)),
    **dict.fromkeys(("olmo2", "flex_olmo"), Family(qk_norm=_RMS)),
    **dict.fromkeys(("apertus", "mellum", "hy_v3"), Family(qk_norm=_RMS_PER_HEAD)),
    "solar_open": Family(out_bias=False),
    "helium": Family(rope_interleaved=True, out_bias=False),
    "qwen2": Family(qkv_bias=True, out_bias=False, layer_types=_layer_types_qwen, defaults=_QWEN_WINDOW),
    "qwen2_moe": Family(qkv_bias="qkv_bias", out_bias=False, bias_default=True, layer_types=_layer_types_qwen2_moe,
                        defaults=_QWEN_WINDOW),
    # attn_logit_softcapping: Gemma3TextConfig keeps it, Gemma3Attention (transformers 5.x) never applies it
    "gemma3_text": Family(scale=_scale_gemma,
                          qk_norm=QKNorm("rms", True, 1e-6, offset=1.0),
                          layer_types=_layer_types_every(6, *_PATTERN_KEYS)),
    "gpt_oss": Family(sinks=True, layer_types=_layer_types_every(2)),
    "llama4_text": Family(rope_interleaved=True, layer_types=_layer_types_chunked, no_rope_layers=True,
                          defaults=_LLAMA4, reads=("attention_chunk_size", "use_qk_norm"),
                          query_scale=_query_scale_llama4,
                          # Llama4TextL2Norm on the rotary layers, after the rotation: weightless, per head, it
                          # commutes with the rotation and is computed before it here
                          qk_norm=QKNorm("rms", True, 1e-5, weight=False), qk_norm_flag="use_qk_norm",
                          qk_norm_rope_only=True),
    "phi3": Family(layout="fused_qkv", qkv_bias=False, out_bias=False, layer_types=_layer_types_mistral),
    "ministral3": Family(layer_types=_layer_types_mistral, query_scale=_query_scale_ministral3,
                         rope_ignore=("llama_4_scaling_beta", "max_position_embeddings"),
                         defaults=dict(rope_parameters=_MINISTRAL3_ROPE)),
    "starcoder2": Family(qkv_bias="use_bias", out_bias="use_bias", bias_default=True, layer_types=_layer_types_mistral),
    "olmo": Family(clip_qkv="clip_qkv"),
    "olmo3": Family(qk_norm=_RMS, layer_types=_layer_types_every(4)),
    "olmoe": Family(qk_norm=QKNorm("rms", False, 1e-5), clip_qkv="clip_qkv"),
    "seed_oss": Family(out_bias="attention_out_bias"),
    "smollm3": Family(layer_types=_layer_types_smollm3, window_flag="use_sliding_window", no_rope_layers=True,
                      defaults=dict(no_rope_layer_interval=4)),
    "nemotron": Family(rope_default=_HALF_ROTARY),
    "glm4_moe": Family(out_bias=False, qk_norm=_RMS_PER_HEAD, qk_norm_flag="use_qk_norm", reads=("use_qk_norm",),
                       rope_default=_HALF_ROTARY),
    "minimax_m2": Family(qkv_bias=False, out_bias=False, qk_norm=_RMS),
    # its QK-norm a LayerNorm per head, each head's weight its own key (joined by ``layer_keys``)
    "stablelm": Family(qkv_bias="use_qkv_bias", out_bias=False, reads_head_dim=False,
                       qk_norm=QKNorm("layer", True, 1e-5, per_head_scale=True), qk_norm_flag="qk_layernorm",
                       qk_norm_eps="layer_norm_eps",
                       rope_default=(("partial_rotary_factor", "rotary_pct"), "partial_rotary_factor", 0.25),
                       per_head_norms={"q_norm": "q_layernorm.norms.", "k_norm": "k_layernorm.norms."}),
    "cohere": Family(rope_interleaved=True, qk_norm=QKNorm("layer", True, 1e-5, per_head_scale=True),
                     qk_norm_flag="use_qk_norm", qk_norm_eps="layer_norm_eps",
                     rope_default=(("rope_theta",), "rope_theta", 500000.0), reads=("use_qk_norm",),
                     head_norm_matrix=True),
    "phi": Family(qkv_bias=True, out_bias=True, renames={"dense.": "o_proj."},
                  rope_default=_HALF_ROTARY, refuses=_QK_LAYERNORM),
    # sinks (an extra softmax logit per head), RMS QK-norm per head, rotary on the sliding layers only
    "flint": Family(sinks=True, qk_norm=_RMS_PER_HEAD, layer_types=_layer_types_flint, rope_windowed_only=True),
    # sinks (as a scale of the output: sigmoid(logsumexp - sink)), Granite's scale, each layer's rotary base
    "granite_swa": Family(sinks=True, scale=_scale_granite, layer_types=_layer_types_every(4, first=True),
                          layer_rope_theta="layer_rope_theta"),
    "gptj": _mha(_GPT2_PREFIX, layout="mha_torch", qkv_bias=False, out_bias=False, rope_interleaved=True,
                 rope_default=_ROTARY_DIM, buffers=_GPT_BUFFERS, rope_fixed=_SINUSOIDAL),
    # heads interleaved in one fused weight, read by ``layer_state``; a quarter of each head rotates
    "gpt_neox": _mha("gpt_neox.layers.{layer}.attention.", layout="gpt_neox", bias_default=True, fused=_NEOX_FUSED,
                     buffers=(*_GPT_BUFFERS, "rotary_emb.inv_freq"),
                     rope_default=(("rotary_pct", "partial_rotary_factor"), "rotary_pct", 0.25)),
    "persimmon": _mha(_PREFIX, layout="gpt_neox", qkv_bias=True, out_bias=True,
                      fused=_NEOX_FUSED, defaults=dict(qk_layernorm=True), rope_default=_HALF_ROTARY,
                      refuses=_QK_LAYERNORM),
    # transposed ``Conv1D`` weights, read by ``layer_state``; no rotary embedding
    "gpt2": _mha(_GPT2_PREFIX, layout="gpt2", qkv_bias=True, out_bias=True, scale=_scale_gpt2, rope=False,
                 buffers=_GPT_BUFFERS, fused=("c_attn", "c_proj")),
    # an encoder: bidirectional unless the config makes it a decoder; the keys as BERT's task
    # models save them (``bert.`` before the base model's names)
    **{name: _bert_like(model) for name, model in (
        ("bert", "bert"), ("bert-generation", "bert"), ("camembert", "roberta"), ("data2vec-text", "data2vec_text"),
        ("electra", "electra"), ("ernie", "ernie"), ("rembert", "rembert"), ("roberta", "roberta"),
        ("roc_bert", "roc_bert"), ("xlm-roberta", "roberta"), ("xmod", "roberta"))},
    "opt": _learned_positions("model.decoder.layers.{layer}.self_attn.", "enable_bias"),
    "biogpt": _learned_positions("biogpt.layers.{layer}.self_attn."),
    "xglm": replace(_learned_positions(_PREFIX), aliases=dict(
        hidden_size="d_model", num_attention_heads="attention_heads", num_hidden_layers="num_layers")),
    "falcon": _mha(_FALCON_PREFIX, layout="falcon", qkv_bias="bias", out_bias="bias", kv_heads=_multi_query_kv_heads,
                   fused=_NEOX_FUSED, defaults=dict(multi_query=True), alibi=_alibi_falcon),
    # ALiBi; each head's q, k, v rows together in its fused query_key_value (GPT-NeoX's layout)
    "bloom": _mha(_FALCON_PREFIX, layout="gpt_neox", qkv_bias=True, out_bias=True, rope=False,
                  alibi=_reading()(lambda config, heads, head_dim: alibi.bloom_slopes(heads)), fused=_NEOX_FUSED),
    # ALiBi; [q; k; v] in one Wqkv; its attention options in attn_config
    "mpt": _mha("transformer.blocks.{layer}.attn.", layout="fused_qkv", qkv_bias=False, out_bias=False,
                scale=_scale_mpt, rope=False, alibi=_alibi_mpt, nested="attn_config",
                renames={"Wqkv.": "qkv_proj.", "out_proj.": "o_proj."},
                clip_qkv="clip_qkv", refuses=(("qk_ln", "QK LayerNorm"), ("prefix_lm", "a prefix-LM mask"),
                         ("attn_uses_sequence_id", "a mask from the content")),
                aliases=dict(hidden_size="d_model", num_attention_heads="n_heads", num_hidden_layers="n_layers",
                             max_position_embeddings="max_seq_len")),
    # [q; k; v] in one Wqkv (key heads attn_config's kv_n_heads), clamped by attn_config's clip_qkv
    "dbrx": _mha("transformer.blocks.{layer}.norm_attn_norm.attn.", layout="fused_qkv", qkv_bias=False,
                 out_bias=False, kv_heads="kv_n_heads", nested="attn_config", clip_qkv="clip_qkv",
                 renames={"Wqkv.": "qkv_proj.", "out_proj.": "o_proj."},
                 aliases=dict(hidden_size="d_model", num_attention_heads="n_heads", num_hidden_layers="n_layers",
                              max_position_embeddings="max_seq_len")),
    # sliding layers (local_attention // 2 keys), rope parameters per layer type, the output projection Wo
    "modernbert-decoder": _mha("model.layers.{layer}.attn.", standardize=_standardize_modernbert,
                               layer_types=_layer_types_every(3, "global_attn_every_n_layers", first=True),
                               renames={"Wo.": "o_proj."}),
    # its own projection names, biases, positions added before it; causal when ``causal`` is set
    "xlm": _mha("transformer.attentions.{layer}.", qkv_bias=True, out_bias=True, rope=False, causal="causal",
                renames={"q_lin.": "q_proj.", "k_lin.": "k_proj.", "v_lin.": "v_proj.", "out_lin.": "o_proj."},
                aliases=dict(hidden_size="emb_dim", num_attention_heads="n_heads", num_hidden_layers="n_layers")),
    # GPT-NeoX's fused layout without biases; the last layer's output bias a key of its own (dense_bias)
    "gpt_neox_japanese": _mha("gpt_neox_japanese.layers.{layer}.attention.", layout="gpt_neox", qkv_bias=False,
                              out_bias=_reading()(lambda config, layer: layer == config["num_hidden_layers"] - 1),
                              fused=_NEOX_FUSED, renames={"dense_bias": "dense.bias"}),
    # GPT-2's layout and scale under its own prefix
    "openai-gpt": _mha(_GPT2_PREFIX, layout="gpt2", qkv_bias=True, out_bias=True, rope=False, buffers=("bias",),
                       fused=("c_attn", "c_proj")),
    # separate projections of its own names, positions added before it
    "ctrl": _mha("transformer.h.{layer}.multi_head_attention.", qkv_bias=True, out_bias=True, rope=False,
                 renames={"Wq.": "q_proj.", "Wk.": "k_proj.", "Wv.": "v_proj.", "dense.": "o_proj."}),
    # logits not scaled; its "local" layers see window_size keys, themselves included
    "gpt_neo": _mha("transformer.h.{layer}.attn.attention.", layout="mha_torch", qkv_bias=False, out_bias=True,
                    scale=1.0, rope=False, layer_types=_layer_types_gpt_neo, window_key="window_size",
                    buffers=_GPT_BUFFERS,
                    aliases=dict(num_attention_heads="num_heads", num_hidden_layers="num_layers")),
    # one fused c_attn (a Linear): [q; k; v] with one key head (multi_query), else each head's q, k, v together
    "gpt_bigcode": _mha(_GPT2_PREFIX, layout="gpt_bigcode", qkv_bias=True, out_bias=True,
                        kv_heads=_multi_query_kv_heads, scale=_scale_gpt2, rope=False, buffers=_GPT_BUFFERS,
                        fused=("c_attn", "c_proj")),
    # GPT-J's rotary (rotary_dim, pairs) and a fused qkv_proj in 4 blocks of (q, v, k), read by ``layer_state``
    "codegen": _mha(_GPT2_PREFIX, layout="codegen", qkv_bias=False, out_bias=False, rope_interleaved=True,
                    rope_default=_ROTARY_DIM, buffers=_GPT_BUFFERS, fused=("qkv_proj", "out_proj"),
                    rope_fixed=_SINUSOIDAL),
    # its rotation by -angle loaded as one by +angle (``rope_reversed``); a weightless RMS norm per head after it,
    # which the rotation and the negations commute with, computed before it here
    "nanochat": Family(qk_norm=QKNorm("rms", True, 1e-6, weight=False), rope_reversed=True,
                       check=_check_norm_after_rotation),
    # gated softmax layers of hybrids: Qwen3-Next's q_proj holds each head's gate rows after its query rows;
    # Gemma 3's RMS QK-norm (1 + weight), a quarter of each head rotating
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), Family(
        qkv_bias=False, out_bias=False, qk_norm=QKNorm("rms", True, 1e-6, offset=1.0), output_gate="feature",
        query_gate=True, layer_types=_layer_types_qwen3_next, refuses=(("attention_bias", "a bias on the gate"),),
        rope_default=(("partial_rotary_factor",), "partial_rotary_factor", 0.25))),
    # a sigmoid gate on each output feature (gate_proj), RMS QK-norm per head, rotary on the sliding layers only
    "afmoe": Family(qk_norm=_RMS_PER_HEAD, output_gate="feature",
                    layer_types=_layer_types_every(4, "global_attn_every_n_layers"), rope_types=("sliding_attention",)),
    # the softmax attention layers of hybrid models (their other layers refused by kind)
    "recurrent_gemma": Family(prefix="model.layers.{layer}.temporal_block.", out_bias=True, reads_head_dim=False,
                              layer_types=_layer_types_recurrent_gemma, window_key="attention_window_size",
                              rope_default=_HALF_ROTARY),
    "lfm2": Family(qkv_bias=False, out_bias=False, qk_norm=_RMS_PER_HEAD, qk_norm_eps="norm_eps",
                   layer_types=_layer_types_lfm2,
                   renames={"out_proj.": "o_proj.", "q_layernorm.": "q_norm.", "k_layernorm.": "k_norm."}),
    # a sigmoid gate on each head's output (g_proj), its full layers' rotary "proportional"
    "lfm3": Family(qk_norm=_RMS_PER_HEAD, qk_norm_eps="norm_eps", output_gate="head",
                   output_gate_flag="use_attention_gate", layer_types=_layer_types_lfm3,
                   renames={"g_proj.": "gate_proj."}),
    "minimax": Family(qkv_bias=False, out_bias=False, standardize=_standardize_minimax),
    "olmo_hybrid": Family(qk_norm=_RMS, layer_types=_layer_types_olmo_hybrid, rope=_rope_olmo_hybrid),
    "jamba": Family(qkv_bias=False, out_bias=False, rope=False, layer_types=_layer_types_jamba),
    "bamba": Family(layer_types=_layer_types_bamba),
    "nemotron_h": Family(prefix="model.layers.{layer}.mixer.", qkv_bias=False, out_bias=False, rope=False,
                         layer_types=_layer_types_nemotron_h,
                         layer_count=_reading()(lambda config: len(_layer_types_nemotron_h(config, 0)))),
    "granitemoehybrid": Family(scale=_scale_granite, rope=_rope_granitemoehybrid, layer_types=_layer_types_mamba),
    "falcon_h1": Family(scale=_scale_falcon_h1),
    # rope parameters per layer type (None: the type does not rotate); its M-RoPE sections, over a text's three
    # equal rows of positions, the plain rotation
    "cohere_compass_text": Family(reads_head_dim=False, rope_ignore=("mrope_section", "mrope_interleaved")),
    # one attention block shared by its hybrid layers, over [hidden; embeddings] (attention_hidden_size), scaled by
    # (head_dim / 2) ** -0.5
    "zamba": Family(prefix="model.layers.{layer}.shared_transf.self_attn.", qkv_bias=False, out_bias=False, rope=False,
                    scale=_reading()(lambda config, head_dim, layer: (head_dim / 2) ** -0.5),
                    standardize=_standardize_zamba, input_size="attention_hidden_size", tied_layers=True),
    # DeepSeek-V3's attention and the classes copied from it
    **dict.fromkeys(("deepseek_v3", "youtu", "axk1"), _latent_family(512, 1536, (64, 128, 128), "rope_interleave")),
    # its rotation complex products of the pairs (2i, 2i + 1) by e^(i angle): interleaved
    "deepseek_v2": _latent_family(512, 1536, (64, 128, 128), True),
    # its latent layers without rotary (the keys' rope part shared, not rotated), scaled by qk_head_dim ** -0.5
    "kimi_linear": replace(_latent_family(512, 1536, (64, 128, 128), False), rope=False,
                           layer_types=_layer_types_kimi_linear),
    "glm4_moe_lite": _latent_family(512, 768, (64, 192, 256), "rope_interleave"),
    "minicpm3": _latent_family(256, 768, (32, 64, None), False),  # rotate_half; v_head_dim: hidden // heads
}
FAMILIES["gpt-sw3"] = FAMILIES["gpt2"]  # GPT-2's model, its own tokenizer
FAMILIES["lfm2_moe"] = replace(FAMILIES["lfm2"], layer_types=_layer_types_lfm2_moe)
FAMILIES["granitemoe_swa"] = FAMILIES["granite_swa"]  # Granite SWA's attention with MoE blocks
# GPT-2's configs name the sizes their own way (transformers' attribute_map)
_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
            "max_position_embeddings": "n_positions"}
# Options that change the attention's function: refused by name by the families that do not read them.
_REFUSED = {
    "use_qk_norm": "Llama 4's QK-norm", "use_bidirectional_attention": "bidirectional attention",
    "attention_chunk_size": "chunked attention (Llama 4)",
}


@dataclass(frozen=True)
class LayerOptions:
    """What one layer's attention needs, in neutral words; each package builds its module from it."""

    model_type: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    out_bias: bool
    scale: float
    logit_soft_cap: float | None
    use_sinks: bool
    window: tuple[int, int] | None
    qk_norm: QKNorm | None
    rope: dict | None  # a config dict for ``RotaryEmbedding.from_config``; None: no rotary embedding
    prefix: str
    layout: str
    is_causal: bool = True  # a decoder's mask; BERT's encoder sees every key
    ignore: tuple[str, ...] = ()  # keys under ``prefix`` that are not the attention's (BERT's LayerNorm)
    attention_chunk_size: int | None = None  # Llama 4's chunked layers: chunks of positions
    alibi_slopes: tuple[float, ...] | None = None  # ALiBi, one slope per head (``mha_spec.alibi``)
    latent: Latent | None = None  # multi-head latent attention; ``rope`` then rotates qk_rope_head_dim features
    rope_interleaved: bool = False  # with ``latent``: the rotary pairs are (2i, 2i + 1), whatever the model_type
    clip_qkv: float | None = None  # the projections' outputs clamped to [-clip_qkv, clip_qkv]
    query_scale: QueryScale | None = None  # each query scaled by its position
    output_gate: str | None = None  # "head" or "feature": a sigmoid gate on each head's output
    input_size: int | None = None  # the projections' input width, where not hidden_size (Zamba's [hidden; embeddings])


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict:
    """A ``config.json`` (or its path) as a dict: a multimodal config's ``text_config``, sizes under our names."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.exists(path):
            raise FileNotFoundError(f"config {path!r} does not exist")
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a config.json dict or its path, got {type(config).__name__}")
    config = dict(config)
    if "text_config" in config and "num_attention_heads" not in config:
        config = dict(config["text_config"])
    family = FAMILIES.get(config.get("model_type"))
    if family and family.layer_count:  # NemotronH's: its layers_block_type's, whatever num_hidden_layers says
        config["num_hidden_layers"] = family.layer_count(config)
    return _aliased(_aliased(config, _ALIASES), family.aliases if family else {})  # a family's own: GPT-Neo's, MPT's


def _aliased(config: dict, aliases: Mapping[str, str]) -> dict:
    """``config`` with each of our names that it lacks read from its alias (our name -> the config's)."""
    config.update({name: config[alias] for name, alias in aliases.items() if name not in config and alias in config})
    return config


# The defaults of transformers' config classes for the keys each record reads, where they do not follow from the
# sizes: what a config.json that leaves a key out holds once its class fills it in. Generated from the installed
# transformers and checked against it by parity_tests/test_hf_config_keys.py.
with open(os.path.join(os.path.dirname(__file__), "config_defaults.json")) as _file:
    CLASS_DEFAULTS: dict[str, dict] = json.load(_file)
# the layer types of softmax attention; a hybrid model's others (transformers' names) are not
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_LEGACY_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}  # remap_legacy_layer_types'
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")  # one setting: a config's replace the class's


def _with_class_defaults(config: Mapping[str, Any], model_type: str, nested: str | None) -> dict:
    """``config`` with its config class's defaults (``CLASS_DEFAULTS``) where it leaves a key out; the rope keys
    as one (a config's ``rope_theta`` is not overridden by the class's ``rope_parameters``), a rope parameters'
    missing ``rope_theta`` the class's; a nested config's keys each."""
    defaults = dict(CLASS_DEFAULTS.get(model_type, {}))
    if any(config.get(key) is not None for key in _ROPE_KEYS):
        theta = (defaults.get("rope_parameters") or {}).get("rope_theta", defaults.get("rope_theta"))
        for key in _ROPE_KEYS:
            defaults.pop(key, None)
        parameters = config.get("rope_parameters")
        flat = isinstance(parameters, Mapping) and not any(isinstance(v, Mapping) for v in parameters.values())
        if flat and "rope_theta" not in parameters and config.get("rope_theta") is None and theta is not None:
            defaults["rope_theta"] = theta  # the class's default_theta, as standardize_rope_params fills it
    merged = {**defaults, **config}
    if nested and isinstance(defaults.get(nested), Mapping) and isinstance(config.get(nested), Mapping):
        merged[nested] = {**defaults[nested], **config[nested]}
    return merged


def family_of(config: Mapping[str, Any]) -> tuple[str, Family, dict]:
    """``(model_type, its record, the config with the record's defaults)``; raises on an unknown family or a
    refused option."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"config's model_type {model_type!r} is not a supported family; "
                         f"supported: {', '.join(sorted(FAMILIES))}")
    family = FAMILIES[model_type]
    config = _with_class_defaults(config, model_type, family.nested)
    nested = config.get(family.nested) if family.nested else None
    config = _aliased({**family.defaults, **(nested if isinstance(nested, Mapping) else {}), **config}, family.aliases)
    layers = config.get("num_hidden_layers")
    if family.no_rope_layers and not config.get("no_rope_layers") and isinstance(layers, int):
        # 1: the layer rotates; the config classes leave every no_rope_layer_interval-th layer without
        interval = config["no_rope_layer_interval"]
        config["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(layers)]
    if family.standardize:
        config = family.standardize(config)
    refused = [f"{key} ({what})" for key, what in _REFUSED.items() if config.get(key) and key not in family.reads]
    rope_parameters = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), Mapping) else {}
    refused += [f"{key} ({what})" for key, what in family.refuses if config.get(key) or rope_parameters.get(key)]
    if refused:
        raise ValueError(f"config ({model_type}) sets {', '.join(refused)}, which this attention does not compute")
    return model_type, family, config


def layer_options(config: Mapping[str, Any], layer: int) -> LayerOptions:
    """The attention options of layer ``layer`` of a transformers model's ``config``."""
    model_type, family, config = family_of(config)
    layers = _required(config, "num_hidden_layers", model_type)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer must be an integer in [0, {layers}) (num_hidden_layers={layers}), got {layer!r}")
    hidden = _required(config, "hidden_size", model_type)
    heads = _required(config, "num_attention_heads", model_type)
    kv_heads = family.kv_heads(config) if callable(family.kv_heads) else config.get(family.kv_heads or "")
    kv_heads = kv_heads or heads
    head_dim = (config.get("head_dim") if family.reads_head_dim else None) or hidden // heads
    if family.check:
        family.check(config, layer)
    qkv_bias = _flag(config, family.qkv_bias, family.bias_default)
    out_bias = family.out_bias(config, layer) if callable(family.out_bias) else _flag(
        config, family.out_bias, family.bias_default)
    scale = family.scale(config, head_dim, layer) if callable(family.scale) else family.scale
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    layer_type = _attention_type(config, family, layers, layer)
    window, sliding = None, layer_type == "sliding_attention"
    if (sliding and config.get(family.window_key)
            and (family.window_flag is None or config.get(family.window_flag))):
        # transformers' sliding_window_overlay: a query sees key j when j > i - sliding_window
        window = (int(config[family.window_key]) - 1, 0)
    rope = _rope_config(config, family, layer_type, head_dim) if _rotates(config, family) else None
    if (family.no_rope_layers and not config["no_rope_layers"][layer]  # the layers that do not rotate
            or family.rope_sliding_only and config.get("sliding_window") is not None and not sliding
            or family.rope_windowed_only and window is None
            or family.rope_types is not None and layer_type not in family.rope_types) \
            and not (family.rope_forced and family.rope_forced(config, layer)):
        rope = None
    if rope is not None and family.layer_rope_theta and config.get(family.layer_rope_theta):
        rope = _with_theta(rope, config[family.layer_rope_theta][layer])
    slopes = family.alibi(config, heads, head_dim) if family.alibi else None
    if slopes is not None:  # positions as ALiBi's distances, not rotary (Falcon's alibi layers)
        rope = None
    chunked = layer_type == "chunked_attention" and "attention_chunk_size" in family.reads
    chunk = config.get("attention_chunk_size") if chunked else None
    qk_norm = None if family.qk_norm_rope_only and rope is None else _qk_norm(config, family)
    options = LayerOptions(
        model_type, hidden, heads, kv_heads, head_dim, qkv_bias, out_bias, scale,
        config.get(family.soft_cap) if family.soft_cap else None, family.sinks, window, qk_norm,
        rope, family.prefix.format(layer=_saved_layer(config, family, layers, layer)), family.layout,
        is_causal=_flag(config, family.causal, False),
        ignore=family.ignore, attention_chunk_size=chunk, alibi_slopes=slopes,
        clip_qkv=(config.get(family.clip_qkv) or None) if family.clip_qkv else None,
        query_scale=family.query_scale(config, layer) if family.query_scale else None,
        output_gate=family.output_gate if _flag(config, family.output_gate_flag or True, True) else None,
        input_size=config[family.input_size] if family.input_size else None)
    return _with_latent(options, config, family) if family.latent else options


def _saved_layer(config: Mapping[str, Any], family: Family, layers: int, layer: int) -> int:
    """The layer whose keys hold layer ``layer``'s weights: itself, or with ``tied_layers`` the first attention
    layer."""
    if not family.tied_layers:
        return layer
    return next(i for i, kind in enumerate(_layer_types(config, family, layers)) if kind in ATTENTION_TYPES)


def _attention_type(config: Mapping[str, Any], family: Family, layers: int, layer: int) -> str:
    """Layer ``layer``'s type; a ValueError naming its kind where it is not softmax attention (a hybrid's)."""
    kinds = _layer_types(config, family, layers)
    if kinds[layer] not in ATTENTION_TYPES:
        raise ValueError(f"layer {layer} of this {config.get('model_type')} config is a {kinds[layer]!r} layer, not "
                         f"softmax attention; its attention layers (by its layer_types or its family's rule): "
                         f"{[i for i, kind in enumerate(kinds) if kind in ATTENTION_TYPES]}")
    return kinds[layer]


def _rotates(config: Mapping[str, Any], family: Family) -> bool:
    """Whether the family's model rotates (its record's ``rope``, or the config's say)."""
    return family.rope(config) if callable(family.rope) else family.rope


def _with_latent(options: LayerOptions, config: Mapping[str, Any], family: Family) -> LayerOptions:
    """A latent layer's options (DeepSeek-V3's): its ``Latent``, head dims and the ``yarn_apply_mscale`` scale."""
    model_type = options.model_type
    dims = [_required(config, key, model_type) for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")]
    v_head_dim = config.get("v_head_dim") or options.hidden_size // options.num_heads  # MiniCPM3Config's default
    latent = Latent(*dims, v_head_dim, config.get("q_lora_rank"))
    scale = latent.qk_head_dim ** -0.5
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if options.rope is not None and parameters.get("rope_type", parameters.get("type", "default")) != "default" \
            and parameters.get("mscale_all_dim"):
        mscale = yarn_mscale(parameters["factor"], parameters["mscale_all_dim"])
        scale = scale * mscale * mscale
    rope = None if options.rope is None else dict(options.rope, head_dim=latent.qk_rope_head_dim)
    return replace(options, num_kv_heads=options.num_heads, head_dim=latent.qk_head_dim, scale=scale, rope=rope,
                   latent=latent, rope_interleaved=_flag(config, family.latent_interleave, True))


def _with_theta(rope: dict, theta: float) -> dict | None:
    """The layer's rotary config at its own base ``theta``; None for 0."""
    if not theta:
        return None
    parameters = rope.get("rope_parameters")
    parameters = dict(parameters) if isinstance(parameters, Mapping) else {}
    return dict(rope, rope_theta=theta, rope_parameters=dict(parameters, rope_theta=theta))


def _flag(config: Mapping[str, Any], value: bool | str, default: bool) -> bool:
    """A record's flag: the value, or the config's value of the key it names."""
    return bool(config.get(value, default)) if isinstance(value, str) else value


def _qk_norm(config: Mapping[str, Any], family: Family) -> QKNorm | None:
    """The family's QK-norm with the config's eps, None without one."""
    if family.qk_norm is None or (family.qk_norm_flag and not config.get(family.qk_norm_flag, False)):
        return None
    return replace(family.qk_norm, eps=config.get(family.qk_norm_eps, family.qk_norm.eps))


def _required(config: Mapping[str, Any], key: str, model_type: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config ({model_type}) needs a positive integer {key}, got {value!r}")
    return value


def _layer_types(config: Mapping[str, Any], family: Family, layers: int) -> list[str]:
    """Each layer's type: the config's ``layer_types`` (older names as transformers remaps them), else the family's
    rule."""
    types = config.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"config's layer_types has {len(types)} entries for num_hidden_layers={layers}")
        return [_LEGACY_TYPES.get(kind, kind) for kind in types]
    # a rule's entries past the layer count (GPT-Neo's attention_types expanded) are not the model's
    return family.layer_types(config, layers)[:layers] if family.layer_types else ["full_attention"] * layers


def attention_layers(config: Mapping[str, Any] | str | os.PathLike) -> list[int]:
    """The layers of a transformers model's ``config`` (a ``config.json`` dict or its path) whose attention is
    softmax attention, those ``layer_options`` and ``from_hf`` build; a hybrid model's others (state space,
    linear, convolution, MLP-only layers) are refused."""
    model_type, family, config = family_of(read_config(config))
    kinds = _layer_types(config, family, _required(config, "num_hidden_layers", model_type))
    return [i for i, kind in enumerate(kinds) if kind in ATTENTION_TYPES]


def _rope_config(config: Mapping[str, Any], family: Family, layer_type: str, head_dim: int) -> dict | None:
    """The config the layer's ``RotaryEmbedding.from_config`` reads, rope parameters of the layer's type; None
    where the type's are None (Cohere Compass's layers without rotary)."""
    rope = dict(config, head_dim=head_dim)
    if family.rope_default:
        keys, key, default = family.rope_default
        if not any(k in config or k in (config.get("rope_parameters") or {}) for k in keys):
            rope[key] = default
    if family.rope_fixed is not None:
        rope.pop("rope_scaling", None)
        rope.pop("rope_theta", None)
        rope["rope_parameters"] = dict(family.rope_fixed)
        return rope
    parameters = config.get("rope_parameters")
    typed = isinstance(parameters, Mapping) and layer_type in parameters
    if typed and parameters[layer_type] is None:
        return None
    if typed and isinstance(parameters[layer_type], Mapping):
        parameters = rope["rope_parameters"] = dict(parameters[layer_type])
    elif config.get("model_type") == "gemma3_text" and layer_type == "sliding_attention" and \
            "rope_local_base_freq" in config:
        rope.pop("rope_scaling", None)  # older Gemma 3 configs: local layers, default rope at their own base
        rope["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    if family.rope_ignore and isinstance(parameters, Mapping):
        rope["rope_parameters"] = {k: v for k, v in parameters.items() if k not in family.rope_ignore}
    return rope


def layer_files(weights: str | os.PathLike, prefix: str) -> list[str]:
    """The ``.safetensors`` files holding the keys under ``prefix``: the file, or the shards an index names."""
    path = os.fspath(weights)
    if not path.endswith(".json"):
        return [path]
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights {path!r} does not exist")
    with open(path) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"weights {path!r} is not a safetensors index: it has no weight_map")
    files = sorted({file for key, file in weight_map.items() if key.startswith(prefix)})
    if not files:
        raise ValueError(f"weights {path!r}: no key of its weight_map starts with {prefix!r}")
    return [os.path.join(os.path.dirname(path), file) for file in files]


def read_layer(weights: Any, prefix: str, read_state: Callable[[Any], Mapping], framework: str) -> Mapping[str, Any]:
    """The checkpoint's keys under ``prefix`` (all of them when none is), from its files or by ``read_state``."""
    if not isinstance(weights, (str, os.PathLike)):
        if not isinstance(weights, Mapping):
            return read_state(weights)  # its TypeError names what a checkpoint may be
        return {k: v for k, v in weights.items() if str(k).startswith(prefix)} or weights
    state = {}
    for path in layer_files(weights, prefix):
        if not os.path.exists(path):
            raise FileNotFoundError(f"weights {path!r} does not exist")
        from safetensors import safe_open  # only when a file is given

        with safe_open(path, framework=framework) as f:
            state.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    return state or read_state(weights)


def load_arguments(options: LayerOptions, weights: Any, read_state: Callable[[Any], Mapping], framework: str,
                   concatenate: Callable[[list], Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, keywords)`` for a twin's ``load_weights``: fused weights split here (``layer_state``), else the
    keys a layout reads (``layer_keys``) with its layout, prefix and ignored keys."""
    state = read_state(read_layer(weights, options.prefix, read_state, framework))
    if FAMILIES[options.model_type].fused:
        return layer_state(options, state), {}
    return layer_keys(options, state, concatenate), {"layout": options.layout, "prefix": options.prefix,
                                                     "ignore": options.ignore}


def layer_keys(options: LayerOptions, state: Mapping[str, Any], concatenate: Callable[[list], Any]) -> dict[str, Any]:
    """The checkpoint's keys as a layout reads them: buffers left out, renamed, per-head QK-norm scales joined
    into one ``(heads * head_dim,)``."""
    prefix = options.prefix
    family = FAMILIES[options.model_type]
    buffers = {prefix + k for k in family.buffers}
    out = {k: v for k, v in state.items() if k not in buffers}
    for norm, start in (family.per_head_norms or {}).items():
        start = prefix + start
        heads = {k: k[len(start):].removesuffix(".weight") for k in out
                 if k.startswith(start) and k.endswith(".weight")}
        if heads and all(h.isdigit() for h in heads.values()):  # else left for the layout to name
            ordered = sorted(heads, key=lambda k: int(heads[k]))
            out[prefix + norm + ".weight"] = concatenate([out.pop(k) for k in ordered])
    out = {prefix + renamed(k[len(prefix):], family.renames) if k.startswith(prefix) else k: v for k, v in out.items()}
    if family.query_gate and f"{prefix}q_proj.weight" in out:
        out[f"{prefix}q_proj.weight"], out[prefix + GATE] = _query_and_gate(
            out[f"{prefix}q_proj.weight"], options.num_heads, options.head_dim, concatenate)
    if family.rope_reversed and options.rope is not None:
        rotary_dim = rope_from_config(options.rope, options.head_dim)["rotary_dim"]
        for name, heads in (("q_proj", options.num_heads), ("k_proj", options.num_kv_heads)):
            for key in (f"{prefix}{name}.weight", f"{prefix}{name}.bias"):
                if key in out:
                    out[key] = _second_halves_negated(out[key], heads, options.head_dim, rotary_dim, concatenate)
    if family.head_norm_matrix:
        for norm in ("q_norm", "k_norm"):
            weight = out.get(f"{prefix}{norm}.weight")
            if weight is not None and len(weight.shape) == 2:
                out[f"{prefix}{norm}.weight"] = weight.reshape(-1)
    return out


def _query_and_gate(rows: Any, heads: int, head_dim: int, concatenate: Callable[[list], Any]) -> tuple[Any, Any]:
    """Qwen3-Next's q_proj rows ``(heads * 2 * head_dim, in)``, each head's query rows then its gate's, as the query
    projection's rows and the gate's (new arrays)."""
    return tuple(concatenate([rows[(2 * h + part) * head_dim:(2 * h + part + 1) * head_dim] for h in range(heads)])
                 for part in (0, 1))


def _second_halves_negated(rows: Any, heads: int, head_dim: int, rotary_dim: int,
                           concatenate: Callable[[list], Any]) -> Any:
    """A projection's ``rows`` ``(heads * head_dim, ...)`` with the second half of each head's rotary features
    negated (a new array): pairs turned by -angle (NanoChat's rotate_half ``(x2, -x1)``) are, so negated, pairs
    turned by +angle, negated again; the negations of a query's and a key's cancel in their product, and a
    weightless per-head norm keeps them."""
    half = rotary_dim // 2
    parts = [(h * head_dim + start, h * head_dim + end, sign) for h in range(heads)
             for start, end, sign in ((0, half, 1), (half, rotary_dim, -1), (rotary_dim, head_dim, 1)) if end > start]
    return concatenate([rows[a:b] if sign > 0 else -rows[a:b] for a, b, sign in parts])


def layer_state(options: LayerOptions, state: Mapping[str, Any]) -> dict[str, Any]:
    """A fused layer's keys under ``options.prefix`` in this package's names, rows split by ``_split_fused``;
    one ValueError lists every bad key."""
    prefix, hidden = options.prefix, options.hidden_size
    family = FAMILIES[options.model_type]
    fused, out = family.fused
    selected = {renamed(k[len(prefix):], family.renames): v for k, v in state.items() if k.startswith(prefix)}
    if not selected:
        raise ValueError(f"state_dict: no key starts with prefix {prefix!r}")
    conv = options.layout == "gpt2"  # Conv1D weights: (in, out)
    rows = (options.num_heads + 2 * options.num_kv_heads) * options.head_dim
    width = options.num_heads * options.head_dim
    expected = {f"{fused}.weight": (hidden, rows) if conv else (rows, hidden)}  # key -> shape as stored
    expected.update({f"{fused}.bias": (rows,)} if options.qkv_bias else {})
    expected[f"{out}.weight"] = (width, hidden) if conv else (hidden, width)
    expected.update({f"{out}.bias": (hidden,)} if options.out_bias else {})
    stored = {new: old for old, new in family.renames.items()}

    def shown(key: str) -> str:  # as the checkpoint names it
        return repr(prefix + renamed(key, stored))

    problems = [f"missing key {shown(k)}" for k in expected if k not in selected]
    problems += [f"{shown(k)} has shape {tuple(selected[k].shape)}, expected {shape}"
                 for k, shape in expected.items() if k in selected and tuple(selected[k].shape) != shape]
    problems += [f"unexpected key {shown(k)}" for k in selected if k not in expected and k not in family.buffers]
    if problems:
        raise ValueError(f"state_dict (layout {options.layout!r}): " + "; ".join(problems))
    result = {}
    for key in expected:
        name, part = key.rsplit(".", 1)
        array = selected[key].T if conv and part == "weight" else selected[key]
        if name == fused:  # its rows split into the query, key and value projections'
            result.update(zip((f"q_proj.{part}", f"k_proj.{part}", f"v_proj.{part}"), _split_fused(array, options)))
        else:
            result[f"out_proj.{part}"] = array
    return result


def _split_fused(fused: Any, options: LayerOptions) -> list[Any]:
    """The q, k, v rows of a fused weight ``(rows, in)`` or bias ``(rows,)``: ``[q; k; v]`` (GPT-2), 4 blocks of
    (q, v, k) (CodeGen), else ``(kv_heads, group + 2, head_dim)`` (GPT-NeoX, Falcon)."""
    heads, kv_heads, head_dim = options.num_heads, options.num_kv_heads, options.head_dim
    rest = tuple(fused.shape[1:])
    if options.layout == "gpt2" or (options.layout == "gpt_bigcode" and kv_heads == 1):
        q, kv = heads * head_dim, kv_heads * head_dim
        return [fused[:q], fused[q:q + kv], fused[q + kv:q + 2 * kv]]
    if options.layout == "codegen":
        if heads % _CODEGEN_BLOCKS:
            raise ValueError(f"codegen's fused qkv_proj holds {_CODEGEN_BLOCKS} blocks of heads: num_attention_heads "
                             f"must be a multiple of {_CODEGEN_BLOCKS}, got {heads}")
        blocks = fused.reshape((_CODEGEN_BLOCKS, 3, heads * head_dim // _CODEGEN_BLOCKS) + rest)
        return [blocks[:, part].reshape((heads * head_dim,) + rest) for part in (0, 2, 1)]
    group = heads // kv_heads
    rows = fused.reshape((kv_heads, group + 2, head_dim) + rest)
    return [rows[:, :group].reshape((heads * head_dim,) + rest),
            rows[:, group].reshape((kv_heads * head_dim,) + rest),
            rows[:, group + 1].reshape((kv_heads * head_dim,) + rest)]
