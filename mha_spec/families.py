"""Hugging Face model families: a layer's attention options read from a ``config.json`` dict.

Plain Python, no array library and no transformers import. Each family's rules are read from
transformers' own ``modeling_*.py`` and ``configuration_*.py`` (5.x): which projections have
biases, the scale, the window of each layer type, the QK-norm, soft-capping, sinks, and where
the layer's weights sit in the whole model's checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mha_spec.qk_norm import QKNorm

# model_type -> the key prefix of layer N's attention in the model's checkpoint, and its layout
_PREFIX = "model.layers.{layer}.self_attn."
FAMILIES = {
    "llama": (_PREFIX, "hf"),
    "mistral": (_PREFIX, "hf"),
    "qwen2": (_PREFIX, "hf"),
    "qwen3": (_PREFIX, "hf"),
    "gemma2": (_PREFIX, "hf"),
    "gemma3_text": (_PREFIX, "hf"),
    "gpt_oss": (_PREFIX, "hf"),
    "olmo2": (_PREFIX, "hf"),
    "llama4_text": (_PREFIX, "hf"),
    "phi3": (_PREFIX, "fused_qkv"),
    "stablelm": (_PREFIX, "hf"),  # its per-head QK-norm's keys joined by ``layer_keys``
    "cohere": (_PREFIX, "hf"),
    "gptj": ("transformer.h.{layer}.attn.", "mha_torch"),
    # read by ``layer_state`` into this package's names: heads interleaved in one fused weight
    # (GPT-NeoX), transposed ``Conv1D`` weights (GPT-2)
    "gpt_neox": ("gpt_neox.layers.{layer}.attention.", "gpt_neox"),
    "gpt2": ("transformer.h.{layer}.attn.", "gpt2"),
    # an encoder: bidirectional unless the config makes it a decoder; the keys as BERT's task
    # models save them (``bert.`` before the base model's names)
    "bert": ("bert.encoder.layer.{layer}.attention.", "bert"),
}
# Keys under a layer's prefix that belong to the block, not to the attention: left unread.
_OUTSIDE = {"bert": ("output.LayerNorm",)}
# GPT-2's configs name the sizes their own way (transformers' attribute_map)
_ALIASES = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
            "max_position_embeddings": "n_positions"}
# Options that change the attention's function and that no family here reads: refused by name
# (by the families that do not read them).
_REFUSED = {
    "use_qk_norm": "Llama 4's QK-norm",
    "use_bidirectional_attention": "bidirectional attention",
    "attention_chunk_size": "chunked attention (Llama 4)",
}
_READ = {"llama4_text": ("attention_chunk_size",), "cohere": ("use_qk_norm",)}
# Llama4TextConfig's defaults, where a config leaves them out
_LLAMA4 = dict(use_qk_norm=True, attention_chunk_size=8192, no_rope_layer_interval=4, attn_temperature_tuning=True)
# Values config classes set where config.json leaves them out: (the keys, in the config or its rope
# parameters, any of which gives it; the key set; its default)
_ROPE_DEFAULTS = {
    "gpt_neox": (("rotary_pct", "partial_rotary_factor"), "rotary_pct", 0.25),  # a quarter of each head rotates
    "stablelm": (("partial_rotary_factor", "rotary_pct"), "partial_rotary_factor", 0.25),
    "gptj": (("rotary_dim",), "rotary_dim", 64),
    "cohere": (("rope_theta",), "rope_theta", 500000.0),  # CohereConfig.default_theta
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


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict:
    """A ``config.json`` as a dict (a path is read); a multimodal config's ``text_config``."""
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
    for name, alias in _ALIASES.items():
        if name not in config and alias in config:
            config[name] = config[alias]
    return config


