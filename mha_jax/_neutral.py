"""The framework-neutral pieces of the package, byte-identical in ``mha_jax`` and ``mha_torch``.

Neither package may import the other, so this one file is copied into both, and a test checks
that the two copies are the same bytes. It uses only Python, NumPy and what NumPy arrays, JAX
arrays and torch tensors share (``.shape``, ``.ndim``, ``.reshape``, slicing along the first axis):

- argument checks that read no array library: head counts, broadcasting, rates, scales,
  logit soft-caps, windows, sequence and sink shapes;
- the batch axes of the modules' inputs, merged into one and restored;
- when a decoding cache overwrites what a query may still see;
- checkpoint naming schemes (layouts), read into ``mha_torch``'s names, and the shape check
  of a loaded state;
- the shape rules of ``torch.nn.MultiheadAttention``'s masks;
- rotary position embeddings' parameters: their checks, what transformers derives from them in
  Python floats, and how a transformers ``config.json`` names them.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any

import numpy as np

# --- argument checks ---------------------------------------------------------------------


def _require_counts(num_heads: int, num_kv_heads: int) -> None:
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive integer, got {n!r}")


def check_head_counts(num_heads: int, num_kv_heads: int) -> None:
    """Both counts positive integers, the key/value heads dividing the query heads."""
    _require_counts(num_heads, num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})"
        )


def check_heads(num_heads: int, num_kv_heads: int, features: int, features_name: str) -> int:
    """Validate head counts against a feature size; return head_dim."""
    _require_counts(num_heads, num_kv_heads)
    if not isinstance(features, (int, np.integer)) or isinstance(features, bool) or features < 1:
        raise ValueError(f"{features_name} must be a positive integer, got {features!r}")
    if features % num_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must divide {features_name} ({features})"
        )
    check_head_counts(num_heads, num_kv_heads)
    return features // num_heads


def check_broadcast(name: str, shape: Sequence[int], target: Sequence[int], target_names: str) -> None:
    """ValueError unless ``shape`` broadcasts to ``target`` (right-aligned, numpy rules)."""
    shape, target = tuple(shape), tuple(target)
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(shape[::-1], target[::-1])
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to {target_names} = {target}"
        )


def check_dropout_rate(name: str, rate: float) -> float:
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number in [0, 1), got {rate!r}") from None
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate}")
    return rate


def resolve_deterministic(call: bool | None, default: bool | None) -> bool:
    """The call's ``deterministic``, else the module's; an error when dropout needs one and neither is set."""
    for value in (call, default):
        if value is not None:
            return bool(value)
    raise ValueError(
        "dropout_rate > 0 needs deterministic=True or False, in the constructor or the call "
        "(nnx: module.eval() / module.train())"
    )


def check_scale(scale) -> float | None:
    """None, or a finite real number."""
    if scale is None:
        return None
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_logit_soft_cap(cap) -> float | None:
    """None, or a positive finite real number (a Python or NumPy scalar: it is static under ``jit``)."""
    if cap is None:
        return None
    if isinstance(cap, (bool, np.bool_, str, bytes)):  # float() would read True or '50'
        raise TypeError(f"logit_soft_cap must be a positive finite number, got {cap!r}")
    try:
        value = float(cap)
    except (TypeError, ValueError):
        raise TypeError(f"logit_soft_cap must be a positive finite number, got {cap!r}") from None
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"logit_soft_cap must be a positive finite number, got {value}")
    return value


def check_sinks_shape(shape: Sequence[int], heads: int) -> None:
    """ValueError unless ``shape`` is ``(heads,)``: one sink logit per query head."""
    if tuple(shape) != (heads,):
        raise ValueError(
            f"sinks must have shape (heads,) = ({heads},), one logit per query head, got {tuple(shape)}"
        )


def check_is_causal(is_causal) -> bool:
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    return bool(is_causal)


def check_implementation(implementation, known: tuple[str, ...]) -> str | None:
    """None (the default choice) or one of ``known``."""
    if implementation is not None and implementation not in known:
        raise ValueError(f"implementation must be one of {known} or None, got {implementation!r}")
    return implementation


def check_window(window) -> tuple[int, int] | None:
    """None, an integer ``w`` (the window ``(w, w)``) or ``(left, right)``, each >= 0."""
    if window is None:
        return None
    pair = (window, window) if isinstance(window, (int, np.integer)) and not isinstance(window, bool) else window
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
        isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in pair
    )):
        raise TypeError(f"local_window_size must be an integer or a pair (left, right) of integers, got {window!r}")
    if min(pair) < 0:
        raise ValueError(f"local_window_size must be >= 0 on both sides, got {window!r}")
    return int(pair[0]), int(pair[1])


@dataclass(frozen=True)
class QKNorm:
    """Normalisation of queries and keys before the logits (QK-norm).

    ``kind``: ``"layer"`` (mean and variance, no bias: flax's ``normalize_qk``, StableLM) or
    ``"rms"`` (root mean square: Qwen3, Gemma 3, OLMo 2). ``per_head``: over each head's
    ``head_dim`` features (scale ``(head_dim,)``), else over the whole projection, every head
    together (scale ``(heads * head_dim,)``, OLMo 2). ``eps`` is added to the variance.
    ``offset``: the features are multiplied by ``offset + scale`` (Gemma: ``1 + weight``, its
    scale initialised to 0). Computed in float32 at least, cast back to the input dtype.
    """

    kind: str = "layer"
    per_head: bool = True
    eps: float = 1e-6
    offset: float = 0.0

    def __post_init__(self):
        if self.kind not in ("layer", "rms"):
            raise ValueError(f"QKNorm kind must be 'layer' or 'rms', got {self.kind!r}")
        if not isinstance(self.per_head, bool):
            raise TypeError(f"QKNorm per_head must be a bool, got {self.per_head!r}")
        for name in ("eps", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not math.isfinite(value):
                raise ValueError(f"QKNorm {name} must be a finite number, got {value!r}")
        if self.eps <= 0:
            raise ValueError(f"QKNorm eps must be > 0, got {self.eps!r}")


def check_qk_norm(normalize_qk) -> QKNorm | None:
    """``normalize_qk`` as a ``QKNorm``: False/None -> None, True -> flax's (LayerNorm per head,
    eps 1e-6), a ``QKNorm`` as it is."""
    if normalize_qk is None or normalize_qk is False:
        return None
    if normalize_qk is True:
        return QKNorm()
    if isinstance(normalize_qk, QKNorm):
        return normalize_qk
    if type(normalize_qk).__name__ == "QKNorm":  # the twin package's (this file, imported there)
        return QKNorm(normalize_qk.kind, normalize_qk.per_head, normalize_qk.eps, normalize_qk.offset)
    raise TypeError(f"normalize_qk must be a bool or a QKNorm, got {type(normalize_qk).__name__}")


def check_sequence_shape(name: str, shape: Sequence[int], batch: int, length: int, length_name: str) -> None:
    """ValueError unless ``shape`` is ``(length,)``, ``(1, length)`` or ``(batch, length)``."""
    shape = tuple(shape)
    if not (shape == (length,) or (len(shape) == 2 and shape[0] in (1, batch) and shape[1] == length)):
        raise ValueError(
            f"{name} must have shape ({length_name},) = ({length},) or (batch, {length_name}) = "
            f"({batch}, {length}), got {shape}"
        )


def check_lengths_shape(name: str, shape: Sequence[int], batch: int) -> None:
    """ValueError unless ``shape`` is ``()``, ``(1,)`` or ``(batch,)``."""
    if tuple(shape) not in ((), (1,), (batch,)):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(shape)}")


def check_lengths_range(name: str, values: np.ndarray, kv_len: int) -> None:
    """ValueError unless every length lies in ``[0, kv_len]``."""
    if values.size and (values.min() < 0 or values.max() > kv_len):
        raise ValueError(f"{name} must lie in [0, kv_len] = [0, {kv_len}], got {values.tolist()}")


# --- batch axes of the modules' inputs ------------------------------------------------------

# Axes after the batch axes, per module argument: masks and biases (heads, q_len, kv_len),
# positions and segment ids (len,), lengths none.
_TRAILING = {"mask": 3, "bias": 3, "dropout_mask": 3, "key_value_seq_lengths": 0}


def flatten_batch(inputs: tuple, broadcast: Callable, **terms: Any) -> tuple[tuple[int, ...], tuple, dict]:
    """Inputs ``(*batch, len, features)`` as ``(prod(batch), len, features)`` and each term with
    its batch axes merged likewise: ``(batch_shape, inputs, terms)``. ``broadcast(x, shape)`` is
    the framework's broadcast; one batch axis is left as it is."""
    batch_shape = tuple(inputs[0].shape[:-2])
    if len(batch_shape) == 1:
        return batch_shape, inputs, terms
    inputs = tuple(x.reshape((math.prod(batch_shape),) + tuple(x.shape[-2:])) for x in inputs)
    return batch_shape, inputs, {
        name: _merge_batch(name, x, batch_shape, _TRAILING.get(name, 1), broadcast) for name, x in terms.items()
    }


