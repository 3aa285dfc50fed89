"""A transformers model's attention layers against ours, behind ``mha-parity verify --config``.

The source is the whole model as transformers builds it from ``config.json`` (eager attention,
float32; a causal language model, or for an encoder such as BERT a masked one), with the
checkpoint's weights. It runs once on a padded batch whose rows start at different positions; a
hook on each verified layer's attention module records what the model gave it: its input, its
mask (causal, padding and the layer's window, as the model builds it) and its rotary tables. The
layer is run again on that input with those arguments, with gradients. Ours
(``mha_torch.from_hf`` and ``mha_jax.from_hf``, the same config and checkpoint) get the same
input with ``is_causal=True`` (a decoder's), the positions and the lengths, nothing else:
everything a layer does differently (window, rotary, scale, soft-cap, norms, sinks) must come
from reading the config. One row per layer: outputs and the gradients of the input and of every weight, ours
against the source in float32, and our two frameworks against each other in float64.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity_tests.tool import verdict

# float32 against transformers (relative, over the output and over every gradient); float64
# between our two frameworks
SOURCE_TOLERANCE, TWINS_TOLERANCE = 1e-4, 1e-12
BATCH, LENGTH, OFFSETS, PADDING = 2, 16, (3, 0), (0, 5)  # row 0 starts at position 3; row 1 ends in 5 pads


@dataclass
class LayerResult:
    """One layer: the worst relative errors (``errors``: name -> value) and whether each is
    within its tolerance."""

    layer: int
    attention: str  # what the config makes of the layer: "full", "window 4", ...
    errors: dict[str, float] = field(default_factory=dict)
    worst: dict[str, str] = field(default_factory=dict)  # name -> the tensor with the worst error

    def failures(self) -> dict[str, float]:
        """The errors beyond their tolerance."""
        return {name: v for name, v in self.errors.items() if not verdict.within(
            v, verdict.bound(TWINS_TOLERANCE if name.startswith("JAX vs PyTorch") else SOURCE_TOLERANCE))}

    @property
    def passed(self) -> bool:
        return not self.failures()

    def as_json(self) -> dict:
        return {"layer": self.layer, "attention": self.attention, "errors": self.errors, "worst": self.worst,
                "passed": self.passed}


@dataclass
class Model:
    """The source model and what was read: ``raw`` the config dict, ``state`` the checkpoint."""

    config_path: str
    raw: dict
    model: Any
    state: dict
    files: list[str]
    missing: list[str]
    unexpected: list[str]


def read_raw(path: str | os.PathLike) -> dict:
    with open(path) as f:
        raw = json.load(f)
    if "text_config" in raw and "num_attention_heads" not in raw:  # a multimodal model's text part
        raw = dict(raw["text_config"])
    return raw


def _model_type(raw: dict, config_path: str | os.PathLike) -> str:
    """The config's ``model_type``; a config older than that key gets the family transformers'
    ``AutoConfig`` reads off its path (the longest family name the path contains)."""
    import transformers

    if "model_type" in raw:
        return raw["model_type"]
    names = sorted(transformers.CONFIG_MAPPING.keys(), key=len, reverse=True)
    found = next((name for name in names if name in os.fspath(config_path)), None)
    if found is None:
        raise ValueError(f"--config {config_path}: no model_type, and its path names no transformers family")
    return found


def _read_weights(path: str) -> dict:
    """One checkpoint file's tensors: ``.safetensors``, or a PyTorch pickle (``.bin``, ``.pt``,
    read with ``weights_only=True``: tensors only, no code)."""
    import torch
    from safetensors.torch import load_file

    if path.endswith((".bin", ".pt", ".pth")):
        return torch.load(path, map_location="cpu", weights_only=True)
    return load_file(path)


def load(config_path: str | os.PathLike, weights: str | os.PathLike) -> Model:
    """transformers' model for ``config_path`` (``AutoModelForCausalLM``, or
    ``AutoModelForMaskedLM`` for an encoder; eager attention, float32) with the checkpoint's
    tensors (a ``.safetensors`` file, a sharded index, or a PyTorch ``.bin``)."""
    import torch
    import transformers

    from mha_spec import checkpoint

    raw = read_raw(config_path)
    raw = dict(raw, model_type=_model_type(raw, config_path))
    config = transformers.AutoConfig.for_model(**raw)
    # eager attention, but Falcon's with ALiBi: its eager model adds the term twice (in the
    # attention and in the mask it passes), its SDPA path once, as Falcon's own code does
    config._attn_implementation = "sdpa" if raw["model_type"] == "falcon" and raw.get("alibi") else "eager"
    files = checkpoint.layer_files(weights, "")  # every shard: the whole model runs
    state = {}
    for path in files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"--weights: {path} does not exist")
        state.update(_read_weights(path))
    torch.manual_seed(0)  # weights the checkpoint lacks (none, for a whole model's) are random
    auto = transformers.AutoModelForCausalLM if _causal(raw) else transformers.AutoModelForMaskedLM
    model = auto.from_config(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    return Model(os.fspath(config_path), raw, model, state, files, list(missing), list(unexpected))


def _causal(raw: dict, layer: int | None = None) -> bool:
    """Whether the layer's attention (default: the first attention layer's) is a decoder's (every family's but an
    encoder's, BERT's)."""
    from mha_spec import families

    raw = families.read_config(raw)
    return families.layer_options(raw, families.attention_layers(raw)[0] if layer is None else layer).is_causal


def is_causal(source: Model) -> bool:
    """Whether the model is a decoder (its first attention layer causal)."""
    return _causal(source.raw)


def _inputs(vocab: int, seed: int, offsets: tuple[int, ...] = OFFSETS):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, LENGTH), generator=g)
    positions = torch.stack([torch.arange(LENGTH) + o for o in offsets])
    lengths = torch.tensor([LENGTH - p for p in PADDING])
    attention_mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    return ids, positions, lengths, attention_mask


def _captured(source: Model, prefixes: dict[int, str], seed: int, offsets: tuple[int, ...]) -> dict[int, tuple]:
    """Each layer's attention module and the (input, keywords) the model called it with."""
    import torch

    seen: dict[int, tuple] = {}
    handles = []
    for layer, prefix in prefixes.items():
        module = source.model.get_submodule(prefix.rstrip("."))

        def hook(module, args, kwargs, output, layer=layer):
            kwargs = dict(kwargs)
            hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
            # the hidden states passed again (CTRL's attention(v, k, q)) are the input again, by position
            rest = tuple(_SAME if a is hidden else a for a in args[1:])
            seen[layer] = (module, hidden.detach().clone(), rest, kwargs)

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    ids, positions, _, attention_mask = _inputs(source.raw.get("vocab_size", 2), seed, offsets)
    try:
        with torch.no_grad():
            source.model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def by_our_names(grads: dict, options) -> dict:
    """transformers' gradient names -> ours, renamed and split as the loaders read the layer's
    checkpoint (``read_layout``; fused weights, GPT-NeoX's, GPT-2's, Falcon's, by ``layer_state``)."""
    from mha_spec import checkpoint, families, layouts

    state = {options.prefix + k: g for k, g in grads.items()}
    if options.latent is not None:  # multi-head latent attention: transformers' names, o_proj as out_proj
        return layouts.read_latent(state, prefix=options.prefix)
    if families.FAMILIES[options.model_type].fused:
        return checkpoint.layer_state(options, state)
    state = checkpoint.layer_keys(options, state, np.concatenate)
    return layouts.read_layout(state, layout=options.layout, prefix=options.prefix,
                                num_heads=options.num_heads, num_kv_heads=options.num_kv_heads)


