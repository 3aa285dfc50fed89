"""transformers' own attention classes as oracles for ``from_hf`` in both frameworks.

Each family's attention class is built from a small config with random weights (nothing is
downloaded), with its real rotary embedding, and runs on a padded batch whose rows start at
different positions, under a causal mask (and the layer's sliding window) that transformers
receives as its 4-D additive mask. ``mha_jax.from_hf`` and ``mha_torch.from_hf`` load the layer
from the whole model's state dict and must give its outputs and gradients (inputs and every
weight): float32 to 1e-6 with transformers' arithmetic as it is; float64 to 1e-12, where two
float32 steps that transformers takes whatever the input dtype are kept in float64 (its eager
softmax, ``softmax(..., dtype=torch.float32)``, and its RMSNorm's cast to float32), and its
rotary tables, which it computes in float32, come from its own ``inv_freq`` in float64.
"""

from __future__ import annotations

import functools
import inspect
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import mha_jax
import mha_torch
from mha_spec import families
from parity_tests.tool import models

B, S, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2, 7, 32, 4, 2, 8, 2
OFFSETS, LENGTHS = (3, 0), (7, 5)  # row 0 starts at position 3; row 1 holds 5 tokens and 2 of padding
WINDOW = 3
COMMON = dict(
    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
    num_hidden_layers=LAYERS, max_position_embeddings=16, intermediate_size=8, vocab_size=11,
)
# family -> (config class, attention class, layer, config keywords): each the feature it proves
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaAttention", 0, dict(
        attention_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8))),
    "mistral-window": ("MistralConfig", "MistralAttention", 1, dict(sliding_window=WINDOW)),
    "qwen2-bias": ("Qwen2Config", "Qwen2Attention", 0, dict(layer_types=["full_attention"] * LAYERS)),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3Attention", 1, dict(rms_norm_eps=1e-5)),
    "gemma2-softcap": ("Gemma2Config", "Gemma2Attention", 0, dict(
        query_pre_attn_scalar=12, attn_logit_softcapping=2.0, sliding_window=WINDOW)),
    "gemma3-norm-window": ("Gemma3TextConfig", "Gemma3Attention", 0, dict(
        query_pre_attn_scalar=12, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "gpt-oss-sinks": ("GptOssConfig", "GptOssAttention", 0, dict(
        sliding_window=WINDOW, num_local_experts=2, num_experts_per_tok=1,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, beta_fast=8.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=8))),
    "olmo2-whole-norm": ("Olmo2Config", "Olmo2Attention", 0, dict()),
    "phi3-fused-partial": ("Phi3Config", "Phi3Attention", 1, dict(
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # heads interleaved in one fused weight, a quarter of each head rotating (its default)
    "gpt-neox-interleaved": ("GPTNeoXConfig", "GPTNeoXAttention", 1, dict()),
    # transposed Conv1D weights, no rotary embedding, the scale divided by the layer's number
    "gpt2-conv1d": ("GPT2Config", "GPT2Attention", 1, dict(scale_attn_by_inverse_layer_idx=True)),
    # pairs (2i, 2i + 1) rotating in the first rotary_dim features, its own sin/cos table, no biases
    "gptj-interleaved-partial": ("GPTJConfig", "GPTJAttention", 1, dict(rotary_dim=4)),
    # half of each head rotating, q/k/v biases, a LayerNorm per head with its own scale
    "stablelm-partial-head-norms": ("StableLmConfig", "StableLmAttention", 0, dict(
        partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True)),
    # pairs (2i, 2i + 1) rotating, biases on all four projections, a LayerNorm (heads, head_dim)
    "cohere-interleaved-norm": ("CohereConfig", "CohereAttention", 1, dict(use_qk_norm=True, attention_bias=True)),
}
INTERLEAVED_TABLES = ("cohere",)  # rotary modules whose cos/sin repeat each frequency in place


def _modeling(config):
    return __import__(f"transformers.models.{config.model_type.removesuffix('_text')}"
                      f".modeling_{config.model_type.removesuffix('_text')}",
                      fromlist=["_"])


def _source(family: str):
    """(config dict, transformers' attention layer (float64, eager), its rotary module, layer index)."""
    config_cls, attention_cls, layer, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    config._attn_implementation = "eager"
    modeling = _modeling(config)
    torch.manual_seed(0)
    attention = getattr(modeling, attention_cls)(config, layer_idx=layer).double().eval()
    with torch.no_grad():
        for name, p in attention.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (0.5 if "norm" in name else 0.0))
    rotary_cls = next((getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding")), None)
    rotary = None if rotary_cls is None else rotary_cls(config)  # GPT-2: none
    return config, attention, rotary, layer


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, S, HIDDEN))
    positions = np.stack([np.arange(S) + o for o in OFFSETS])
    live = np.arange(S)[None] < np.array(LENGTHS)[:, None]
    return x, positions, live


def _hf_mask(positions, live, window):
    """transformers' 4-D additive mask: causal by position, the window, padded keys."""
    q, k = positions[:, :, None], positions[:, None, :]
    allowed = (k <= q) & live[:, None, :]
    if window is not None:
        allowed &= q - k <= window[0]
    return np.where(allowed, 0.0, np.finfo(np.float64).min)[:, None]


def _hf_run(family, dtype, monkeypatch):
    """transformers' output and gradients (input, then each parameter by our names)."""
    config, attention, rotary, layer = _source(family)
    x, positions, live = _inputs()
    window = mha_torch.from_hf(config.to_dict(), layer=layer).local_window_size
    torch_dtype = getattr(torch, dtype)
    attention = attention.to(torch_dtype)
    hidden = torch.tensor(x, dtype=torch_dtype, requires_grad=True)
    position_ids = torch.tensor(positions)
    rotary_inputs = {}
    if rotary is not None:
        # its own tables (and its dynamic update); Gemma 3 keeps one set per layer type
        layer_type = config.layer_types[layer] if "layer_type" in inspect.signature(rotary.forward).parameters else None
        cos, sin = rotary(hidden.float(), position_ids, *([layer_type] if layer_type else []))
        if dtype == "float64":
            cos, sin = _tables64(rotary, position_ids, cos.shape[-1], layer_type,
                                 config.model_type in INTERLEAVED_TABLES)
        rotary_inputs["position_embeddings"] = (cos.to(torch_dtype), sin.to(torch_dtype))
    elif "position_ids" in inspect.signature(attention.forward).parameters:  # GPT-J: its table inside
        rotary_inputs["position_ids"] = position_ids
    if dtype == "float64":
        _keep_float64(monkeypatch, attention)
    mask = torch.tensor(_hf_mask(positions, live, window), dtype=torch_dtype)
    out, _ = attention(hidden, attention_mask=mask, **rotary_inputs)
    d_out = torch.tensor(np.random.default_rng(1).normal(size=out.shape), dtype=torch_dtype)
    out.backward(d_out)
    grads = {"input": hidden.grad}
    grads.update({name: p.grad for name, p in attention.named_parameters()})
    return config, layer, attention, (x, positions, live, d_out.double().numpy()), out.detach().double().numpy(), grads


def _tables64(rotary, position_ids, width, layer_type=None, interleaved=False):
    """cos/sin as transformers forms them (its float32 ``inv_freq``, ``attention_scaling``), in float64."""
    name = f"{layer_type}_" if layer_type else ""
    inv_freq, scaling = getattr(rotary, f"{name}inv_freq"), getattr(rotary, f"{name}attention_scaling")
    freqs = position_ids[..., None].double() * inv_freq.double()
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    emb = emb[..., :width]
    return emb.cos() * scaling, emb.sin() * scaling


def _keep_float64(monkeypatch, attention):
    """transformers' eager softmax and RMSNorm compute in float32 whatever the input; keep float64."""
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, dtype=None, **kwargs):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)
    for module in attention.modules():
        if type(module).__name__.endswith("RMSNorm"):
            offset = 1.0 if "1.0 + self.weight" in inspect.getsource(type(module).forward) else 0.0  # Gemma's
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))

            def forward(h, module=module, offset=offset, eps=eps):  # NanoChat's: no weight
                weight = getattr(module, "weight", None)
                return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 if weight is None else
                                                                                 offset + weight)

            monkeypatch.setattr(module, "forward", forward)
        if type(module).__name__ == "Llama4TextL2Norm":  # weightless, the same cast to float32

            def forward(h, module=module):
                return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eps)

            monkeypatch.setattr(module, "forward", forward)
        if type(module).__name__ == "CohereLayerNorm":  # the same cast to float32

            def forward(h, module=module):
                h = h - h.mean(-1, keepdim=True)
                return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon) * module.weight

            monkeypatch.setattr(module, "forward", forward)
    kind = type(attention)
    names = (kind.__name__, f"{kind.__module__.rsplit('.', 1)[-1]}.{kind.__name__}")  # XLM's name is CTRL's too
    patch = next((patch for keys, patch in _FLOAT32_STEPS.items() if set(names) & set(keys)), None)
    if patch is not None:
        patch(monkeypatch, attention)


