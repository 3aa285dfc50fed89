"""Every causal-LM family of the installed transformers, accounted for.

Each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` has one record in ``RECORDS``:
supported (``from_hf`` builds it; its own model, built by transformers from a small config with
random weights, runs once, and the attention module of a layer is run again on the arguments
the model gave it: its mask and its rotary tables; both twins must give its outputs and
gradients, float64 to 1e-12 with transformers' float32 steps kept in float64 as
``test_hf_models.py`` does, float32 to 1e-6) or refused with a reason from ``REASONS`` (and
``from_hf`` raises on it). A family that transformers adds fails the census until recorded.
The table of ``docs/models.md`` is generated from the records.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pathlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import safetensors
import torch
import transformers
from flax import nnx

import mha_jax
import mha_torch
from mha_spec import families, records
from parity_tests.test_hf_models import (
    _keep_float64,
    _ours_jax,
    _ours_torch,
    _rel,
    _tables64,
    _theirs_by_our_names,
)

B, S, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2, 7, 32, 4, 2, 8
OFFSETS, LENGTHS = (3, 0), (7, 5)  # as test_hf_models.py: the same shapes, compiled once
COMMON = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
              num_hidden_layers=2, max_position_embeddings=16, intermediate_size=8, vocab_size=11, pad_token_id=0)
WINDOW = 3

# Why a family is refused: its layers compute no softmax attention, or it is an encoder-decoder,
# or its attention needs a feature this package does not compute (named).
NO_SOFTMAX = "no softmax attention (state space, linear or recurrent layers)"
ENCODER_DECODER = "encoder-decoder"
FEATURES = (
    "ALiBi", "multi-head latent attention", "value head dim != head dim",
    "relative position bias",  # a learned or bucketed bias of the distance (XLNet, Reformer, CPM-Ant)
    "differential attention",  # two softmaxes subtracted
    "learned gates on the attention",  # a gate from the input on the output, or a learned per-key bias
    "a norm inside the attention block",  # a LayerNorm before the projections, inside the saved module
    "a mask from the content",  # block-sparse or dynamic masks
    "RoFormer's sinusoidal rotary table",
    "a norm after the attention",  # a norm of the heads' output before the output projection
    "a rotation the other way",  # pairs turned by -angle
    "per-position query scaling",
    "routed query and output projections",  # experts chosen per token for the query and output projections
    "clipped projections",  # a clamp of the projections' outputs (clip_qkv)
    "shared key/value layers",  # layers that reuse another layer's keys and values
    "a checkpoint layout not yet written",
    "cross-attention",  # layers that attend to another model's states
    "a multimodal model's checkpoint (its text model's weights under another prefix)",
)
REASONS = (NO_SOFTMAX, ENCODER_DECODER, *FEATURES)


@dataclass(frozen=True)
class Supported:
    """A family ``from_hf`` builds: ``config`` its small config's own keywords, ``uses`` what it proves."""

    uses: str
    config: dict = field(default_factory=dict)
    layers: int = 2  # the config's layer count: a whole period of its layer pattern


@dataclass(frozen=True)
class Refused:
    reason: str
    detail: str = ""


# multimodal families' other towers, small (their text model's keys go under text_config)
OUTER = {
    "gemma3": dict(vision_config=dict(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=8, patch_size=4), mm_tokens_per_image=4),
    "llama4": dict(vision_config=dict(hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=8, patch_size=4, vision_output_dim=16, projector_input_dim=16,
                                      projector_output_dim=16)),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), dict(vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=8, num_heads=2, out_hidden_size=HIDDEN,
        num_position_embeddings=16))),
    "got_ocr2": dict(vision_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=16, patch_size=4, window_size=2, global_attn_indexes=[0],
                                        mlp_dim=8)),
    "moss_transcribe_diarize": dict(audio_config=dict(num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                                                      hidden_size=16)),
    "fuyu": dict(patch_size=2),
}


def _config(model_type: str, extra: dict, layers: int = 2):
    """transformers' config of the family, small, eager attention (``extra``'s None: a key left out; a multimodal
    family's keys its text model's)."""
    keywords = {k: v for k, v in dict(COMMON, num_hidden_layers=layers, **extra).items() if v is not None}
    if model_type in records.MULTIMODAL:
        keywords = dict(OUTER[model_type], text_config=keywords)
    config = transformers.AutoConfig.for_model(model_type, **keywords)
    config._attn_implementation = "eager"
    return config


def _model(config):
    """transformers' causal LM of the family with random weights (of a few units: every scale and cap matters)."""
    torch.manual_seed(0)
    auto = transformers.models.auto.modeling_auto  # a multimodal family's model that takes its whole config
    multimodal = auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if config.model_type in records.MULTIMODAL else {}
    cls = getattr(transformers, multimodal.get(config.model_type) or
                  auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type])
    model = cls._from_config(config).eval()  # float32: grouped expert kernels take no float64
    if hasattr(model, "set_default_language"):  # X-MOD's adapters: one language's
        model.set_default_language("en_XX")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (0.5 if "norm" in name else 0.0))
    return model


def _positions():
    return torch.stack([torch.arange(S) + o for o in OFFSETS])


def _captured(model, modules: dict):
    """(args, keywords) the model gives each of ``modules`` (name -> module) on a padded batch
    whose rows start at OFFSETS."""
    seen = {}
    handles = [module.register_forward_pre_hook(
        lambda module, args, kwargs, name=name: seen.setdefault(name, (args, dict(kwargs))), with_kwargs=True)
        for name, module in modules.items()]
    ids = torch.tensor(np.random.default_rng(2).integers(0, 11, (B, S)))
    live = torch.tensor(np.arange(S)[None] < np.array(LENGTHS)[:, None]).long()
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=live, position_ids=_positions(), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def text_rotary(model):
    """The model's rotary embedding of its text layers (not a multimodal model's vision tower's), None without."""
    return next((m for m in model.modules()
                 if type(m).__name__.endswith("RotaryEmbedding") and "Vision" not in type(m).__name__), None)


def _layer_rotary(model, module):
    """The rotary embedding whose tables the model gives ``module`` (of a model holding several, Granite SWA's one
    per base: the one whose tables match those the model's call gives), None without one (or, of such a model, for
    a layer it gives none)."""
    first = text_rotary(model)
    candidates = [m for m in model.modules() if type(m) is type(first)]
    if len(candidates) < 2:
        return first
    given = _captured(model, {0: module})[0][1]["position_embeddings"]
    if given is None:  # a layer that does not rotate
        return None
    zero = torch.zeros(1, dtype=torch.float32)
    return min(candidates, key=lambda m: float((m(zero, _positions())[0] - given[0]).abs().max()))


def _rotary64(model, module, cos, layer_type):
    """The rotary tables the model gave ``module`` (``cos`` of them), computed again in float64 from the
    ``inv_freq`` of the rotary embedding that gave them."""
    rotary = _layer_rotary(model, module)
    has_type = hasattr(rotary, f"{layer_type}_inv_freq")
    interleaved = type(rotary).__name__.startswith(("CohereRotary", "Cohere2"))  # not Cohere Compass's
    return _tables64(rotary, _positions(), cos.shape[-1], layer_type if has_type else None, interleaved)


def _at_dtype(model, module, layer, args, kwargs, dtype):
    """The model's arguments to a layer at ``dtype``: its additive mask at the dtype's minimum, its
    rotary tables (in float64 from ``inv_freq``), the hidden states left out."""
    torch_dtype = getattr(torch, dtype)
    kwargs = dict(kwargs)
    kwargs.pop("hidden_states", None)
    tables = kwargs.get("position_embeddings")
    if isinstance(tables, torch.Tensor) and tables.is_complex() and dtype == "float64":  # DeepSeek-V2's e^(i angle)
        rotary = text_rotary(model)
        angles = _positions()[..., None].double() * rotary.inv_freq.double()
        kwargs["position_embeddings"] = torch.polar(torch.ones_like(angles), angles) * rotary.attention_scaling
    if isinstance(tables, tuple) and dtype == "float64":
        layer_types = getattr(model.config.get_text_config(), "layer_types", None)
        kwargs["position_embeddings"] = _rotary64(model, module, tables[0],
                                                  layer_types[layer] if layer_types else None)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dtype.is_floating_point:  # Falcon's with ALiBi also holds it: left out
        kwargs["attention_mask"] = torch.zeros(mask.shape, dtype=torch_dtype).masked_fill(
            mask < torch.finfo(mask.dtype).min / 2, torch.finfo(torch_dtype).min)
    for key, value in kwargs.items():
        if isinstance(value, transformers.Cache):  # XLM's, filled by the model's call: the layer runs alone
            kwargs[key] = None
        elif isinstance(value, tuple) and all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in value):
            kwargs[key] = tuple(v.to(torch_dtype) for v in value)
        elif key != "attention_mask" and isinstance(value, torch.Tensor) and value.is_floating_point():
            kwargs[key] = value.to(torch_dtype)  # ALiBi's tensors (bloom's, Falcon's alibi, MPT's position_bias)
    return args[1:], kwargs


def _positional(module, given, rest, hidden):
    """The layer's positional arguments after its input, for the input ``hidden``: where the model
    gave its input again (``given``: CTRL's ``forward(v, k, q)``), ``hidden``; Bloom's ``residual``
    (added inside its attention) zero, for the attention alone."""
    names = list(inspect.signature(module.forward).parameters)[1:]
    return [torch.zeros_like(hidden) if name == "residual" else hidden if a is given else a
            for name, a in zip(names, rest)]


