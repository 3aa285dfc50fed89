"""A layer's attention options read from a transformers ``config.json`` dict (``layer_options``) by its family's
record (``mha_spec.records``); plain Python, no transformers import."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from mha_spec.latent import Latent
from mha_spec.qk_norm import QKNorm
from mha_spec.query_terms import QueryScale
from mha_spec.records import (
    ALIASES,
    ATTENTION_TYPES,
    CLASS_DEFAULTS,
    FAMILIES,
    LEGACY_TYPES,
    MULTIMODAL,
    REFUSED,
    Family,
    rope_defaults,
)
from mha_spec.rotary import yarn_mscale


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
    output_gate: str | None = None  # ``mha_spec.query_terms.OUTPUT_GATES``: a gate on each head's output
    input_size: int | None = None  # the projections' input width, where not hidden_size (Zamba's [hidden; embeddings])
    older_prefixes: tuple[str, ...] = ()  # where checkpoints saved in an older layout hold the layer (multimodal)


MULTIMODAL_KEY = "_multimodal"  # read_config's note of the multimodal model whose text model a config is


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
        outer = config.get("model_type")
        config = dict(config["text_config"])
        if outer in MULTIMODAL:
            config[MULTIMODAL_KEY] = outer
    family = FAMILIES.get(config.get("model_type"))
    if family and family.layer_count:  # NemotronH's: its layers_block_type's, whatever num_hidden_layers says
        config["num_hidden_layers"] = family.layer_count(config)
    return _aliased(_aliased(config, ALIASES), family.aliases if family else {})  # a family's own: GPT-Neo's, MPT's


def _aliased(config: dict, aliases: Mapping[str, str]) -> dict:
    """``config`` with each of our names that it lacks read from its alias (our name -> the config's)."""
    config.update({name: config[alias] for name, alias in aliases.items() if name not in config and alias in config})
    return config


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
    refused = [f"{key} ({what})" for key, what in REFUSED.items() if config.get(key) and key not in family.reads]
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
    if family.heads_per_layer and config.get(family.heads_per_layer):
        heads = config[family.heads_per_layer][layer]
    if family.check:
        family.check(config, layer)
    qkv_bias = _flag(config, family.qkv_bias, family.bias_default)
    out_bias = family.out_bias(config, layer) if callable(family.out_bias) else _flag(
        config, family.out_bias, family.bias_default)
    scale = family.scale(config, head_dim, layer) if callable(family.scale) else family.scale
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    layer_type = _attention_type(config, family, layers, layer)
    window = None
    if (layer_type == "sliding_attention" and config.get(family.window_key)
            and (family.window_flag is None or config.get(family.window_flag))):
        # transformers' sliding_window_overlay: a query sees key j when j > i - sliding_window
        window = (int(config[family.window_key]) - 1, 0)
    rope = _layer_rope(config, family, layer, layer_type, window, head_dim)
    slopes = family.alibi(config, heads, head_dim) if family.alibi else None
    if slopes is not None:  # positions as ALiBi's distances, not rotary (Falcon's alibi layers)
        rope = None
    chunked = layer_type == "chunked_attention" and "attention_chunk_size" in family.reads
    chunk = config.get("attention_chunk_size") if chunked else None
    qk_norm = None if family.qk_norm_rope_only and rope is None else _qk_norm(config, family)
    prefixes = _prefixes(config, family.prefix.format(layer=_saved_layer(config, family, layers, layer)))
    options = LayerOptions(
        model_type, hidden, heads, kv_heads, head_dim, qkv_bias, out_bias, scale,
        config.get(family.soft_cap) if family.soft_cap else None, family.sinks, window, qk_norm,
        rope, prefixes[0], family.layout,
        is_causal=_flag(config, family.causal, False),
        ignore=family.ignore, attention_chunk_size=chunk, alibi_slopes=slopes,
        clip_qkv=(config.get(family.clip_qkv) or None) if family.clip_qkv else None,
        query_scale=family.query_scale(config, layer) if family.query_scale else None,
        output_gate=_output_gate(config, family, layer),
        input_size=config[family.input_size] if family.input_size else None, older_prefixes=prefixes[1:])
    return _with_latent(options, config, family) if family.latent else options


def _layer_rope(config: Mapping[str, Any], family: Family, layer: int, layer_type: str,
                window: tuple[int, int] | None, head_dim: int) -> dict | None:
    """The layer's rotary config (``_rope_config``'s at its own base), None where the layer does not rotate."""
    rope = _rope_config(config, family, layer_type, head_dim) if _rotates(config, family) else None
    if (family.no_rope_layers and not config["no_rope_layers"][layer]  # the layers that do not rotate
            or family.rope_sliding_only and config.get("sliding_window") is not None
            and layer_type != "sliding_attention"
            or family.rope_windowed_only and window is None
            or family.rope_types is not None and layer_type not in family.rope_types) \
            and not (family.rope_forced and family.rope_forced(config, layer)):
        return None
    if rope is not None and family.layer_rope_theta and config.get(family.layer_rope_theta):
        rope = _with_theta(rope, config[family.layer_rope_theta][layer])
    return rope


def _prefixes(config: Mapping[str, Any], prefix: str) -> tuple[str, ...]:
    """The layer's prefix in the model, then where older checkpoints hold it: a multimodal model's text model's
    (``MULTIMODAL``) in place of the text family's ``model.``."""
    starts = MULTIMODAL.get(config.get(MULTIMODAL_KEY), ())
    if not starts or not prefix.startswith("model."):
        return (prefix,)
    return tuple(start + prefix.removeprefix("model.") for start in starts)


def _output_gate(config: Mapping[str, Any], family: Family, layer: int) -> str | None:
    """The layer's ``output_gate``: the record's (or its function's), None where its flag is off."""
    if not _flag(config, family.output_gate_flag or True, True):
        return None
    return family.output_gate(config, layer) if callable(family.output_gate) else family.output_gate


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
        return [LEGACY_TYPES.get(kind, kind) for kind in types]
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
    rope = rope_defaults(dict(config, head_dim=head_dim))[0]
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
    if family.rope_ignore and isinstance(parameters, Mapping):
        rope["rope_parameters"] = {k: v for k, v in parameters.items() if k not in family.rope_ignore}
    return rope
