"""Checkpoint naming schemes (layouts), read into ``mha_torch``'s names, and the shape check of a loaded state."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from mha_spec.arguments import check_head_counts

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
# Fused entries: their weight stacks the projections' rows in this order, q over k over v.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "kv_proj": ("k_proj", "v_proj")}
PARTS = ("weight", "bias")
# Optional QK-norm scales (``normalize_qk``), ``(head_dim,)`` per head or ``(heads * head_dim,)``.
NORMS = ("q_norm", "k_norm")
# Optional learned sink logits, ``(num_heads,)``: a key of its own, no weight/bias part.
SINKS = "sinks"
# Optional output gate (``output_gate``): ``gate_proj.weight`` ``(num_heads, in)`` or ``(num_heads * head_dim, in)``.
GATE = "gate_proj.weight"


class _Source(NamedTuple):
    """One key of a checkpoint: ``key`` (relative to the prefix) holds ``part`` of ``targets``."""

    key: str
    part: str
    targets: tuple[str, ...]


def from_names(names: Mapping[str, str]) -> tuple[_Source, ...]:
    """Sources of a per-projection mapping: entry ``ours -> name`` reads ``name.weight``/``.bias``."""
    return tuple(_Source(f"{name}.{part}", part, FUSED.get(ours, (ours,)))
                 for ours, name in names.items() for part in PARTS)


_QKV = FUSED["qkv_proj"]
# QK-norm scales and sinks, named alike by this package and Hugging Face's attention classes
_EXTRAS = tuple(_Source(f"{norm}.weight", "weight", (norm,)) for norm in NORMS) + (
    _Source(SINKS, "", (SINKS,)), _Source(GATE, "weight", ("gate_proj",)))
LAYOUTS: dict[str, tuple[_Source, ...]] = {
    "mha_torch": from_names(dict(zip(PROJECTIONS, PROJECTIONS))) + _EXTRAS,
    # torch.nn.MultiheadAttention: a fused in_proj_weight when kdim == vdim == embed_dim, else
    # three separate weights; the input bias stays fused in both cases.
    "torch_mha": (_Source("in_proj_weight", "weight", _QKV), *(_Source(f"{p}_weight", "weight", (p,)) for p in _QKV),
                  _Source("in_proj_bias", "bias", _QKV), *from_names({"out_proj": "out_proj"})),
    "hf": from_names(dict(zip(PROJECTIONS, ("q_proj", "k_proj", "v_proj", "o_proj")))) + _EXTRAS,
    "bert": from_names(dict(zip(PROJECTIONS, ("self.query", "self.key", "self.value", "output.dense")))),
    "fused_qkv": from_names({"qkv_proj": "qkv_proj", "out_proj": "o_proj"}) + _EXTRAS,
}
# Keys of options we do not have: an error naming the option, even under ``ignore``.
_UNSUPPORTED = {"torch_mha": {"bias_k": "add_bias_kv=True", "bias_v": "add_bias_kv=True"}}
FLAX = "flax"  # Flax parameter names (query.kernel), read by mha_jax.to_torch, not by read_layout
AUTO = "auto"  # the layout detected from the keys
# Every layout a file may be in, as errors list them.
LAYOUT_NAMES = (*LAYOUTS, FLAX)
# The keys that show a layout (a key shows ``name`` when it is ``name`` or ends with ``.name``),
# and, for a file that shows none, the words that make a layout likely.
_SIGNATURES = {
    "mha_torch": (("q_proj.weight", "out_proj.weight"),), "torch_mha": (("in_proj_weight",), ("q_proj_weight",)),
    "hf": (("q_proj.weight", "o_proj.weight"),), "bert": (("self.query.weight",),),
    "fused_qkv": (("qkv_proj.weight",),), FLAX: (("query.kernel",), ("out.kernel",)),
}
_WORDS = {
    "mha_torch": ("q_proj", "out_proj"), "torch_mha": ("in_proj", "out_proj"), "hf": ("q_proj", "o_proj"),
    "bert": ("query", "output.dense"), "fused_qkv": ("qkv",), FLAX: ("kernel", "query"),
}


def _shows(keys: Sequence[str], name: str) -> bool:
    return any(k == name or k.endswith("." + name) for k in keys)


def detect_layout(keys: Any, *, where: str = "the keys") -> str:
    """The layout whose ``_SIGNATURES`` the keys show (maybe under a prefix); ValueError when none or several fit."""
    keys = sorted(map(str, keys))
    fits = [name for name, alternatives in _SIGNATURES.items()
            if any(all(_shows(keys, k) for k in group) for group in alternatives)]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise ValueError(f"{where} fit more than one layout ({', '.join(fits)}); "
                         f"choose one with layout= ({some(keys)})")
    likely = sorted((-sum(w in k for k in keys for w in words), name) for name, words in _WORDS.items())
    likely = [name for hits, name in likely if hits]
    hint = f"likely layouts: {', '.join(likely)}; " if likely else ""
    raise ValueError(f"{where} show no layout ({some(keys)}): {hint}give layout= (one of {', '.join(LAYOUT_NAMES)}) "
                     "or mapping= for another naming scheme")


def _choose_layout(selected: Mapping[str, Any], layout: str | None, mapping, where: str
                   ) -> tuple[str, bool, str | None]:
    """(layout, whether detected from the keys, why none was detected when not given)."""
    detected = layout == AUTO and mapping is None
    undetected = None
    if layout is None:
        layout = "mha_torch"  # the default where the keys show no one layout
        if mapping is None and selected:
            try:
                layout = detect_layout(selected, where=where)
            except ValueError as error:
                undetected = str(error)
            detected = layout != "mha_torch"
    elif detected and selected:
        layout = detect_layout(selected, where=where)
    return layout, detected, undetected


def _read_sources(selected: Mapping[str, Any], sources, prefix: str, ignored: set, num_heads, num_kv_heads,
                  problems: list[str]) -> tuple[dict[str, Any], dict[str, str], dict[str, str], set[str]]:
    """(our name -> array, -> its key, -> its name in messages; the keys used), fused weights split by rows."""
    out, given, shown, used = {}, {}, {}, set()
    for source in sources:
        if source.key not in selected or source.key in ignored:
            continue
        used.add(source.key)
        full = prefix + source.key
        pieces = _split(selected[source.key], source.targets, num_heads, num_kv_heads, full, problems)
        for target, piece in zip(source.targets, pieces):
            name = f"{target}.{source.part}" if source.part else target
            if name in given:
                problems.append(f"{name} is given twice, by {given[name]!r} and {full!r}")
            given[name], out[name] = full, piece
            shown[name] = repr(full) if len(source.targets) == 1 else f"{full!r} (its {target} rows)"
    return out, given, shown, used


def _missing(given: Mapping[str, str], sources, prefix: str) -> list[str]:
    """Problems for the keys a layer needs and lacks (weights; q/k/v biases all or none; both QK-norms or none)."""
    problems = []
    has_bias = any(f"{proj}.bias" in given for proj in PROJECTIONS[:3])
    for proj in PROJECTIONS:
        for part in PARTS if has_bias and proj != "out_proj" else PARTS[:1]:
            if f"{proj}.{part}" not in given:
                problems.append(f"missing key {_expected(sources, proj, part, prefix)}")
    norms = [norm for norm in NORMS if f"{norm}.weight" in given]
    if len(norms) == 1:
        other = NORMS[1 - NORMS.index(norms[0])]
        problems.append(f"missing key {prefix + other + '.weight'!r} (normalize_qk takes both q_norm and k_norm)")
    return problems


def read_layout(state: Mapping[str, Any], *, layout: str | None = None, mapping: Mapping[str, str] | None = None,
                prefix: str = "", ignore: Sequence[str] = (), num_heads: int | None = None,
                num_kv_heads: int | None = None, expected: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """``mha_torch`` names -> arrays, from the keys under ``prefix`` of a checkpoint in another naming scheme.

    ``layout``: one of ``LAYOUT_NAMES`` but ``"flax"``; ``"auto"``: the one the keys show (``detect_layout``);
    None: that one when exactly one fits, else ``"mha_torch"``. Every key under the prefix is used or starts with
    an ``ignore`` entry. Fused weights ``((heads + 2 * kv_heads) * head_dim, in)`` are split by rows with
    ``num_heads``/``num_kv_heads``, which also check every shape; ``expected`` (name -> shape, a module's) adds
    the keys the module has and lacks. Raises one ValueError listing every bad key, in the file's names.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if isinstance(ignore, str) or not all(isinstance(i, str) and i for i in ignore):
        raise TypeError(f"ignore must be a sequence of non-empty str, got {ignore!r}")
    selected = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    where = f"the keys under prefix {prefix!r}" if prefix else "the keys"
    layout, detected, undetected = _choose_layout(selected, layout, mapping, where)
    sources = _sources(layout, mapping)
    if not selected:
        raise ValueError(f"state_dict: no key starts with prefix {prefix!r} (keys: {some(state)})")
    ignored = {k for k in selected if k.startswith(tuple(ignore))}
    problems = [f"ignore entry {entry!r} matches no key under prefix {prefix!r}" for entry in ignore
                if not any(k.startswith(entry) for k in selected)]
    unsupported = _UNSUPPORTED.get(layout, {}) if mapping is None else {}
    problems += [f"key {prefix + key!r} comes from {option}, which this attention does not have"
                 for key, option in unsupported.items() if key in selected]
    out, given, shown, used = _read_sources(selected, sources, prefix, ignored, num_heads, num_kv_heads, problems)
    unexpected = sorted(k for k in selected if k not in used and k not in ignored and k not in unsupported)
    problems += [f"unexpected key {prefix + k!r}" for k in unexpected]
    if unexpected:
        problems[-1] += " (select one layer with prefix=, leave other keys out with ignore=)"
    problems += _missing(given, sources, prefix)
    if expected is not None:
        problems += _module_fit(out, given, expected, sources, prefix, problems)
    if _positive_int(num_heads) and _positive_int(num_kv_heads):
        present = {name: array for name, array in out.items() if expected is None or name in expected}
        problems += _check_shapes(present, num_heads, num_kv_heads, expected, shown)[1]
    if any(p.startswith("missing key") for p in problems):
        problems += _fitting_prefixes(state, sources, prefix)
        try:
            shown_layout = detect_layout(selected) if not detected and mapping is None else layout
        except ValueError:
            shown_layout = layout
        problems += [f"the keys look like layout {shown_layout!r}"] if shown_layout != layout else []
    if problems:
        problems += [undetected] if undetected else []
        named = repr(layout) if mapping is None else f"mapping {dict(mapping)!r}"
        named += ", detected from the keys" if detected else ""
        raise ValueError(f"state_dict (layout {named}): " + "; ".join(dict.fromkeys(problems)))
    return out


# What a module option adds, for the messages about keys a module has or lacks.
_OPTIONS = {"q_norm.weight": "normalize_qk", "k_norm.weight": "normalize_qk", SINKS: "use_sinks",
            GATE: "output_gate"}


def _module_fit(out: Mapping[str, Any], given: Mapping[str, str], expected: Mapping[str, Sequence[int]],
                sources: tuple[_Source, ...], prefix: str, problems: list[str]) -> list[str]:
    """Keys the module has and the checkpoint lacks, and the reverse."""
    found = []
    for name in expected:
        proj, _, part = name.partition(".")
        if name not in out and not (part == "bias" and f"{proj}.weight" not in out):  # a missing weight says it all
            key = _expected(sources, proj, part, prefix) if proj in PROJECTIONS else repr(prefix + name)
            if f"missing key {key}" not in problems:
                option = f" ({_OPTIONS[name]})" if name in _OPTIONS else ""
                found.append(f"missing key {key}: the module has {name}{option} of shape {tuple(expected[name])}")
    for name in out:
        if name not in expected:
            option = f" ({_OPTIONS[name]}=False)" if name in _OPTIONS else ""
            found.append(f"unexpected key {given[name]!r}: the module has no {name}{option}")
    return found


def _sources(layout: str, mapping: Mapping[str, str] | None) -> tuple[_Source, ...]:
    """The layout's sources, or the mapping's after checking that it names each projection once."""
    if mapping is None:
        if layout == FLAX:
            raise ValueError("layout 'flax' is Flax parameter names (query.kernel, ...): mha_jax.to_torch reads them "
                             "(the command line: mha-parity convert)")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUT_NAMES) + [AUTO]}, got {layout!r}")
        return LAYOUTS[layout]
    if layout not in ("mha_torch", AUTO):
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
    return from_names(mapping)


