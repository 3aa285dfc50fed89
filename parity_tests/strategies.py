"""Hypothesis profiles and the strategies that draw whole attention configurations.

Profiles, chosen by the environment variable ``MHA_HYPOTHESIS_PROFILE`` (loaded by
``conftest.py``):

- ``ci`` (the default): ``examples(n) = n`` examples per property, derandomized (the same
  examples on every run, so CI is reproducible), no example database, no deadline (JAX compiles
  every new shape, so a first call is slow).
- ``long``: ``examples(n) = 20 * n``, drawn afresh on every run, failing examples remembered
  in ``.hypothesis/``. For example ``MHA_HYPOTHESIS_PROFILE=long python -m pytest -q
  parity_tests/test_properties.py``.

A drawn case is a ``Spec``: a plain, printable description (shapes, dtype, mask form, seed).
``build`` turns it into numbers, so a failure Hypothesis shrinks can be pasted into
``parity_tests/regressions.py`` and replayed as an explicit test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from parity_tests.tool import arrays, harness, oracle

PROFILE_VARIABLE = "MHA_HYPOTHESIS_PROFILE"
LONG_FACTOR = 20
_NO_HEALTH_CHECKS_FOR_SLOW_TESTS = [HealthCheck.too_slow, HealthCheck.data_too_large]


def load_profile() -> None:
    """Register ``ci`` and ``long`` and load the one ``MHA_HYPOTHESIS_PROFILE`` names."""
    common = dict(deadline=None, print_blob=True, suppress_health_check=_NO_HEALTH_CHECKS_FOR_SLOW_TESTS)
    settings.register_profile("ci", derandomize=True, database=None, **common)
    settings.register_profile("long", **common)
    settings.load_profile(profile())


def profile() -> str:
    name = os.environ.get(PROFILE_VARIABLE, "ci")
    if name not in ("ci", "long"):
        raise ValueError(f"{PROFILE_VARIABLE} must be 'ci' or 'long', got {name!r}")
    return name


def examples(n: int) -> int:
    """How many examples a property draws: ``n`` under ``ci``, ``LONG_FACTOR * n`` under ``long``."""
    return n * LONG_FACTOR if profile() == "long" else n


# --- known defects -----------------------------------------------------------------------


# --- drawn configurations ----------------------------------------------------------------

MASK_FORMS = ("none", "bool", "int8", "uint8", "int32", "int64", "float", "padding")


@dataclass(frozen=True)
class Spec:
    """One drawn case: a module configuration, a dtype, a mask and the implementations to run.

    ``mask_shape`` is the mask's own (broadcasting) shape; ``keep_shape`` that of an explicit
    dropout keep-mask, or None for no dropout. ``empty_rows`` makes some queries attend to no
    key. Array values come from ``seed``.
    """

    config: harness.Config
    dtype: str
    mask: str = "none"
    mask_shape: tuple[int, ...] = ()
    empty_rows: bool = False
    is_causal: bool = False
    keep_shape: tuple[int, ...] | None = None
    dropout_rate: float = 0.25
    jax_impl: str = "xla"
    jax_module: str = "nnx"
    torch_impl: str = "math"
    seed: int = 0
    positions: str = "default"  # "default", "after" (queries start after the keys) or "shuffled"
    window: tuple[int, int] | None = None
    segments: int = 0  # number of packed segments drawn (0: none)
    lengths: bool = False
    bias_shape: tuple[int, ...] | None = None


def broadcast_shapes(full: tuple[int, ...]):
    """Every shape that broadcasts to ``full``: rank 0 to ``len(full)``, each axis full or 1."""
    return st.lists(st.booleans(), max_size=len(full)).map(
        lambda keep: tuple(n if k else 1 for n, k in zip(full[len(full) - len(keep):], keep))
    )


def _with_edges(low: int, high: int, inner: tuple[int, ...]):
    """Integers in [low, high], a third of the time one of the ends or of ``inner`` (block and
    power-of-two boundaries), which a uniform draw would rarely reach."""
    edges = sorted({low, high, *(n for n in inner if low <= n <= high)})
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(low, high))


@st.composite
def configs(draw) -> harness.Config:
    """batch 1-3; lengths 1-67 (query and key differ in cross-attention); kv heads 1-4 in
    groups of 1-8 query heads, at most 8 (multi-head, grouped, multi-query); head_dim 1-80;
    feature sizes 1-24; bias on or off."""
    lengths = _with_edges(1, 67, (2, 7, 8, 9, 16, 17, 63, 64, 65))
    self_attention = draw(st.booleans())
    q_len = draw(lengths)
    kv_len = q_len if self_attention else draw(lengths)
    kv_heads = draw(st.integers(1, 4))
    heads = kv_heads * draw(st.integers(1, 8 // kv_heads))
    head_dim = draw(_with_edges(1, 80, (2, 64)))
    return harness.Config(
        name="drawn", batch=draw(st.integers(1, 3)), q_len=q_len, kv_len=kv_len,
        in_features=draw(st.integers(1, 24)),
        in_kv_features=None if self_attention else draw(st.integers(1, 24)),
        num_heads=heads, num_kv_heads=kv_heads, qkv_features=heads * head_dim,
        out_features=draw(st.integers(1, 24)), use_bias=draw(st.booleans()),
    )


@st.composite
def specs(draw) -> Spec:
    """A whole case: configuration, dtype, mask form and broadcast shape, causality, dropout,
    and which implementation (and JAX module) of each framework runs it."""
    config = draw(configs())
    mask = draw(st.sampled_from(MASK_FORMS))
    dropout = draw(st.booleans())
    return Spec(
        config=config,
        dtype=draw(st.sampled_from(harness.DTYPES)),
        mask=mask,
        mask_shape=draw(broadcast_shapes(config.mask_shape)) if mask not in ("none", "padding") else (),
        empty_rows=mask != "none" and draw(st.booleans()),
        is_causal=draw(st.booleans()),
        keep_shape=draw(broadcast_shapes(config.mask_shape)) if dropout else None,
        dropout_rate=draw(st.sampled_from([0.25, 0.5])) if dropout else 0.25,
        jax_impl=draw(st.sampled_from(["xla", "blockwise"])),
        jax_module=draw(st.sampled_from(["nnx", "linen"])),
        torch_impl="math" if dropout else draw(st.sampled_from(["math", "sdpa"])),
        seed=draw(st.integers(0, 2**32 - 1)),
        positions=draw(st.sampled_from(["default", "default", "after", "shuffled"])),
        window=draw(st.none() | st.tuples(st.integers(0, 9), st.integers(0, 9))),
        segments=draw(st.sampled_from([0, 0, 1, 2, 3])),
        lengths=draw(st.booleans()),
        bias_shape=draw(st.none() | broadcast_shapes(config.mask_shape)),
    )


def draw_mask(spec: Spec, rng: np.random.Generator) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(mask as the oracle reads it, padding validity ``(batch, kv_len)`` or None)."""
    b, _, _, k = spec.config.mask_shape
    if spec.mask == "none":
        return None, None
    if spec.mask == "padding":
        lengths = rng.integers(0 if spec.empty_rows else 1, k + 1, size=b)
        valid = np.arange(k)[None, :] < lengths[:, None]
        return valid[:, None, None, :], valid
    shape = spec.mask_shape
    attend = rng.random(shape) < 0.7
    if spec.empty_rows and len(shape) >= 2:  # some queries (of some heads) see no key at all
        attend = attend & ~(rng.random(shape[:-1]) < 0.4)[..., None]
    elif spec.empty_rows:  # a mask of rank 0 or 1 is a single row, shared by every query
        attend = np.zeros(shape, bool)
    if spec.mask == "float":
        bias = np.where(attend, 2.0 * rng.normal(size=shape), -np.inf)
        return arrays.rounded(np.asarray(bias), spec.dtype), None
    if spec.mask == "bool":
        return np.asarray(attend), None
    nonzero = [1, 2, 7] if spec.mask.startswith("u") else [-1, 2, 7]  # any nonzero attends
    weights = rng.choice(np.array(nonzero, dtype=spec.mask), size=shape)
    return np.where(attend, weights, 0).astype(spec.mask), None


