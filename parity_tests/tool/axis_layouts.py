"""One array brought to another's layout without reading its elements in another order by mistake.

Two sides may hold the same numbers in different layouts: a port keeping ``(batch, length, heads,
head_dim)`` where transformers keeps ``(batch, heads, length, head_dim)``, or ``(..., heads *
head_dim)`` where the other keeps ``(..., heads, head_dim)``. Reshaping one to the other's shape
whenever the element counts agree reads the wrong elements against each other. Here an array is
never reshaped across shapes: equal shapes are taken as they are; otherwise every ``Layout`` is
searched that makes the shapes equal: the axes permuted (the first, the batch, kept first for
arrays of three axes or more); or the last axis split in two (``(..., H*D) -> (..., H, D)``) and
the axes permuted; or the axes permuted and the last two merged (``(..., H, D) -> (..., H*D)``),
the last axis (head_dim) kept last wherever heads are split or merged; where none fits, the same
without the axes of size 1. Layouts that read the elements in the same order are one. Exactly one
fits: it is used (and named). Several fit (heads == length, say): the caller declares one, or
nothing is compared. None fits: nothing is compared. Either way a ``LayoutError`` says why, naming
both shapes and the candidates. Equal shapes whose axes of one size could be exchanged (heads ==
length) are compared as they are, and not compared where an exchange reads nearer (``alternatives``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


class LayoutError(ValueError):
    """No layout, or more than one, brings an array to the other's shape; the message names them."""


@dataclass(frozen=True)
class Layout:
    """From ``source`` to ``target`` shape: the last axis split into ``split`` (or not), the axes
    in the order ``axes``, then the last two merged when ``merge``."""

    source: tuple[int, ...]
    target: tuple[int, ...]
    split: tuple[int, int] | None = None
    axes: tuple[int, ...] = ()
    merge: bool = False
    squeezed: bool = False  # axes of size 1 left out first, and put in where the target has them

    def apply(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if tuple(x.shape) != self.source:
            raise LayoutError(f"the layout {self} takes an array of {self.source}, got {tuple(x.shape)}")
        if self.squeezed:
            x = x.reshape(_squeeze(self.source))  # an axis of size 1 orders nothing: reading order kept
        if self.split is not None:
            x = x.reshape(x.shape[:-1] + self.split)
        x = np.transpose(x, self.axes) if self.axes else x
        if self.merge:
            x = x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))
        return x.reshape(self.target) if self.squeezed else x

    @property
    def identity(self) -> bool:
        return (self.split is None and not self.merge and not self.squeezed
                and self.axes == tuple(range(len(self.source))))

    def __str__(self) -> str:
        if self.identity:
            return "as is"
        steps = ["axes of size 1 taken out or put in"] if self.squeezed else []
        steps += [f"last axis split into {self.split}"] if self.split else []
        if self.axes != tuple(range(len(self.axes))):
            steps.append(f"axes {self.axes}")
        if self.merge:
            steps.append("last two axes merged")
        return ", ".join(steps)


def _orders(ndim: int) -> list[tuple[int, ...]]:
    """The axis orders searched: every permutation, the first axis (the batch) kept first from three axes on."""
    if ndim < 3:
        return list(itertools.permutations(range(ndim)))
    return [(0, *rest) for rest in itertools.permutations(range(1, ndim))]


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def candidates(source: Sequence[int], target: Sequence[int]) -> list[Layout]:
    """Every layout from ``source`` to ``target`` (equal shapes: only as they are), one per order in
    which it reads the elements, the simplest first; where none fits, those of the shapes without
    their axes of size 1 (``(length, hidden)`` against ``(1, length, hidden)``)."""
    source, target = tuple(int(n) for n in source), tuple(int(n) for n in target)
    found = _candidates(source, target)
    inner = _squeeze(source), _squeeze(target)
    if found or inner == (source, target):
        return found
    # without the axes of size 1 the shapes may be equal: its axes of one size exchanged fit too
    return [Layout(source, target, c.split, c.axes, c.merge, True) for c in _candidates(*inner, searched=True)]


def alternatives(shape: Sequence[int]) -> list[Layout]:
    """The layouts other than as is that take an array of ``shape`` to ``shape`` (axes of one size
    exchanged: heads == length, say): equal shapes are compared as they are, unless one of these
    reads the port nearer PyTorch (``arrays.relative_error``)."""
    shape = tuple(int(n) for n in shape)
    return [c for c in _candidates(shape, shape, searched=True) if not c.identity]