def _split(array: Any, targets: tuple[str, ...], num_heads, num_kv_heads, key: str, problems: list[str]) -> list:
    """Rows of a fused weight or bias, one view per target; ``[]`` after recording a problem."""
    if len(targets) == 1:
        return [array]
    heads = [_positive_int(num_heads if t == "q_proj" else num_kv_heads) for t in targets]
    if not all(heads):
        problems.append(f"splitting {key!r} needs positive num_heads and num_kv_heads, got {num_heads!r}, "
                        f"{num_kv_heads!r}")
        return []
    rows = array.shape[0] if array.ndim in (1, 2) else 0
    if rows == 0 or rows % sum(heads):
        problems.append(f"{key!r} has shape {tuple(array.shape)}, but a fused {'/'.join(targets)} needs rank 1 or 2 "
                        f"and {' + '.join(map(str, heads))} = {sum(heads)} x head_dim rows "
                        f"(num_heads={num_heads}, num_kv_heads={num_kv_heads})")
        return []
    head_dim = rows // sum(heads)
    starts = [sum(heads[:i]) * head_dim for i in range(len(heads) + 1)]
    return [array[a:b] for a, b in zip(starts, starts[1:])]


def _fitting_prefixes(state: Mapping[str, Any], sources: tuple[_Source, ...], prefix: str) -> list[str]:
    """A hint: the prefixes under which the layout's weights are found."""
    starts = {key[: len(key) - len(s.key)] for key in state for s in sources
              if s.part == "weight" and key.endswith(s.key)}
    fits = {start for start in starts if start.endswith(".") or not start}  # whole dotted components only
    fits.discard(prefix)
    shown = ", ".join(map(repr, sorted(fits)[:4])) + (", ..." if len(fits) > 4 else "")
    return [f"the layout's weights are found under prefix {shown}"] if fits else []


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


