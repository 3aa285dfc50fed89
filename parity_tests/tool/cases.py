"""What the verification grid is made of: configurations, mask forms, dtypes, implementations,
and the two grids of cases built from them.

A ``Case`` is one module configuration, one mask form, one dtype and the implementations that
run it (the float64 oracle always runs). ``full_grid`` runs every implementation on every mask
form of every configuration (a few forms on the configurations whose point is elsewhere) in
every dtype. ``covering_grid`` runs a fraction of it that still covers every pair: each value of
each parameter (configuration, mask form, dtype, JAX implementation, PyTorch implementation)
with each value of every other parameter, wherever the full grid runs that pair. Both
frameworks run every case of both grids, so every case is a cross-framework comparison.

NumPy-free and framework-free: ``harness`` (running a case) and ``workers`` (running many) both
import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Tolerances: (forward, gradients), relative error ||a - b|| / ||b||, also
# applied to the largest elementwise error scaled by max |b|.
TOLERANCES = {"float64": (1e-13, 1e-12), "float32": (1e-6, 1e-5), "bfloat16": (2e-2, 5e-2)}
DTYPES = tuple(TOLERANCES)
DROPOUT_RATE = 0.25


@dataclass(frozen=True)
class Config:
    """A module configuration. ``in_kv_features=None`` means self-attention (one input)."""

    name: str
    batch: int = 2
    q_len: int = 6
    kv_len: int = 6
    in_features: int = 16
    in_kv_features: int | None = None
    num_heads: int = 4
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    normalize_qk: bool = False
    # what today's models add: an RMS QK-norm per head ("rms"), rotary embedding (theta 10000,
    # rotate-half, over the whole head), a soft-cap, sinks, a scale other than 1/sqrt(head_dim)
    qk_norm: str | None = None
    rotary: bool = False
    soft_cap: float | None = None
    sinks: bool = False
    scale: float | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def self_attention(self) -> bool:
        return self.in_kv_features is None

    @property
    def mask_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.num_heads, self.q_len, self.kv_len)


CONFIGS = {
    c.name: c
    for c in (
        Config("self"),
        Config(
            "cross-gqa", q_len=5, kv_len=7, in_kv_features=10, num_kv_heads=2,
            qkv_features=24, out_features=12,
        ),
        Config(
            "cross-mqa-nobias", q_len=5, kv_len=7, in_kv_features=10, num_kv_heads=1,
            use_bias=False,
        ),
        Config("normalize-qk", num_kv_heads=2, normalize_qk=True),
        # head_dim 4 makes the rotary frequencies exactly 1 and 0.01 in every framework
        Config("rope-cap-sinks", num_kv_heads=2, qk_norm="rms", rotary=True, soft_cap=2.0, sinks=True, scale=0.4),
    )
}

# Every mask form; see ``harness.make_data`` for what each one draws.
MASKS = (
    "none", "bool", "int", "float", "padding", "causal", "padding+causal", "per-head",
    "bcast-qk", "bcast-k", "bcast-b11k-float", "fully-masked", "dropout",
    "flax-float", "bias", "positions+causal", "window", "segments", "lengths", "everything",
)
# The masks that the positions-first terms add; the grid runs them on the first two configs.
STRUCTURED = ("flax-float", "bias", "positions+causal", "window", "segments", "lengths", "everything")

# name -> (framework, implementation): every implementation the grid compares.
IMPLEMENTATIONS = {
    "jax": ("jax", "xla"), "jax-blockwise": ("jax", "blockwise"),
    "torch": ("torch", "math"), "torch-sdpa": ("torch", "sdpa"),
}
# The oracle, then every implementation: the order ``harness.compare`` pairs them in.
SIDES = ("oracle", *IMPLEMENTATIONS)


@dataclass(frozen=True)
class Case:
    """``implementations``: the names (of ``IMPLEMENTATIONS``) that run the case, besides the
    oracle; every one by default. ``sides`` says which of them can."""

    config: Config
    mask: str
    dtype: str
    implementations: tuple[str, ...] = tuple(IMPLEMENTATIONS)

    @property
    def id(self) -> str:
        return f"{self.config.name}/{self.mask}/{self.dtype}"

    @property
    def sides(self) -> tuple[str, ...]:
        """The oracle and the case's implementations that run it, in ``SIDES``' order.
        ``F.scaled_dot_product_attention`` takes no dropout mask and no soft-cap, so PyTorch's
        ``sdpa`` sits out the ``dropout`` form and a soft-capped configuration."""
        running = {n for n in self.implementations if runs(n, self.config, self.mask)}
        return tuple(n for n in SIDES if n == "oracle" or n in running)


def runs(implementation: str, config: Config, mask: str) -> bool:
    """Whether ``implementation`` can run ``mask`` on ``config`` (see ``Case.sides``)."""
    return implementation != "torch-sdpa" or (mask != "dropout" and config.soft_cap is None)


def grid_masks(config: Config) -> tuple[str, ...]:
    """The mask forms the built-in grid runs on ``config``: every one, or a few on the
    configurations whose point is elsewhere (and every one on a configuration not in the grid)."""
    if CONFIGS.get(config.name) == config and config.name in ("cross-mqa-nobias", "normalize-qk", "rope-cap-sinks"):
        return ("none", "padding+causal", "fully-masked", "dropout", "everything")
    return MASKS


def full_grid(masks: Sequence[str] | None = None, dtypes: Sequence[str] | None = None) -> list[Case]:
    """Every mask form on self- and grouped cross-attention, a few on multi-query, on
    normalised queries and keys, and on today's models' terms; every dtype; every
    implementation on every case. ``masks``/``dtypes``: only those."""
    return [
        Case(config, mask, dtype) for config in CONFIGS.values() for mask in grid_masks(config) for dtype in DTYPES
        if (masks is None or mask in masks) and (dtypes is None or dtype in dtypes)
    ]


# The parameters of a row of the covering grid, and the values of the two implementation ones.
PARAMETERS = ("config", "mask", "dtype", "jax", "torch")
JAX_IMPLEMENTATIONS = tuple(n for n, (framework, _) in IMPLEMENTATIONS.items() if framework == "jax")
TORCH_IMPLEMENTATIONS = tuple(n for n, (framework, _) in IMPLEMENTATIONS.items() if framework == "torch")


def covering_grid(masks: Sequence[str] | None = None, dtypes: Sequence[str] | None = None) -> list[Case]:
    """The cases of ``full_grid(masks, dtypes)`` that cover every pair of values of two of
    ``PARAMETERS`` that it runs, each with one JAX and one PyTorch implementation or more.

    Rows (configuration, mask form, dtype, one JAX implementation, one PyTorch implementation)
    are chosen by ``all_pairs``, with ties going to the row that adds the fewest compiled JAX
    programs; the rows of one configuration, mask form and dtype make one case, which runs
    their implementations. Cases come in ``full_grid``'s order. Deterministic."""
    full = full_grid(masks, dtypes)
    rows = [
        (case.config.name, case.mask, case.dtype, j, t) for case in full
        for j in JAX_IMPLEMENTATIONS for t in TORCH_IMPLEMENTATIONS if runs(t, case.config, case.mask)
    ]
    chosen = all_pairs(rows, cost=_new_programs)
    implementations: dict[tuple, set[str]] = {}
    for config, mask, dtype, j, t in chosen:
        implementations.setdefault((config, mask, dtype), set()).update((j, t))
    return [
        Case(case.config, case.mask, case.dtype, tuple(n for n in IMPLEMENTATIONS if n in names))
        for case in full if (names := implementations.get((case.config.name, case.mask, case.dtype)))
    ]