def _merge_batch(name: str, x: Any, batch_shape: tuple[int, ...], trailing: int, broadcast: Callable) -> Any:
    """``x`` broadcasting to ``(*batch_shape, *rest)`` with ``trailing`` = len(rest), as
    ``(prod(batch)|1, *rest)``; an ``x`` without batch axes unchanged."""
    if x is None or not hasattr(x, "shape") or 0 < trailing and x.ndim <= trailing:
        return x
    full = len(batch_shape) + trailing
    lead = tuple(x.shape[:x.ndim - trailing])
    if x.ndim > full or any(a not in (1, b) for a, b in zip(reversed(lead), reversed(batch_shape))):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, whose batch axes {lead} do not broadcast to the "
            f"inputs' batch axes {batch_shape}"
        )
    rest = tuple(x.shape[x.ndim - trailing:])
    if trailing > 0 and all(a == 1 for a in lead):
        return x.reshape((1,) + rest)
    return broadcast(x.reshape((1,) * (full - x.ndim) + tuple(x.shape)), batch_shape + rest).reshape((math.prod(batch_shape),) + rest)


def unflatten_batch(x: Any, batch_shape: tuple[int, ...]) -> Any:
    """``(prod(batch)|1, ...)`` back to ``(*batch_shape, ...)``, a broadcast axis as ones."""
    if len(batch_shape) == 1:
        return x
    lead = batch_shape if x.shape[0] == math.prod(batch_shape) else (1,) * len(batch_shape)
    return x.reshape(lead + tuple(x.shape[1:]))


# --- decoding caches ------------------------------------------------------------------------