def renamed(key: str, renames: Mapping[str, str]) -> str:
    """``key`` with the first start of ``renames`` it has replaced (``o_proj.`` -> ``out_proj.``)."""
    start = next((old for old in renames if key.startswith(old)), None)
    return key if start is None else renames[start] + key[len(start):]


def some(state: Mapping[str, Any], n: int = 4) -> str:
    """The first ``n`` keys of ``state``, sorted, for a message."""
    keys = sorted(state)
    return ", ".join(map(repr, keys[:n])) + (f", ... ({len(keys)} in all)" if len(keys) > n else "") or "none"


def check_state(state: Mapping[str, Any], num_heads: int, num_kv_heads: int,
                expected: Mapping[str, Sequence[int]] | None = None) -> int:
    """head_dim of a state in ``mha_torch`` names (as ``read_layout`` returns it) whose shapes fit the
    head counts and ``expected`` (a module's shapes, when known); else one ValueError naming each problem."""
    head_dim, problems = _check_shapes(state, num_heads, num_kv_heads, expected, {})
    if problems:
        raise ValueError("state_dict: " + "; ".join(problems))
    return head_dim


_WEIGHTS = tuple(f"{p}.weight" for p in PROJECTIONS)
_ORDER = tuple(f"{p}.{part}" for p in PROJECTIONS for part in PARTS) + tuple(f"{n}.weight" for n in NORMS) + (
    SINKS, GATE)
