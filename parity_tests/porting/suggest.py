"""A ``mapping`` for ``compare`` suggested from both sides' module calls, for ports whose names differ.

Both models are run once on the inputs, every module call recorded (the PyTorch side as ``record``
records it, the JAX side through ``compare``'s interception). Modules are paired level by level:
the children of a pair (the calls whose nearest recorded ancestor it is) with the other side's
children, by name after the parent (``self_attn.q_proj`` under ``self_attn`` is ``q_proj``), kind
(linear, embedding, norm, attention, MLP, ...), output shape and call order; what is left over is
then paired across the whole model by kind and shape. Only modules whose first outputs have a
layout in common are paired (the same shape, or one ``axis_layouts`` brings to the other: a port
keeping ``(batch, length, heads, head_dim)`` where PyTorch keeps ``(batch, heads, length,
head_dim)`` pairs; ``compare`` can compare nothing else). A pair's names become a
regular expression with the layer indices both names share as groups
(``model\\.layers\\.(\\d+)\\.self_attn`` -> ``model.layers.\\1.attn``) when every layer pairs alike.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass

import numpy as np

from parity_tests.porting import jax_side, settings
from parity_tests.porting.reference import record
from parity_tests.tool import arrays, axis_layouts

# kind of a module from its class name, else its own name's last part: the first that matches
_KINDS = (("rotary", r"rotary|rope"), ("embedding", r"embed|wte|wpe"), ("norm", r"norm|(^|_)ln(_|\d|$)"),
          ("attention", r"attention|attn"), ("mlp", r"mlp|feed_?forward|ffn"), ("activation", r"activation|act_fn"),
          ("linear", r"linear|dense|proj|conv1d"), ("block", r"layer|block"))


@dataclass
class Module:
    """One side's first call of a module: ``name`` (dotted), ``cls``, ``shape`` of its first output
    (None: no array), ``order`` (its place among the calls, in the order they finished)."""

    name: str
    cls: str
    shape: tuple[int, ...] | None
    order: int

    @property
    def size(self) -> int | None:
        return None if self.shape is None else int(np.prod(self.shape))

    def fits(self, other: Module) -> bool:
        """Whether ``other``'s output (JAX's) reads in this one's layout (PyTorch's), in one layout or more."""
        return self.shape is not None and other.shape is not None and bool(
            axis_layouts.candidates(other.shape, self.shape))

    @property
    def kind(self) -> str:
        return kind(self.cls, self.name)


def kind(cls: str, name: str) -> str:
    """``linear``, ``embedding``, ``norm``, ``attention``, ``mlp``, ``activation``, ``rotary``,
    ``block`` or ``other``: by the class name, else by the module's own name."""
    for text in (cls.rsplit(".", 1)[-1].lower(), re.sub(r"\d+", "", name.rsplit(".", 1)[-1]).lower()):
        for found, pattern in _KINDS:
            if re.search(pattern, text):
                return found
    return "other"


class Suggestion(dict):
    """The mapping to give ``compare`` (PyTorch name pattern -> JAX name; None: a PyTorch module left
    out, whose same-named JAX module is not its pair), with ``pairs`` (every paired PyTorch module ->
    its JAX module, same names included), ``unpaired`` (PyTorch modules with no JAX module that
    fits) and ``unpaired_jax``; ``mismatched``: ``(PyTorch name, JAX name, PyTorch shape, JAX shape)``
    of modules that bear the same name but whose outputs have no layout in common."""

    def __init__(self, mapping: dict, pairs: dict, unpaired: list, unpaired_jax: list, mismatched: list):
        super().__init__(mapping)
        self.pairs, self.unpaired, self.unpaired_jax, self.mismatched = pairs, unpaired, unpaired_jax, mismatched


def _torch_modules(torch_model, inputs) -> tuple[list[Module], list[np.ndarray]]:
    """The PyTorch side's first call of each module (``torch_model`` a model or a saved ``Recording``),
    and the inputs it ran on."""
    recording = record(torch_model, *inputs)
    calls = [c for c in recording.calls if c.occurrence == 0]
    return [Module(c.name, c.cls, None if c.output is None else tuple(c.output.shape), i)
            for i, c in enumerate(calls)], recording.inputs


