"""The implementation a checkpoint came from, rebuilt from the same file, as the reference that
``mha-parity verify --weights`` compares our modules with.

Each layout names its source: ``torch_mha`` -> ``torch.nn.MultiheadAttention``; ``hf`` ->
Hugging Face's ``LlamaAttention`` (its rotary embedding set to the identity: ours has none);
``bert`` -> Hugging Face's ``BertAttention`` (self-attention and ``output.dense``; its dropout off
and its LayerNorm, which is not attention, left out); ``fused_qkv`` -> ``FusedQKVAttention``
below, the tutorials' layer; ``flax`` -> ``flax.nnx.MultiHeadAttention``. The source reads the
file with its own ``load_state_dict`` (or ``nnx.update``), never with our converters, so that a
converter that swaps, transposes or misplaces a weight shows as a difference.

A file does not say how many heads its model has. ``spec`` (``--source``) says what the source
is: a Hugging Face ``config.json`` (also found beside the weights), or ``module:function`` /
``path.py:function``, a function returning the PyTorch model the weights belong to (the layer
under ``--prefix`` is used). Without either, the source is built with ``--num-heads`` and the
header says that the head count was not checked.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from parity_tests.tool.arrays import numpy_dtype
from parity_tests.tool.ports import FLAX, MAPPED, Checkpoint, read_flax_tree


@dataclass
class Source:
    """``build(dtype) -> fn(inputs_q, inputs_kv, mask)`` (see ``callables``) in ``framework``;
    ``name`` says what it is and ``notes`` what the comparison could not check."""

    name: str
    framework: str
    build: Callable[[str], Callable]
    notes: list[str] = field(default_factory=list)


def fused_qkv_attention(embed_dim: int, heads: int, kv_heads: int, bias: bool = True, dtype=None):
    """The tutorials' fused layer (layout ``fused_qkv``, Phi-3's grouping): one ``qkv_proj`` whose
    rows are ``[q; k; v]``, ``o_proj``, 0/1 masks filled with ``-inf`` (so a query that may attend
    to no key gives NaN). Called as ``layer(x, att_mask)``."""
    import torch

    class FusedQKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, embed_dim // heads
            self.qkv_proj = torch.nn.Linear(embed_dim, (heads + 2 * kv_heads) * self.head_dim, bias=bias, dtype=dtype)
            self.o_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, dtype=dtype)

        def forward(self, x: torch.Tensor, att_mask: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
            q, k, v = torch.split(self.qkv_proj(x), sizes, dim=-1)
            q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
            k, v = (t.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
            scores = scores.masked_fill(att_mask == 0, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
            return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    return FusedQKV()


def _file_state(checkpoint: Checkpoint) -> dict:
    """The file's tensors under the prefix (prefix taken off), ignored names left out, as torch tensors."""
    from safetensors.torch import load_file

    prefix = checkpoint.load.get("prefix", "")
    ignore = checkpoint.load.get("ignore", ())
    state = {}
    for key, tensor in load_file(checkpoint.path).items():
        if key.startswith(prefix) and not key[len(prefix):].startswith(tuple(ignore) or ("\0",)):
            state[key[len(prefix):]] = tensor
    return state


def _hf_config(spec: str | None, checkpoint: Checkpoint) -> dict | None:
    """A Hugging Face config: ``spec`` if it is a ``.json`` file, else ``config.json`` beside the weights."""
    path = (spec if spec and spec.endswith(".json")
            else os.path.join(os.path.dirname(os.path.abspath(checkpoint.path)), "config.json"))
    if not os.path.exists(path):
        if spec and spec.endswith(".json"):
            raise FileNotFoundError(f"--source {spec} does not exist")
        return None
    with open(path) as f:
        return dict(json.load(f), _path=path)


