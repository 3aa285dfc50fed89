"""What one side's run leaves behind, as NumPy: its inputs, its outputs and, for every module
call in the order the calls finished (a module after the modules it calls), the arrays it was
given and the array it returned. The PyTorch side's recording is also the saved reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Call:
    """One module call: ``name`` (dotted path), ``occurrence`` (0 for its first call), ``cls``
    (``module.Class`` of the module), ``inputs`` (parameter name -> array, in the call's order;
    a tuple argument's arrays as ``name.0``, ``name.1``...), ``output`` (its first array);
    ``sources``: for each input, the call whose output it is (``name#occurrence``; ``input.N``
    the model's input N; None: made by code between modules); ``output64``: the module's output
    when a float64 copy of it is run on the same inputs (its own rounding: ``output`` against it);
    ``inherited64``: its output when the whole model runs in float64 (None: not measured, e.g. a
    float64 model, or a module whose float64 run failed)."""

    name: str
    occurrence: int
    cls: str
    inputs: list[tuple[str, np.ndarray]]
    output: np.ndarray | None
    sources: list[str | None] = field(default_factory=list)
    output64: np.ndarray | None = None
    inherited64: np.ndarray | None = None

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.occurrence

    @property
    def label(self) -> str:
        return f"{self.name}#{self.occurrence}"


@dataclass
class Recording:
    """A run: ``inputs`` as given, ``outputs`` (field -> array), ``calls`` in order, ``dtype`` of
    the parameters, the ``settings`` it ran under and ``outputs64``, the outputs of the whole model
    run in float64 (empty: not measured)."""

    inputs: list[np.ndarray]
    outputs: list[tuple[str, np.ndarray]]
    calls: list[Call] = field(default_factory=list)
    dtype: str = "float32"
    settings: dict = field(default_factory=dict)
    outputs64: list[tuple[str, np.ndarray]] = field(default_factory=list)

    def by_key(self) -> dict[tuple[str, int], Call]:
        return {c.key: c for c in self.calls}


@dataclass
class Flow:
    """Which call made each array (by identity; the array kept alive by its entry, so that its id
    is not reused): an array a module passes on unchanged keeps the call that made it first.
    Labels are ``name#occurrence``, ``input.N`` for the model's inputs."""

    made: dict = field(default_factory=dict)

    def mark(self, value, label: str) -> None:
        """``value`` (an array, or None: nothing) is ``label``'s output, unless an earlier call made it."""
        if value is not None and id(value) not in self.made:
            self.made[id(value)] = (value, label)

    def source(self, value) -> str | None:
        """The label of the call that made ``value``; None: made by code between modules."""
        found = self.made.get(id(value))
        return found[1] if found is not None and found[0] is value else None