def _jax_modules(flax_model, inputs) -> list[Module]:
    """The JAX side's first call of each module, run on a copy of an nnx model (its state stays as it was)."""
    flax = jax_side.as_flax(flax_model)
    if flax.kind == "nnx":
        from flax import nnx

        flax = jax_side.Flax("nnx", nnx.clone(flax.module))
    found: dict[str, Module] = {}

    def seen(name, cls, fn, signature, args, kwargs, again=None, state=None):
        output = fn(*args, **kwargs)
        if name not in found:
            out = arrays.primary(output)
            found[name] = Module(name, cls, None if out is None else tuple(out.shape), len(found))
        return output

    context = jax_side._nnx_intercepted(flax.module, seen) if flax.kind == "nnx" else jax_side._linen_intercepted(seen)
    with context, settings.numerics(torch_needed=False):  # compare's numerics: the same compiled operations
        flax(*(jax_side.to_jax(x) for x in inputs))
    return list(found.values())


def _parent(module: Module, names: set[str]) -> str | None:
    """The nearest recorded ancestor's name."""
    parts = module.name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:end]) in names:
            return ".".join(parts[:end])
    return None


def _relative(module: Module, parent: str | None) -> str:
    return module.name if parent is None else module.name[len(parent) + 1:]


def _score(t: Module, j: Module, t_name: str, j_name: str, t_rank: float, j_rank: float) -> float | None:
    """How well PyTorch's ``t`` fits JAX's ``j`` (None: not at all): their outputs must have a layout
    in common and their kinds must not be two different known kinds."""
    if not t.fits(j):
        return None
    if t.kind != j.kind and "other" not in (t.kind, j.kind):
        return None
    score = 10.0 if t_name == j_name else 2 * difflib.SequenceMatcher(None, t_name, j_name).ratio()
    score += 4 * (t.kind == j.kind) + 2 * (t.shape == j.shape)
    return score - abs(t_rank - j_rank)


def _match(torch_side: list[Module], jax_modules: list[Module], t_names: list[str], j_names: list[str],
           strict: bool = False) -> list[tuple[Module, Module]]:
    """Pairs of the two lists, best scores first (each module in one pair at most); ``strict``: of
    one known kind and one shape only."""
    candidates = []
    for a, (t, t_name) in enumerate(zip(torch_side, t_names)):
        for b, (j, j_name) in enumerate(zip(jax_modules, j_names)):
            if strict and (t.kind != j.kind or t.kind == "other" or t.shape != j.shape):
                continue
            score = _score(t, j, t_name, j_name, a / max(len(torch_side), 1), b / max(len(jax_modules), 1))
            if score is None:
                continue
            candidates.append((-score, a, b))
    taken_t, taken_j, pairs = set(), set(), []
    for _, a, b in sorted(candidates):
        if a not in taken_t and b not in taken_j:
            taken_t.add(a), taken_j.add(b)
            pairs.append((torch_side[a], jax_modules[b]))
    return pairs


def _pair(torch_modules: list[Module], jax_modules: list[Module]) -> dict[str, str]:
    """PyTorch name -> JAX name: level by level from the top, then what is left across the model."""
    t_names, j_names = {m.name for m in torch_modules}, {m.name for m in jax_modules}
    t_parent = {m.name: _parent(m, t_names) for m in torch_modules}
    j_parent = {m.name: _parent(m, j_names) for m in jax_modules}
    pairs: dict[str, str] = {}
    queue: list[tuple[str | None, str | None]] = [(None, None)]
    while queue:
        t_top, j_top = queue.pop(0)
        ts = [m for m in torch_modules if t_parent[m.name] == t_top and m.name not in pairs]
        js = [m for m in jax_modules if j_parent[m.name] == j_top and m.name not in pairs.values()]
        found = _match(ts, js, [_relative(m, t_top) for m in ts], [_relative(m, j_top) for m in js])
        for t, j in found:
            pairs[t.name] = j.name
            queue.append((t.name, j.name))
    ts = [m for m in torch_modules if m.name not in pairs]
    js = [m for m in jax_modules if m.name not in pairs.values()]
    for t, j in _match(ts, js, [m.name for m in ts], [m.name for m in js], strict=True):
        pairs[t.name] = j.name
    return {m.name: pairs[m.name] for m in torch_modules if m.name in pairs}


