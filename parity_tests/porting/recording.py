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
    a tuple argument's arrays as ``name.0``, ``name.1``...), ``output`` (its first array)."""

    name: str
    occurrence: int
    cls: str
    inputs: list[tuple[str, np.ndarray]]
    output: np.ndarray | None

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.occurrence


@dataclass
class Recording:
    """A run: ``inputs`` as given, ``outputs`` (field -> array), ``calls`` in order, ``dtype`` of
    the parameters and the ``settings`` it ran under."""

    inputs: list[np.ndarray]
    outputs: list[tuple[str, np.ndarray]]
    calls: list[Call] = field(default_factory=list)
    dtype: str = "float32"
    settings: dict = field(default_factory=dict)

    def by_key(self) -> dict[tuple[str, int], Call]:
        return {c.key: c for c in self.calls}