def layer_options(config: Mapping[str, Any], layer: int) -> LayerOptions:
    """The attention options of layer ``layer`` of a transformers model's ``config``."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"config's model_type {model_type!r} is not a supported family; supported: {', '.join(sorted(FAMILIES))}"
        )
    if model_type == "llama4_text":
        config = _llama4_config(config)
    refused = [f"{key} ({what})" for key, what in _REFUSED.items()
               if config.get(key) and key not in _READ.get(model_type, ())]
    if refused:
        raise ValueError(f"config ({model_type}) sets {', '.join(refused)}, which this attention does not compute")
    layers = _required(config, "num_hidden_layers", model_type)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layers:
        raise ValueError(f"layer must be an integer in [0, {layers}) (num_hidden_layers={layers}), got {layer!r}")
    hidden = _required(config, "hidden_size", model_type)
    heads = _required(config, "num_attention_heads", model_type)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    # their attention reads neither key: one key head per query head
    if model_type in ("gpt_neox", "gpt2", "bert", "gptj"):
        kv_heads, head_dim = heads, hidden // heads
    if model_type == "stablelm":  # reads num_key_value_heads, not head_dim
        head_dim = hidden // heads
    if model_type == "bert" and config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"config (bert) sets position_embedding_type={config['position_embedding_type']!r}, "
                         "which this attention does not compute (only 'absolute' embeddings, added before it)")
    qkv_bias, out_bias = _biases(config, model_type)
    scale = _scale(config, model_type, head_dim, layer)
    cap = config.get("attn_logit_softcapping") if model_type in ("gemma2", "gemma3_text") else None
    qk_norm = _qk_norm(config, model_type)
    layer_type = _layer_types(config, model_type, layers)[layer]
    window = None
    if layer_type == "sliding_attention" and config.get("sliding_window"):
        # transformers' sliding_window_overlay: a query sees key j when j > i - sliding_window
        window = (int(config["sliding_window"]) - 1, 0)
    prefix, layout = FAMILIES[model_type]
    rope = None if model_type in ("gpt2", "bert") else _rope_config(config, model_type, layer_type, head_dim)
    chunk = None
    if model_type == "llama4_text":  # chunked layers rotate, the others (NoPE) do not
        rope, chunk = _llama4_layer(config, layer, layer_type, rope)
    return LayerOptions(
        model_type, hidden, heads, kv_heads, head_dim, qkv_bias, out_bias, scale, cap, model_type == "gpt_oss",
        window, qk_norm, rope, prefix.format(layer=layer), layout,
        is_causal=model_type != "bert" or bool(config.get("is_decoder", False)), ignore=_OUTSIDE.get(model_type, ()),
        attention_chunk_size=chunk,
    )


def _biases(config: Mapping[str, Any], model_type: str) -> tuple[bool, bool]:
    """Whether the layer has ``(query/key/value biases, an output bias)``."""
    if model_type in ("gpt2", "bert"):  # no bias key in their configs, biases always
        return True, True
    bias = bool(config.get("attention_bias", model_type == "gpt_neox"))  # GPTNeoXConfig's default is True
    return {"qwen2": (True, False), "phi3": (False, False), "gptj": (False, False),
            "stablelm": (bool(config.get("use_qkv_bias", False)), False)}.get(model_type, (bias, bias))


def _scale(config: Mapping[str, Any], model_type: str, head_dim: int, layer: int) -> float:
    """The factor of layer ``layer``'s logits: ``1 / sqrt(head_dim)`` unless the family sets another."""
    scale = 1.0 / math.sqrt(head_dim)
    if model_type in ("gemma2", "gemma3_text"):
        scale = config.get("query_pre_attn_scalar", head_dim) ** -0.5
    if model_type == "gpt2":
        scale = scale if config.get("scale_attn_weights", True) else 1.0
        scale = scale / (layer + 1) if config.get("scale_attn_by_inverse_layer_idx", False) else scale
    return scale