def cache_overflows(start: Any, end: Any, max_length: int, window: tuple[int, int] | None, causal: bool) -> Any:
    """bool ``(batch,)``: the step overwrote a position some new query may still see. Past
    ``max_length`` positions the oldest are overwritten; with a window of ``left`` (causal or
    ``right == 0``) a chunk from ``start`` to ``end`` still sees them unless
    ``left + (end - start) <= max_length``."""
    wrapped = end > max_length
    if window is not None and (causal or window[1] == 0):
        return wrapped & (end - start + window[0] > max_length)
    return wrapped


# --- checkpoint layouts ------------------------------------------------------------------

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")
# Fused entries: their weight stacks the projections' rows in this order, q over k over v.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "kv_proj": ("k_proj", "v_proj")}
PARTS = ("weight", "bias")
# Optional QK-norm scales (``normalize_qk``), ``(head_dim,)`` per head or ``(heads * head_dim,)``.
NORMS = ("q_norm", "k_norm")
# Optional learned sink logits, ``(num_heads,)``: a key of its own, no weight/bias part.
SINKS = "sinks"


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
# QK-norm scales and sinks, named alike by this package and Hugging Face's attention classes
_EXTRAS = tuple(_Source(f"{norm}.weight", "weight", (norm,)) for norm in NORMS) + (_Source(SINKS, "", (SINKS,)),)
LAYOUTS: dict[str, tuple[_Source, ...]] = {
    "mha_torch": _from_names(
        {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "out_proj": "out_proj"}
    ) + _EXTRAS,
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
    ) + _EXTRAS,
    "bert": _from_names(
        {"q_proj": "self.query", "k_proj": "self.key", "v_proj": "self.value", "out_proj": "output.dense"}
    ),
    "fused_qkv": _from_names({"qkv_proj": "qkv_proj", "out_proj": "o_proj"}) + _EXTRAS,
}
# Keys of options we do not have: an error naming the option, even under ``ignore``.
_UNSUPPORTED = {"torch_mha": {"bias_k": "add_bias_kv=True", "bias_v": "add_bias_kv=True"}}
FLAX = "flax"  # Flax parameter names (query.kernel), read by mha_jax.to_torch, not by read_layout
AUTO = "auto"  # the layout detected from the keys
# Every layout a file may be in, as errors list them.
LAYOUT_NAMES = ("mha_torch", "torch_mha", "hf", "bert", "fused_qkv", FLAX)
# The keys that show a layout (a key shows ``name`` when it is ``name`` or ends with ``.name``),
# and, for a file that shows none, the words that make a layout likely.
_SIGNATURES = {
    "mha_torch": (("q_proj.weight", "out_proj.weight"),),
    "torch_mha": (("in_proj_weight",), ("q_proj_weight",)),
    "hf": (("q_proj.weight", "o_proj.weight"),),
    "bert": (("self.query.weight",),),
    "fused_qkv": (("qkv_proj.weight",),),
    FLAX: (("query.kernel",), ("out.kernel",)),
}
_WORDS = {
    "mha_torch": ("q_proj", "out_proj"), "torch_mha": ("in_proj", "out_proj"), "hf": ("q_proj", "o_proj"),
    "bert": ("query", "output.dense"), "fused_qkv": ("qkv",), FLAX: ("kernel", "query"),
}


def _shows(keys: Sequence[str], name: str) -> bool:
    return any(k == name or k.endswith("." + name) for k in keys)


def detect_layout(keys: Any, *, where: str = "the keys") -> str:
    """The layout of a checkpoint from its key names (a mapping's keys or any iterable of str).

    ``in_proj_weight``/``q_proj_weight``: ``torch_mha``; ``q_proj.weight`` with
    ``out_proj.weight``: ``mha_torch``, with ``o_proj.weight``: ``hf``; ``self.query.weight``:
    ``bert``; ``qkv_proj.weight``: ``fused_qkv``; ``query.kernel``: ``flax``. A key may carry a
    prefix (``encoder.layer.0.attention.self.query.weight``). ValueError naming the likely
    layouts when none or several fit.
    """
    keys = sorted(map(str, keys))
    fits = [name for name, alternatives in _SIGNATURES.items() if any(all(_shows(keys, k) for k in group) for group in alternatives)]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise ValueError(f"{where} fit more than one layout ({', '.join(fits)}); choose one with layout= ({_some(keys)})")
    likely = sorted((-sum(w in k for k in keys for w in words), name) for name, words in _WORDS.items())
    likely = [name for hits, name in likely if hits]
    hint = f"likely layouts: {', '.join(likely)}; " if likely else ""
    raise ValueError(
        f"{where} show no layout ({_some(keys)}): {hint}give layout= (one of {', '.join(LAYOUT_NAMES)}) "
        "or mapping= for another naming scheme"
    )