def _rotation64(monkeypatch, attention):
    """Cohere's and ModernBERT decoder's rotation, which casts queries and keys to float32, in float64."""
    modeling = __import__(type(attention).__module__, fromlist=["_"])

    def rotate64(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + modeling.rotate_half(q) * sin, k * cos + modeling.rotate_half(k) * sin

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", rotate64)


def _pair_rotation64(monkeypatch, attention):
    """ERNIE 4.5's rotation of pairs, which casts queries and keys to float32, in float64."""
    modeling = __import__(type(attention).__module__, fromlist=["_"])

    def rotate_pairs64(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = (t.unsqueeze(unsqueeze_dim)[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)
                    for t in (cos, sin))
        return q * cos + modeling.rotate_half(q) * sin, k * cos + modeling.rotate_half(k) * sin

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", rotate_pairs64)


def _complex_rotation64(monkeypatch, attention):
    """DeepSeek-V2's rotation, complex products of queries and keys cast to float32, in complex128."""
    modeling = __import__(type(attention).__module__, fromlist=["_"])

    def rotate64(xq, xk, freqs_cis):
        pairs = [torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous()) for x in (xq, xk)]
        return tuple(torch.view_as_real(x * freqs_cis.unsqueeze(1)).flatten(3) for x in pairs)

    monkeypatch.setattr(modeling, "apply_rotary_emb", rotate64)


def _own_rotary64(monkeypatch, attention):
    """Recurrent Gemma's rotary tables, made inside its attention in float32, in float64 from its ``inv_freq``."""
    rotary = attention.rotary_emb

    def tables64(x, position_ids):
        return _tables64(rotary, position_ids, 2 * rotary.inv_freq.shape[-1]) if x.dtype == torch.float64 \
            else type(rotary).forward(rotary, x, position_ids)

    monkeypatch.setattr(rotary, "forward", tables64)


def _gptj64(monkeypatch, attention):
    """GPT-J's logits in float32 from a float32 sin/cos table: both in float64."""
    _keep_table64(monkeypatch, attention)

    def attn64(query, key, value, attention_mask=None):
        weights = torch.matmul(query, key.transpose(-1, -2)) / attention.scale_attn + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1)
        return torch.matmul(weights, value), weights

    monkeypatch.setattr(attention, "_attn", attn64)