def _rel(a, b, floor: float) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), floor))


def _worst(ours: dict, theirs: dict) -> tuple[float, str]:
    """The worst relative error over matching tensors; a tensor whose norm is below a hundredth
    of the input gradient's is compared to that: a gradient that is 0 in exact arithmetic (a key
    bias without rotary shifts a row's logits alike) is rounding noise on both sides."""
    if sorted(ours) != sorted(theirs):
        raise AssertionError(f"gradients of {sorted(ours)} against the source's {sorted(theirs)}")
    floor = 1e-2 * float(np.linalg.norm(theirs["input"]))
    return max((_rel(ours[k], theirs[k], floor), k) for k in theirs)


_SAME = object()  # in a hooked call's arguments: the hidden states, given again


def _run_source(module, hidden, rest, kwargs, d_out, ignore: tuple[str, ...] = ()):
    """The hooked module on ``hidden`` with the model's arguments; where the module holds more
    than the attention (``ignore``: BERT's residual and LayerNorm after ``output.dense``), its
    self-attention and output projection only, as ours computes."""
    import inspect

    x = hidden.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    rest = tuple(x if a is _SAME else a for a in rest)
    if ignore:
        out = module.output.dense(module.self(x, *rest, **kwargs)[0])
    else:
        bound = inspect.signature(module.forward).bind(x, *rest, **kwargs)
        if "residual" in bound.arguments:  # BLOOM's attention adds the block's residual: not the attention's
            bound.arguments["residual"] = bound.arguments["residual"].new_zeros(bound.arguments["residual"].shape)
        for name in ("cache", "past_key_values", "past_key_value", "layer_past"):  # the run again appends nothing
            if name in bound.arguments:
                bound.arguments[name] = None
        out = module(*bound.args, **bound.kwargs)
    if isinstance(out, (tuple, list)):
        dense_bias = getattr(module, "dense_bias", None)  # GPT-NeoX-Japanese returns its output bias apart
        out = out[0] + dense_bias if dense_bias is not None and any(o is dense_bias for o in out) else out[0]
    out.backward(d_out)
    grads = {"input": x.grad.double().numpy()}
    grads.update({n: p.grad.double().numpy() for n, p in module.named_parameters() if p.grad is not None})
    return out.detach().double().numpy(), grads