def _factory(spec: str) -> Callable:
    """``module:function`` or ``path/to/file.py:function``."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--source must be a config.json, module:function or file.py:function, got {spec!r}")
    if where.endswith(".py"):
        loaded = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(where))[0], where)
        if loaded is None or not os.path.exists(where):
            raise FileNotFoundError(f"--source {where} does not exist")
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"--source: {where} has no {name!r}")
    return getattr(module, name)


def build(checkpoint: Checkpoint, spec: str | None = None) -> Source | None:
    """The source of ``checkpoint`` (None for our own ``mha_torch`` names: the twins are the source)."""
    c = checkpoint.config()
    if spec and not spec.endswith(".json"):
        return _from_factory(checkpoint, spec)
    layout = checkpoint.layout
    heads_note = (f"the source was built with --num-heads {c.num_heads}"
                  + (f" and --num-kv-heads {c.kv_heads}" if c.kv_heads != c.num_heads else "")
                  + ": the file does not say how many heads its model has, so the head count was not checked "
                  "(give --source with the model's config.json or a function that builds the model)")
    if spec and layout not in ("hf", "bert"):
        raise ValueError(f"--source {spec}: a config.json describes --layout hf or bert, not {layout}")
    if layout == MAPPED:
        return Source("", "", None, ["the file's names (read by --mapping) show no layout whose source is known: "
                                     "only our two implementations and the oracle were compared"])
    if layout == "mha_torch":
        return None
    fits = {  # the shapes each source class can hold
        "torch_mha": c.qkv_features in (None, c.in_features) and c.out_features in (None, c.in_features)
        and c.kv_heads == c.num_heads,
        "hf": c.self_attention and c.out_features in (None, c.in_features),
        "bert": c.self_attention and c.qkv_features in (None, c.in_features) and c.out_features in (None, c.in_features)
        and c.kv_heads == c.num_heads,
        "fused_qkv": c.self_attention and c.qkv_features in (None, c.in_features)
        and c.out_features in (None, c.in_features),
    }
    if not fits.get(layout, True):
        return Source("", "", None, [f"the checkpoint's shapes ({_shapes_of(c)}) do not fit the {layout} source's "
                                     "class: it was not built, only our two implementations and the oracle "
                                     "were compared"])
    if layout == FLAX:
        return _flax_source(checkpoint)
    if layout == "torch_mha":
        source = _torch_mha(checkpoint, c.num_heads)
        source.notes.append(heads_note)
        return source
    if layout == "fused_qkv":
        source = _wrap_fused(checkpoint, c.num_heads, c.kv_heads)
        source.notes.append(heads_note)
        return source
    if layout in ("hf", "bert"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            return Source("", "", None, [f"transformers is not installed: the {layout} source was not built, "
                                         "only our two implementations and the oracle were compared"])
        config = _hf_config(spec, checkpoint)
        source = _llama(checkpoint, config) if layout == "hf" else _bert(checkpoint, config)
        if config is None:
            source.notes.append(heads_note)
        return source
    raise ValueError(f"no source implementation is known for --layout {layout}")


def _shapes_of(c) -> str:
    kv = "self-attention" if c.self_attention else f"key/value features {c.in_kv_features}"
    return (f"{kv}, features {c.in_features}, qkv {c.qkv_features}, out {c.out_features}, "
            f"{c.num_heads}/{c.kv_heads} heads")


def _dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def _load(module, state: dict, what: str, allowed_missing=()) -> None:
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as error:  # shapes that do not fit
        raise ValueError(f"the weights do not fit {what}: {error}") from error
    missing = [k for k in missing if not k.startswith(tuple(allowed_missing) or ("\0",))]
    if missing or unexpected:
        raise ValueError(f"the weights do not fit {what}: missing {missing}, unexpected {unexpected}")


def _torch_mha(checkpoint: Checkpoint, num_heads: int, module=None) -> Source:
    import torch

    c = checkpoint.config()
    state = _file_state(checkpoint)

    def make(dtype):
        kdim = c.in_kv_features or c.in_features
        layer = module or torch.nn.MultiheadAttention(c.in_features, num_heads, bias=c.use_bias, kdim=kdim, vdim=kdim,
                                                      batch_first=True)
        if module is None:
            _load(layer, state, "torch.nn.MultiheadAttention")
        layer = _copy_to(layer, dtype).eval()

        def fn(q, kv, mask):
            b, _, q_len, kv_len = mask.shape if mask is not None else (0, 0, 0, 0)
            attn_mask = (None if mask is None
                         else ~mask.expand(b, layer.num_heads, q_len, kv_len).reshape(-1, q_len, kv_len))
            if not layer.batch_first:
                q, kv = q.transpose(0, 1), kv.transpose(0, 1)
            out = layer(q, kv, kv, attn_mask=attn_mask, need_weights=False)[0]
            return out if layer.batch_first else out.transpose(0, 1)

        return fn

    return Source(f"torch.nn.MultiheadAttention ({num_heads if module is None else module.num_heads} heads)", "torch",
                  make)


def _copy_to(module, dtype: str):
    import copy

    return copy.deepcopy(module).to(_dtype(dtype))


def _wrap_fused(checkpoint: Checkpoint, heads: int, kv_heads: int, module=None) -> Source:
    c = checkpoint.config()
    state = _file_state(checkpoint)

    def make(dtype):
        layer = module
        if layer is None:
            layer = fused_qkv_attention(c.in_features, heads, kv_heads, bias=c.use_bias)
            _load(layer, state, "the fused-QKV layer")
        layer = _copy_to(layer, dtype).eval()
        return lambda q, kv, mask: layer(q, mask.to(q.dtype) if mask is not None else q.new_ones(()))

    return Source(f"fused-QKV tutorial layer ({heads} heads, {kv_heads} key/value heads)", "torch", make)


def _identity_rotation(x):
    import torch

    b, s, _ = x.shape
    return lambda d: (torch.ones(b, s, d, dtype=x.dtype), torch.zeros(b, s, d, dtype=x.dtype))


def _hf_source(checkpoint: Checkpoint, config: dict | None, module, heads: int | None, construct, call,
               name: str) -> Source:
    """A transformers layer: ``module`` as given, or ``construct(heads)`` loaded from the file;
    ``call(layer, inputs, mask)`` runs it."""
    heads = heads or (config or {}).get("num_attention_heads") or checkpoint.num_heads

    def make(dtype):
        layer = module if module is not None else construct(heads)
        layer = _copy_to(layer, dtype).eval()
        return lambda q, kv, mask: call(layer, q, mask)

    where = f", from {config['_path']}" if config else ""
    return Source(name.format(heads=heads, where=where), "torch", make)


def _llama(checkpoint: Checkpoint, config: dict | None, module=None) -> Source:
    c = checkpoint.config()

    def construct(heads):
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention

        kv = (config.get("num_key_value_heads") or heads) if config else c.kv_heads
        hf = LlamaConfig(
            hidden_size=c.in_features, num_attention_heads=heads, num_key_value_heads=kv,
            head_dim=(config or {}).get("head_dim") or c.qkv_features // heads, attention_bias=c.use_bias,
            vocab_size=8, intermediate_size=8, num_hidden_layers=1, attn_implementation="sdpa",
        )
        layer = LlamaAttention(hf, layer_idx=0)
        _load(layer, _file_state(checkpoint), "LlamaAttention")
        return layer

    def call(layer, q, mask):
        return layer(q, position_embeddings=_identity_rotation(q)(layer.head_dim), attention_mask=mask)[0]

    heads = module.config.num_attention_heads if module is not None else None
    return _hf_source(checkpoint, config, module, heads, construct, call,
                      "transformers LlamaAttention ({heads} heads{where}; rotary embedding set to the identity)")


def _bert(checkpoint: Checkpoint, config: dict | None, module=None) -> Source:
    c = checkpoint.config()

    def construct(heads):
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertAttention

        hf = BertConfig(hidden_size=c.in_features, num_attention_heads=heads, intermediate_size=8,
                        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0, attn_implementation="eager")
        layer = BertAttention(hf)
        _load(layer, _file_state(checkpoint), "BertAttention", allowed_missing=("output.LayerNorm",))
        return layer

    def call(layer, q, mask):
        import torch

        additive = None if mask is None else (~mask).to(q.dtype) * torch.finfo(q.dtype).min
        context = layer.self(q, attention_mask=additive)[0]
        return layer.output.dense(context)  # the attention's own output; LayerNorm and residual are not

    heads = module.self.num_attention_heads if module is not None else None
    return _hf_source(checkpoint, config, module, heads, construct, call,
                      "transformers BertAttention ({heads} heads{where}; self-attention and output.dense)")


def _flax_source(checkpoint: Checkpoint) -> Source:
    c = checkpoint.config()
    tree = read_flax_tree(checkpoint.path)

    def make(dtype):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        jdtype = jnp.dtype(numpy_dtype(dtype))
        layer = nnx.MultiHeadAttention(
            c.num_heads, c.in_features, c.qkv_features, c.out_features, num_kv_heads=c.kv_heads,
            in_kv_features=c.in_kv_features, use_bias=c.use_bias, normalize_qk=c.normalize_qk, param_dtype=jdtype,
            dtype=jdtype, decode=False, rngs=nnx.Rngs(0),
        )
        nnx.update(layer, jax.tree.map(lambda a: jnp.asarray(a, jdtype), tree))
        graphdef, state = nnx.split(layer)

        def fn(q, kv, mask):  # sow_weights: flax's own softmax, exact in float64 (jax.nn's is float32)
            inside = nnx.merge(graphdef, state)  # a module of the caller's trace, which sowing mutates
            out, _ = nnx.capture(inside, nnx.Intermediate)(q, kv, mask=mask, sow_weights=True)
            return out

        return fn

    return Source(f"flax.nnx.MultiHeadAttention ({c.num_heads} heads, {c.kv_heads} key/value heads, "
                  "read from the kernels)", "jax", make)


def _from_factory(checkpoint: Checkpoint, spec: str) -> Source:
    """The user's model, from ``spec``, its weights loaded from the file by its own ``load_state_dict``."""
    import torch
    from safetensors.torch import load_file

    model = _factory(spec)()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--source {spec} returned {type(model).__name__}, not a torch.nn.Module")
    prefix = checkpoint.load.get("prefix", "")
    whole = load_file(checkpoint.path)
    own = set(model.state_dict())
    if own <= {k[len(prefix):] for k in whole if k.startswith(prefix)} and prefix:
        # the layer itself: its keys are the file's under the prefix
        layer = model
        _load(layer, {k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)}, f"--source {spec}")
    else:
        _load(model, whole, f"--source {spec}", allowed_missing=tuple(k for k in own if not k.startswith(prefix)))
        layer = model.get_submodule(prefix.rstrip(".")) if prefix else model
    kind = type(layer).__name__
    if isinstance(layer, torch.nn.MultiheadAttention):
        source = _torch_mha(checkpoint, layer.num_heads, module=layer)
    elif kind == "LlamaAttention" or (hasattr(layer, "o_proj") and hasattr(layer, "config")
                                      and hasattr(layer, "head_dim")):
        source = _llama(checkpoint, None, module=layer)
    elif kind == "BertAttention":
        source = _bert(checkpoint, None, module=layer)
    else:
        def make(dtype):
            copy = _copy_to(layer, dtype).eval()
            return lambda q, kv, mask: copy(q, mask) if kv is q else copy(q, kv, mask)

        source = Source(f"{kind} from {spec}, called as layer(inputs, mask) with a bool mask, True = attend", "torch",
                        make)
    source.name += f" from --source {spec}" if "--source" not in source.name and " from " not in source.name else ""
    return source