def _codegen64(monkeypatch, attention):
    """CodeGen's float32 table and logits (GPT-J's) in float64; its mask added before the scale."""
    _keep_table64(monkeypatch, attention)

    def attn64(query, key, value, attention_mask=None):
        weights = torch.matmul(query, key.transpose(-1, -2))
        weights = (weights if attention_mask is None else weights + attention_mask) / attention.scale_attn
        weights = torch.nn.functional.softmax(weights, dim=-1)
        return torch.matmul(weights, value), weights

    monkeypatch.setattr(attention, "_attn", attn64)


def _gpt_neo64(monkeypatch, attention):
    """GPT-Neo's logits, cast to float32, in float64; its causal and local mask (``bias``) kept."""

    def attn64(query, key, value, attention_mask=None):
        weights = torch.matmul(query, key.transpose(-1, -2))
        q, k = query.size(-2), key.size(-2)
        weights = torch.where(attention.bias[:, :, k - q:k, :k], weights, torch.finfo(weights.dtype).min)
        weights = weights if attention_mask is None else weights + attention_mask
        weights = torch.nn.functional.softmax(weights, dim=-1)
        return torch.matmul(weights, value), weights

    monkeypatch.setattr(attention, "_attn", attn64)


def _sinks64(monkeypatch, attention, as_scale: bool):
    """An eager attention with sinks whose steps run in float32 whatever the input, in float64:
    Flint's (its logits cast to float32; the sink an extra softmax logit) or, ``as_scale``, Granite
    SWA's (the sink a scale ``sigmoid(logsumexp(logits) - sink)`` of the output, cast to float32)."""
    modeling = __import__(type(attention).__module__, fromlist=["_"])

    def eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = (modeling.repeat_kv(t, module.num_key_value_groups) for t in (key, value))
        logits = torch.matmul(query, key.transpose(2, 3)) * scaling
        logits = logits if attention_mask is None else logits + attention_mask
        sinks = module.sinks.view(1, -1, 1).to(logits.dtype)
        if as_scale:
            weights = torch.nn.functional.softmax(logits, dim=-1)
            out = torch.matmul(weights, value) * (torch.logsumexp(logits, dim=-1) - sinks).sigmoid().unsqueeze(-1)
        else:
            sinks = sinks[..., None].expand(*logits.shape[:-1], 1)
            weights = torch.nn.functional.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
            out = torch.matmul(weights, value)
        return out.transpose(1, 2).contiguous(), weights

    monkeypatch.setattr(modeling, "eager_attention_forward", eager64)