def _general(torch_name: str, jax_name: str) -> tuple[str, str]:
    """``(pattern, replacement)``: the names' numeric parts as groups when both hold the same
    numbers in the same order, else the PyTorch name exactly."""
    t_parts, j_parts = torch_name.split("."), jax_name.split(".")
    numbers = [p for p in t_parts if p.isdigit()]
    if not numbers or numbers != [p for p in j_parts if p.isdigit()]:
        return re.escape(torch_name), jax_name
    group = iter(range(1, len(numbers) + 1))
    pattern = r"\.".join(r"(\d+)" if p.isdigit() else re.escape(p) for p in t_parts)
    replacement = ".".join(f"\\{next(group)}" if p.isdigit() else p for p in j_parts)
    return pattern, replacement


def _patterns(pairs: dict[str, str], torch_names: list[str]) -> dict[str, str]:
    """A mapping entry per renamed module, one per pattern where every name it matches pairs as it says."""
    groups: dict[tuple[str, str], list[str]] = {}
    for t, j in pairs.items():
        if t != j:
            groups.setdefault(_general(t, j), []).append(t)
    mapping: dict[str, str] = {}
    for (pattern, replacement), members in groups.items():
        compiled = re.compile(pattern)
        alike = all(pairs.get(n) == compiled.sub(replacement, n) for n in torch_names if compiled.fullmatch(n))
        if alike:
            mapping[pattern] = replacement
        else:
            mapping.update({re.escape(t): pairs[t] for t in members})
    return mapping


def suggest_mapping(torch_model, flax_model, *inputs) -> Suggestion:
    """A ``mapping`` for ``compare(torch_model, flax_model, *inputs, mapping=...)``, from both sides'
    module calls on ``inputs`` (NumPy arrays; none for a saved reference, which has its own).

    Modules are paired by their names (relative to their paired parents), kind, output shape and
    call order; a pair whose outputs have no layout in common is never made. Returns a
    ``Suggestion``: the mapping (a dict, in PyTorch's call order), with ``pairs``, ``unpaired``,
    ``unpaired_jax`` and ``mismatched`` (see ``Suggestion``). ``print_suggestion`` prints it to paste.
    """
    torch_modules, inputs = _torch_modules(torch_model, inputs)
    jax_modules = _jax_modules(flax_model, inputs)
    pairs = _pair(torch_modules, jax_modules)
    jax_by_name = {m.name: m for m in jax_modules}
    mapping: dict[str, str | None] = dict(_patterns(pairs, [m.name for m in torch_modules]))
    mismatched = []
    for m in torch_modules:  # a same-named JAX module left unpaired would be paired by compare: say no
        same = jax_by_name.get(m.name)
        if m.name not in pairs and same is not None:
            mapping[re.escape(m.name)] = None
            if not m.fits(same):
                mismatched.append((m.name, same.name, m.shape, same.shape))
    first = {p: min((i for i, m in enumerate(torch_modules) if re.fullmatch(p, m.name)), default=len(torch_modules))
             for p in mapping}
    mapping = {p: mapping[p] for p in sorted(mapping, key=first.get)}
    paired_jax = set(pairs.values())
    return Suggestion(mapping, pairs, [m.name for m in torch_modules if m.name not in pairs],
                      [m.name for m in jax_modules if m.name not in paired_jax], mismatched)


def _literal(text: str) -> str:
    return f'r"{text}"' if "\\" in text else f'"{text}"'


def format_suggestion(suggestion: Suggestion) -> str:
    """The mapping as a Python dict literal to paste, the unpaired modules as comments after it."""
    lines = ["{"]
    for pattern, replacement in suggestion.items():
        value = "None" if replacement is None else _literal(replacement)
        lines.append(f"    {_literal(pattern)}: {value},")
    lines.append("}")
    mismatched = {t: (ts, js) for t, _, ts, js in suggestion.mismatched}
    for name in suggestion.unpaired:
        why = (f"the JAX module of this name returns {mismatched[name][1]}, PyTorch's {mismatched[name][0]}"
               if name in mismatched else "no JAX module fits")
        lines.append(f"# unpaired PyTorch module {name}: {why}")
    lines += [f"# unpaired JAX module {name}" for name in suggestion.unpaired_jax]
    return "\n".join(lines)


def print_suggestion(torch_model, flax_model, *inputs, file=None) -> Suggestion:
    """``suggest_mapping``'s mapping printed to ``file`` (default: standard output as it is at the
    call) as a dict literal to paste; returns it."""
    suggestion = suggest_mapping(torch_model, flax_model, *inputs)
    print(format_suggestion(suggestion), file=sys.stdout if file is None else file)
    return suggestion