def _attention_output(out):
    """The attention's output from what its module returns: a tensor, or the first of a tuple (a
    list: OpenAI GPT's); GPT-NeoX-Japanese's output bias, returned apart for its block to add, added."""
    if not isinstance(out, (tuple, list)):
        return out
    bias = out[2] if len(out) == 3 and isinstance(out[2], torch.Tensor) else None
    return out[0] if bias is None or bias.shape != out[0].shape[-1:] else out[0] + bias


def _theirs(model, options, layer, call, dtype, monkeypatch):
    """transformers' attention of ``layer`` on the arguments its model gave it (``call``):
    inputs, output, gradients by our names, the layer's checkpoint."""
    module = copy.deepcopy(model.get_submodule(options.prefix.rstrip("."))).to(getattr(torch, dtype))
    rest, kwargs = _at_dtype(model, model.get_submodule(options.prefix.rstrip(".")), layer, *call, dtype)
    if dtype == "float64":
        _keep_float64(monkeypatch, module)
    x = np.random.default_rng(0).normal(size=(B, S, options.input_size or HIDDEN))
    hidden = torch.tensor(x, dtype=getattr(torch, dtype), requires_grad=True)
    rest = _positional(module, call[0][0] if call[0] else call[1].get("hidden_states"), rest, hidden)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # XGLM's clamp builds its bound at the default dtype
    try:
        if options.ignore:  # BERT's block: its self-attention and output projection, not the residual and norm
            out = module.output.dense(module.self(hidden, *rest, **kwargs)[0])
        else:
            out = _attention_output(module(hidden, *rest, **kwargs))
    finally:
        torch.set_default_dtype(default)
    blind = _blind(kwargs.get("attention_mask"), out.shape[:2])[..., None]
    d_out = np.where(blind, 0.0, np.random.default_rng(1).normal(size=out.shape))
    out.backward(torch.tensor(d_out, dtype=out.dtype))
    grads = {"input": hidden.grad}
    grads.update({name: p.grad for name, p in module.named_parameters() if p.grad is not None})
    state = {options.prefix + k: v.detach().clone() for k, v in module.state_dict().items()}
    inputs = (x, _positions().numpy(), None, d_out)
    return inputs, np.where(blind, 0.0, out.detach().double().numpy()), _theirs_by_our_names(grads, options), state