def _mpt64(monkeypatch, attention):
    """MPT's softmax, of its logits cast to float32, in float64 (its forward, that cast left out)."""

    def forward(hidden_states, position_bias, past_key_values=None, attention_mask=None, **kwargs):
        batch, length = hidden_states.shape[:2]
        mixed = attention.Wqkv(hidden_states)
        if attention.clip_qkv:
            mixed = mixed.clamp(min=-attention.clip_qkv, max=attention.clip_qkv)
        q, k, v = (t.reshape(batch, length, attention.n_heads, attention.head_dim).transpose(1, 2)
                   for t in mixed.chunk(3, dim=2))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, attention.layer_idx)
        scores = torch.matmul(q, k.transpose(-1, -2)) * attention.softmax_scale
        if position_bias is not None:
            scores = scores + position_bias[:, -min(position_bias.size(1), length):, -k.shape[-2]:]
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, torch.finfo(q.dtype).min)
        weights = torch.nn.functional.softmax(scores, dim=-1)
        out = torch.matmul(weights, v).permute(0, 2, 1, 3).reshape(batch, length, -1)
        return attention.out_proj(out), weights

    monkeypatch.setattr(attention, "forward", forward)


def _xlm64(monkeypatch, attention):
    """XLM's softmax, of its logits cast to float32, in float64 (its self-attention, that cast left out)."""

    def forward(input, mask, kv=None, cache=None, output_attentions=False, **kwargs):
        batch, length, _ = input.size()
        q, k, v = (lin(input).view(batch, -1, attention.n_heads, attention.head_dim).transpose(1, 2)
                   for lin in (attention.q_lin, attention.k_lin, attention.v_lin))
        scores = torch.matmul(q / math.sqrt(attention.head_dim), k.transpose(2, 3))
        masked = (mask == 0).view((batch, 1, length, -1) if mask.dim() == 3 else (batch, 1, 1, -1))
        scores = scores.masked_fill(masked.expand_as(scores), torch.finfo(scores.dtype).min)
        weights = torch.nn.functional.softmax(scores, dim=-1)
        return (attention.out_lin(torch.matmul(weights, v).transpose(1, 2).reshape(batch, length, -1)),)

    monkeypatch.setattr(attention, "forward", forward)


# attention classes -> their float32 steps kept in float64 (beside the softmax and the norms)
def _temperature64(monkeypatch, attention):
    """Llama 4's temperature tuning, whose scale it computes from float32 positions, in float64."""
    modeling = __import__(type(attention).__module__, fromlist=["_"])

    class Torch64:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def log1p(x):
            return torch.log1p(x.double())

    monkeypatch.setattr(modeling, "torch", Torch64())


def _gate64(monkeypatch, attention):
    """Laguna's softplus gate, of its projection cast to float32, in float64 (that cast a no-op)."""
    projection = attention.g_proj

    class Wide(torch.Tensor):
        def float(self):
            return self.as_subclass(torch.Tensor)

    monkeypatch.setattr(projection, "forward", lambda h: torch.nn.functional.linear(h, projection.weight).as_subclass(
        Wide))