def _candidates(source: tuple[int, ...], target: tuple[int, ...], searched: bool = False) -> list[Layout]:
    if source == target and not searched:
        return [Layout(source, target, None, tuple(range(len(source))))]
    if int(np.prod(source)) != int(np.prod(target)):
        return []
    splits: list[tuple[int, int] | None] = [None]
    if source and source[-1] > 1:
        last = source[-1]
        splits += [(last // q, q) for q in sorted(set(target)) if 1 < q < last and last % q == 0]
    found: list[Layout] = []
    for split in splits:
        shape = source[:-1] + split if split else source
        for axes in _orders(len(shape)):
            permuted = tuple(shape[i] for i in axes)
            for merge in (False, True):
                if (merge and (split or len(permuted) < 2)) or ((split or merge) and axes[-1] != len(shape) - 1):
                    continue  # a head split or merge keeps head_dim, the last axis, last
                result = permuted[:-2] + (permuted[-2] * permuted[-1],) if merge else permuted
                if result == target:
                    found.append(Layout(source, target, split, axes, merge))
    simplest = sorted(found, key=lambda lay: (lay.split is not None, lay.merge,
                                               sum(a != i for i, a in enumerate(lay.axes))))
    distinct, seen = [], set()
    if simplest:
        index = np.arange(int(np.prod(source))).reshape(source)
        for layout in simplest:
            order = layout.apply(index).tobytes()
            if order not in seen:
                seen.add(order)
                distinct.append(layout)
    return distinct


Declared = Callable[[np.ndarray], np.ndarray] | Sequence[int] | Layout | None


def choose(source: Sequence[int], target: Sequence[int], declared: Declared = None,
           sides: tuple[str, str] = ("the JAX array", "PyTorch's")) -> Layout | Callable:
    """The layout from ``source`` to ``target``: the one that fits, or of several the ``declared``
    one (a ``Layout``, an axis order ``axes`` as ``Layout.axes``, or a function of the array that
    returns it in ``target``'s shape); a ``LayoutError`` when none fits or several do and none is declared."""
    source, target = tuple(source), tuple(target)
    if callable(declared) and not isinstance(declared, Layout):
        return declared
    # equal shapes read as they are, unless a layout is declared (axes of one size exchanged)
    found = candidates(source, target) if declared is None or source != target else _candidates(source, target, True)
    if isinstance(declared, Layout):
        found = [declared] if declared.source == source and declared.target == target else []
    elif declared is not None:
        found = [c for c in found if c.axes == tuple(declared)]
    if len(found) == 1:
        return found[0]
    if not found:
        also = f" in the declared layout {declared}" if declared is not None else ""
        raise LayoutError(f"no layout of {sides[0]} {source} gives {sides[1]} {target}{also}")
    raise LayoutError(f"{sides[0]} {source} gives {sides[1]} {target} in {len(found)} layouts ("
                      + "; ".join(str(c) for c in found) + "): declare one in the mapping")


def fit(x: np.ndarray, shape: Sequence[int], declared: Declared = None,
        sides: tuple[str, str] = ("the JAX array", "PyTorch's")) -> np.ndarray:
    """``x`` in ``shape`` by the layout ``choose`` finds (equal shapes: ``x`` itself)."""
    x = np.asarray(x)
    if tuple(x.shape) == tuple(shape) and declared is None:
        return x
    layout = choose(x.shape, shape, declared, sides)
    out = np.asarray(layout(x) if not isinstance(layout, Layout) else layout.apply(x))
    if tuple(out.shape) != tuple(shape):
        raise LayoutError(f"the declared layout gave {tuple(out.shape)}, not PyTorch's {tuple(shape)}")
    return out


def describe(source: Sequence[int], target: Sequence[int], declared: Declared = None) -> str:
    """The layout ``fit`` uses, in words (``"as is"`` for equal shapes none is declared for); a
    ``LayoutError`` as ``choose``."""
    if tuple(source) == tuple(target) and declared is None:
        return "as is"
    layout = choose(source, target, declared)
    return str(layout) if isinstance(layout, Layout) else f"declared {getattr(layout, '__name__', 'function')}"


def inverse(declared: Declared, ndim: int) -> tuple[int, ...] | None:
    """The axis order that takes PyTorch's layout back to the JAX one, for a declared axis order of
    ``ndim`` axes (None for anything else)."""
    if declared is None or callable(declared) or isinstance(declared, Layout) or len(declared) != ndim:
        return None
    return tuple(int(a) for a in np.argsort(declared))
