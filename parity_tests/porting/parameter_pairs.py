"""PyTorch's parameters paired with the port's, each read in the other's layout.

A PyTorch parameter pairs through its module (``mapping``, as in ``compare``) and its name:
``weight`` is the JAX module's ``kernel``, ``scale``, ``embedding`` or ``weight``; other names are
the same. Each pair is compared in PyTorch's layout:

- a kernel by its module's kind: a ``Linear`` keeps ``(out, in)``, GPT-2's ``Conv1D`` ``(in, out)``,
  against a kernel ``(in..., out...)`` (``(in, heads, head_dim)``, ``(heads, head_dim, out)``)
  flattened to two axes; a kernel whose other orientation is the only one that fits is read in it
  (a square one goes by its module's kind);
- a fused projection (GPT-2's ``c_attn``, Falcon's and BLOOM's ``query_key_value``) beside a port
  built on ``mha_jax.MultiHeadAttention``: split as ``mha_spec.checkpoint.layer_state`` splits it
  for ``from_hf``, its query, key and value parts against the port's ``query``, ``key`` and
  ``value`` (its output projection against ``out``); the parameter is one row, its error that of
  its parts together;
- a tied pair (transformers' ``lm_head.weight`` that is ``wte.weight``): one parameter, compared
  with the port's parameter of either name (both, where the port keeps two);
- anything else by ``axis_layouts`` (a bias ``(heads, head_dim)`` against ``(heads * head_dim,)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from parity_tests.porting import names
from parity_tests.tool import arrays, axis_layouts

WEIGHT_NAMES = ("kernel", "scale", "embedding", "weight")
# mha_spec's names of a converted attention's projections -> mha_jax.MultiHeadAttention's
_OURS = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "out_proj": "out"}


@dataclass(frozen=True)
class Part:
    """A JAX parameter against (a part of) a PyTorch one: ``index`` picks the part's elements of the
    PyTorch parameter, flattened, in the part's shape (None: the whole parameter); ``kind``:
    ``"linear"`` (a ``(out, in)`` weight), ``"conv1d"`` (``(in, out)``) or ``""``."""

    jax_name: str
    kind: str = ""
    index: np.ndarray | None = field(default=None, compare=False)

    def torch_side(self, value: np.ndarray) -> np.ndarray:
        value = np.asarray(value)
        return value if self.index is None else value.reshape(-1)[self.index]

    def jax_side(self, value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The JAX parameter in the PyTorch part's ``shape`` (a ``LayoutError`` when it has no layout of it)."""
        value = np.asarray(value)
        if self.jax_name.rsplit(".", 1)[-1] == "kernel" and len(shape) == 2:
            return kernel(value, tuple(shape), self.kind)
        return axis_layouts.fit(value, shape)


@dataclass
class Pair:
    """One PyTorch parameter ``name`` and the JAX parameters it is compared with (``parts``)."""

    name: str
    parts: list[Part]

    @property
    def jax_name(self) -> str:
        return ", ".join(dict.fromkeys(p.jax_name for p in self.parts))

    def error(self, torch_values: Mapping[str, np.ndarray], jax_values: Mapping[str, np.ndarray]) -> float:
        """The relative error of every part together: the JAX parts against PyTorch's, in PyTorch's layout."""
        theirs, mine = [], []
        for part in self.parts:
            t = part.torch_side(torch_values[self.name])
            theirs.append(arrays.to_float64(t).reshape(-1))
            mine.append(arrays.to_float64(part.jax_side(jax_values[part.jax_name], t.shape)).reshape(-1))
        return arrays.relative_error(np.concatenate(mine), np.concatenate(theirs))


def kernel(value: np.ndarray, shape: tuple[int, int], kind: str) -> np.ndarray:
    """A kernel ``(in..., out...)`` as a PyTorch weight of ``shape``: ``(out, in)`` for a Linear,
    ``(in, out)`` for a Conv1D; the other orientation where only it fits (a square one by ``kind``)."""
    flat = [(int(np.prod(value.shape[:k])), int(np.prod(value.shape[k:]))) for k in range(1, max(value.ndim, 2))]
    if value.ndim < 2:
        flat = []
    as_is = any(f == shape for f in flat)  # (in, out): Conv1D's
    turned = any(f[::-1] == shape for f in flat)  # (out, in): Linear's
    if not (as_is or turned):
        raise axis_layouts.LayoutError(f"a kernel of {value.shape} has no (in, out) or (out, in) layout of "
                                       f"PyTorch's {shape}")
    if turned and (kind != "conv1d" or not as_is):
        return value.reshape(shape[::-1]).T
    return value.reshape(shape)