_FLOAT32_STEPS = {
    ("Llama4TextAttention",): _temperature64,
    ("CohereAttention", "Cohere2Attention", "Cohere2MoeAttention", "ModernBertDecoderAttention"): _rotation64,
    ("Ernie4_5Attention", "Ernie4_5_MoeAttention"): _pair_rotation64,
    ("GPTJAttention",): _gptj64,
    ("CodeGenAttention",): _codegen64,
    ("GPTNeoSelfAttention",): _gpt_neo64,
    ("FlintAttention",): functools.partial(_sinks64, as_scale=False),
    ("GraniteSWAAttention", "GraniteMoeSWAAttention"): functools.partial(_sinks64, as_scale=True),
    ("MptAttention",): _mpt64,
    ("LagunaAttention",): _gate64,
    ("DeepseekV2Attention",): _complex_rotation64,
    ("RecurrentGemmaAttention",): _own_rotary64,
    ("modeling_xlm.MultiHeadAttention",): _xlm64,
}


def _keep_table64(monkeypatch, attention):
    """GPT-J's and CodeGen's sin/cos table (``embed_positions``), computed in float32, in float64
    from the same float32 frequencies."""
    dim = attention.rotary_dim
    inv_freq = (1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))).double()  # float32 values
    angles = torch.arange(attention.max_positions, dtype=torch.float64)[:, None] * inv_freq
    monkeypatch.setattr(attention, "embed_positions", torch.cat((angles.sin(), angles.cos()), dim=1))


def _ours_torch(config, layer, state, inputs, dtype, implementation=None):
    x, positions, _, d_out = inputs
    return models.run_torch(config.to_dict(), state, layer, x, positions, LENGTHS, d_out, getattr(torch, dtype),
                            implementation)


def _ours_jax(config, layer, state, inputs, dtype, implementation=None):
    x, positions, _, d_out = inputs
    return models.run_jax(config.to_dict(), state, layer, x, positions, LENGTHS, d_out, getattr(jnp, dtype),
                          implementation)


def _theirs_by_our_names(grads, options):
    """transformers' gradients (the input's and each weight's) by our names."""
    grads = {name: g.double().numpy() for name, g in grads.items()}
    weights = models.by_our_names({k: g for k, g in grads.items() if k != "input"}, options)
    return dict(weights, input=grads["input"])