def build(spec: Spec) -> tuple[harness.Case, harness.Data]:
    """The case's numbers: the harness's weights and inputs, with the drawn mask and dropout."""
    data = harness.make_data(harness.Case(spec.config, "none", spec.dtype), seed=spec.seed)
    rng = np.random.default_rng(spec.seed)
    mask, valid = draw_mask(spec, rng)
    keep = None if spec.keep_shape is None else rng.random(spec.keep_shape) >= spec.dropout_rate
    data.attention = oracle.Attention(
        mask=mask, is_causal=spec.is_causal, keep=keep,
        dropout_rate=spec.dropout_rate if keep is not None else 0.0, window=spec.window,
        **draw_structure(spec, rng),
    )
    data.padding_valid = valid
    return harness.Case(spec.config, "drawn", spec.dtype), data


def draw_structure(spec: Spec, rng: np.random.Generator) -> dict:
    """The spec's positions, segment ids, lengths and bias, as ``oracle.Attention`` fields. In
    self-attention the keys share the queries' positions and segment ids (the same arrays)."""
    c = spec.config
    b, _, q, k = c.mask_shape
    terms = {}
    if spec.positions == "after":  # each batch element's queries end at or past its last key
        qp = np.arange(q)[None] + max(k - q, 0) + rng.integers(0, 3, size=(b, 1))
        terms["query_positions"] = qp
        terms["key_positions"] = qp if c.self_attention else np.arange(k)
    elif spec.positions == "shuffled":
        qp = np.stack([rng.permutation(q) for _ in range(b)]) + rng.integers(-2, 3)
        terms["query_positions"] = qp
        terms["key_positions"] = qp if c.self_attention else np.stack([rng.permutation(k) for _ in range(b)])
    if spec.segments:
        qs = np.sort(rng.integers(0, spec.segments, size=(b, q)), axis=1)
        terms["query_segment_ids"] = qs
        terms["key_segment_ids"] = (qs if c.self_attention
                                    else np.sort(rng.integers(0, spec.segments, size=(b, k)), axis=1))
    if spec.lengths:
        terms["lengths"] = rng.integers(0 if spec.empty_rows else 1, k + 1, size=b)
    if spec.bias_shape is not None:
        terms["bias"] = arrays.rounded(rng.normal(size=spec.bias_shape), spec.dtype)
    return terms