def _qk_norm(config: Mapping[str, Any], model_type: str) -> QKNorm | None:
    """The norm of the queries and keys of the family (and config), None without one."""
    eps = config.get("rms_norm_eps", 1e-6)
    qk_norm = {
        "qwen3": QKNorm("rms", True, eps),
        "gemma3_text": QKNorm("rms", True, eps, offset=1.0),
        "olmo2": QKNorm("rms", False, eps),
    }.get(model_type)
    if config.get({"stablelm": "qk_layernorm", "cohere": "use_qk_norm"}.get(model_type, ""), False):
        # a LayerNorm of each head's features, without bias, with each head's own scale
        qk_norm = QKNorm("layer", True, config.get("layer_norm_eps", 1e-5), per_head_scale=True)
    return qk_norm


def _llama4_config(config: Mapping[str, Any]) -> dict:
    """A Llama 4 text config with ``Llama4TextConfig``'s defaults where it leaves them out: its
    NoPE layers every ``no_rope_layer_interval``-th."""
    config = {**_LLAMA4, **config}
    layers = config.get("num_hidden_layers")
    if not config.get("no_rope_layers") and isinstance(layers, int):
        config["no_rope_layers"] = [int((i + 1) % config["no_rope_layer_interval"] != 0) for i in range(layers)]
    return config


def _llama4_layer(config: Mapping[str, Any], layer: int, layer_type: str, rope: dict) -> tuple[dict | None, int | None]:
    """(rope config or None, chunk size or None) of a Llama 4 text layer, as ``Llama4TextAttention``
    reads them: a layer with ``no_rope_layers[layer]`` 0 (a NoPE layer) has no rotary embedding,
    and its queries scaled by position (``attn_temperature_tuning``), which is refused; a
    ``"chunked_attention"`` layer sees the keys of its chunk of ``attention_chunk_size``."""
    if config["no_rope_layers"][layer] == 0 and config["attn_temperature_tuning"]:
        raise ValueError(
            f"config (llama4_text) sets attn_temperature_tuning, which scales the queries of its NoPE layer {layer} by "
            "position: this attention does not compute it"
        )
    chunk = config["attention_chunk_size"] if layer_type == "chunked_attention" else None
    return (rope if config["no_rope_layers"][layer] else None), chunk


def _required(config: Mapping[str, Any], key: str, model_type: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config ({model_type}) needs a positive integer {key}, got {value!r}")
    return value


def _layer_types(config: Mapping[str, Any], model_type: str, layers: int) -> list[str]:
    """Each layer's ``"sliding_attention"``/``"full_attention"``: the config's ``layer_types``,
    else the rule its transformers configuration class applies when it has none."""
    types = config.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"config's layer_types has {len(types)} entries for num_hidden_layers={layers}")
        return list(types)
    if model_type in ("gemma2", "gpt_oss"):  # alternating, the first sliding
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if model_type == "gemma3_text":
        pattern = config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if model_type in ("qwen2", "qwen3"):
        sliding = config.get("use_sliding_window", False) and config.get("sliding_window") is not None
        first = config.get("max_window_layers", layers)
        return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(layers)]
    if model_type == "llama4_text":  # Llama4TextConfig: the layers that rotate are chunked
        return ["chunked_attention" if rope else "full_attention" for rope in config["no_rope_layers"]]
    if model_type in ("mistral", "phi3") and config.get("sliding_window") is not None:
        return ["sliding_attention"] * layers
    return ["full_attention"] * layers


