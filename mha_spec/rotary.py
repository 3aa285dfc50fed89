"""Rotary position embeddings: parameters and checks, how a ``config.json`` names them, and the frequencies
both twins compute (``FrequencyOps``) as ``transformers.modeling_rope_utils`` (5.x) does in float32.

``dynamic`` and ``longrope`` read each call's length ``max(positions) + 1``; transformers' ``dynamic`` keeps the
longest seen, so the two agree while the call's length is the longest so far.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, ClassVar

import numpy as np

from mha_spec.records import rope_defaults

# rope_type -> (keys transformers' init function requires, keys it reads when present), as
# ``transformers.modeling_rope_utils`` (5.x) reads ``rope_parameters``.
ROPE_TYPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()), "linear": (("factor",), ()), "dynamic": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("short_factor", "long_factor", "original_max_position_embeddings"), ("factor", "attention_factor")),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "proportional": ((), ("factor", "partial_rotary_factor")),
}
# Keys whose value may be None: transformers then derives it.
_NULLABLE = {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}
_NULLABLE_FACTOR = {"yarn", "longrope"}


class Scaling(Mapping):
    """A rope scaling as an immutable, hashable mapping (``rope_type`` and its keys, lists as tuples)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any]):
        object.__setattr__(self, "_items", dict(items))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Scaling is immutable")

    def __reduce__(self):  # copy and pickle rebuild it through __init__
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
        raise ValueError(f"scaling for rope_type {rope_type!r} is missing required key(s) "
                         f"{', '.join(map(repr, missing))}")
    unknown = [k for k in scaling if k != "rope_type" and k not in required + optional]
    if unknown:
        reads = ", ".join(map(repr, required + optional)) or "no other key"
        raise ValueError(f"scaling for rope_type {rope_type!r} has key(s) {', '.join(map(repr, unknown))}, which "
                         f"transformers does not read for it (it reads {reads})")
    items = {"rope_type": rope_type}
    for key in required + optional:
        if key in scaling:
            items[key] = _scaling_value(rope_type, key, scaling[key], rotary_dim)
    if rope_type == "default":
        return None
    if rope_type == "dynamic" and max_pos is None:
        raise ValueError("rope_type 'dynamic' needs max_position_embeddings (the length it scales beyond)")
    if rope_type == "dynamic" and rotary_dim == 2:
        raise ValueError("rope_type 'dynamic' needs rotary_dim > 2 (its base grows with exponent dim / (dim - 2))")
    if rope_type in _NULLABLE_FACTOR and items.get("factor") is None and max_pos is None:
        raise ValueError(f"rope_type {rope_type!r} without scaling['factor'] needs max_position_embeddings "
                         "(the factor is then max_position_embeddings / original_max_position_embeddings)")
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


def scaling_factor(scaling: Scaling, max_pos: int | None) -> float:
    """``factor``, or (yarn, longrope) max_position_embeddings / original_max_position_embeddings."""
    factor = scaling.get("factor")
    return max_pos / scaling["original_max_position_embeddings"] if factor is None else factor