def _blind(mask, shape) -> np.ndarray:
    """``(batch, len)``: the queries whose every key transformers' mask hides (a padding query whose window holds
    padding alone: a window of 2 keys). Transformers' eager softmax spreads such a row over every key (each logit
    plus the dtype's minimum, all equal), ours is 0 (no key to attend): both taken as 0, given no gradient. Only
    an additive mask is read: a boolean one means "hidden" in some families (MPT) and "seen" in others."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or not mask.dtype.is_floating_point:
        return np.zeros(shape, bool)
    return ~(mask > torch.finfo(mask.dtype).min / 2).any(-1).any(1).numpy()


def _grad_error(ours: dict, theirs: dict) -> float:
    """The worst relative error over the gradients, each floored at a hundredth of the largest
    gradient's norm: a gradient that is 0 in exact arithmetic (a key bias without rotary shifts a
    row's logits alike) is rounding noise on both sides, of the size of the others' rounding."""
    floor = 1e-2 * max(float(np.linalg.norm(g)) for g in theirs.values())
    return max(float(np.linalg.norm(ours[k] - theirs[k])) / max(float(np.linalg.norm(theirs[k])), floor)
               for k in theirs)


def _representatives(raw: dict, count: int) -> list[int]:
    """The first layer of each kind (its options but the prefix): every kind of attention layer the config has,
    once (a config without one: layer 0, refused naming its kind)."""
    kinds = {}
    for layer in families.attention_layers(raw) or [0]:
        options = families.layer_options(raw, layer)
        kinds.setdefault(repr(dataclasses.replace(options, prefix="")), layer)
    return sorted(kinds.values())


class _Bare:
    """A transformers config as a config.json may hold it: without the per-layer keys its class fills in."""

    def __init__(self, config):
        self.config = config

    def to_dict(self) -> dict:
        raw = {k: v for k, v in self.config.to_dict().items() if k not in DERIVED}
        if isinstance(raw.get("text_config"), dict):  # a multimodal model's
            raw["text_config"] = {k: v for k, v in raw["text_config"].items() if k not in DERIVED}
        return raw


TWINS = ("torch", "jax")


def check_family(model_type: str, record: Supported, dtypes, monkeypatch, layers=None, bare: bool = False,
                 model=None, twins=TWINS) -> dict:
    """Layers ``layers`` (default: one of each kind; ``test_every_layer_reads_as_transformers_model_uses_it``
    checks that the kinds are the model's) of the family's small model, both twins against it (``bare``: read
    from its config without ``DERIVED`` keys; ``model``: the family's small model, built once by the caller;
    ``twins``: those of ``TWINS`` to run):
    dtype -> the worst (output, gradient) errors."""
    config = _config(model_type, record.config, record.layers)
    model = _model(config) if model is None else model
    ours = _Bare(config) if bare else config
    raw = families.read_config(ours.to_dict())
    layers = _representatives(raw, record.layers) if layers is None else layers
    options = {layer: families.layer_options(raw, layer) for layer in layers}
    calls = _captured(model, {layer: model.get_submodule(o.prefix.rstrip(".")) for layer, o in options.items()})
    worst = {}
    for dtype in dtypes:
        out_worst = grad_worst = 0.0
        for layer in layers:
            inputs, out_hf, theirs, state = _theirs(model, options[layer], layer, calls[layer], dtype, monkeypatch)
            for run in [run for twin, run in (("torch", _ours_torch), ("jax", _ours_jax)) if twin in twins]:
                out, grads = run(ours, layer, state, inputs, dtype)
                assert sorted(grads) == sorted(theirs), (run.__name__, sorted(grads), sorted(theirs))
                out_worst = max(out_worst, _rel(out, out_hf))
                grad_worst = max(grad_worst, _grad_error(grads, theirs))
            monkeypatch.undo()
        worst[dtype] = out_worst, grad_worst
    return worst


_TESTED = "proven in test_hf_models.py"
_MOE = dict(num_local_experts=2, num_experts_per_tok=1)
_MOE_EXPERTS = dict(num_experts=2, num_experts_per_tok=1)
_MAMBA = dict(mamba_n_heads=8, mamba_d_state=4, mamba_chunk_size=4)  # Mamba 2 layers beside attention, small
_TEXT = FEATURES[-1]
_HYBRID = NO_SOFTMAX
_BERT = dict(is_decoder=True)
_PLAIN = dict(num_key_value_heads=None, head_dim=None)  # families with one key head per query head
RECORDS: dict[str, Supported | Refused] = {
    # families proven in test_hf_models.py on their own (their record there names what each proves)
    **{name: Supported(_TESTED) for name in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss",
                                             "olmo2", "phi3", "gpt_neox", "gpt2", "gptj", "stablelm", "cohere")},
    "llama4_text": Supported("proven in test_chunked.py: chunked layers, NoPE layers; use_qk_norm (a weightless RMS "
                             "norm per head) and attn_temperature_tuning (NoPE layers' queries scaled by position) in "
                             "test_hf_config_variants.py",
                             dict(attn_temperature_tuning=False, attention_chunk_size=16, no_rope_layer_interval=2,
                                  use_qk_norm=False, **_MOE)),
    "bert": Supported("a decoder (is_decoder): causal, biases, no rotary; its block's LayerNorm left unread",
                      dict(is_decoder=True, num_key_value_heads=None, head_dim=None)),
    "gpt-sw3": Supported(_TESTED),  # GPT-2's classes, its config's model_type gpt2
    **{name: Supported("BERT's self-attention as a decoder (is_decoder): causal, biases, no rotary; the block's "
                       "LayerNorm left unread", dict(is_decoder=True, num_key_value_heads=None, head_dim=None))
       for name in ("bert-generation", "camembert", "data2vec-text", "electra", "ernie", "rembert", "roberta",
                    "roc_bert", "xlm-roberta", "xmod")},
    **{name: Supported("biases, positions added before it, the output projection out_proj",
                       dict(num_key_value_heads=None, head_dim=None)) for name in ("opt", "biogpt", "xglm")},
    "mixtral": Supported("Mistral's layer: sliding window", dict(sliding_window=WINDOW, **_MOE)),
    "ministral": Supported("sliding layers from layer_types", dict(sliding_window=WINDOW)),
    "ministral3": Supported("queries scaled by position (rope parameters' llama_4_scaling_beta), yarn rope",
                            dict(rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=2.0,
                                                      original_max_position_embeddings=2, llama_4_scaling_beta=0.5,
                                                      max_position_embeddings=16))),
    "starcoder2": Supported("biases on all four projections (use_bias), sliding window", dict(sliding_window=WINDOW)),
    "qwen2_moe": Supported("q/k/v biases (qkv_bias)", dict(num_experts=2, num_experts_per_tok=1)),
    "qwen3_moe": Supported("RMS QK-norm per head", dict(num_experts=2, num_experts_per_tok=1)),
    "gemma": Supported("Llama's layer"),
    "vaultgemma": Supported("soft-cap, query_pre_attn_scalar, alternating sliding layers",
                            dict(sliding_window=WINDOW, attn_logit_softcapping=2.0, query_pre_attn_scalar=12)),
    "olmo": Supported("the projections clamped (clip_qkv)", dict(clip_qkv=0.5)),
    "olmo3": Supported("RMS QK-norm over the projection, rope parameters per layer type, sliding layers",
                       dict(sliding_window=WINDOW), layers=5),
    "olmoe": Supported("RMS QK-norm over the projection, the projections clamped after it (clip_qkv)",
                       dict(clip_qkv=0.5, num_experts=2, num_experts_per_tok=1)),
    "flex_olmo": Supported("RMS QK-norm over the projection", dict(num_experts=2, num_experts_per_tok=1)),
    "phimoe": Supported("biases (attention_bias), sliding window", dict(sliding_window=WINDOW, **_MOE)),
    "granite": Supported("the scale from attention_multiplier", dict(attention_multiplier=0.2)),
    "granitemoe": Supported("the scale from attention_multiplier", dict(attention_multiplier=0.2, **_MOE)),
    "granitemoeshared": Supported("the scale from attention_multiplier", dict(attention_multiplier=0.2, **_MOE)),
    "hyperclovax": Supported("the scale from attention_multiplier", dict(attention_multiplier=0.2)),
    "helium": Supported("interleaved pairs (2i, 2i + 1)"),
    "glm": Supported("interleaved pairs, half of each head rotating"),
    "glm4": Supported("interleaved pairs, half of each head rotating, q/k/v biases"),
    "glm4_moe": Supported("half of each head rotating, RMS QK-norm (use_qk_norm)",
                          dict(use_qk_norm=True, n_routed_experts=2, num_experts_per_tok=1)),
    "seed_oss": Supported("head_dim not hidden / heads, the output bias apart (attention_out_bias)",
                          dict(attention_bias=True)),
    "smollm3": Supported("no_rope_layers: every 4th layer without rotary, sliding NoPE layers",
                         dict(use_sliding_window=True, sliding_window=WINDOW), layers=5),
    "arcee": Supported("Llama's layer"),
    "aria_text": Refused(_TEXT),
    "apertus": Supported("RMS QK-norm per head"),
    "ernie4_5": Supported("interleaved pairs (its rotation in float32), biases (use_bias)", dict(use_bias=True)),
    "exaone4": Supported("RMS QK-norm, sliding layers, rotary on the sliding layers only",
                         dict(sliding_window=WINDOW), layers=5),
    "exaone_moe": Supported("RMS QK-norm, sliding layers, rotary on the sliding layers only",
                            dict(sliding_window=WINDOW, num_experts=2, num_experts_per_tok=1), layers=5),
    "cohere2": Supported("interleaved pairs, sliding layers, rotary on the sliding layers only",
                         dict(sliding_window=WINDOW), layers=5),
    "ernie4_5_moe": Supported("interleaved pairs (its rotation in float32), biases (use_bias)",
                              dict(use_bias=True, moe_num_experts=2, moe_k=1)),
    "cohere2_moe": Supported("interleaved pairs, sliding layers, rotary on the sliding layers only",
                             dict(sliding_window=WINDOW, num_experts=2, num_experts_per_tok=1), layers=5),
    "internlm3": Supported(_TESTED),  # LlamaForCausalLM itself
    "iquestcoder": Supported(_TESTED),  # LlamaForCausalLM itself
    "jais2": Supported("Llama's layer"),
    "nemotron": Supported("half of each head rotating"),
    "cwm": Supported("sliding layers from layer_types", dict(sliding_window=WINDOW)),
    "phi": Supported("q/k/v and output (dense) biases, half of each head rotating (its QK LayerNorm, with a bias, "
                     "refused)"),
    "persimmon": Supported("a fused query_key_value with each head's rows together, half of each head rotating "
                           "(its QK LayerNorm, with a bias, refused)", dict(qk_layernorm=False, head_dim=None)),
    "falcon": Supported("a fused query_key_value: one key head (multi_query) or grouped (new_decoder_architecture); "
                        "ALiBi (alibi: bloom's slopes in bfloat16, added before the scale)", dict(head_dim=None)),
    "solar_open": Supported("q/k/v biases", dict(attention_bias=True, n_routed_experts=2, num_experts_per_tok=1)),
    "minimax_m2": Supported("RMS QK-norm over the projection", dict(rotary_dim=HEAD_DIM, **_MOE)),
    "minimax_m3_vl_text": Supported("RMS QK-norm per head (1 + weight), the rope parameters' partial_rotary_factor "
                                    "(rotary_dim unread); its sparse layers (minimax_m3_sparse: an indexer's top-k "
                                    "blocks) refused by kind",
                                    dict(rope_parameters=dict(rope_type="default", rope_theta=100.0,
                                                              partial_rotary_factor=0.5), rotary_dim=2, **_MOE)),
    "dots1": Supported("RMS QK-norm per head", dict(n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1)),
    "mellum": Supported("RMS QK-norm per head"),
    "kolibri1": Supported("RMS QK-norm, sliding layers, rotary on the sliding layers only",
                          dict(sliding_window=WINDOW), layers=5),
    "hy_v3": Supported("RMS QK-norm per head", dict(num_experts=2, num_experts_per_tok=1)),
    "flint": Supported("sinks, RMS QK-norm per head, rotary on the sliding layers only (none without a window)",
                       dict(sliding_window=WINDOW, num_experts=2, num_experts_per_tok=1), layers=4),
    "granite_swa": Supported("sinks as a scale of the output (sigmoid(logsumexp - sink)), attention_multiplier, "
                             "sliding layers, a rotary base per layer (layer_rope_theta, 0: none)",
                             dict(sliding_window=WINDOW, attention_multiplier=0.2,
                                  layer_rope_theta=[10000.0, 10000.0, 0.0]), layers=3),
    "bloom": Supported("ALiBi (bloom's slopes), each head's q, k, v rows together in query_key_value, biases",
                       _PLAIN),
    "mpt": Supported("ALiBi (MPT's slopes, alibi_bias_max), [q; k; v] in one Wqkv clamped (clip_qkv), softmax_scale "
                     "from attn_config (qk_ln, prefix_lm refused)",
                     dict(_PLAIN, attn_config=dict(softmax_scale=0.3, clip_qkv=0.5))),
    "modernbert-decoder": Supported("sliding layers (local_attention // 2 keys), rope parameters per layer type, "
                                    "the output projection Wo", dict(_PLAIN, local_attention=2 * WINDOW), layers=3),
    "gpt_neox_japanese": Supported("GPT-NeoX's fused query_key_value without biases, the last layer's output bias "
                                   "(dense_bias, added by its block)", _PLAIN),
    "xlm": Supported("its own projection names (q_lin, k_lin, v_lin, out_lin), biases, positions added before it; "
                     "bidirectional unless causal (compared bidirectional: its causal mask lets padded queries see "
                     "padding)", _PLAIN),
    "jetmoe": Refused("routed query and output projections", "a mixture of attention experts (JetMoeMoA)"),
    "openai-gpt": Supported("GPT-2's fused Conv1D c_attn, biases, no rotary", _PLAIN),
    "ctrl": Supported("its own projection names (Wq, Wk, Wv, dense), biases, positions added before it", _PLAIN),
    "gpt_neo": Supported("logits not scaled, local layers (window_size keys, itself included), an output bias",
                         dict(_PLAIN, window_size=WINDOW, attention_types=[[["global", "local"], 1]])),
    "gpt_bigcode": Supported("a fused c_attn: one key head, [q; k; v] (multi_query), biases, no rotary", _PLAIN),
    "codegen": Supported("a fused qkv_proj in 4 blocks of (q, v, k), pairs (2i, 2i + 1) in the first rotary_dim",
                         dict(_PLAIN, rotary_dim=4)),
    # refused: no softmax attention in some or all layers
    **{name: Refused(NO_SOFTMAX) for name in ("falcon_mamba", "mamba", "mamba2", "rwkv", "xlstm")},
    **{name: Refused("learned gates on the attention", "its softmax layers (a hybrid's; the others linear "
                     "attention) gate each head's output by a sigmoid of the input") for name in (
        "bailing_hybrid",)},
    "lfm3": Supported("its attention layers (layer_types; the others convolutions): a sigmoid gate on each head's "
                      "output (g_proj), RMS QK-norm per head, sliding layers, the full layers' proportional rotary "
                      "(half of each head's frequencies zero)",
                      dict(sliding_window=WINDOW), layers=5),
    **{name: Supported("its softmax layers (layer_types; the others gated delta nets): a sigmoid gate on each "
                       "output feature (its rows after each head's query rows in q_proj), RMS QK-norm (1 + weight), "
                       "a quarter of each head rotating", dict(layer_types=["linear_attention", "full_attention"],
                                                                linear_num_key_heads=2, linear_num_value_heads=2,
                                                                linear_key_head_dim=8, linear_value_head_dim=8,
                                                                **_MOE_EXPERTS))
       for name in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "hrm_text": Refused("learned gates on the attention", "a sigmoid gate on each feature of the output, two stacks "
                        "of layers, instructions attended bidirectionally"),
    **{name: Refused("a mask from the content", "indexed attention (a top-k sparse mask) on its softmax layers, "
                     "linear attention on the others") for name in ("qwen4_exp", "qwen4_exp_text")},
    **{name: Refused("relative position bias", "learned relative logits, and short convolutions of the keys and "
                     "values") for name in ("inkling_text", "inkling2_text")},
    "zamba2": Refused("a checkpoint layout not yet written", "shared attention blocks over [hidden; embeddings] "
                      "with LoRA adapters per layer (use_shared_attention_adapter) and rotary (use_mem_rope)"),
    "zamba": Supported("its hybrid layers (layers_block_type; the others Mamba layers): one attention block shared "
                       "by all (its keys the first's), over [hidden; embeddings] (attention_hidden_size), scaled by "
                       "(head_dim / 2) ** -0.5, no rotary",
                       dict(attention_head_dim=8, n_mamba_heads=2, mamba_d_state=4, attn_layer_period=2,
                            attn_layer_offset=0), layers=4),
    "zaya": Refused("a checkpoint layout not yet written", "its queries and keys from a CCA projection "
                    "(convolutions inside the projection)"),
    # hybrid models: their softmax attention layers (the others refused by kind: test_a_hybrid_model_s_...)
    "lfm2": Supported("its attention layers (full_attn_idxs; the others convolutions): RMS QK-norm per head "
                      "(q_layernorm, k_layernorm), the output projection out_proj", dict(full_attn_idxs=[1])),
    "lfm2_moe": Supported("its attention layers (layer_types; the others convolutions): RMS QK-norm per head, "
                          "the output projection out_proj",
                          dict(layer_types=["conv", "full_attention"], num_dense_layers=1, **_MOE_EXPERTS)),
    "minimax": Supported("its softmax layers (layer_types; the others lightning attention): Mixtral's, every one "
                         "sliding with a sliding_window", dict(sliding_window=WINDOW, **_MOE)),
    "olmo_hybrid": Supported("its attention layers (layer_types; the others gated delta nets): RMS QK-norm over the "
                             "projection, rotary only with rope parameters", dict(linear_num_key_heads=2)),
    "jamba": Supported("its attention layers (attn_layer_period, attn_layer_offset; the others Mamba): no rotary",
                       dict(attn_layer_period=2, attn_layer_offset=1, num_experts=2, expert_layer_period=2)),
    "bamba": Supported("its attention layers (attn_layer_indices; the others Mamba 2): half of each head rotating",
                       dict(attn_layer_indices=[1], **_MAMBA)),
    "nemotron_h": Supported("its attention layers (layers_block_type; the others Mamba 2, MLP, MoE): no rotary, "
                            "under mixer", dict(layers_block_type=["linear_attention", "full_attention"], **_MAMBA)),
    "granitemoehybrid": Supported("its attention layers (layer_types; the others Mamba 2): attention_multiplier, "
                                  "rotary with position_embedding_type='rope'",
                                  dict(layer_types=["mamba", "attention"], position_embedding_type="rope",
                                       attention_multiplier=0.2, **_MAMBA, **_MOE)),
    "falcon_h1": Supported("every layer (Mamba 2 beside it): the keys times key_multiplier (the scale times it)",
                           dict(key_multiplier=0.7, **_MAMBA)),
    "granitemoe_swa": Supported("Granite SWA's: sinks as a scale of the output, sliding layers, a rotary base per "
                                "layer", dict(sliding_window=WINDOW, attention_multiplier=0.2,
                                              layer_rope_theta=[10000.0, 10000.0, 0.0], **_MOE), layers=3),
    **{name: Refused(ENCODER_DECODER) for name in (
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "musicgen", "musicgen_melody",
        "mvp", "pegasus", "plbart", "prophetnet", "whisper", "trocr")},
    **{name: Supported("multi-head latent attention: low-rank projections, the rope part, v_head_dim apart", dict(
        head_dim=None, num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        n_group=1, topk_group=1)) for name in ("deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "axk1")},
    "recurrent_gemma": Supported("its attention blocks (block_types; the others recurrent): every one sliding "
                                 "(attention_window_size), half of each head rotating, an output bias",
                                 dict(_PLAIN, attention_window_size=WINDOW, block_types=["recurrent", "attention"],
                                      lru_width=HIDDEN)),
    "kimi_linear": Supported("its latent attention layers (layer_types; the others delta attention): multi-head "
                             "latent attention without rotary", dict(
                                 head_dim=None, num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=8,
                                 qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=12, num_local_experts=2,
                                 num_experts_per_tok=1, moe_intermediate_size=8, linear_num_heads=2,
                                 linear_head_dim=8, layer_types=["linear_attention", "full_attention"])),
    "deepseek_v2": Supported("multi-head latent attention, its rotation as complex products e^(i angle) of the "
                             "pairs (2i, 2i + 1): interleaved pairs", dict(
                                 head_dim=None, num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=8,
                                 qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=12, n_routed_experts=2,
                                 num_experts_per_tok=1, moe_intermediate_size=8, n_group=1, topk_group=1)),
    "longcat_flash": Refused("multi-head latent attention", "its scales of the query and latent (mla_scale_*_lora)"),
    **{name: Refused("a mask from the content", "DSA's indexer, a top-k sparse mask") for name in (
        "deepseek_v32", "glm_moe_dsa", "axk2")},
    **{name: Refused("learned gates on the attention", "a gate on each head's output, and DSA's indexer") for name in (
        "dots3_note", "dots3_note_text", "hy_v4")},
    "mimo_v2_flash": Refused("value head dim != head dim", "on a module without latent attention; and its sliding "
                             "layers' doubled key/value heads, their sinks, its values scaled (attention_value_scale)"),
    **{name: Refused("relative position bias") for name in ("cpmant", "xlnet", "reformer", "deepseek_v4")},
    **{name: Refused("differential attention") for name in ("diffllama",)},
    **{name: Refused("learned gates on the attention") for name in ("beam",)},
    "laguna": Supported("a softplus gate on each head's output (g_proj), RMS QK-norm per head, sliding layers, each "
                        "layer's own query head count, rope parameters per layer type (half of each head rotating "
                        "on the full layers)", dict(layer_types=["sliding_attention", "full_attention"],
                                                     sliding_window=WINDOW, num_attention_heads_per_layer=[4, 2],
                                                     **_MOE_EXPERTS)),
    "afmoe": Supported("a sigmoid gate on each output feature (gate_proj), RMS QK-norm per head, sliding layers, "
                       "rotary on the sliding layers only", dict(sliding_window=WINDOW, global_attn_every_n_layers=2,
                                                                 num_experts=2, num_experts_per_tok=1,
                                                                 num_dense_layers=1), layers=2),
    "blt": Refused("cross-attention", "between bytes and patches"),
    "dbrx": Supported("[q; k; v] in one Wqkv clamped (attn_config's clip_qkv), key heads attn_config's kv_n_heads",
                      dict(_PLAIN, d_model=HIDDEN, attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=500.0),
                           ffn_config=dict(hidden_size=HIDDEN, ffn_hidden_size=8, moe_num_experts=2, moe_top_k=1))),
    "doge": Refused("a mask from the content", "its dynamic mask"),
    **{name: Refused("a norm after the attention") for name in ("bitnet",)},
    "hunyuan_v1_dense": Supported("RMS QK-norm per head after the rotary embedding (query_layernorm, "
                                  "key_layernorm), biases (attention_bias), NTK-alpha rotary (rope parameters' alpha: "
                                  "the base times alpha ** (d / (d - 2)))",
                                  dict(attention_bias=True, rope_parameters=dict(rope_type="dynamic", alpha=2.0,
                                                                                 rope_theta=100.0, factor=1.0))),
    "hunyuan_v1_moe": Supported("RMS QK-norm per head after the rotary embedding (query_layernorm, key_layernorm)",
                                dict(num_experts=2, moe_topk=1)),
    "nanochat": Supported("its rotation by -angle (rotate_half (x2, -x1)): the second half of each head's rotary "
                          "rows of q_proj and k_proj negated when loading, which turns it by +angle and cancels in "
                          "the scores; a weightless RMS norm per head after the rotation (which undoes yarn's "
                          "attention factor)"),
    **{name: Refused("a checkpoint layout not yet written") for name in (
        "git", "moshi")},
    "cohere_compass_text": Supported("sliding layers, rope parameters per layer type (None: the layer does not "
                                     "rotate), its M-RoPE sections over a text's positions the plain rotation",
                                     dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW,
                                          rope_parameters={"sliding_attention": dict(
                                              rope_type="default", rope_theta=100.0, mrope_section=[2, 1, 1]),
                                              "full_attention": None})),
    **{name: Refused("cross-attention") for name in ("mllama",)},
    # a LayerNorm before the attention inside its block, or block-sparse or rotary BERTs
    **{name: Refused("a norm inside the attention block") for name in (
        "megatron-bert", "roberta-prelayernorm", "xlm-roberta-xl")},
    "big_bird": Refused("a mask from the content", "block-sparse attention (attention_type='block_sparse')"),
    "roformer": Refused("RoFormer's sinusoidal rotary table"),
    "gemma3n_text": Supported("RMS QK-norm per head, the values RMS-normed per head (v_norm), logits not scaled, "
                              "sliding layers, rope parameters per layer type; its layers that reuse another's keys "
                              "and values (num_kv_shared_layers) refused by kind",
                              dict(sliding_window=WINDOW, num_kv_shared_layers=0, laurel_rank=4, altup_num_inputs=2,
                                   hidden_size_per_layer_input=4, vocab_size_per_layer_input=11), layers=5),
    "gemma3n": Refused(_TEXT, "its text model is gemma3n_text's"),
    **{name: Refused("shared key/value layers") for name in (
        "gemma4", "gemma4_text", "gemma4_assistant", "gemma4_unified",
        "gemma4_unified_text", "gemma4_unified_assistant")},
    **{name: Refused(_TEXT) for name in ("emu3", "phi4_multimodal")},
}
# multimodal families: their text model's attention (its record's config under text_config), under its own prefix
TEXT_MODELS = {name: transformers.CONFIG_MAPPING[name]().text_config.model_type for name in records.MULTIMODAL}
RECORDS.update({name: Supported(
    f"its text model's ({text}'s) attention, under {records.MULTIMODAL[name][0]}"
    + "".join(f" ({start} in checkpoints saved in the older layout)" for start in records.MULTIMODAL[name][1:]),
    RECORDS[text].config, RECORDS[text].layers) for name, text in TEXT_MODELS.items()})


def test_every_causal_lm_family_of_transformers_is_recorded():
    """Each family of the installed transformers is supported or refused with a listed reason; a
    family that transformers adds (or drops) fails here until its record is written."""
    names = set(transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert sorted(names - set(RECORDS)) == [], "families without a record"
    assert sorted(set(RECORDS) - names) == [], "records of families transformers does not have"
    assert all(r.reason in REASONS for r in RECORDS.values() if isinstance(r, Refused))
    supported = [name for name, r in RECORDS.items() if isinstance(r, Supported)]
    assert all(name in families.FAMILIES or name in records.MULTIMODAL for name in supported)
    assert len(supported) >= 126, len(supported)


REFUSED_OPTIONS = {  # a supported family with an option it does not compute: (config keywords, feature)
    "mpt": (dict(attn_config=dict(qk_ln=True)), "QK LayerNorm"),
    "phi": (dict(qk_layernorm=True), "QK LayerNorm with bias"),
    "persimmon": (dict(head_dim=None), "QK LayerNorm with bias"),
}


def test_the_families_that_rotate_pairs_are_those_whose_records_say_so():
    """``rope_from_config`` (``RotaryEmbedding.from_config``) rotates pairs ``(2i, 2i + 1)`` for a
    config whose family's record sets ``rope_interleaved``, the halves for every other family."""
    from mha_spec.rotary import rope_from_config

    pairs = {"gptj", "codegen", "llama4_text", "cohere", "cohere2", "cohere2_moe", "glm", "glm4", "helium", "ernie4_5",
             "ernie4_5_moe"}
    assert {name for name, family in families.FAMILIES.items() if family.rope_interleaved} == pairs
    for name in (*families.FAMILIES, "t5", None):
        assert rope_from_config(dict(model_type=name, rope_theta=10.0, head_dim=HEAD_DIM))["interleaved"] == (
            name in pairs), name


@pytest.mark.parametrize("heads", [12, 71])
def test_alibi_slopes_are_those_transformers_builds(heads):
    """Each ALiBi family's slopes, for head counts that are not powers of two, against the tensors
    its transformers model builds (the key at position 1): bloom's float32 ones, Falcon's rounded to
    bfloat16 (ours over ``sqrt(head_dim)``: it adds them before the scale), MPT's."""
    from transformers.models.bloom import modeling_bloom
    from transformers.models.falcon import modeling_falcon
    from transformers.models.mpt import modeling_mpt

    keys = torch.ones(1, 2, dtype=torch.long)
    head_dim = 2
    expected = {
        "bloom": modeling_bloom.build_alibi_tensor(keys, heads, torch.float32)[:, 0, 1],
        "falcon": modeling_falcon.build_alibi_tensor(keys, heads, torch.float32)[:, 0, 1],
        "mpt": -modeling_mpt.build_mpt_alibi_tensor(heads, 2)[:, 0, 0],
    }
    for name, theirs in expected.items():
        raw = dict(model_type=name, hidden_size=heads * head_dim, num_attention_heads=heads, num_hidden_layers=1,
                   alibi=True)
        ours = np.array(families.layer_options(raw, 0).alibi_slopes) * (np.sqrt(head_dim) if name == "falcon" else 1)
        assert np.allclose(ours, theirs.double().numpy(), rtol=1e-15, atol=0), name


def test_falcon_alibi_is_its_sdpa_path():
    """Falcon with ``alibi``: its model's SDPA path (the ALiBi in its mask, over ``sqrt(head_dim)``)
    computes what ``from_hf`` builds, as its original code did (``(q.k + alibi) * inv_norm_factor``);
    its eager path adds the ALiBi a second time (in its attention and in the model's mask), which
    the census leaves out by giving the attention the causal mask alone."""
    model_type, record = VARIANTS["falcon-alibi"]
    config = _config(model_type, record.config, record.layers)
    config._attn_implementation = "sdpa"
    model = _model(config)
    options = families.layer_options(config.to_dict(), 1)
    attention = model.get_submodule(options.prefix.rstrip("."))
    args, kwargs = _captured(model, {1: attention})[1]
    kwargs.pop("hidden_states", None)
    x = torch.tensor(np.random.default_rng(0).normal(size=(B, S, HIDDEN)), dtype=torch.float32)
    state = {options.prefix + k: v for k, v in attention.state_dict().items()}
    with torch.no_grad():
        theirs = attention(x, *args[1:], **kwargs)[0]
        ours = mha_torch.from_hf(config.to_dict(), state, layer=1)(
            x, is_causal=True, query_positions=_positions(), key_value_seq_lengths=torch.tensor(LENGTHS))
    live = torch.arange(S)[None] < torch.tensor(LENGTHS)[:, None]
    assert _rel(ours[live].double().numpy(), theirs[live].double().numpy()) < 1e-6


def test_read_config_names_the_sizes_of_every_supported_family():
    """``read_config`` of each supported family's config as transformers saves it holds its sizes
    under our names (``mha-parity verify`` reads them there), whatever the family calls them."""
    for name, record in RECORDS.items():
        if isinstance(record, Supported) and record.uses != _TESTED:
            raw = families.read_config(_config(name, record.config, record.layers).to_dict())
            sizes = [raw.get(k) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers")]
            assert sizes == [HIDDEN, HEADS, record.layers], (name, sizes)


def test_an_older_modernbert_decoder_config_reads_as_its_config_class_fills_it_in():
    """A ModernBERT decoder config.json of the older form (``local_attention``, ``global_rope_theta``,
    ``local_rope_theta``, ``rope_scaling``; no ``sliding_window``, ``layer_types`` or per-type
    ``rope_parameters``): each layer's window and rope parameters as ``ModernBertDecoderConfig`` derives them."""
    old = dict(model_type="modernbert-decoder", hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=4,
               local_attention=6, global_rope_theta=1234.0, local_rope_theta=55.0, global_attn_every_n_layers=2,
               rope_scaling=dict(rope_type="linear", factor=2.0))
    theirs = transformers.ModernBertDecoderConfig(**{k: v for k, v in old.items() if k != "model_type"})
    for layer in range(4):
        options = families.layer_options(old, layer)
        layer_type = theirs.layer_types[layer]
        assert options.window == ((theirs.sliding_window - 1, 0) if layer_type == "sliding_attention" else None)
        assert options.rope["rope_parameters"] == theirs.rope_parameters[layer_type], layer


def test_xlm_is_causal_where_its_config_says_causal():
    """XLM's attention is causal when its config sets ``causal`` (its model's triangular mask), else bidirectional."""
    for causal in (False, True):
        raw = _config("xlm", dict(_PLAIN, causal=causal)).to_dict()
        assert families.layer_options(families.read_config(raw), 1).is_causal is causal


def test_a_fused_layer_names_its_missing_keys_as_its_checkpoint_names_them():
    """GPT-NeoX-Japanese's last layer without its output bias: the error names ``dense_bias``, the
    key its checkpoint holds, not the name it is read under."""
    raw = _config("gpt_neox_japanese", _PLAIN).to_dict()
    prefix = families.layer_options(raw, 1).prefix
    state = {prefix + "query_key_value.weight": torch.zeros(3 * HIDDEN, HIDDEN),
             prefix + "dense.weight": torch.zeros(HIDDEN, HIDDEN)}
    for from_hf in (mha_jax.from_hf, mha_torch.from_hf):
        with pytest.raises(ValueError, match=rf"missing key '{prefix}dense_bias'"):
            from_hf(raw, {k: v.numpy() for k, v in state.items()}, layer=1)


def test_a_head_dim_apart_from_hidden_over_heads_loads_as_transformers_made_it():
    """Seed-OSS's head_dim 12 with hidden 32 and 4 heads: the checkpoint's projections
    ``(48, 32)`` and ``(32, 48)`` load (a misread head_dim fails by shape; both twins read the
    same ``layer_options``)."""
    config = _config("seed_oss", dict(head_dim=12))
    state = {k: v for k, v in _model(config).state_dict().items() if ".layers.1." in k}
    assert families.layer_options(config.to_dict(), 1).head_dim == 12
    assert mha_torch.from_hf(config.to_dict(), state, layer=1).head_dim == 12


def test_refused_families_and_options_raise_naming_what_is_missing():
    """A refused family's config (transformers' defaults) raises (a multimodal model's reads as its
    text model, whose weights sit elsewhere); an option of a supported family that changes the
    function is refused by name."""
    for name, record in RECORDS.items():
        if isinstance(record, Refused) and record.reason != _TEXT:
            try:
                raw = transformers.AutoConfig.for_model(name).to_dict()
            except Exception:  # noqa: BLE001 -- transformers refuses its own defaults (gemma4_assistant)
                continue
            expected = rf"\({record.reason}\)" if name in families.FAMILIES else r"model_type '.*' is not a supported"
            with pytest.raises(ValueError, match=expected):
                families.layer_options(families.read_config(raw), 0)
    for name, (extra, feature) in REFUSED_OPTIONS.items():
        raw = _config(name, extra).to_dict()
        for from_hf in (mha_jax.from_hf, mha_torch.from_hf):
            with pytest.raises(ValueError, match=rf"config \({name}\) sets .*\({feature}\), which this attention"):
                from_hf(raw)


FLOAT32 = ("llama4_text", "llama4")  # transformers' rotation: complex64 tables and products whatever the input
NEW = [name for name, r in RECORDS.items() if isinstance(r, Supported) and not r.uses.startswith("proven in")]
# a family's second config, where its checkpoint's layout depends on the config: name -> (family, record)
VARIANTS = {
    "falcon-alibi": ("falcon", Supported("ALiBi, one key head per head (falcon-rw)",
                                         dict(head_dim=None, alibi=True, multi_query=False))),
    "laguna-feature": ("laguna", Supported("a softplus gate on each output feature (gating False)",
                                           dict(RECORDS["laguna"].config, gating=False))),
    "gpt_bigcode-multi-head": ("gpt_bigcode", Supported("each head's q, k, v together in c_attn",
                                                        dict(_PLAIN, multi_query=False))),
}


@pytest.mark.parametrize("name", NEW + list(VARIANTS))
def test_family_equals_its_transformers_attention(name, monkeypatch):
    """Every layer of the family's small model (a whole period of its layer pattern): both twins
    against transformers' attention, outputs and gradients of the input and of every weight."""
    model_type, record = VARIANTS.get(name, (name, RECORDS.get(name)))
    worst = check_family(model_type, record, ("float32",) if name in FLOAT32 else ("float64", "float32"), monkeypatch)
    assert name in FLOAT32 or max(worst["float64"]) < 1e-12, worst
    assert worst["float32"][0] < 1e-6 and worst["float32"][1] < 1e-5, worst


HYBRIDS = ("lfm2", "lfm2_moe", "lfm3", "zamba", "minimax", "olmo_hybrid", "jamba", "bamba", "nemotron_h",
           "granitemoehybrid", "kimi_linear", "recurrent_gemma", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def test_gemma3n_s_layers_that_reuse_another_s_keys_and_values_are_refused_by_kind():
    """Gemma 3n's last ``num_kv_shared_layers`` layers attend with an earlier layer's keys and values: the layers
    ``attention_layers`` lists are those transformers' config does not make reuse; the others refused by kind."""
    config = _config("gemma3n_text", dict(RECORDS["gemma3n_text"].config, num_kv_shared_layers=5), 10)
    raw = config.to_dict()
    assert families.attention_layers(raw) == [i for i, mode in enumerate(config.kv_sharing_modes) if mode != "reuse"]
    for build in (families.layer_options, mha_torch.from_hf, mha_jax.from_hf):
        with pytest.raises(ValueError, match=r"layer 5 of this gemma3n_text config is a 'shared_kv_attention' layer"):
            build(families.read_config(raw), layer=5)


@pytest.mark.parametrize("name", sorted(records.MULTIMODAL))
def test_a_multimodal_checkpoint_as_transformers_saves_it_loads_its_text_model_s_attention(name, tmp_path):
    """The family's small model saved by transformers (in the older layout, where it converts that on loading)
    and read back by both twins' ``from_hf`` from the file, its keys as a state dict, and a sharded save's index:
    every attention layer holds the weights of the model's own module at the record's prefix (whose function the
    family's test holds to transformers')."""
    record = RECORDS[name]
    model = _model(_config(name, record.config, record.layers))
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    (weights,) = tmp_path.glob("*.safetensors")
    with safetensors.safe_open(weights, "pt") as f:
        saved = {key: f.get_tensor(key) for key in f.keys()}
    assert any(key.startswith(records.MULTIMODAL[name][-1]) for key in saved)
    raw = families.read_config(tmp_path / "config.json")
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    for layer in families.attention_layers(raw):
        options = families.layer_options(raw, layer)
        own = {options.prefix + k: v for k, v in model.get_submodule(options.prefix.rstrip(".")).state_dict().items()}
        expected = mha_torch.from_hf(raw, own, layer=layer).state_dict()
        for got in (mha_torch.from_hf(tmp_path / "config.json", weights, layer=layer).state_dict(),
                    mha_torch.from_hf(raw, saved, layer=layer).state_dict(),  # the saved keys as a state dict
                    mha_torch.from_hf(raw, index, layer=layer).state_dict(),  # a sharded checkpoint's index
                    mha_jax.to_torch(mha_jax.from_hf(tmp_path / "config.json", weights, layer=layer))):
            assert sorted(got) == sorted(expected), layer
            assert all(np.array_equal(np.asarray(got[k]), expected[k].numpy()) for k in expected), layer


# google/gemma-3-4b-it's config.json as released (transformers 4.50): its text_config leaves the head counts,
# head_dim, rope_theta and rope_local_base_freq to Gemma3TextConfig, and gives rope_scaling in the older form
GEMMA3_RELEASED = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False}}


# google/gemma-3-1b-it's (text only): the older keys rope_theta and rope_local_base_freq, no rope_scaling
GEMMA3_1B_RELEASED = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "transformers_version": "4.50.0.dev0", "vocab_size": 262144}