def _rel(a, b):
    """Relative error; below a norm of 1 absolute (the gradients here have norms 4 to 330):
    a gradient that is 0 in exact arithmetic
    (the key bias without rotary shifts a row's logits alike) is rounding noise in both."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1.0))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_hf_equals_transformers_attention(family, dtype, monkeypatch):
    config, layer, attention, inputs, out_hf, grads_hf = _hf_run(family, dtype, monkeypatch)
    options = families.layer_options(families.read_config(config.to_dict()), layer)
    other = families.layer_options(families.read_config(config.to_dict()), 1 - layer).prefix
    # the whole model's checkpoint: this layer under its names, and another layer's keys beside it
    state = {options.prefix + k: v.detach().clone() for k, v in attention.state_dict().items()}
    state.update({other + k: v.detach().clone() for k, v in attention.state_dict().items()})
    state["model.embed_tokens.weight"] = torch.zeros(3, HIDDEN, dtype=getattr(torch, dtype))
    theirs = _theirs_by_our_names(grads_hf, options)
    tol, grad_tol = (1e-12, 1e-12) if dtype == "float64" else (1e-6, 1e-5)
    # the defaults (JAX "xla"; PyTorch "sdpa", or "math" for a soft-cap, which SDPA cannot apply),
    # and in float64 the others: JAX's "blockwise" kernel, PyTorch's "math"
    runs = [("torch", _ours_torch, None), ("jax", _ours_jax, None)]
    if dtype == "float64":
        runs += [("jax blockwise", _ours_jax, "blockwise")]
        runs += [] if config.to_dict().get("attn_logit_softcapping") else [("torch math", _ours_torch, "math")]
    for name, run, implementation in runs:
        out, grads = run(config, layer, state, inputs, dtype, implementation)
        assert _rel(out, out_hf) < tol, (name, _rel(out, out_hf))
        assert sorted(grads) == sorted(theirs), (name, sorted(grads), sorted(theirs))
        worst = max((_rel(grads[k], theirs[k]), k) for k in grads)
        assert worst[0] < grad_tol, (name, worst)


DEFAULTED = {  # model_type -> (config class, what a config.json may leave out, transformers' value of it)
    "gptj": ("GPTJConfig", "rotary_dim", lambda config, attention: attention.rotary_dim),
    "stablelm": ("StableLmConfig", "partial_rotary_factor", lambda config, attention: attention.rotary_ndims),
    "cohere": ("CohereConfig", "rope_theta", lambda config, attention: config.rope_parameters["rope_theta"]),
}


@pytest.mark.parametrize("model_type", list(DEFAULTED))
def test_a_config_json_without_the_rotary_settings_reads_as_transformers_fills_them_in(model_type):
    """GPT-J's ``rotary_dim``, StableLM's rotary fraction, Cohere's rotary base, left out of
    config.json: the values transformers' config class gives them; GPT-J's buffers that older
    checkpoints saved (``attn.bias``, ``attn.masked_bias``) are left unread."""
    config_cls, _, theirs = DEFAULTED[model_type]
    # num_key_value_heads given: StableLmConfig's default is 32 whatever the heads
    raw = dict(model_type=model_type, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
               num_hidden_layers=1, vocab_size=11)
    config = getattr(transformers, config_cls)(**{k: v for k, v in raw.items() if k != "model_type"})
    attention = getattr(_modeling(config), f"{config_cls.removesuffix('Config')}Attention")(config, layer_idx=0)
    for from_hf in (mha_jax.from_hf, mha_torch.from_hf):
        rotary = from_hf(raw).rotary
        ours = {"gptj": rotary.rotary_dim, "stablelm": rotary.rotary_dim, "cohere": rotary.theta}[model_type]
        assert ours == theirs(config, attention), (from_hf, ours)
    if model_type == "gptj":
        prefix = "transformer.h.0.attn."
        state = {prefix + k: v for k, v in attention.state_dict().items()}
        state.update({prefix + "bias": torch.ones(1, 1, 4, 4, dtype=torch.bool),
                      prefix + "masked_bias": torch.tensor(-1e9)})
        for from_hf in (mha_jax.from_hf, mha_torch.from_hf):
            from_hf(raw, state)


def test_a_wrong_setting_fails_against_transformers(monkeypatch):
    """The comparison above catches a port that differs by one setting: a rotary base off by one
    part in ten changes the output far beyond the float32 tolerance."""
    config, layer, attention, inputs, out_hf, _ = _hf_run("llama3", "float32", monkeypatch)
    state = {f"model.layers.{layer}.self_attn.{k}": v for k, v in attention.state_dict().items()}
    wrong = config.to_dict()
    wrong["rope_parameters"] = dict(wrong["rope_parameters"], rope_theta=550.0)
    module = mha_torch.from_hf(wrong, state, layer=layer)
    x, positions, _, _ = inputs
    out = module(torch.tensor(x, dtype=torch.float32), is_causal=True, query_positions=torch.tensor(positions),
                 key_value_seq_lengths=torch.tensor(LENGTHS)).detach().double().numpy()
    assert _rel(out, out_hf) > 100 * 1e-6  # a hundred times the float32 tolerance


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_from_hf_names_what_it_cannot_build(framework):
    from_hf = mha_jax.from_hf if framework == "jax" else mha_torch.from_hf
    base = dict(COMMON, model_type="llama")
    with pytest.raises(ValueError, match=r"model_type 't5' is not a supported family; "
                                         r"supported: afmoe, apertus, arcee, axk1, bamba, .*, phi3, .*, stablelm, .*"):
        from_hf(dict(base, model_type="t5"))
    with pytest.raises(ValueError,
                       match=r"position_embedding_type='relative_key', which this attention does not compute"):
        from_hf(dict(base, model_type="bert", position_embedding_type="relative_key"))
    with pytest.raises(ValueError, match=r"sets attention_chunk_size \(chunked attention \(Llama 4\)\)"):
        from_hf(dict(base, attention_chunk_size=8))
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\) \(num_hidden_layers=2\), got 2"):
        from_hf(base, layer=2)
    with pytest.raises(ValueError, match=r"no key starts with prefix 'model.layers.1.self_attn.'"):
        from_hf(base, {"model.layers.0.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}, layer=1)