_KV = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")


def _check_shapes(state: Mapping[str, Any], heads: int, kv_heads: int, module: Mapping[str, Sequence[int]] | None,
                  names: Mapping[str, str]) -> tuple[int, list[str]]:
    """``(head_dim, problems)``: every mis-shaped entry of ``state``, named by ``names``; shapes are ``module``'s,
    else from the head counts and ``_head_dim``; head_dim 0 when none fits."""
    check_head_counts(heads, kv_heads)
    shapes = {k: tuple(v.shape) for k, v in state.items() if k in _ORDER}
    shown = {k: names.get(k, repr(k)) for k in _ORDER}
    rank = {k: 2 if k in (*_WEIGHTS, GATE) else 1 for k in _ORDER}
    problems = [f"{shown[k]} has shape {s}, expected rank {rank[k]}" for k, s in shapes.items()
                if len(s) != rank[k] and not (module and k in module)]
    ranked = {k: s for k, s in shapes.items() if len(s) == rank[k]}
    from_module = module and "q_proj.weight" in module
    head_dim = module["q_proj.weight"][0] // heads if from_module else _head_dim(ranked, heads, kv_heads)
    if not head_dim and not any(k in ranked for k in _WEIGHTS):
        return 0, problems  # nothing to split into heads: the missing weights are reported by name
    if not head_dim:
        sizes = ", ".join(f"{shown[k]} {s}" for k, s in ranked.items() if k in _WEIGHTS)
        return 0, problems + [f"no head_dim fits num_heads={heads} and num_kv_heads={kv_heads} (shapes: {sizes})"]
    allowed = _allowed(ranked, heads, kv_heads, head_dim)
    for k, s in shapes.items():
        want = [tuple(module[k])] if module and k in module else allowed.get(k) if k in ranked else None
        if want and s not in want:
            why = _why(k, s, want[0], heads, kv_heads, head_dim)
            problems.append(f"{shown[k]} has shape {s}, expected {' or '.join(map(str, want))}{why}")
    if (n := _kv_heads_found(ranked, heads, head_dim)) and n != kv_heads:
        problems.append(f"the key/value rows fit num_kv_heads={n} (head_dim={head_dim}), not num_kv_heads={kv_heads}")
    return head_dim, problems