def _kind(cls: str) -> str:
    return "conv1d" if cls == "Conv1D" else "linear" if "Linear" in cls else ""


def _fused_layers(torch_model, torch_names: list[str]) -> dict[str, tuple[dict[str, tuple[str, np.ndarray]], str]]:
    """For each attention of a family whose projections are fused (``mha_spec``'s ``fused``), its prefix
    -> (``{converted key: (PyTorch name, index)}``, module prefix): where each of ``layer_state``'s
    outputs takes its elements from, found by converting a state of element numbers."""
    config = getattr(torch_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    from mha_spec import checkpoint, families

    try:
        settings = families.read_config(config.to_dict())
        family = families.FAMILIES.get(settings.get("model_type"))
        if family is None or not family.fused:
            return {}
        layers = settings["num_hidden_layers"]
        options = [families.layer_options(settings, i) for i in range(layers)]
    except (KeyError, ValueError, TypeError):  # a config mha_spec cannot read: its parameters pair by name
        return {}
    shapes = {n: tuple(p.shape) for n, p in torch_model.named_parameters()}
    found = {}
    for option in options:
        keys = [n for n in torch_names if n.startswith(option.prefix)]
        if not keys:
            continue
        offsets, state, start = {}, {}, 0
        for key in keys:  # each element numbered: a key's numbers start where the previous key's end
            offsets[key] = start
            state[key] = np.arange(start, start + int(np.prod(shapes[key])), dtype=np.float64).reshape(shapes[key])
            start += int(np.prod(shapes[key]))
        try:
            converted = checkpoint.layer_state(option, state)
        except ValueError:
            continue
        where = {}
        for name, numbers in converted.items():
            numbers = np.asarray(numbers).astype(np.int64)
            key = max((k for k in keys if offsets[k] <= numbers.min()), key=offsets.get)
            where[name] = (key, numbers - offsets[key])
        found[option.prefix] = (where, option.prefix[:-1])
    return found


def pair(torch_model, torch_names: list[str], jax_names: list[str], mapping) -> tuple[list[Pair], list[str]]:
    """Every PyTorch parameter of ``torch_names`` with its JAX parts, and those without any."""
    compiled = names.check_mapping(mapping)
    by_module: dict[str, dict[str, str]] = {}
    for j in jax_names:
        module, _, leaf = j.rpartition(".")
        by_module.setdefault(module, {})[leaf] = j
    classes = {n: type(m).__name__ for n, m in torch_model.named_modules()} if torch_model is not None else {}
    aliases: dict[str, list[str]] = {}
    if torch_model is not None:
        first: dict[int, str] = {}
        for n, p in torch_model.named_parameters(remove_duplicate=False):
            aliases.setdefault(first.setdefault(id(p), n), []).append(n)
    fused = _fused_layers(torch_model, torch_names) if torch_model is not None else {}

    def find(module: str, leaf: str, child: str = "") -> str | None:
        target = names.jax_name(module, compiled) if module else module
        target = f"{target}.{child}" if child and target is not None else target
        leaves = by_module.get(target, {}) if target is not None else {}
        return next((leaves[c] for c in (WEIGHT_NAMES if leaf == "weight" else (leaf,)) if c in leaves), None)

    pairs, unpaired = [], []
    for t in torch_names:
        parts = []
        for name in aliases.get(t, [t]):
            module, _, leaf = name.rpartition(".")
            found = find(module, leaf)
            if found is not None:
                parts.append(Part(found, _kind(classes.get(module, ""))))
        if not parts:
            parts = _fused_parts(t, fused, find)
        (pairs.append(Pair(t, parts)) if parts else unpaired.append(t))
    return pairs, unpaired


def _fused_parts(t: str, fused: dict, find) -> list[Part]:
    """``t``'s parts as the port's attention keeps them, where ``t`` is a fused attention's parameter
    and the port's attention is ours (its ``query``, ``key``, ``value`` and ``out``)."""
    for prefix, (where, module) in fused.items():
        if not t.startswith(prefix):
            continue
        parts = []
        for converted, (key, index) in where.items():
            if key != t:
                continue
            projection, _, leaf = converted.rpartition(".")
            found = find(module, leaf, _OURS.get(projection, projection))
            if found is None:
                return []
            parts.append(Part(found, "linear", index))  # layer_state gives (out, in): a Linear's
        return parts
    return []