@pytest.mark.parametrize("released", [GEMMA3_RELEASED, GEMMA3_1B_RELEASED], ids=["gemma-3-4b-it", "gemma-3-1b-it"])
def test_a_released_gemma3_config_reads_layer_by_layer_as_transformers_reads_it(released):
    """Every layer of the released config: heads, key heads, head_dim, scale, window and the rope parameters of its
    type as transformers' config class makes them (the full layers' at base 1e6, linear x8 for the 4B; the sliding
    ones default at 1e4). The 4B's before: no head count (refused), then every layer at base 1e4 and the sliding
    ones scaled x8."""
    from mha_spec.rotary import rope_from_config

    cls = transformers.CONFIG_MAPPING[released["model_type"]]
    theirs = cls(**{k: v for k, v in released.items() if k != "model_type"}).get_text_config()
    raw = families.read_config(released)
    for layer, kind in enumerate(theirs.layer_types):
        options, parameters = families.layer_options(raw, layer), theirs.rope_parameters[kind]
        assert (options.num_heads, options.num_kv_heads, options.head_dim) == (
            theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim), layer
        assert options.scale == theirs.query_pre_attn_scalar ** -0.5, layer
        assert options.window == ((theirs.sliding_window - 1, 0) if kind == "sliding_attention" else None), layer
        rope = rope_from_config(options.rope, options.head_dim)
        assert rope["theta"] == parameters["rope_theta"], (layer, kind)
        assert rope["scaling"] == (None if parameters["rope_type"] == "default" else
                                   {k: v for k, v in parameters.items() if k != "rope_theta"}), (layer, kind)
    assert families.layer_options(raw, 0).prefix == ("model.language_model.layers.0.self_attn." if "text_config" in
                                                     released else "model.layers.0.self_attn.")