# --- drawn calls of the functional core ------------------------------------------------------
# Each new shape or static option compiles anew (and builds a new TPU-kernel program in interpret
# mode), so a call is drawn from small fixed sets: query and key lengths unequal both ways (and
# multiples of 4, for a ring over 2 devices), windows lopsided both ways.

CALL_HEADS = (4, 2)  # query heads, key/value heads
CALL_BATCH, CALL_HEAD_DIM = 2, 8
CALL_LENGTHS = ((12, 8), (8, 12), (8, 8))  # (q_len, kv_len)
CALL_WINDOWS = (None, (3, 0), (0, 3), (5, 1), (1, 5))
CALL_CHUNK = 4
CALL_DROPOUT_RATE = 0.25


@dataclass(frozen=True)
class Call:
    """One drawn call of ``dot_product_attention``: lengths, the masking terms, dropout (an
    explicit keep-mask), soft-cap and sinks; array values come from ``seed``. ``lengths``: every
    example's key length strictly between 0 and ``kv_len``."""

    q_len: int = 8
    kv_len: int = 8
    is_causal: bool = False
    window: tuple[int, int] | None = None
    chunk: bool = False
    segments: int = 0  # packed segments drawn (0: none)
    lengths: bool = False
    dropout: bool = False
    soft_cap: float | None = None
    sinks: bool = False
    seed: int = 0


