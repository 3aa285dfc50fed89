"""Naming schemes (layouts) of attention checkpoints, read into ``mha_torch``'s names.

Twin of ``mha_torch/_layouts.py``. Neither package may import the other, so the code below this
docstring is the same text in both files (a test checks it): it uses only strings, ``.shape``,
``.ndim`` and slicing along the first axis, which NumPy arrays and torch tensors share.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
# Fused entries: their weight stacks the projections' rows in this order, q over k over v.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "kv_proj": ("k_proj", "v_proj")}
PARTS = ("weight", "bias")


@dataclass(frozen=True)
class _Source:
    """One key of a checkpoint: ``key`` (relative to the prefix) holds ``part`` of ``targets``."""

    key: str
    part: str
    targets: tuple[str, ...]


def _from_names(names: Mapping[str, str]) -> tuple[_Source, ...]:
    """Sources of a per-projection mapping: entry ``ours -> name`` reads ``name.weight``/``.bias``."""
    return tuple(
        _Source(f"{name}.{part}", part, FUSED.get(ours, (ours,)))
        for ours, name in names.items()
        for part in PARTS
    )


_QKV = FUSED["qkv_proj"]
LAYOUTS: dict[str, tuple[_Source, ...]] = {
    "mha_torch": _from_names(
        {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "out_proj"}
    ),
    # torch.nn.MultiheadAttention: a fused in_proj_weight when kdim == vdim == embed_dim, else
    # three separate weights; the input bias stays fused in both cases.
    "torch_mha": (
        _Source("in_proj_weight", "weight", _QKV),
        _Source("q_proj_weight", "weight", ("q_proj",)),
        _Source("k_proj_weight", "weight", ("k_proj",)),
        _Source("v_proj_weight", "weight", ("v_proj",)),
        _Source("in_proj_bias", "bias", _QKV),
        _Source("out_proj.weight", "weight", ("out_proj",)),
        _Source("out_proj.bias", "bias", ("out_proj",)),
    ),
    "hf": _from_names(
        {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "o_proj"}
    ),
    "bert": _from_names(
        {"q_proj": "self.query", "k_proj": "self.key", "v_proj": "self.value", "out_proj": "output.dense"}
    ),
    "fused_qkv": _from_names({"qkv_proj": "qkv_proj", "out_proj": "o_proj"}),
}
# Keys of options we do not have: an error naming the option, even under ``ignore``.
_UNSUPPORTED = {"torch_mha": {"bias_k": "add_bias_kv=True", "bias_v": "add_bias_kv=True"}}


def read_layout(
    state: Mapping[str, Any],
    *,
    layout: str = "mha_torch",
    mapping: Mapping[str, str] | None = None,
    prefix: str = "",
    ignore: Sequence[str] = (),
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> dict[str, Any]:
    """``mha_torch`` names -> arrays, from a checkpoint in another naming scheme.

    Only keys starting with ``prefix`` are read; the rest of a bigger checkpoint is left alone.
    Every key under the prefix must be used, or named (by its start, relative to the prefix) in
    ``ignore``. Fused weights ``((heads + 2 * kv_heads) * head_dim, in)`` are split by rows into
    views, which is why ``num_heads``/``num_kv_heads`` are needed. Raises one ValueError listing
    every missing, repeated, unsupported or unexpected key.
    """
    sources = _sources(layout, mapping)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if isinstance(ignore, str) or not all(isinstance(i, str) and i for i in ignore):
        raise TypeError(f"ignore must be a sequence of non-empty str, got {ignore!r}")
    selected = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not selected:
        raise ValueError(
            f"state_dict: no key starts with prefix {prefix!r} (keys: {_some(state)})"
        )

    problems: list[str] = []
    ignored = set()
    for entry in ignore:
        hits = {k for k in selected if k.startswith(entry)}
        if not hits:
            problems.append(f"ignore entry {entry!r} matches no key under prefix {prefix!r}")
        ignored |= hits
    unsupported = _UNSUPPORTED.get(layout, {}) if mapping is None else {}
    for key, option in unsupported.items():
        if key in selected:
            problems.append(f"key {prefix + key!r} comes from {option}, which this attention does not have")

    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # our name -> the key it came from
    used = set()
    for source in sources:
        if source.key not in selected or source.key in ignored:
            continue
        used.add(source.key)
        full = prefix + source.key
        pieces = _split(selected[source.key], source.targets, num_heads, num_kv_heads, full, problems)
        for target, piece in zip(source.targets, pieces):
            name = f"{target}.{source.part}"
            if name in given:
                problems.append(f"{name} is given twice, by {given[name]!r} and {full!r}")
            given[name], out[name] = full, piece

    unexpected = sorted(k for k in selected if k not in used and k not in ignored and k not in unsupported)
    problems += [f"unexpected key {prefix + k!r}" for k in unexpected]
    if unexpected:
        problems[-1] += " (select one layer with prefix=, leave other keys out with ignore=)"
    has_bias = any(name.endswith(".bias") for name in given)
    for proj in PROJECTIONS:
        for part in PARTS if has_bias else PARTS[:1]:
            if f"{proj}.{part}" not in given:
                problems.append(f"missing key {_expected(sources, proj, part, prefix)}")
    if any(p.startswith("missing key") for p in problems):
        problems += _fitting_prefixes(state, sources, prefix)
    if problems:
        raise ValueError(f"state_dict (layout {_name(layout, mapping)}): " + "; ".join(dict.fromkeys(problems)))
    return out


def _sources(layout: str, mapping: Mapping[str, str] | None) -> tuple[_Source, ...]:
    """The layout's sources, or the mapping's after checking that it names each projection once."""
    if mapping is None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
        return LAYOUTS[layout]
    if layout != "mha_torch":
        raise ValueError(f"give layout or mapping, not both: got layout={layout!r} and a mapping")
    if not isinstance(mapping, Mapping):
        raise TypeError(f"mapping must be a mapping of projection to name, got {type(mapping).__name__}")
    allowed = PROJECTIONS + tuple(FUSED)
    problems = [f"unknown entry {k!r} (entries: {', '.join(allowed)})" for k in mapping if k not in allowed]
    problems += [f"{k!r} -> {v!r} is not a non-empty str" for k, v in mapping.items() if not (isinstance(v, str) and v)]
    covered = [t for k in mapping if k in allowed for t in FUSED.get(k, (k,))]
    problems += [f"{p} is named {covered.count(p)} times" for p in PROJECTIONS if covered.count(p) > 1]
    problems += [f"{p} is not named" for p in PROJECTIONS if p not in covered]
    if problems:
        raise ValueError("mapping: " + "; ".join(problems))
    return _from_names(mapping)


def _split(array: Any, targets: tuple[str, ...], num_heads, num_kv_heads, key: str, problems: list[str]) -> list:
    """Rows of a fused weight or bias, one view per target; ``[]`` after recording a problem."""
    if len(targets) == 1:
        return [array]
    heads = [_positive_int(num_heads if t == "q_proj" else num_kv_heads) for t in targets]
    if not all(heads):
        problems.append(f"splitting {key!r} needs positive num_heads and num_kv_heads, got {num_heads!r}, {num_kv_heads!r}")
        return []
    rows = array.shape[0] if array.ndim in (1, 2) else 0
    if rows == 0 or rows % sum(heads):
        problems.append(
            f"{key!r} has shape {tuple(array.shape)}, but a fused {'/'.join(targets)} needs rank 1 or 2 "
            f"and {' + '.join(map(str, heads))} = {sum(heads)} x head_dim rows "
            f"(num_heads={num_heads}, num_kv_heads={num_kv_heads})"
        )
        return []
    head_dim = rows // sum(heads)
    starts = [sum(heads[:i]) * head_dim for i in range(len(heads) + 1)]
    return [array[a:b] for a, b in zip(starts, starts[1:])]


def _fitting_prefixes(state: Mapping[str, Any], sources: tuple[_Source, ...], prefix: str) -> list[str]:
    """A hint when weights are missing: the prefixes under which the layout's weights are found."""
    fits = {
        key[: len(key) - len(s.key)]
        for key in state for s in sources
        if s.part == "weight" and key.endswith(s.key) and key[: len(key) - len(s.key)] in ("", *_dotted_heads(key))
    }
    fits.discard(prefix)
    shown = ", ".join(map(repr, sorted(fits)[:4])) + (", ..." if len(fits) > 4 else "")
    return [f"the layout's weights are found under prefix {shown}"] if fits else []