def _kv_heads_found(shapes: Mapping[str, tuple], heads: int, head_dim: int) -> int:
    """The key/value head count that every key/value row count agrees on, if it divides ``heads``; else 0."""
    rows = {shapes[k][0] for k in _KV if k in shapes}
    n, rest = divmod(rows.pop(), head_dim) if len(rows) == 1 else (0, 1)
    return n if n and not rest and heads % n == 0 else 0


def _why(name: str, found: tuple, want: tuple, heads: int, kv_heads: int, head_dim: int) -> str:
    """What an expected row or column count is made of, when that is what differs."""
    if len(found) != len(want):
        return ""
    if name == f"{PROJECTIONS[3]}.weight" and found[1:] != want[1:]:
        return f" (num_heads={heads} x head_dim={head_dim} columns)"
    if name.split(".")[0] in PROJECTIONS[:3] and found[:1] != want[:1]:
        n, what = (heads, "num_heads") if name.startswith("q_") else (kv_heads, "num_kv_heads")
        return f" ({what}={n} x head_dim={head_dim} rows)"
    return ""


def _allowed(shapes: Mapping[str, tuple], heads: int, kv_heads: int, head_dim: int) -> dict[str, list[tuple]]:
    """The shapes each entry of ``shapes`` may have for this head_dim; free axes as found."""
    rows = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim, "v_proj": kv_heads * head_dim}
    allowed: dict[str, list[tuple]] = {}
    for proj, n in rows.items():
        if f"{proj}.weight" in shapes:
            allowed[f"{proj}.weight"] = [(n, shapes[f"{proj}.weight"][1])]
        allowed[f"{proj}.bias"] = [(n,)]
    if "out_proj.weight" in shapes:
        allowed["out_proj.weight"] = [(shapes["out_proj.weight"][0], heads * head_dim)]
        allowed["out_proj.bias"] = [(shapes["out_proj.weight"][0],)]
    for norm, n in zip(NORMS, (heads, kv_heads)):
        allowed[f"{norm}.weight"] = [(head_dim,), (n * head_dim,)] if n > 1 else [(head_dim,)]
    allowed[SINKS] = [(heads,)]
    if GATE in shapes and "q_proj.weight" in shapes:
        allowed[GATE] = [(n, shapes["q_proj.weight"][1]) for n in (heads, heads * head_dim)]
    return {k: v for k, v in allowed.items() if k in shapes}