def attention_factor(scaling: Scaling | None, max_pos: int | None) -> float:
    """The factor cos and sin are multiplied by: 1 but for yarn and longrope (``attention_factor`` or the formula)."""
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
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_mscale(scale: float, mscale: float = 1) -> float:
    """``get_mscale`` of ``_compute_yarn_parameters``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RotaryParameters:
    """A rotary embedding's checked parameters and arithmetic, the base of each twin's ``RotaryEmbedding``
    (which sets ``array_ops``); ``scaling`` kept as a ``Scaling``, ``rotary_dim`` None as ``head_dim``."""

    head_dim: int
    _: KW_ONLY
    rotary_dim: int | None = None
    theta: float = 10000.0
    interleaved: bool = False
    scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int | None = None

    array_ops: ClassVar[FrequencyOps]  # the twin's array operations, set by its RotaryEmbedding

    def __post_init__(self) -> None:
        head_dim, theta, max_pos = self.head_dim, self.theta, self.max_position_embeddings
        if not _is_int(head_dim) or head_dim < 1:
            raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if not _is_int(rotary_dim) or not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be an even integer in [2, head_dim] = [2, {head_dim}], "
                             f"got {rotary_dim!r}")
        if not _is_real(theta) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
        if not isinstance(self.interleaved, (bool, np.bool_)):
            raise TypeError(f"interleaved must be a bool, got {type(self.interleaved).__name__}")
        if max_pos is not None and (not _is_int(max_pos) or max_pos < 1):
            raise ValueError(f"max_position_embeddings must be a positive integer or None, got {max_pos!r}")
        max_pos = None if max_pos is None else int(max_pos)
        checked = (int(head_dim), int(rotary_dim), float(theta), bool(self.interleaved),
                   _check_scaling(self.scaling, int(rotary_dim), max_pos), max_pos)
        for field, value in zip(fields(self), checked):
            object.__setattr__(self, field.name, value)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], head_dim: int | None = None):
        """The rotary embedding a ``config.json`` dict describes (``rope_from_config``), or None."""
        arguments = rope_from_config(config, head_dim)
        return None if arguments is None else cls(**arguments)

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else self.scaling.rope_type

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' ``attention_scaling``)."""
        return attention_factor(self.scaling, self.max_position_embeddings)

    def seq_len_threshold(self) -> int | None:
        """The sequence length past which the frequencies change (dynamic, longrope); None where they never do."""
        if self.rope_type == "dynamic":
            return self.max_position_embeddings
        if self.rope_type == "longrope":
            return self.scaling["original_max_position_embeddings"]
        return None

    @property
    def inv_freq(self) -> Any:
        """float32 ``(rotary_dim // 2,)``: the frequencies before any sequence length is seen."""
        return self.frequencies()

    def frequencies(self, seq_len: Any = None) -> Any:
        """float32 ``(rotary_dim // 2,)``: the frequencies for length ``seq_len`` (an integer or 0-d integer
        array) after ``dynamic_rope_update``; they differ from ``inv_freq`` only past the threshold."""
        ops = self.array_ops
        initial = ops.constant(lambda: _INIT_INV_FREQ[self.rope_type](self, ops))
        threshold = self.seq_len_threshold()
        if seq_len is None or threshold is None:
            return initial
        seq_len = ops.asarray(seq_len)
        if self.rope_type == "dynamic":
            longer = _dynamic_inv_freq(self, seq_len, ops)
        else:
            longer = ops.constant(lambda: _longrope_inv_freq(self, ops, "long_factor"))
        return ops.where(seq_len > threshold, ops.on(longer, seq_len), ops.on(initial, seq_len))

    def cos_sin(self, positions: Any, dtype: Any) -> tuple[Any, Any]:
        """cos and sin ``(*batch, len, rotary_dim // 2)`` of integer ``positions`` ``(*batch, len)`` in ``dtype``,
        times the attention factor."""
        ops = self.array_ops
        seq_len = positions.max() + 1 if self.seq_len_threshold() is not None else None
        frequencies = ops.on(self.frequencies(seq_len), positions)
        angles = ops.cast(positions[..., None], dtype) * ops.cast(frequencies, dtype)
        return ops.cos(angles) * self.attention_factor, ops.sin(angles) * self.attention_factor

    def rotate(self, x: Any, cos: Any, sin: Any) -> Any:
        """``x * cos + rotate(x) * sin`` on the first ``rotary_dim`` features of ``x`` (in ``cos``'s dtype);
        pairs ``(2i, 2i + 1)`` when ``interleaved``, else ``(i, i + rotary_dim / 2)``."""
        ops, dim, half = self.array_ops, self.rotary_dim, self.rotary_dim // 2
        rot = ops.cast(x[..., :dim], cos.dtype)
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if self.interleaved else (rot[..., :half], rot[..., half:])
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rotated = ops.stack([y1, y2]).reshape(rot.shape) if self.interleaved else ops.concat([y1, y2])
        return ops.concat([ops.cast(rotated, x.dtype), x[..., dim:]])


# Keys whose presence says a config.json describes rotary embeddings.
_ROPE_CONFIG_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_pct", "rotary_dim", "rotary_emb_base",
                     "partial_rotary_factor")