@st.composite
def calls(draw) -> Call:
    """A ``Call`` from the fixed shapes, windows and chunk size, every term on or off."""
    q_len, kv_len = draw(st.sampled_from(CALL_LENGTHS))
    sometimes = st.sampled_from([False, False, True])  # terms that the TPU kernel refuses, a third of the time
    return Call(
        q_len=q_len, kv_len=kv_len, is_causal=draw(st.booleans()), window=draw(st.sampled_from(CALL_WINDOWS)),
        chunk=draw(sometimes), segments=draw(st.sampled_from([0, 2, 3])), lengths=draw(st.booleans()),
        dropout=draw(sometimes), soft_cap=draw(st.sampled_from([None, 2.0])), sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def build_call(call: Call) -> tuple[tuple[np.ndarray, ...], dict, oracle.Attention]:
    """``((q, k, v, d_out) in PyTorch's layout (batch, heads, len, head_dim), the call's keywords
    for ``cores.run_core``, the same terms as ``oracle.Attention``)``, float64."""
    rng = np.random.default_rng(call.seed)
    (heads, kv_heads), b, d = CALL_HEADS, CALL_BATCH, CALL_HEAD_DIM
    q, d_out = rng.normal(size=(2, b, heads, call.q_len, d))
    k, v = rng.normal(size=(2, b, kv_heads, call.kv_len, d))
    terms = {}
    if call.window is not None:
        terms["local_window_size"] = call.window
    if call.chunk:
        terms["attention_chunk_size"] = CALL_CHUNK
    if call.segments:
        terms["query_segment_ids"] = np.sort(rng.integers(0, call.segments, size=(b, call.q_len)), axis=1)
        terms["key_segment_ids"] = np.sort(rng.integers(0, call.segments, size=(b, call.kv_len)), axis=1)
    if call.lengths:
        terms["key_value_seq_lengths"] = rng.integers(1, call.kv_len, size=b)
    keep = rng.random((b, heads, call.q_len, call.kv_len)) >= CALL_DROPOUT_RATE if call.dropout else None
    sinks = rng.normal(size=heads) if call.sinks else None
    kwargs = dict(is_causal=call.is_causal, terms=terms, logit_soft_cap=call.soft_cap, sinks=sinks,
                  dropout_mask=keep, dropout_rate=CALL_DROPOUT_RATE if call.dropout else 0.0)
    names = {"local_window_size": "window", "attention_chunk_size": "chunk_size", "key_value_seq_lengths": "lengths"}
    att = oracle.Attention(is_causal=call.is_causal, keep=keep, dropout_rate=kwargs["dropout_rate"],
                           soft_cap=call.soft_cap, sinks=sinks, **{names.get(n, n): x for n, x in terms.items()})
    return (q, k, v, d_out), kwargs, att


# --- drawn decodings ---------------------------------------------------------------------------

DECODE_STEPS = ((1,) * 8, (3, 1, 4), (8,))  # tokens per call: one by one, in chunks, all at once


@dataclass(frozen=True)
class Decoding:
    """A layer decoding 8 tokens through its cache, ``steps`` tokens per call, causal (and
    within ``window`` where given), against the full pass."""

    kv_heads: int = 2
    window: tuple[int, int] | None = None
    steps: tuple[int, ...] = DECODE_STEPS[0]
    seed: int = 0


@st.composite
def decodings(draw) -> Decoding:
    return Decoding(kv_heads=draw(st.sampled_from([1, 2, 4])), window=draw(st.sampled_from([None, (3, 0), (1, 0)])),
                    steps=draw(st.sampled_from(DECODE_STEPS)), seed=draw(st.integers(0, 2**32 - 1)))