def test_laguna_s_rope_parameters_per_layer_type_are_its_config_class_s_where_a_config_leaves_them_out():
    """A Laguna config.json without ``rope_parameters`` reads as transformers' config class fills them in (full
    layers: half of each head at base 500000; sliding layers: all of it at 10000), layer by layer."""
    full = _config("laguna", dict(RECORDS["laguna"].config, rope_parameters=None)).to_dict()
    assert set(full["rope_parameters"]) == {"full_attention", "sliding_attention"}
    bare = {k: v for k, v in full.items() if k != "rope_parameters"}
    for layer, kind in enumerate(full["layer_types"]):
        options = families.layer_options(families.read_config(bare), layer)
        assert options.rope["rope_parameters"] == full["rope_parameters"][kind], (layer, kind)
        assert options == families.layer_options(families.read_config(full), layer)


def _softmax_attention(model, prefix: str, layer: int) -> bool:
    """Whether transformers' model holds softmax attention at the layer's ``prefix`` (not a Mamba mixer, a
    convolution, a linear or lightning attention, an MLP, or nothing)."""
    try:  # Zamba's Mamba layers hold no shared_transf
        module = model.get_submodule(prefix.format(layer=layer).rstrip("."))
    except AttributeError:
        return False
    name = type(module).__name__
    return name.endswith("Attention") and not any(word in name for word in ("Lightning", "Delta"))


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrid_model_s_attention_layers_are_those_of_softmax_attention(name):
    """Every layer of the hybrid's small model (a whole period): ``attention_layers`` lists those whose module at
    the record's prefix is softmax attention in transformers' model; ``layer_options`` and both twins' ``from_hf``
    refuse each other layer, naming the layer and its kind."""
    record = RECORDS[name]
    config = _config(name, record.config, record.layers)
    model = _model(config)
    raw = families.read_config(config.to_dict())
    theirs = [i for i in range(record.layers) if _softmax_attention(model, families.FAMILIES[name].prefix, i)]
    assert families.attention_layers(raw) == theirs != []
    for layer in sorted(set(range(record.layers)) - set(theirs)):
        for build in (families.layer_options, mha_torch.from_hf, mha_jax.from_hf):
            with pytest.raises(ValueError, match=rf"layer {layer} of this {name} config is a '\w+' layer, not"):
                build(raw, layer=layer)