def read_layout(
    state: Mapping[str, Any],
    *,
    layout: str = "mha_torch",
    mapping: Mapping[str, str] | None = None,
    prefix: str = "",
    ignore: Sequence[str] = (),
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    expected: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """``mha_torch`` names -> arrays, from a checkpoint in another naming scheme.

    ``layout``: one of ``LAYOUT_NAMES`` but ``"flax"`` (read by ``mha_jax.to_torch``), or
    ``"auto"``: the layout the keys under the prefix show (``detect_layout``). Only keys
    starting with ``prefix`` are read; the rest of a bigger checkpoint is left alone. Every key
    under the prefix must be used, or named (by its start, relative to the prefix) in
    ``ignore``. Fused weights ``((heads + 2 * kv_heads) * head_dim, in)`` are split by rows into
    views, which is why ``num_heads``/``num_kv_heads`` are needed. With them, every shape is
    checked too (``shape_problems``); ``expected`` (``mha_torch`` name -> shape, a module's
    parameters) adds the keys the module has and lacks. Raises one ValueError listing every
    missing, repeated, unsupported, unexpected or mis-shaped key, each once, in the file's names.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if isinstance(ignore, str) or not all(isinstance(i, str) and i for i in ignore):
        raise TypeError(f"ignore must be a sequence of non-empty str, got {ignore!r}")
    selected = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    detected = layout == AUTO and mapping is None
    if detected and selected:
        layout = detect_layout(selected, where=f"the keys under prefix {prefix!r}" if prefix else "the keys")
    sources = _sources(layout, mapping)
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
    shown: dict[str, str] = {}  # our name -> how messages name it
    used = set()
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

    unexpected = sorted(k for k in selected if k not in used and k not in ignored and k not in unsupported)
    problems += [f"unexpected key {prefix + k!r}" for k in unexpected]
    if unexpected:
        problems[-1] += " (select one layer with prefix=, leave other keys out with ignore=)"
    # q/k/v biases come all or none; the output projection's bias on its own (Qwen2 has none there)
    has_bias = any(f"{proj}.bias" in given for proj in PROJECTIONS[:3])
    for proj in PROJECTIONS:
        for part in PARTS if has_bias and proj != "out_proj" else PARTS[:1]:
            if f"{proj}.{part}" not in given:
                problems.append(f"missing key {_expected(sources, proj, part, prefix)}")
    norms = [norm for norm in NORMS if f"{norm}.weight" in given]
    if len(norms) == 1:
        other = NORMS[1 - NORMS.index(norms[0])]
        problems.append(f"missing key {prefix + other + '.weight'!r} (normalize_qk takes both q_norm and k_norm)")
    if expected is not None:
        problems += _module_fit(out, given, expected, sources, prefix, problems)
    if _positive_int(num_heads) and _positive_int(num_kv_heads):
        present = {name: array for name, array in out.items() if expected is None or name in expected}
        problems += shape_problems(present, num_heads, num_kv_heads, expected, names=shown)
    if any(p.startswith("missing key") for p in problems):
        problems += _fitting_prefixes(state, sources, prefix)
        if not detected and mapping is None:
            problems += _looks_like(selected, layout)
    if problems:
        named = _name(layout, mapping) + (", detected from the keys" if detected else "")
        raise ValueError(f"state_dict (layout {named}): " + "; ".join(dict.fromkeys(problems)))
    return out


# What a module option adds, for the messages about keys a module has or lacks.
_OPTIONS = {"q_norm.weight": "normalize_qk", "k_norm.weight": "normalize_qk", SINKS: "use_sinks"}


def _module_fit(out: Mapping[str, Any], given: Mapping[str, str], expected: Mapping[str, Sequence[int]],
                sources: tuple[_Source, ...], prefix: str, problems: list[str]) -> list[str]:
    """Keys the module has and the checkpoint lacks, and the reverse; names already reported
    missing, and the biases of missing weights, are not repeated."""
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


def _looks_like(keys: Any, layout: str) -> list[str]:
    """A hint when a layout's weights are missing: the layout the keys show, if another."""
    try:
        shown = detect_layout(keys)
    except ValueError:
        return []
    return [f"the keys look like layout {shown!r}"] if shown != layout else []


def _sources(layout: str, mapping: Mapping[str, str] | None) -> tuple[_Source, ...]:
    """The layout's sources, or the mapping's after checking that it names each projection once."""
    if mapping is None:
        if layout == FLAX:
            raise ValueError(
                "layout 'flax' is Flax parameter names (query.kernel, ...): mha_jax.to_torch reads them "
                "(the command line: mha-parity convert)"
            )
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


def check_state(state: Mapping[str, Any], num_heads: int, num_kv_heads: int,
                expected: Mapping[str, Sequence[int]] | None = None) -> int:
    """Validate the shapes of a state in ``mha_torch`` names, collecting every problem; return head_dim.

    ``state`` has every weight, and the query/key/value biases all or none (the output bias on
    its own), as ``read_layout`` returns it. ``expected``: a module's shapes, when one is known.
    """
    head_dim, problems = _check_shapes(state, num_heads, num_kv_heads, expected, {})
    if problems:
        raise ValueError("state_dict: " + "; ".join(problems))
    return head_dim


def shape_problems(state: Mapping[str, Any], num_heads: int, num_kv_heads: int,
                   expected: Mapping[str, Sequence[int]] | None = None, *, names: Mapping[str, str] | None = None) -> list[str]:
    """Every mis-shaped entry of ``state`` (``mha_torch`` names; any may be absent), each once,
    as ``"'key' has shape (found), expected (shape)"``; ``names`` gives the key a message shows.

    The shapes expected are ``expected``'s (a module's) where given; otherwise they follow from
    ``num_heads``, ``num_kv_heads`` and the head_dim that the most entries agree on: query rows
    and output columns ``num_heads * head_dim``, key/value rows ``num_kv_heads * head_dim``,
    biases ``(rows,)``, norms ``(head_dim,)`` or ``(heads * head_dim,)``, sinks ``(num_heads,)``.
    So one wrong entry is named, not the others that disagree with it.
    """
    return _check_shapes(state, num_heads, num_kv_heads, expected, names or {})[1]


_WEIGHTS = tuple(f"{p}.weight" for p in PROJECTIONS)
_ORDER = tuple(f"{p}.{part}" for p in PROJECTIONS for part in PARTS) + tuple(f"{n}.weight" for n in NORMS) + (SINKS,)
_KV = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")


def _rank(name: str) -> int:
    return 2 if name in _WEIGHTS else 1


def _check_shapes(state: Mapping[str, Any], heads: int, kv_heads: int, module: Mapping[str, Sequence[int]] | None,
                  names: Mapping[str, str]) -> tuple[int, list[str]]:
    """``(head_dim, problems)``; head_dim 0 when no head_dim fits. Head counts that cannot be
    raise first: no shape could fit them."""
    check_head_counts(heads, kv_heads)
    shapes = {k: tuple(v.shape) for k, v in state.items() if k in _ORDER}
    shown = {k: names.get(k, repr(k)) for k in _ORDER}
    problems = [f"{shown[k]} has shape {s}, expected rank {_rank(k)}" for k, s in shapes.items()
                if len(s) != _rank(k) and not (module and k in module)]
    ranked = {k: s for k, s in shapes.items() if len(s) == _rank(k)}
    if module and "q_proj.weight" in module:
        head_dim = module["q_proj.weight"][0] // heads
    else:
        head_dim = _head_dim(ranked, heads, kv_heads)
    if not head_dim and not any(k in ranked for k in _WEIGHTS):
        return 0, problems  # nothing to split into heads: the missing weights are reported by name
    if not head_dim:
        sizes = ", ".join(f"{shown[k]} {s}" for k, s in ranked.items() if k in _WEIGHTS)
        return 0, problems + [f"no head_dim fits num_heads={heads} and num_kv_heads={kv_heads} (shapes: {sizes})"]
    allowed = _allowed(ranked, heads, kv_heads, head_dim)
    for k, s in shapes.items():
        want = [tuple(module[k])] if module and k in module else allowed.get(k) if k in ranked else None
        if want and s not in want:
            problems.append(f"{shown[k]} has shape {s}, expected {' or '.join(map(str, want))}{_why(k, s, want[0], heads, kv_heads, head_dim)}")
    kv_rows = {ranked[k][0] for k in _KV if k in ranked}
    if len(kv_rows) == 1 and (n := kv_rows.pop()) != kv_heads * head_dim and n % head_dim == 0 and heads % (n // head_dim) == 0:
        problems.append(f"the key/value rows fit num_kv_heads={n // head_dim} (head_dim={head_dim}), not num_kv_heads={kv_heads}")
    return head_dim, problems


def _why(name: str, found: tuple, want: tuple, heads: int, kv_heads: int, head_dim: int) -> str:
    """What an expected row or column count is made of, when that is what differs."""
    if len(found) != len(want):
        return ""
    if name == "out_proj.weight" and found[1:] != want[1:]:
        return f" (num_heads={heads} x head_dim={head_dim} columns)"
    if name.split(".")[0] in PROJECTIONS[:3] and found[:1] != want[:1]:
        n, what = (heads, "num_heads") if name.startswith("q_") else (kv_heads, "num_kv_heads")
        return f" ({what}={n} x head_dim={head_dim} rows)"
    return ""


def _allowed(shapes: Mapping[str, tuple], heads: int, kv_heads: int, head_dim: int) -> dict[str, list[tuple]]:
    """The shapes each entry of ``shapes`` (ranks right) may have for this head_dim; free axes
    (input features, output features) as found."""
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
    return {k: v for k, v in allowed.items() if k in shapes}


def _head_dim(shapes: Mapping[str, tuple], heads: int, kv_heads: int) -> int:
    """The head_dim under which the fewest entries are mis-shaped (key/value rows that all agree
    on another key/value head count count once: that count is the one mistake); 0 if none fits.
    Candidates: each query, key, value row count and output column count over its heads."""
    counts = [(shapes[k][0], heads) for k in ("q_proj.weight", "q_proj.bias") if k in shapes]
    counts += [(shapes[k][0], kv_heads) for k in _KV if k in shapes]
    counts += [(shapes["out_proj.weight"][1], heads)] if "out_proj.weight" in shapes else []
    votes = [n // h for n, h in counts if n and n % h == 0]

    def cost(head_dim: int) -> tuple[int, int, int]:
        allowed = _allowed(shapes, heads, kv_heads, head_dim)
        bad = {k for k, s in shapes.items() if k in allowed and s not in allowed[k]}
        kv_bad = bad & set(_KV)
        kv_rows = {shapes[k][0] for k in _KV if k in shapes}
        one_mistake = len(kv_rows) == 1 and next(iter(kv_rows)) % head_dim == 0 and heads % (next(iter(kv_rows)) // head_dim or heads + 1) == 0
        return len(bad - kv_bad) + (min(len(kv_bad), 1) if one_mistake else len(kv_bad)), -votes.count(head_dim), head_dim

    return min(set(votes), key=cost, default=0)


# --- torch.nn.MultiheadAttention's masks: shape rules --------------------------------------


def torch_mha_attn_shape(shape: Sequence[int], num_heads) -> tuple[int, ...]:
    """Its ``attn_mask`` ``(q_len, kv_len)`` or ``(batch * num_heads, q_len, kv_len)`` as ours:
    the shape to reshape it to, broadcasting to ``(batch, num_heads, q_len, kv_len)``."""
    shape = tuple(shape)
    if len(shape) == 3:
        if not isinstance(num_heads, int) or num_heads < 1 or shape[0] % num_heads:
            raise ValueError(
                f"a 3-d attn_mask (batch * num_heads, q_len, kv_len) needs num_heads dividing "
                f"its first axis; got shape {shape} and num_heads={num_heads!r}"
            )
        return (shape[0] // num_heads, num_heads, *shape[1:])
    if len(shape) != 2:
        raise ValueError(
            "attn_mask must have rank 2 (q_len, kv_len) or 3 (batch * num_heads, q_len, kv_len), "
            f"got shape {shape}"
        )
    return shape


def check_torch_mha_padding(attn_shape: Sequence[int] | None, padding_shape: Sequence[int]) -> None:
    """Its ``key_padding_mask`` is ``(batch, kv_len)``, with ``attn_mask``'s kv_len."""
    if len(padding_shape) != 2:
        raise ValueError(f"key_padding_mask must have rank 2 (batch, kv_len), got shape {tuple(padding_shape)}")
    if attn_shape is not None and attn_shape[-1] != padding_shape[-1]:
        raise ValueError(
            f"attn_mask and key_padding_mask disagree on kv_len: shapes {tuple(attn_shape)} "
            f"and {tuple(padding_shape)}"
        )


def torch_mha_layout(mask_shape: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """The ``attn_mask`` shape ``torch.nn.MultiheadAttention`` takes for one of ours broadcasting to
    ``shape`` = (batch, heads, q_len, kv_len): ``(q_len, kv_len)`` when it is the same for every
    batch element and head, else ``(batch * heads, q_len, kv_len)``."""
    batch, heads, q_len, kv_len = shape
    lead = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    return (q_len, kv_len) if lead[0] == lead[1] == 1 else (batch * heads, q_len, kv_len)


# --- rotary position embeddings: parameters -------------------------------------------------

# rope_type -> (keys transformers' init function requires, keys it reads when present), as
# ``transformers.modeling_rope_utils`` (5.x) reads ``rope_parameters``: ``_compute_*_parameters``
# and the ``_validate_*_rope_parameters`` that list each type's keys.
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "dynamic": (("factor",), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
}
# Keys whose value may be None: transformers then derives it (factor = max_position_embeddings /
# original_max_position_embeddings, the attention factor from the paper's formula, beta defaults).
_NULLABLE = {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
_NULLABLE_FACTOR = {"yarn", "longrope"}


class Scaling(Mapping):
    """A rope scaling as an immutable, hashable mapping: ``rope_type`` and the keys transformers
    reads for it (lists of factors as tuples), so that a rotary embedding can be a static argument."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]):
        object.__setattr__(self, "_items", dict(items))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Scaling is immutable")

    def __reduce__(self):
        # copy and pickle rebuild it through __init__, not by setting its slot.
        return Scaling, (self._items,)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._items.items())))

    def __repr__(self) -> str:
        return f"Scaling({self._items!r})"

    @property
    def rope_type(self) -> str:
        return self._items["rope_type"]


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_rope(
    head_dim: Any, rotary_dim: Any, theta: Any, interleaved: Any, scaling: Mapping | None, max_position_embeddings: Any
) -> tuple[int, int, float, bool, Scaling | None, int | None]:
    """Validate a rotary embedding's arguments; return them normalised:
    ``(head_dim, rotary_dim, theta, interleaved, scaling, max_position_embeddings)``."""
    if not _is_int(head_dim) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if not _is_int(rotary_dim) or not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even integer in [2, head_dim] = [2, {head_dim}], got {rotary_dim!r}")
    if not _is_real(theta) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    if max_position_embeddings is not None and (not _is_int(max_position_embeddings) or max_position_embeddings < 1):
        raise ValueError(f"max_position_embeddings must be a positive integer or None, got {max_position_embeddings!r}")
    max_pos = None if max_position_embeddings is None else int(max_position_embeddings)
    checked = _check_scaling(scaling, int(rotary_dim), max_pos)
    return int(head_dim), int(rotary_dim), float(theta), bool(interleaved), checked, max_pos


def _check_scaling(scaling: Mapping | None, rotary_dim: int, max_pos: int | None) -> Scaling | None:
    """``scaling`` as a ``Scaling``; None for no scaling (``rope_type`` 'default' alone)."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a mapping with a 'rope_type' or None, got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {tuple(ROPE_TYPES)}, got {rope_type!r}")
    required, optional = ROPE_TYPES[rope_type]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"scaling for rope_type {rope_type!r} is missing required key(s) {', '.join(map(repr, missing))}")
    unknown = [k for k in scaling if k != "rope_type" and k not in required + optional]
    if unknown:
        reads = ", ".join(map(repr, required + optional)) or "no other key"
        raise ValueError(
            f"scaling for rope_type {rope_type!r} has key(s) {', '.join(map(repr, unknown))}, which transformers "
            f"does not read for it (it reads {reads})"
        )
    items = {"rope_type": rope_type}
    for key in required + optional:
        if key in scaling:
            items[key] = _scaling_value(rope_type, key, scaling[key], rotary_dim)
    if rope_type == "default":
        return None
    _check_derivable(rope_type, items, rotary_dim, max_pos)
    return Scaling(items)


def _scaling_value(rope_type: str, key: str, value: Any, rotary_dim: int) -> Any:
    """One scaling value checked and as Python numbers: factor lists as tuples of floats."""
    where = f"scaling[{key!r}] (rope_type {rope_type!r})"
    if value is None and (key in _NULLABLE or key == "factor" and rope_type in _NULLABLE_FACTOR):
        return None
    if key in ("short_factor", "long_factor"):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(map(_is_real, value)):
            raise TypeError(f"{where} must be a list of numbers, got {value!r}")
        if len(value) != rotary_dim // 2:
            raise ValueError(f"{where} must have rotary_dim // 2 = {rotary_dim // 2} entries, got {len(value)}")
        return tuple(float(v) for v in value)
    if key == "truncate":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{where} must be a bool, got {value!r}")
        return bool(value)
    if key == "original_max_position_embeddings":
        if not _is_int(value) or value < 1:
            raise ValueError(f"{where} must be a positive integer, got {value!r}")
        return int(value)
    if not _is_real(value) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    if key == "factor" and value <= 0:
        raise ValueError(f"{where} must be > 0, got {value!r}")
    return int(value) if _is_int(value) else float(value)


def _check_derivable(rope_type: str, items: Mapping[str, Any], rotary_dim: int, max_pos: int | None) -> None:
    """The values transformers derives from ``max_position_embeddings`` need it."""
    if rope_type == "dynamic" and max_pos is None:
        raise ValueError("rope_type 'dynamic' needs max_position_embeddings (the length it scales beyond)")
    if rope_type == "dynamic" and rotary_dim == 2:
        raise ValueError("rope_type 'dynamic' needs rotary_dim > 2 (its base grows with exponent dim / (dim - 2))")
    if rope_type in _NULLABLE_FACTOR and items.get("factor") is None and max_pos is None:
        raise ValueError(
            f"rope_type {rope_type!r} without scaling['factor'] needs max_position_embeddings "
            "(the factor is then max_position_embeddings / original_max_position_embeddings)"
        )
    if rope_type == "llama3" and items["high_freq_factor"] == items["low_freq_factor"]:
        raise ValueError("scaling['high_freq_factor'] must differ from scaling['low_freq_factor'] (rope_type 'llama3')")


def scaling_factor(scaling: Scaling, max_pos: int | None) -> float:
    """``factor``, or where yarn and longrope leave it out, max_position_embeddings /
    original_max_position_embeddings (``_compute_yarn_parameters``, ``_compute_longrope_parameters``)."""
    factor = scaling.get("factor")
    return max_pos / scaling["original_max_position_embeddings"] if factor is None else factor


def attention_factor(scaling: Scaling | None, max_pos: int | None) -> float:
    """The factor transformers multiplies cos and sin by: 1 except for yarn and longrope, where
    an explicit ``attention_factor`` wins over the paper's formula."""
    if scaling is None or scaling.rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling_factor(scaling, max_pos)
    if scaling.rope_type == "longrope":
        omax = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    """``get_mscale`` of ``_compute_yarn_parameters``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_ramp_bounds(scaling: Scaling, rotary_dim: int, theta: float) -> tuple[float, float]:
    """``(low, high)`` of yarn's linear ramp over the frequency index, in Python floats as
    ``find_correction_range`` of ``_compute_yarn_parameters`` computes them; ``high`` nudged by
    0.001 where the two meet, as its ``linear_ramp_factor`` does."""
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    omax = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(omax / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    return (low, high + 0.001) if low == high else (low, high)


def dynamic_theta(theta: float, factor: float, seq_len: int, max_pos: int, rotary_dim: int) -> float:
    """The base of ``_compute_dynamic_ntk_parameters`` for a Python ``seq_len`` (in doubles, as at
    a module's construction); it grows once ``seq_len`` passes ``max_pos``."""
    seq_len = max(seq_len, max_pos)
    return theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


@dataclass(frozen=True)
class RotaryParameters:
    """The parameters of a rotary position embedding, checked; the base of each framework's
    ``RotaryEmbedding``, which adds the arrays. Immutable and hashable (a static argument to
    ``jax.jit``); ``scaling`` is kept as a ``Scaling``, ``rotary_dim`` None as ``head_dim``."""

    head_dim: int
    _: KW_ONLY
    rotary_dim: int | None = None
    theta: float = 10000.0
    interleaved: bool = False
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        checked = check_rope(
            self.head_dim, self.rotary_dim, self.theta, self.interleaved, self.scaling, self.max_position_embeddings
        )
        for field, value in zip(fields(self), checked):
            object.__setattr__(self, field.name, value)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], head_dim: int | None = None):
        """The rotary embedding a transformers ``config.json`` dict describes, or None if it names
        none; ``head_dim`` overrides the config's. See ``rope_from_config`` for what is read."""
        arguments = rope_from_config(config, head_dim)
        return None if arguments is None else cls(**arguments)

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else self.scaling.rope_type

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (yarn, longrope; 1 otherwise), as transformers'
        ``attention_scaling``; it does not depend on the sequence length."""
        return attention_factor(self.scaling, self.max_position_embeddings)

    def seq_len_threshold(self) -> int | None:
        """The sequence length past which the frequencies change (dynamic: max_position_embeddings;
        longrope: original_max_position_embeddings); None where they never do."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.rope_type == "longrope":
            return self.scaling["original_max_position_embeddings"]
        return None


# --- rotary position embeddings: transformers configs ----------------------------------------

# Keys whose presence says a config.json describes rotary embeddings.
_ROPE_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_pct", "rotary_dim", "rotary_emb_base", "partial_rotary_factor")
# Rotary fractions that models' config classes set when config.json leaves them out.
_DEFAULT_ROTARY_FRACTION = {"gpt_neox": 0.25, "phi": 0.5}  # GPTNeoXConfig (rotary_pct), PhiConfig
# Models that rotate pairs (2i, 2i + 1): GPT-J's and CodeGen's ``rotate_every_two``.
_INTERLEAVED_MODELS = ("gptj", "codegen")


def rope_from_config(config: Mapping[str, Any], head_dim: int | None = None) -> dict[str, Any] | None:
    """``RotaryEmbedding``'s arguments from a transformers ``config.json`` dict, or None when it
    has none of the keys in ``_ROPE_CONFIG_KEYS``. Read as ``RotaryEmbeddingConfigMixin``
    (``convert_rope_params_to_dict``, ``standardize_rope_params``) and the model config classes
    read them; ``config`` is not modified:

    - the rope parameters: ``rope_scaling`` (older) or ``rope_parameters`` (transformers 5), whose
      ``rope_type`` (or ``type``) and the keys it reads become ``scaling``;
    - theta: ``rope_parameters['rope_theta']``, ``rope_theta``, ``rotary_emb_base`` (GPT-NeoX), 10000;
    - head_dim: the argument, ``head_dim``, or ``hidden_size // num_attention_heads`` (GPT-J:
      ``n_embd // n_head``);
    - rotary_dim: ``rotary_dim`` (GPT-J), else ``int(head_dim * fraction)`` with the fraction from
      ``partial_rotary_factor`` (in the rope parameters or beside them), ``rotary_pct``
      (GPT-NeoX), the model's default (GPT-NeoX 0.25, Phi 0.5) or 1;
    - max_position_embeddings (GPT-J: ``n_positions``), and for llama3, yarn and longrope
      ``original_max_position_embeddings``: a top-level one (Phi-3) wins, else the rope
      parameters' own, else max_position_embeddings;
    - interleaved for GPT-J and CodeGen (``model_type``), whose attention rotates pairs
      ``(2i, 2i + 1)``; every other model rotates halves."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (a config.json dict), got {type(config).__name__}")
    if not any(key in config for key in _ROPE_CONFIG_KEYS):
        return None
    model_type = config.get("model_type")
    # transformers: ``rope_scaling or rope_parameters``, the older name first.
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    nested = [k for k, v in params.items() if isinstance(v, Mapping)]
    if nested:
        raise ValueError(
            f"config's rope parameters are given per layer type ({', '.join(map(repr, nested))}); "
            "build one RotaryEmbedding per type, from a config whose 'rope_parameters' is that entry"
        )
    theta = _first(params.get("rope_theta"), config.get("rope_theta"), config.get("rotary_emb_base"), 10000.0)
    fraction = _first(
        params.get("partial_rotary_factor"), config.get("partial_rotary_factor"), config.get("rotary_pct"),
        _DEFAULT_ROTARY_FRACTION.get(model_type), 1.0,
    )
    head_dim = _config_head_dim(config) if head_dim is None else head_dim
    if not _is_int(head_dim) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    rotary_dim = config.get("rotary_dim") or int(head_dim * fraction)
    max_pos = _first(config.get("max_position_embeddings"), config.get("n_positions"))
    return {
        "head_dim": head_dim,
        "rotary_dim": rotary_dim,
        "theta": theta,
        "interleaved": model_type in _INTERLEAVED_MODELS,
        "scaling": _config_scaling(params, config, max_pos),
        "max_position_embeddings": max_pos,
    }


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _config_head_dim(config: Mapping[str, Any]) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads`` (GPT-J: ``n_embd // n_head``)."""
    if config.get("head_dim"):
        return config["head_dim"]
    hidden, heads = _first(config.get("hidden_size"), config.get("n_embd")), _first(config.get("num_attention_heads"), config.get("n_head"))
    if not (_is_int(hidden) and _is_int(heads) and heads > 0):
        raise ValueError(
            "config names neither head_dim nor hidden_size and num_attention_heads; pass head_dim= to from_config"
        )
    return hidden // heads


def _config_scaling(params: dict[str, Any], config: Mapping[str, Any], max_pos: int | None) -> dict[str, Any] | None:
    """The scaling keys of a config's rope parameters, ``rope_type`` standardised."""
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    params.pop("rope_theta", None)
    params.pop("partial_rotary_factor", None)
    # Phi3Config: its older names for LongRoPE.
    if config.get("model_type") == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type in ("llama3", "yarn", "longrope"):
        # standardize_rope_params: a top-level original_max_position_embeddings (Phi-3) wins,
        # else the key defaults to max_position_embeddings.
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif max_pos is not None:
            params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "default" and not params:
        return None
    return {"rope_type": rope_type, **params}


# --- rotary position embeddings: inputs -------------------------------------------------------


def check_positions_shape(shape: Sequence[int], batch_shape: Sequence[int], length: int) -> None:
    """ValueError unless ``shape`` is ``(len,)`` or ``(*batch, len)`` with batch axes broadcasting
    to the input's."""
    shape, batch_shape = tuple(shape), tuple(batch_shape)
    lead = shape[:-1]
    ok = len(shape) >= 1 and shape[-1] == length and len(lead) <= len(batch_shape) and all(
        a in (1, b) for a, b in zip(reversed(lead), reversed(batch_shape))
    )
    if not ok:
        raise ValueError(
            f"positions must have shape (len,) = ({length},) or (*batch, len) with batch axes broadcasting "
            f"to {batch_shape}, got {shape}"
        )