def _rope_config(config: Mapping[str, Any], model_type: str, layer_type: str, head_dim: int) -> dict:
    """The config the layer's ``RotaryEmbedding.from_config`` reads: the model's, with rope
    parameters of the layer's type where the model keeps one set per type (Gemma 3)."""
    rope = dict(config, head_dim=head_dim)
    if model_type in _ROPE_DEFAULTS:
        keys, key, default = _ROPE_DEFAULTS[model_type]
        if not any(k in config or k in (config.get("rope_parameters") or {}) for k in keys):
            rope[key] = default
    parameters = config.get("rope_parameters")
    if isinstance(parameters, Mapping) and layer_type in parameters and isinstance(parameters[layer_type], Mapping):
        rope["rope_parameters"] = dict(parameters[layer_type])
    elif model_type == "gemma3_text" and layer_type == "sliding_attention" and "rope_local_base_freq" in config:
        rope.pop("rope_scaling", None)  # older Gemma 3 configs: local layers, default rope at their own base
        rope["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    return rope


def layer_files(weights: str | os.PathLike, prefix: str) -> list[str]:
    """The ``.safetensors`` files holding the keys under ``prefix``: the file itself, or from a
    sharded checkpoint's ``model.safetensors.index.json``, the shards its ``weight_map`` names."""
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


# Keys under a layer's prefix that hold no weight: buffers older checkpoints saved (causal masks,
# rotary tables), read by no layout.
_BUFFERS = {"gpt_neox": ("bias", "masked_bias", "rotary_emb.inv_freq"), "gpt2": ("bias", "masked_bias"),
            "gptj": ("bias", "masked_bias")}
_FUSED_NAMES = {"gpt_neox": ("query_key_value", "dense"), "gpt2": ("c_attn", "c_proj")}
# StableLM's QK-norm: one LayerNorm per head, ``q_layernorm.norms.{head}.weight`` ``(head_dim,)``
_PER_HEAD_NORMS = {"stablelm": {"q_norm": "q_layernorm.norms.", "k_norm": "k_layernorm.norms."}}


def read_layer(weights: Any, prefix: str, read_state: Callable[[Any], Mapping], read_file: Callable[[str, str], dict]
               ) -> Mapping[str, Any]:
    """The checkpoint's keys under ``prefix``, read from as few files as hold them (all of them
    when none is, so that the loader names the keys it found). ``read_state``: a framework's
    reader of a whole checkpoint; ``read_file(path, prefix)``: the keys under ``prefix`` of one
    ``.safetensors`` file."""
    if not isinstance(weights, (str, os.PathLike)):
        if not isinstance(weights, Mapping):
            return read_state(weights)  # its TypeError names what a checkpoint may be
        return {k: v for k, v in weights.items() if str(k).startswith(prefix)} or weights
    state = {}
    for path in layer_files(weights, prefix):
        if not os.path.exists(path):
            raise FileNotFoundError(f"weights {path!r} does not exist")
        state.update(read_file(path, prefix))
    return state or read_state(weights)


def load_arguments(options: LayerOptions, state: Mapping[str, Any], concatenate: Callable[[list], Any]
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, keywords)`` for a twin's ``load_weights`` to load the layer: GPT-NeoX's and GPT-2's
    fusions, which no loader layout reads, split here (``layer_state``); for the others the keys
    a layout reads (``layer_keys``) and the layout's name, prefix and ignored keys."""
    if options.layout in ("gpt_neox", "gpt2"):
        return layer_state(options, state), {}
    return layer_keys(options, state, concatenate), {"layout": options.layout, "prefix": options.prefix,
                                                     "ignore": options.ignore}


def layer_keys(options: LayerOptions, state: Mapping[str, Any], concatenate: Callable[[list], Any]) -> dict[str, Any]:
    """The checkpoint's keys as a layout reads them: the layer's buffers (older GPT-J files)
    left out, and a per-head QK-norm's scales (StableLM's one weight ``(head_dim,)`` per head,
    joined by ``concatenate``, heads in order; Cohere's ``(heads, head_dim)``) as one
    ``q_norm.weight``/``k_norm.weight`` ``(heads * head_dim,)``. Other keys and arrays are
    passed as they are."""
    prefix = options.prefix
    buffers = {prefix + k for k in _BUFFERS.get(options.model_type, ())}
    out = {k: v for k, v in state.items() if k not in buffers}
    for norm, start in _PER_HEAD_NORMS.get(options.model_type, {}).items():
        start = prefix + start
        heads = {k: k[len(start):].removesuffix(".weight") for k in out
                 if k.startswith(start) and k.endswith(".weight")}
        if heads and all(h.isdigit() for h in heads.values()):  # else left for the layout to name
            ordered = sorted(heads, key=lambda k: int(heads[k]))
            out[prefix + norm + ".weight"] = concatenate([out.pop(k) for k in ordered])
    if options.model_type == "cohere":
        for norm in ("q_norm", "k_norm"):
            weight = out.get(f"{prefix}{norm}.weight")
            if weight is not None and len(weight.shape) == 2:
                out[f"{prefix}{norm}.weight"] = weight.reshape(-1)
    return out


def layer_state(options: LayerOptions, state: Mapping[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX or GPT-2 layer's keys (under ``options.prefix``) in this package's names.

    GPT-NeoX's ``query_key_value`` rows are ``(heads, 3, head_dim)``: each head's query, key and
    value rows together; GPT-2's ``Conv1D`` weights are ``(in, out)``, the transposes of a
    ``Linear``'s, with ``c_attn``'s columns ``[q; k; v]``. Raises one ValueError listing every
    missing, unexpected or mis-shaped key.
    """
    prefix, heads, head_dim, hidden = options.prefix, options.num_heads, options.head_dim, options.hidden_size
    fused, out = _FUSED_NAMES[options.layout]
    selected = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not selected:
        raise ValueError(f"state_dict: no key starts with prefix {prefix!r}")
    conv = options.layout == "gpt2"
    expected = {  # key -> shape as stored
        f"{fused}.weight": (hidden, 3 * hidden) if conv else (3 * hidden, hidden),
        f"{fused}.bias": (3 * hidden,),
        f"{out}.weight": (hidden, hidden),
        f"{out}.bias": (hidden,),
    }
    if not options.qkv_bias:
        expected.pop(f"{fused}.bias")
    if not options.out_bias:
        expected.pop(f"{out}.bias")
    problems = [f"missing key {prefix + k!r}" for k in expected if k not in selected]
    problems += [
        f"{prefix + k!r} has shape {tuple(selected[k].shape)}, expected {shape}"
        for k, shape in expected.items() if k in selected and tuple(selected[k].shape) != shape
    ]
    buffers = _BUFFERS[options.model_type]
    problems += [f"unexpected key {prefix + k!r}" for k in selected if k not in expected and k not in buffers]
    if problems:
        raise ValueError(f"state_dict (layout {options.layout!r}): " + "; ".join(problems))
    weight = selected[f"{fused}.weight"]
    bias = selected.get(f"{fused}.bias")
    if conv:
        weight = weight.T
    if options.layout == "gpt_neox":  # rows (heads, 3, head_dim): part i of every head
        parts = [weight.reshape(heads, 3, head_dim, hidden)[:, i].reshape(heads * head_dim, hidden) for i in range(3)]
        bias_parts = None if bias is None else [bias.reshape(heads, 3, head_dim)[:, i].reshape(-1) for i in range(3)]
    else:  # rows [q; k; v]
        parts = [weight[i * hidden:(i + 1) * hidden] for i in range(3)]
        bias_parts = None if bias is None else [bias[i * hidden:(i + 1) * hidden] for i in range(3)]
    result = {f"{name}.weight": part for name, part in zip(("q_proj", "k_proj", "v_proj"), parts)}
    if bias_parts is not None:
        result.update({f"{name}.bias": part for name, part in zip(("q_proj", "k_proj", "v_proj"), bias_parts)})
    result["out_proj.weight"] = selected[f"{out}.weight"].T if conv else selected[f"{out}.weight"]
    if f"{out}.bias" in selected:
        result["out_proj.bias"] = selected[f"{out}.bias"]
    return result