# configs longer than their layer pattern's period: (family, config keywords, layers)
PATTERNS = {
    "llama4_text": (dict(RECORDS["llama4_text"].config, attention_chunk_size=4, no_rope_layer_interval=4), 9),
    "smollm3": (RECORDS["smollm3"].config, 9),
    "olmo3": (RECORDS["olmo3"].config, 9),
    "cohere2": (RECORDS["cohere2"].config, 9),
    "exaone4": (RECORDS["exaone4"].config, 9),
    "gemma2": (dict(sliding_window=WINDOW), 5),
    "gemma3_text": (dict(sliding_window=WINDOW, sliding_window_pattern=3), 7),
    "gpt_oss": (dict(sliding_window=WINDOW, **_MOE), 5),
    "qwen2": (dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2), 5),
    "mistral": (dict(sliding_window=WINDOW), 3),
    "vaultgemma": (RECORDS["vaultgemma"].config, 5),
    "flint": (RECORDS["flint"].config, 9),
    "modernbert-decoder": (dict(RECORDS["modernbert-decoder"].config, global_attn_every_n_layers=3), 7),
    "granite_swa": (dict(RECORDS["granite_swa"].config, layer_rope_theta=[10.0, 0.0, 20.0] * 3), 9),
    "gemma3n_text": (RECORDS["gemma3n_text"].config, 9),
}
DERIVED = ("layer_types", "no_rope_layers")  # keys config classes fill in: a config.json may leave them out