def rope_from_config(config: Mapping[str, Any], head_dim: int | None = None) -> dict[str, Any] | None:
    """``RotaryEmbedding``'s arguments from a ``config.json`` dict (not modified), or None when it has none of
    ``_ROPE_CONFIG_KEYS``; read as transformers' ``RotaryEmbeddingConfigMixin`` reads them:

    - ``scaling``: ``rope_scaling`` (older) or ``rope_parameters``, ``rope_type`` (or ``type``) standardised;
    - theta: ``rope_parameters['rope_theta']``, ``rope_theta``, ``rotary_emb_base`` (GPT-NeoX), 10000;
    - head_dim: the argument, else ``_config_head_dim``;
    - rotary_dim: ``rotary_dim``, else ``int(head_dim * fraction)`` (``partial_rotary_factor``, ``rotary_pct``,
      the family record's ``rope_default`` or 1);
    - max_position_embeddings (GPT-J: ``n_positions``); interleaved where the family's record says so."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping (a config.json dict), got {type(config).__name__}")
    if not any(key in config for key in _ROPE_CONFIG_KEYS):
        return None
    config, interleaved = rope_defaults(config)  # the family's record: a default rotary fraction, pairs
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    nested = [k for k, v in params.items() if isinstance(v, Mapping)]
    if nested:
        raise ValueError(f"config's rope parameters are given per layer type ({', '.join(map(repr, nested))}); "
                         "build one RotaryEmbedding per type, from a config whose 'rope_parameters' is that entry")
    theta = _first(params.get("rope_theta"), config.get("rope_theta"), config.get("rotary_emb_base"), 10000.0)
    fraction = _first(params.get("partial_rotary_factor"), config.get("partial_rotary_factor"),
                      config.get("rotary_pct"), 1.0)
    head_dim = _config_head_dim(config) if head_dim is None else head_dim
    if not _is_int(head_dim) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    rotary_dim = config.get("rotary_dim") or int(head_dim * fraction)
    max_pos = _first(config.get("max_position_embeddings"), config.get("n_positions"))
    scaling = _config_scaling(params, config, max_pos)
    if scaling is not None and scaling["rope_type"] == "proportional":  # all of each head, zero frequencies past
        rotary_dim, scaling = head_dim, dict(scaling, partial_rotary_factor=fraction)  # the fraction's
    return dict(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta, interleaved=interleaved,
                scaling=scaling, max_position_embeddings=max_pos)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _config_head_dim(config: Mapping[str, Any]) -> int:
    """``head_dim``, else ``hidden_size // num_attention_heads`` (GPT-J: ``n_embd // n_head``)."""
    if config.get("head_dim"):
        return config["head_dim"]
    hidden = _first(config.get("hidden_size"), config.get("n_embd"))
    heads = _first(config.get("num_attention_heads"), config.get("n_head"))
    if not (_is_int(hidden) and _is_int(heads) and heads > 0):
        raise ValueError("config names neither head_dim nor hidden_size and num_attention_heads; "
                         "pass head_dim= to from_config")
    return hidden // heads


def _config_scaling(params: dict[str, Any], config: Mapping[str, Any], max_pos: int | None) -> dict[str, Any] | None:
    """The scaling of a config's rope parameters, ``rope_type`` and ``original_max_position_embeddings`` filled."""
    rope_type = params.pop("rope_type", params.pop("type", "default"))  # pops "type" either way
    params.pop("rope_theta", None)
    params.pop("partial_rotary_factor", None)
    if config.get("model_type") == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config's older names
        rope_type = "longrope"
    if rope_type in ("llama3", "yarn", "longrope"):  # as standardize_rope_params
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif max_pos is not None:
            params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "default" and not params:
        return None
    return {"rope_type": rope_type, **params}


def rotate_at(rotary: Any, query: Any, key: Any, query_positions: Any, key_positions: Any) -> tuple[Any, Any]:
    """Queries and keys rotated by ``rotary`` (or None) at positions ``(batch|1, len)``; one row serves every batch
    row."""
    if rotary is None:
        return query, key

    def rows(positions, batch):
        return positions[0] if positions.ndim == 2 and positions.shape[0] == 1 and batch != 1 else positions

    return rotary(query, rows(query_positions, query.shape[0])), rotary(key, rows(key_positions, key.shape[0]))


@dataclass(frozen=True)
class FrequencyOps:
    """A twin's array operations, in float32 rounding as torch's: ``rdiv(a, x)`` a number over an array,
    ``div(x, a)`` an array over a number, ``pow(x, p)`` a 0-d array to a float power, ``exponents(dim, like)``
    ``arange(0, dim, 2) / dim`` (on ``like``'s device if given), ``arange(n)``, ``array(values)``, ``where``,
    ``clip``, ``at_least(n, m)`` the integer ``max(n, m)`` as float32; ``constant(f)``: ``f()`` as a constant
    (under ``jax.jit`` too), ``asarray``, ``on(x, like)``, ``cast``, ``cos``, ``sin``, ``stack``/``concat``."""

    rdiv: Callable
    div: Callable
    pow: Callable
    exponents: Callable
    arange: Callable
    array: Callable
    where: Callable
    clip: Callable
    at_least: Callable
    constant: Callable
    asarray: Callable
    on: Callable
    cast: Callable
    cos: Callable
    sin: Callable
    stack: Callable
    concat: Callable


def _default_inv_freq(ops: FrequencyOps, theta: Any, dim: int, like: Any = None) -> Any:
    """``compute_default_rope_parameters``: ``1 / theta ** (2i / dim)``."""
    return ops.rdiv(1.0, theta ** ops.exponents(dim, like))


