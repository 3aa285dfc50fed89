"""A layer's weights read from a transformers checkpoint (a safetensors file, its index, or a state dict) and
split into what our modules load: buffers left out, keys renamed, fused projections split, per-head norms joined."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from mha_spec.families import LayerOptions
from mha_spec.layouts import GATE, renamed
from mha_spec.records import FAMILIES
from mha_spec.rotary import rope_from_config

_CODEGEN_BLOCKS = 4  # CodeGenAttention's mp_num: its fused projection's blocks of heads


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
    options = replace(options, prefix=_held_prefix(options, weights, read_state))
    state = read_state(read_layer(weights, options.prefix, read_state, framework))
    if FAMILIES[options.model_type].fused:
        return layer_state(options, state), {}
    return layer_keys(options, state, concatenate), {"layout": options.layout, "prefix": options.prefix,
                                                     "ignore": options.ignore}


def _held_prefix(options: LayerOptions, weights: Any, read_state: Callable[[Any], Mapping]) -> str:
    """The first of the layer's prefixes (``prefix``, then ``older_prefixes``) the checkpoint holds keys under."""
    if not options.older_prefixes:
        return options.prefix
    if isinstance(weights, (str, os.PathLike)):
        keys = _file_keys(os.fspath(weights))
    else:
        keys = list(weights if isinstance(weights, Mapping) else read_state(weights))
    prefixes = (options.prefix, *options.older_prefixes)
    return next((p for p in prefixes if any(str(k).startswith(p) for k in keys)), options.prefix)


def _file_keys(path: str) -> list[str]:
    """The keys of a ``.safetensors`` file, or of its index's weight_map (none where it cannot be read: the loader
    then names what is wrong)."""
    if not os.path.exists(path):
        return []
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f).get("weight_map")
        return list(weight_map) if isinstance(weight_map, Mapping) else []
    from safetensors import safe_open  # only when a file is given

    with safe_open(path, framework="numpy") as f:
        return list(f.keys())


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