def run_torch(raw, state, layer, x, positions, lengths, d_out, dtype, implementation=None):
    """``mha_torch.from_hf``'s layer on ``x`` (causal for a decoder, at ``positions``, keys past ``lengths``
    padding): its output and the gradients of the input and of every weight, float64 NumPy."""
    import torch

    import mha_torch

    module = mha_torch.from_hf(raw, state, layer=layer, dtype=dtype, implementation=implementation)
    causal = _causal(raw, layer)
    hidden = torch.tensor(x, dtype=dtype, requires_grad=True)
    out = module(hidden, is_causal=causal, query_positions=torch.as_tensor(positions),
                 key_value_seq_lengths=torch.as_tensor(lengths))
    out.backward(torch.tensor(d_out, dtype=dtype))
    grads = {"input": hidden.grad.double().numpy()}
    grads.update({n: p.grad.double().numpy() for n, p in module.named_parameters()})
    return out.detach().double().numpy(), grads


def run_jax(raw, state, layer, x, positions, lengths, d_out, dtype, implementation=None):
    """``run_torch`` with ``mha_jax.from_hf``'s layer (gradients in ``mha_torch`` names)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import mha_jax

    module = mha_jax.from_hf(raw, state, layer=layer, param_dtype=dtype, implementation=implementation)
    causal = _causal(raw, layer)
    graph, params = nnx.split(module, nnx.Param)

    def f(params, hidden):
        return nnx.merge(graph, params)(hidden, is_causal=causal, query_positions=jnp.asarray(positions),
                                        key_value_seq_lengths=jnp.asarray(lengths))

    out, vjp = jax.vjp(f, params, jnp.asarray(x, dtype))
    d_params, d_hidden = vjp(jnp.asarray(d_out, out.dtype))
    grads = {"input": np.asarray(d_hidden, np.float64)}
    grads.update({k: np.asarray(v, np.float64) for k, v in mha_jax.to_torch(nnx.to_pure_dict(d_params)).items()})
    return np.asarray(out, np.float64), grads


def verify(config_path, weights, layers: list[int] | None = None, seed: int = 0, done=None,
           source: Model | None = None) -> tuple[Model, list[LayerResult]]:
    """Every layer in ``layers`` (default: every attention layer, ``families.attention_layers``) of the model,
    ours against the source; ``done`` is called with each layer's result as it finishes."""
    import jax
    import jax.numpy as jnp
    import torch

    from mha_spec import families

    source = source or load(config_path, weights)
    raw = families.read_config(source.raw)
    count = int(raw["num_hidden_layers"])
    layers = families.attention_layers(raw) if layers is None else list(layers)
    for layer in layers:
        if not 0 <= layer < count:
            raise ValueError(f"--layer {layer}: the model has layers 0 to {count - 1}")
    options = {layer: families.layer_options(raw, layer) for layer in layers}
    missing = [k for k in source.missing if any(k.startswith(o.prefix) for o in options.values())]
    if missing:
        raise ValueError(f"--weights lacks the attention weights {missing}")
    # transformers chunks (Llama 4) by the index in the sequence, ours by position: both agree on
    # rows that start at position 0, which a model with chunked layers is given
    offsets = (0,) * BATCH if any(o.attention_chunk_size for o in options.values()) else OFFSETS
    seen = _captured(source, {layer: o.prefix for layer, o in options.items()}, seed, offsets)
    _, positions, lengths, _ = _inputs(2, seed, offsets)
    # padded queries' outputs mean nothing (transformers spreads a row that sees no key evenly,
    # ours gives 0): they are neither compared nor sent a gradient
    live = (np.arange(LENGTH)[None] < np.asarray(lengths)[:, None])[..., None]
    results = []
    with jax.enable_x64(True):
        for layer in layers:
            module, hidden, rest, kwargs = seen[layer]
            x = hidden.double().numpy()
            d_out = np.random.default_rng(seed + 1 + layer).normal(size=x.shape[:2] + (raw["hidden_size"],)) * live
            out_src, grads_src = _run_source(module, hidden, rest, kwargs, torch.tensor(d_out, dtype=torch.float32),
                                             options[layer].ignore)
            grads_src = dict(by_our_names({k: v for k, v in grads_src.items() if k != "input"}, options[layer]),
                             input=grads_src["input"])
            window = options[layer].window
            result = LayerResult(layer, "full" if window is None else f"window {window[0] + 1}")
            runs = {
                "torch": run_torch(source.raw, source.state, layer, x, positions, lengths, d_out, torch.float32),
                "jax": run_jax(source.raw, source.state, layer, x, positions, lengths, d_out, jnp.float32),
            }
            out_src = out_src * live
            floor = 1e-6 * float(np.linalg.norm(out_src))
            for name, (out, grads) in runs.items():
                label = "PyTorch" if name == "torch" else "JAX"
                result.errors[f"{label} vs source: output"] = _rel(out * live, out_src, floor)
                (result.errors[f"{label} vs source: gradients"],
                 result.worst[f"{label} vs source: gradients"]) = _worst(grads, grads_src)
            out64_t, grads64_t = run_torch(source.raw, source.state, layer, x, positions, lengths, d_out, torch.float64)
            out64_j, grads64_j = run_jax(source.raw, source.state, layer, x, positions, lengths, d_out, jnp.float64)
            result.errors["JAX vs PyTorch, float64: output"] = _rel(out64_j * live, out64_t * live,
                                                                    1e-6 * float(np.linalg.norm(out64_t)))
            (result.errors["JAX vs PyTorch, float64: gradients"],
             result.worst["JAX vs PyTorch, float64: gradients"]) = _worst(grads64_j, grads64_t)
            results.append(result)
            if done:
                done(result)
    return source, results