def _linear_inv_freq(rope: RotaryParameters, ops: FrequencyOps) -> Any:
    """``_compute_linear_scaling_rope_parameters``: every frequency divided by ``factor``."""
    return ops.div(_default_inv_freq(ops, rope.theta, rope.rotary_dim), rope.scaling["factor"])


def _dynamic_init_inv_freq(rope: RotaryParameters, ops: FrequencyOps) -> Any:
    """``_compute_dynamic_ntk_parameters`` at construction (Python floats, ``seq_len = max_position_embeddings``)."""
    factor, max_pos, dim = rope.scaling["factor"], rope.max_position_embeddings, rope.rotary_dim
    theta = rope.theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(ops, theta, dim)


def _dynamic_inv_freq(rope: RotaryParameters, seq_len: Any, ops: FrequencyOps) -> Any:
    """``_compute_dynamic_ntk_parameters`` for a 0-d integer ``seq_len``: the grown base in float32."""
    factor, max_pos, dim = rope.scaling["factor"], rope.max_position_embeddings, rope.rotary_dim
    seq_len = ops.at_least(seq_len, max_pos)
    theta = rope.theta * ops.pow(((factor * seq_len / max_pos) - (factor - 1)), dim / (dim - 2))
    return _default_inv_freq(ops, theta, dim, seq_len)


def _yarn_inv_freq(rope: RotaryParameters, ops: FrequencyOps) -> Any:
    """``_compute_yarn_parameters``: divided by ``factor`` below the ramp, unchanged above, blended along it."""
    scaling, dim = rope.scaling, rope.rotary_dim
    factor = scaling_factor(scaling, rope.max_position_embeddings)
    pos_freqs = rope.theta ** ops.exponents(dim, None)
    extrapolation = ops.rdiv(1.0, pos_freqs)
    interpolation = ops.rdiv(1.0, factor * pos_freqs)
    omax = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(omax / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ops.clip(ops.div(ops.arange(dim // 2) - low, high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _longrope_inv_freq(rope: RotaryParameters, ops: FrequencyOps, which: str = "short_factor") -> Any:
    """``_compute_longrope_parameters``: each frequency divided by its own factor of ``which``."""
    ext_factors = ops.array(rope.scaling[which])
    return ops.rdiv(1.0, ext_factors * rope.theta ** ops.exponents(rope.rotary_dim, None))


def _llama3_inv_freq(rope: RotaryParameters, ops: FrequencyOps) -> Any:
    """``_compute_llama3_parameters``: long wavelengths divided by ``factor``, short kept, between blended."""
    scaling = rope.scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    omax = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = omax / low, omax / high
    inv_freq = _default_inv_freq(ops, rope.theta, rope.rotary_dim)
    wavelen = ops.rdiv(2 * math.pi, inv_freq)
    inv_freq_llama = ops.where(wavelen > low_freq_wavelen, ops.div(inv_freq, factor), inv_freq)
    if high == low:  # no band between: every wavelength is long or short (transformers' blend is then 0 / 0)
        return inv_freq_llama
    smooth_factor = ops.div(ops.rdiv(omax, wavelen) - low, high - low)
    smoothed = ops.div((1 - smooth_factor) * inv_freq_llama, factor) + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return ops.where(is_medium_freq, smoothed, inv_freq_llama)


def _proportional_inv_freq(rope: RotaryParameters, ops: FrequencyOps) -> Any:
    """``_compute_proportional_rope_parameters``: the default frequencies over all of each head, those past the
    first ``int(partial_rotary_factor * head_dim // 2)`` zero, all divided by ``factor``."""
    inv_freq = _default_inv_freq(ops, rope.theta, rope.rotary_dim)
    angles = int(rope.scaling.get("partial_rotary_factor", 1.0) * rope.rotary_dim // 2)
    kept = ops.where(ops.arange(rope.rotary_dim // 2) < angles, inv_freq, 0 * inv_freq)
    return ops.div(kept, rope.scaling.get("factor", 1.0))


# rope_type -> transformers' init function: float32 ``(rotary_dim // 2,)``, the frequencies at construction.
_INIT_INV_FREQ = {
    "default": lambda rope, ops: _default_inv_freq(ops, rope.theta, rope.rotary_dim), "linear": _linear_inv_freq,
    "dynamic": _dynamic_init_inv_freq, "yarn": _yarn_inv_freq, "longrope": _longrope_inv_freq,
    "llama3": _llama3_inv_freq, "proportional": _proportional_inv_freq,
}