def _their_rope(module) -> bool:
    """Whether transformers' attention module rotates (each family's own test, read from its forward)."""
    if hasattr(module, "use_rope"):  # Llama 4, SmolLM3: no_rope_layers
        return bool(module.use_rope)
    if type(module).__name__ == "FlintAttention":  # rotary on its layers with a window
        return module.sliding_window is not None
    if type(module).__name__ == "GraniteSWAAttention":  # its model's rotary base of the layer, 0: none
        return bool(module.config.layer_rope_theta[module.layer_idx])
    if type(module).__name__.startswith("Cohere2"):
        return module.sliding_window is not None
    if hasattr(module, "is_sliding"):  # EXAONE 4: rotary on the sliding layers, or everywhere without a window
        return module.sliding_window is None or module.is_sliding
    return True


def _our_mask(options, positions, live):
    """The keys each query sees under the layer's options: causal by position, its window, its chunk."""
    q, k = positions[:, :, None], positions[:, None, :]
    allowed = (k <= q) & live[:, None, :]
    if options.window is not None:
        allowed &= q - k <= options.window[0]
    if options.attention_chunk_size:
        allowed &= q // options.attention_chunk_size == k // options.attention_chunk_size
    return allowed


@pytest.mark.parametrize("model_type", list(PATTERNS))
def test_every_layer_reads_as_transformers_model_uses_it(model_type):
    """Each layer of a config longer than its pattern's period: the keys each query sees (the
    mask transformers' model builds for that layer: window, chunk), whether it rotates, and its
    rope parameters where the model keeps one set per layer type; from the config as transformers
    saves it and without the per-layer keys its config class fills in."""
    extra, count = PATTERNS[model_type]
    config = _config(model_type, extra, count)
    model = _model(config)
    full = config.to_dict()
    bare = {k: v for k, v in full.items() if k not in DERIVED}
    modules = {layer: model.get_submodule(families.layer_options(full, layer).prefix.rstrip("."))
               for layer in range(count)}
    calls = _captured(model, modules)
    positions = _positions().numpy()
    live = np.arange(S)[None] < np.array(LENGTHS)[:, None]
    for raw in (full, bare):
        for layer, module in modules.items():
            options = families.layer_options(families.read_config(raw), layer)
            mask = calls[layer][1]["attention_mask"]
            theirs = (mask == 0).numpy()[:, 0] if mask.dtype.is_floating_point else mask.numpy()[:, 0]
            ours = _our_mask(options, positions - positions[:, :1], live)  # transformers: by index
            assert (ours == theirs)[live].all(), (layer, options.window, options.attention_chunk_size)
            assert (options.rope is not None) == _their_rope(module), (layer, "rotary")
            parameters = full.get("rope_parameters") or {}
            layer_type = full.get("layer_types", [None] * count)[layer]
            if options.rope is not None and isinstance(parameters.get(layer_type), dict):
                assert options.rope["rope_parameters"] == parameters[layer_type], (layer, "rope parameters")
            theta = (full.get("layer_rope_theta") or [None] * count)[layer]  # Granite SWA: a base per layer
            if options.rope is not None and theta:
                assert options.rope["rope_parameters"]["rope_theta"] == theta, (layer, "rotary base")


def family_table() -> str:
    """The family table of ``docs/models.md``, from ``RECORDS``."""
    rows = ["| `model_type` | from_hf | what its layers use, or what it lacks |", "|---|---|---|"]
    for name in sorted(RECORDS):
        record = RECORDS[name]
        if isinstance(record, Supported):
            rows.append(f"| `{name}` | supported | {record.uses} |")
        else:
            why = record.reason + (f": {record.detail}" if record.detail else "")
            rows.append(f"| `{name}` | refused | {why} |")
    supported = sum(isinstance(r, Supported) for r in RECORDS.values())
    return "\n".join(rows) + f"\n\n{supported} of {len(RECORDS)} families supported.\n"


def test_the_docs_family_table_is_the_records():
    """``docs/models.md``'s table between its markers is ``family_table()``: regenerate it with
    ``python -c "from parity_tests.test_hf_families import family_table; print(family_table())"``."""
    page = (pathlib.Path(__file__).parents[1] / "docs" / "models.md").read_text()
    start, end = "<!-- families: start -->\n", "<!-- families: end -->"
    assert start in page and end in page
    assert page.split(start)[1].split(end)[0].strip() == family_table().strip()


CACHED = ("mixtral", "granite", "falcon", "smollm3", "glm4", "bloom", "mpt", "falcon-alibi", "hunyuan_v1_dense",
          "hunyuan_v1_moe", "minimax_m3_vl_text", "gemma3n_text", "laguna", "laguna-feature")
STEPS = (4, 1, 1, 1)  # a prompt of 4 tokens, then one at a time: S = 7


def _their_decode(model, layer, options, x, dtype, monkeypatch):
    """transformers' attention of ``layer`` with a ``DynamicCache``, over ``STEPS``: its outputs."""
    torch_dtype = getattr(torch, dtype)
    module = copy.deepcopy(model.get_submodule(options.prefix.rstrip("."))).to(torch_dtype)
    if dtype == "float64":
        _keep_float64(monkeypatch, module)
    layer_type = (getattr(model.config.get_text_config(), "layer_types", None) or [None] * (layer + 1))[layer]
    tables = _decode_tables(model, model.get_submodule(options.prefix.rstrip(".")), dtype, layer_type)
    attention = module.self if options.ignore else module  # BERT's block: its self-attention, then output.dense
    parameters = inspect.signature(attention.forward).parameters
    cache, outs, start = transformers.DynamicCache(), [], 0
    for n in STEPS:
        keywords = {"past_key_values" if "past_key_values" in parameters else "layer_past": cache,
                    **_step_arguments(model, attention, options, parameters, start, n, tables, torch_dtype)}
        keywords.update({k: v for k, v in (("use_cache", True),) if k in parameters})
        with torch.no_grad():
            out = attention(torch.tensor(x[:, start:start + n], dtype=torch_dtype), **keywords)
            out = module.output.dense(out[0]) if options.ignore else _attention_output(out)
        outs.append(out.double().numpy())
        start += n
    monkeypatch.undo()
    return np.concatenate(outs, axis=1), {k: v.detach().clone() for k, v in module.state_dict().items()}


def _decode_tables(model, module, dtype, layer_type=None):
    """The rotary tables (cos, sin) the model gives ``module`` at positions ``0 .. S - 1`` (the layer type's, where
    it keeps one per type: Gemma 3n), float64 from its ``inv_freq`` in float64; None without a rotary embedding
    (the ALiBi families) or tables for the layer's type."""
    rotary = _layer_rotary(model, module)
    if rotary is None:
        return None
    positions = torch.arange(S)[None].expand(B, -1)
    typed = layer_type if hasattr(rotary, f"{layer_type}_inv_freq") else None
    if typed is None and any(name.endswith("_inv_freq") and name != "original_inv_freq"
                             for name, _ in rotary.named_buffers()):
        return None  # tables per layer type, none for this one (Cohere Compass's full layers)
    tables = rotary(torch.zeros(1, dtype=torch.float32), positions, *([typed] if typed else []))
    if isinstance(tables, torch.Tensor):  # DeepSeek-V2's, Llama 4's e^(i angle) (complex128 from inv_freq)
        angles = positions[..., None].double() * rotary.inv_freq.double()
        return torch.polar(torch.ones_like(angles), angles) * rotary.attention_scaling if dtype == "float64" \
            else tables
    interleaved = type(rotary).__name__.startswith(("CohereRotary", "Cohere2"))  # not Cohere Compass's
    return _tables64(rotary, positions, tables[0].shape[-1], typed, interleaved) if dtype == "float64" else tables


