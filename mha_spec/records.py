"""Hugging Face model families as ``Family`` records (``FAMILIES``, from transformers 5.x): how each
family's attention reads its config and saves its weights; plain Python data and small rules, no transformers
import."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mha_spec import alibi
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale

_PREFIX = "model.layers.{layer}.self_attn."
# the layer types of softmax attention; a hybrid model's others (transformers' names) are not
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
LEGACY_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}  # remap_legacy_layer_types'


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
    config["layer_types"] = ["full_attention" if kind == "hybrid" else LEGACY_TYPES.get(kind, kind) for kind in kinds]
    return config


_standardize_zamba.derives = ("layer_types", "attention_hidden_size", "head_dim")


@_reading("full_attention_interval")
def _layer_types_qwen3_next(config: Mapping[str, Any], layers: int) -> list[str]:
    """Qwen3NextConfig's (and Qwen3.5's) rule: every ``full_attention_interval``-th layer (default 4) attends, the
    others are gated delta nets."""
    interval = config.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]


@_reading("rope_parameters", "rope_scaling", "rope_theta", "head_dim")
def _standardize_hunyuan(config: dict) -> dict:
    """HunYuan's rotary ``"dynamic"`` with an ``alpha`` (its checkpoints'): NTK-alpha, the base times
    ``alpha ** (d / (d - 2))`` at every length (HunYuanDenseV1RotaryEmbedding's ``ntk_alpha``), read as default rope."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if parameters.get("rope_type", parameters.get("type")) == "dynamic" and parameters.get("alpha"):
        dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
        theta = theta * parameters["alpha"] ** (dim / (dim - 2))
        config.pop("rope_scaling", None)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return config


@_reading("layer_types", "sparse_attention_config", "rotary_dim")
def _standardize_minimax_m3(config: dict) -> dict:
    """MiniMaxM3VLTextConfig's layer types from ``sparse_attention_config``'s ``sparse_attention_freq`` (its sparse
    layers an indexer's top-k blocks); ``rotary_dim`` left out (its rotary reads ``partial_rotary_factor``)."""
    frequencies = (config.get("sparse_attention_config") or {}).get("sparse_attention_freq")
    if not config.get("layer_types") and frequencies is not None:
        config["layer_types"] = ["minimax_m3_sparse" if f else "full_attention" for f in frequencies]
    config.pop("rotary_dim", None)
    return config


_standardize_minimax_m3.derives = ("layer_types",)


@_reading("layer_types", "num_kv_shared_layers", "rope_parameters", "rope_scaling", "rope_theta",
          "rope_local_base_freq")
def _standardize_gemma3n(config: dict) -> dict:
    """Gemma3nTextConfig's derived keys: its layer types (every 5th full, the others sliding), the last
    ``num_kv_shared_layers`` reusing an earlier layer's keys and values (refused by kind); rope parameters per layer
    type (an older config's ``rope_theta``, ``rope_local_base_freq``)."""
    layers = config["num_hidden_layers"]
    kinds = config.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                                          for i in range(layers)]
    first_shared = layers - (config.get("num_kv_shared_layers") or 0)
    config["layer_types"] = [kind if i < first_shared else "shared_kv_attention" for i, kind in enumerate(kinds)]
    return _standardize_gemma_rope(config)


_standardize_gemma3n.derives = ("layer_types", "rope_parameters")


@_reading("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")
def _standardize_gemma_rope(config: dict) -> dict:
    """Gemma 3's and 3n's rope parameters per layer type from an older config's keys, as their config classes
    convert them: the full layers' ``rope_scaling`` at ``rope_theta`` (default 1e6), the sliding layers' default
    rope at ``rope_local_base_freq`` (default 1e4)."""
    parameters = config.get("rope_parameters")
    if not (isinstance(parameters, Mapping) and isinstance(parameters.get("full_attention"), Mapping)):
        scaling = dict(config.pop("rope_scaling", None) or {})
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", **scaling, "rope_theta": config.get("rope_theta", 1000000.0)},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}}
    return config


_standardize_gemma_rope.derives = ("rope_parameters",)


@_reading("rope_parameters")
def _standardize_laguna(config: dict) -> dict:
    """LagunaConfig's rope parameters per layer type where the config has none (its full layers rotate half of
    each head at base 500000, its sliding layers all of it at 10000)."""
    if config.get("rope_parameters") is None:
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}}
    return config


_standardize_laguna.derives = ("rope_parameters",)