def _dotted_heads(key: str) -> list[str]:
    """Every start of ``key`` that ends with a dot: 'a.b.c' -> ['a.', 'a.b.']."""
    parts = key.split(".")
    return [".".join(parts[:i]) + "." for i in range(1, len(parts))]


def _positive_int(n: Any) -> int:
    """``n`` as an int if it is a positive integer (NumPy's included), else 0."""
    try:
        return max(operator.index(n), 0) if not isinstance(n, bool) else 0
    except TypeError:
        return 0


def _expected(sources: tuple[_Source, ...], proj: str, part: str, prefix: str) -> str:
    """The key(s) that would have given ``proj``'s ``part``, for a 'missing key' message."""
    keys = [repr(prefix + s.key) for s in sources if s.part == part and proj in s.targets]
    return keys[0] if len(keys) == 1 else f"{keys[0]} (or {' or '.join(keys[1:])})"


def _name(layout: str, mapping: Mapping[str, str] | None) -> str:
    return repr(layout) if mapping is None else f"mapping {dict(mapping)!r}"


def _some(state: Mapping[str, Any], n: int = 4) -> str:
    keys = sorted(state)
    return ", ".join(map(repr, keys[:n])) + (f", ... ({len(keys)} in all)" if len(keys) > n else "") or "none"