def _head_dim(shapes: Mapping[str, tuple], heads: int, kv_heads: int) -> int:
    """The candidate head_dim under which the fewest entries are mis-shaped; 0 if none fits."""
    counts = [(shapes[k][0], heads) for k in ("q_proj.weight", "q_proj.bias") if k in shapes]
    counts += [(shapes[k][0], kv_heads) for k in _KV if k in shapes]
    counts += [(shapes["out_proj.weight"][1], heads)] if "out_proj.weight" in shapes else []
    votes = [n // h for n, h in counts if n and n % h == 0]

    def cost(head_dim: int) -> tuple[int, int, int]:
        allowed = _allowed(shapes, heads, kv_heads, head_dim)
        bad = {k for k, s in shapes.items() if k in allowed and s not in allowed[k]}
        kv_bad = bad & set(_KV)
        one_mistake = _kv_heads_found(shapes, heads, head_dim)
        mistakes = len(bad - kv_bad) + (min(len(kv_bad), 1) if one_mistake else len(kv_bad))
        return mistakes, -votes.count(head_dim), head_dim

    return min(set(votes), key=cost, default=0)


def read_checkpoint(state_dict_or_path: Any, load_file: Callable[[str], dict], value: Callable[[str, Any], Any]
                    ) -> dict[str, Any]:
    """Name -> array of one framework: a ``.safetensors`` path read by ``load_file(path)``, or a
    mapping whose values ``value(name, v)`` copies (raising ValueError for one not numeric)."""
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        path = os.fspath(state_dict_or_path)
        if not path.endswith(".safetensors"):
            raise ValueError(f"state_dict_or_path must be a .safetensors file, got {path!r}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"state_dict_or_path {path!r} does not exist")
        try:
            return load_file(path)
        except Exception as error:  # safetensors raises its own types for bad headers
            raise ValueError(f"state_dict_or_path {path!r} is not a readable safetensors file: {error}") from error
    if not isinstance(state_dict_or_path, Mapping):
        raise TypeError("state_dict_or_path must be a mapping of name to array or a .safetensors path, "
                        f"got {type(state_dict_or_path).__name__}")
    return {str(k): value(str(k), v) for k, v in state_dict_or_path.items()}


# --- multi-head latent attention (mha_spec.latent): transformers' names, ``o_proj`` read as ``out_proj``

LATENT = "mla"
_LATENT_RENAMES = {"o_proj.": "out_proj."}


def read_latent(state: Mapping[str, Any], *, layout: str | None = None, mapping: Mapping[str, str] | None = None,
                prefix: str = "", ignore: Sequence[str] = (),
                expected: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """A latent layer's keys under ``prefix`` (``o_proj`` read as ``out_proj``) but those starting with an
    ``ignore`` entry. ``layout``: None, ``"auto"``, ``"mla"`` or ``"mha_torch"``; ``expected``: names -> shapes."""
    if mapping is not None:
        raise ValueError("a latent module reads transformers' names: pass no mapping")
    if layout not in (None, AUTO, LATENT, "mha_torch"):
        raise ValueError(f"a latent module reads layout {LATENT!r} (transformers' names) or 'mha_torch', "
                         f"got {layout!r}")
    selected = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not selected:
        raise ValueError(f"state_dict: no key starts with prefix {prefix!r} (keys: {some(state)})")
    out = {renamed(k, _LATENT_RENAMES): v for k, v in selected.items() if not k.startswith(tuple(ignore))}
    if expected is None:
        return out
    problems = [f"missing key {prefix + k!r} (shape {tuple(shape)})" for k, shape in expected.items() if k not in out]
    problems += [f"unexpected key {prefix + k!r}" for k in out if k not in expected]
    problems += [f"{prefix + k!r} has shape {tuple(v.shape)}, the module's is {tuple(expected[k])}"
                 for k, v in out.items() if k in expected and tuple(v.shape) != tuple(expected[k])]
    if problems:
        raise ValueError(f"state_dict (layout {LATENT!r}): " + "; ".join(problems))
    return out