@_reading("gating")
def _output_gate_laguna(config: Mapping[str, Any], layer: int) -> str:
    """Laguna's softplus gate: one per head where ``gating`` is True or ``"per-head"``, else one per feature."""
    gating = config.get("gating", True)
    return "head_softplus" if gating is True or gating == "per-head" else "feature_softplus"


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
    reads: tuple[str, ...] = ()  # keys of ``REFUSED`` that it computes
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
    # ``output_gate``'s value ("head", "feature", their "_softplus" forms), or (config, layer) -> it
    output_gate: str | Callable[[Mapping[str, Any], int], str] | None = None
    output_gate_flag: str | None = None  # the key that switches ``output_gate`` on; None: always on
    query_gate: bool = False  # the gate's rows after each head's query rows in q_proj (Qwen3-Next's)
    rope_types: tuple[str, ...] | None = None  # only the layers of these types rotate (AFMoE's sliding ones)
    input_size: str | None = None  # the key of the projections' input width, where not hidden_size
    heads_per_layer: str | None = None  # the key of each layer's query head count (head_dim still the config's)
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
                          layer_types=_layer_types_every(6, *_PATTERN_KEYS), standardize=_standardize_gemma_rope),
    "gpt_oss": Family(sinks=True, layer_types=_layer_types_every(2)),
    "llama4_text": Family(rope_interleaved=True, layer_types=_layer_types_chunked, no_rope_layers=True,
                          defaults=_LLAMA4, reads=("attention_chunk_size", "use_qk_norm"),
                          query_scale=_query_scale_llama4,
                          # Llama4TextL2Norm on the rotary layers, after the rotation (which it commutes with, but
                          # not with a rotary's attention factor: yarn's, which it undoes)
                          qk_norm=QKNorm("rms", True, 1e-5, weight=False, after_rotary=True),
                          qk_norm_flag="use_qk_norm",
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
    # its rotation by -angle loaded as one by +angle (``rope_reversed``); a weightless RMS norm per head after it
    # (which undoes a rotary's attention factor: yarn's, longrope's)
    "nanochat": Family(qk_norm=QKNorm("rms", True, 1e-6, weight=False, after_rotary=True), rope_reversed=True),
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
    # a softplus gate on each head's output (g_proj; per feature where gating says so), RMS QK-norm per head, each
    # layer's own query head count; rope parameters per layer type
    "laguna": Family(qk_norm=_RMS_PER_HEAD, output_gate=_output_gate_laguna,
                     heads_per_layer="num_attention_heads_per_layer", standardize=_standardize_laguna,
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
    **dict.fromkeys(("hunyuan_v1_dense", "hunyuan_v1_moe"), Family(
        qk_norm=QKNorm("rms", True, 1e-5, after_rotary=True), standardize=_standardize_hunyuan,
        renames={"query_layernorm.": "q_norm.", "key_layernorm.": "k_norm."})),
    "minimax_m3_vl_text": Family(qkv_bias=False, out_bias=False, qk_norm=QKNorm("rms", True, 1e-6, offset=1.0),
                                 standardize=_standardize_minimax_m3),
    "gemma3n_text": Family(qk_norm=QKNorm("rms", True, 1e-6, value_norm=True), scale=1.0,
                           standardize=_standardize_gemma3n),
}
FAMILIES["gpt-sw3"] = FAMILIES["gpt2"]  # GPT-2's model, its own tokenizer
FAMILIES["lfm2_moe"] = replace(FAMILIES["lfm2"], layer_types=_layer_types_lfm2_moe)
FAMILIES["granitemoe_swa"] = FAMILIES["granite_swa"]  # Granite SWA's attention with MoE blocks
# Multimodal model types whose text model (its config's text_config) holds the attention its text family's record
# reads: the starts that replace that record's prefix's "model.", the model's own names first, then those of
# checkpoints saved in the older layout (which transformers converts when it loads them)
MULTIMODAL: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gemma3", "got_ocr2", "fuyu"), ("model.language_model.", "language_model.model.")),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "moss_transcribe_diarize"), ("model.language_model.",)),
    "llama4": ("language_model.model.",),
}
# GPT-2's configs name the sizes their own way (transformers' attribute_map)
ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
            "max_position_embeddings": "n_positions"}
# Options that change the attention's function: refused by name by the families that do not read them.
REFUSED = {
    "use_qk_norm": "Llama 4's QK-norm", "use_bidirectional_attention": "bidirectional attention",
    "attention_chunk_size": "chunked attention (Llama 4)",
}


# The defaults of transformers' config classes for the keys each record reads, where they do not follow from the
# sizes: what a config.json that leaves a key out holds once its class fills it in. Generated from the installed
# transformers and checked against it by parity_tests/test_hf_config_keys.py.
with open(os.path.join(os.path.dirname(__file__), "config_defaults.json")) as _file:
    CLASS_DEFAULTS: dict[str, dict] = json.load(_file)


def rope_defaults(config: Mapping[str, Any]) -> tuple[dict, bool]:
    """``config`` (a copy) with its family's ``rope_default`` where it sets none of its keys (nor its rope
    parameters), and whether the family rotates pairs ``(2i, 2i + 1)``; for another model_type, as it is."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    config = dict(config)
    if family and family.rope_default:
        keys, key, default = family.rope_default
        if not any(k in config or k in (config.get("rope_parameters") or {}) for k in keys):
            config[key] = default
    return config, bool(family and family.rope_interleaved)