def _step_arguments(model, module, options, parameters, start, n, tables, torch_dtype):
    """A decoding step's arguments for queries ``start .. start + n`` over keys ``0 .. start + n``:
    the causal (and window) mask (MPT's: boolean, True = masked), the rotary tables, the ALiBi
    tensors the models build (bloom's and Falcon's ``alibi``, MPT's ``position_bias``) and
    Bloom's residual (zero: the attention alone)."""
    modeling = __import__(type(module).__module__, fromlist=["_"])
    q, k = torch.arange(start, start + n)[:, None], torch.arange(start + n)[None]
    allowed = ((k <= q) & ((q - k <= options.window[0]) if options.window else True))[None, None]
    if "position_bias" in parameters:  # MPT
        return {"attention_mask": ~allowed.expand(B, 1, -1, -1),
                "position_bias": modeling.build_mpt_alibi_tensor(options.num_heads, start + n).to(torch_dtype)}
    mask = torch.zeros(allowed.shape, dtype=torch_dtype).masked_fill(~allowed, torch.finfo(torch_dtype).min)
    arguments = {"attention_mask": mask.expand(B, 1, -1, -1)}
    if tables is not None or "position_embeddings" in parameters:  # None: a layer that does not rotate
        arguments["position_embeddings"] = None if tables is None else tables[:, start:start + n] if isinstance(
            tables, torch.Tensor) else tuple(t[:, start:start + n].to(torch_dtype) for t in tables)  # complex: one
    positions = torch.arange(start, start + n)
    arguments.update({k: v for k, v in (("position_ids", positions[None].expand(B, -1)), ("cache_position", positions))
                      if k in parameters})
    if "alibi" in parameters:
        keys = torch.ones(B, start + n, dtype=torch.long)
        arguments["alibi"] = (modeling.build_alibi_tensor(keys, options.num_heads, torch_dtype)
                              if getattr(model.config, "alibi", True) else None)
    if "residual" in parameters:  # Bloom adds the block's residual inside its attention
        arguments["residual"] = torch.zeros(B, n, HIDDEN, dtype=torch_dtype)
    return arguments


def _our_decode(raw, layer, state, x, dtype, twins=TWINS):
    """The twins' decoding over ``STEPS`` (a cache of S slots): their outputs, torch's first."""
    import jax.numpy as jnp

    options = families.layer_options(families.read_config(raw), layer)
    outs = []
    if "torch" in twins:
        module = mha_torch.from_hf(raw, state, layer=layer, dtype=getattr(torch, dtype))
        cache = mha_torch.LatentCache(B, S, options.latent, dtype=getattr(torch, dtype)) if options.latent else \
            mha_torch.KVCache(B, S, options.num_kv_heads, options.head_dim, dtype=getattr(torch, dtype))
        with torch.no_grad():
            outs.append(np.concatenate([module(torch.tensor(chunk, dtype=getattr(torch, dtype)), cache=cache,
                                               is_causal=True).double().numpy() for chunk in _steps(x)], axis=1))
    if "jax" in twins:
        module = mha_jax.from_hf(raw, state, layer=layer, param_dtype=getattr(jnp, dtype))
        module.init_cache((B, S, HIDDEN), getattr(jnp, dtype))
        outs.append(np.concatenate([np.asarray(module(jnp.asarray(chunk, getattr(jnp, dtype)), decode=True,
                                                      is_causal=True), np.float64) for chunk in _steps(x)], axis=1))
    return outs


def _steps(x):
    """``x``'s tokens in the chunks of ``STEPS``."""
    starts = np.cumsum((0, *STEPS))
    return [x[:, start:end] for start, end in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize("model_type", CACHED)
def test_decoding_with_a_cache_equals_transformers_attention_with_its_cache(model_type, monkeypatch):
    """A prompt then single tokens: transformers' attention with ``past_key_values`` (a
    ``DynamicCache``) against both twins decoding with their caches, every kind of layer."""
    model_type, record = VARIANTS.get(model_type, (model_type, RECORDS.get(model_type)))
    for (layer, dtype), error in check_decode(model_type, record, ("float64", "float32"), monkeypatch).items():
        assert error < (1e-12 if dtype == "float64" else 1e-6), (layer, dtype, error)


def check_decode(model_type: str, record: Supported, dtypes, monkeypatch, layers=None, bare: bool = False,
                 model=None, twins=TWINS) -> dict:
    """Layers ``layers`` (default: one of each kind) decoding over ``STEPS`` with both twins' caches against
    transformers' attention with its ``DynamicCache`` (``bare``: ours read from the config without ``DERIVED``
    keys; ``model`` as ``check_family``'s): (layer, dtype) -> the worse twin's relative error."""
    config = _config(model_type, record.config, record.layers)
    model, raw = _model(config) if model is None else model, (_Bare(config) if bare else config).to_dict()
    x = np.random.default_rng(3).normal(size=(B, S, HIDDEN))
    layers = _representatives(families.read_config(raw), record.layers) if layers is None else layers
    worst = {}
    for layer in layers:
        options = families.layer_options(families.read_config(raw), layer)
        for dtype in dtypes:
            theirs, state = _their_decode(model, layer, options, x, dtype, monkeypatch)
            state = {options.prefix + k: v for k, v in state.items()}
            worst[layer, dtype] = max(_rel(ours, theirs) for ours in _our_decode(raw, layer, state, x, dtype, twins))
    return worst


def test_verify_and_conversion_of_a_new_family(tmp_path):
    """Falcon (its fused query_key_value, grouped: two key heads) saved by transformers:
    ``mha-parity verify --config`` passes on its layer 1, and a layer converted JAX -> PyTorch (``to_torch``,
    ``load_weights``) computes what the PyTorch layer from the same checkpoint computes."""
    import jax.numpy as jnp
    from safetensors.torch import save_model

    from parity_tests.tool import models

    config = _config("falcon", dict(head_dim=None, vocab_size=50, pad_token_id=None, new_decoder_architecture=True,
                                    num_kv_heads=KV_HEADS))
    model = _model(config)
    config.save_pretrained(tmp_path)
    save_model(model, str(tmp_path / "model.safetensors"))
    _, results = models.verify(tmp_path / "config.json", tmp_path / "model.safetensors", layers=[1])
    assert [r.layer for r in results] == [1] and results[0].passed, results[0].errors
    state = model.state_dict()
    flax_layer = mha_jax.from_hf(config.to_dict(), state, layer=1)
    twin = mha_torch.from_hf(config.to_dict(), layer=1)
    mha_torch.load_weights(twin, mha_jax.to_torch(flax_layer))
    reference = mha_torch.from_hf(config.to_dict(), state, layer=1)
    x = torch.tensor(np.random.default_rng(4).normal(size=(B, S, HIDDEN)), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(twin(x, is_causal=True), reference(x, is_causal=True))
    assert np.allclose(np.asarray(flax_layer(jnp.asarray(x.numpy()), is_causal=True)),
                       reference(x, is_causal=True).detach().numpy(), atol=1e-5)


VERIFIED_CALLS = {  # families whose attention transformers calls another way, and the extra config keys
    "ctrl": {},  # attention(v, k, q, mask, ...): the hidden states three times
    "openai-gpt": {},  # returns a list
    "gpt_neox_japanese": {},  # returns its last layer's output bias apart, added by the block
    "bloom": {},  # attention(hidden, residual, alibi, mask): adds the block's residual
    "falcon": dict(alibi=True, multi_query=False, head_dim=None),  # ALiBi (its eager model adds it twice)
    "llama4_text": {},  # chunked layers: rows from position 0, where index and position chunk alike
    "xlm": {},  # given its model's cache even without use_cache: the run again must not append to it
}


@pytest.mark.parametrize("name", list(VERIFIED_CALLS))
def test_verify_config_runs_each_call_form_of_the_source_attention(name, tmp_path):
    """``mha-parity verify --config`` on every layer of a saved model whose attention transformers
    calls with other arguments than Llama's, or whose layers chunk: every row passes."""
    from safetensors.torch import save_model

    from parity_tests.tool import models

    record = RECORDS[name]
    config = _config(name, dict(record.config, **VERIFIED_CALLS[name]), record.layers)
    config.max_position_embeddings = 32  # the tool's rows reach position 18
    model = _model(config)
    config.save_pretrained(tmp_path)
    save_model(model, str(tmp_path / "model.safetensors"))
    _, results = models.verify(tmp_path / "config.json", tmp_path / "model.safetensors")
    assert len(results) == config.num_hidden_layers
    assert all(r.passed for r in results), [(r.layer, r.failures()) for r in results]


def test_verify_runs_the_source_eager_but_falcon_with_alibi_through_sdpa(tmp_path):
    """The tool's source is transformers' eager attention; only Falcon with ``alibi`` runs SDPA
    (its eager model adds ALiBi twice)."""
    from safetensors.torch import save_model

    from parity_tests.tool import models

    found = {}
    for alibi in (False, True):
        config = _config("falcon", dict(RECORDS["falcon"].config, **dict(VERIFIED_CALLS["falcon"], alibi=alibi)))
        path = tmp_path / str(alibi)
        config.save_pretrained(path)
        save_model(_model(config), str(path / "model.safetensors"))
        found[alibi] = models.load(path / "config.json", path / "model.safetensors").model.config._attn_implementation
    assert found == {False: "eager", True: "sdpa"}


def test_a_tied_block_is_read_from_its_one_saved_copy(tmp_path):
    """Zamba's checkpoint holds its shared attention block once, under its first hybrid layer: a later hybrid layer's
    ``from_hf`` reads it there, in both twins, the same parameters as the first's."""
    record = RECORDS["zamba"]
    model = _model(_config("zamba", record.config, record.layers))
    model.save_pretrained(tmp_path)
    config, weights = tmp_path / "config.json", tmp_path / "model.safetensors"
    with safetensors.safe_open(weights, "pt") as f:
        assert not [k for k in f.keys() if k.startswith("model.layers.3.shared_transf.")]
    first, later = (mha_torch.from_hf(config, weights, layer=layer).state_dict() for layer in (2, 3))
    assert first.keys() == later.keys() and all(torch.equal(first[k], later[k]) for k in first)
    first, later = (nnx.to_flat_state(nnx.state(mha_jax.from_hf(config, weights, layer=layer), nnx.Param))
                    for layer in (2, 3))
    assert all(np.array_equal(a[1].value, b[1].value) and a[0] == b[0] for a, b in zip(first, later))