def all_pairs(rows: Sequence[tuple], cost: Callable[[tuple, list[tuple]], float] | None = None) -> list[tuple]:
    """A greedy all-pairs cover: rows of ``rows`` such that every pair of values at two
    positions that occur together in some row of ``rows`` occur together in a chosen one.

    ``rows`` are the allowed combinations, so a pair no allowed row has is never asked for. Each
    step takes the row that covers the most pairs not yet covered; of those, the one of least
    ``cost(row, chosen)``, then the first. Deterministic: the same rows give the same cover."""
    pairs = [frozenset((i, row[i], j, row[j]) for i in range(len(row)) for j in range(i + 1, len(row))) for row in rows]
    uncovered = set().union(*pairs)
    chosen: list[tuple] = []
    while uncovered:
        gains = [len(p & uncovered) for p in pairs]
        top = max(gains)
        most = [r for r, gain in enumerate(gains) if gain == top]
        best = min(most, key=lambda r: cost(rows[r], chosen)) if cost else most[0]
        chosen.append(rows[best])
        uncovered -= pairs[best]
    return chosen


# What a jitted blockwise program is specialised on besides the configuration and dtype, by
# mask form (``harness.static_options`` of the form's data: causality, a window, dropout).
CAUSAL = ("causal", "padding+causal", "positions+causal", "everything")
WINDOWED = ("window", "everything")


def _new_programs(row: tuple, chosen: list[tuple]) -> float:
    """Roughly the CPU seconds of compiling that ``row`` adds to ``chosen``'s (the means of a
    cold run of the covering grid on 2 cores): a blockwise row 2.3 s for a program
    (configuration, dtype, static options) not yet compiled; an ``xla`` row 3.4 s for a
    configuration and dtype whose per-operation programs are not yet compiled, and 0.3 s for
    the operations of a mask form new to them."""
    config, mask, dtype, j, _ = row

    def program(r):
        return (r[0], r[2], r[1] in CAUSAL, r[1] in WINDOWED, r[1] == "dropout")

    if j == "jax-blockwise":
        return 2.3 * (program(row) not in {program(r) for r in chosen if r[3] == j})
    eager = [r for r in chosen if r[3] == j]
    new_group = (config, dtype) not in {(r[0], r[2]) for r in eager}
    return 3.4 * new_group + 0.3 * ((config, mask, dtype) not in {r[:3] for r in eager})
