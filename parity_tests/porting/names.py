"""Module names on both sides, in one spelling: PyTorch's dotted paths.

nnx paths (``('layers', 0, 'mlp')``, printed ``layers[0].mlp`` or ``layers.0.mlp``) and linen paths
(``('layers_0', 'mlp')``) become ``layers.0.mlp``; a PyTorch name is paired with the JAX module of
the same name after ``mapping`` (regular expressions on the PyTorch name, first match wins;
a replacement of None leaves the module out; ``(name, adapter)`` also gives the module's input
adapter, see ``jax_side.adapted``; ``(name, adapter, layout)`` also declares the layout in which
its output reads as PyTorch's, see ``axis_layouts.choose``: an axis order, or a function) has renamed it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

Mapping_ = Mapping[str, "str | None | tuple[str, Callable]"]


def normalize(name: str | Iterable) -> str:
    """``layers[0].mlp``, ``layers.0.mlp`` or a path tuple ``('layers', 0, 'mlp')`` as ``layers.0.mlp``."""
    if not isinstance(name, str):
        name = ".".join(str(part) for part in name)
    return re.sub(r"\[(\d+)\]", r".\1", name).strip(".")


def linen(path: Iterable[str]) -> str:
    """A linen module path (``('layers_0', 'mlp')``) as ``layers.0.mlp``: a list attribute's
    ``name_N`` is element ``N`` of ``name``."""
    return ".".join(re.sub(r"^(.+)_(\d+)$", r"\1.\2", part) for part in path)


def check_mapping(mapping: Mapping_ | None) -> list[tuple]:
    """The mapping compiled, in order, as ``(pattern, replacement, adapter, layout)``: a value is a JAX
    name, None, ``(JAX name, input adapter or None)`` or ``(JAX name, input adapter or None, output
    layout)``; a pattern that is not a regular expression is an error naming it."""
    compiled = []
    for pattern, value in (mapping or {}).items():
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise ValueError(f"mapping: {pattern!r} is not a regular expression ({error})") from None
        replacement, adapter, layout = (*value, None)[:3] if isinstance(value, tuple) and len(value) in (2, 3) \
            else (value, None, None)
        if replacement is not None and not isinstance(replacement, str):
            raise TypeError(f"mapping: the replacement of {pattern!r} must be a string, None or (string, adapter), "
                            f"got {value!r}")
        if adapter is not None and not callable(adapter):
            raise TypeError(f"mapping: the input adapter of {pattern!r} must be callable, got {adapter!r}")
        if layout is not None and not callable(layout) and not (
                isinstance(layout, (tuple, list)) and all(isinstance(a, int) for a in layout)):
            raise TypeError(f"mapping: the output layout of {pattern!r} must be an axis order (a tuple of ints) or "
                            f"a function, got {layout!r}")
        compiled.append((regex, replacement, adapter, layout))
    return compiled


def _match(torch_name: str, mapping) -> tuple | None:
    return next((entry for entry in mapping if entry[0].fullmatch(torch_name)), None)


def jax_name(torch_name: str, mapping: list[tuple]) -> str | None:
    """The JAX module name paired with ``torch_name``: the first pattern that matches the whole
    name renames it (None: unpaired); no match: the same name."""
    entry = _match(torch_name, mapping)
    if entry is None:
        return torch_name
    pattern, replacement = entry[0], entry[1]
    return None if replacement is None else normalize(pattern.sub(replacement, torch_name))


def adapter(torch_name: str, mapping: list[tuple]) -> Callable | None:
    """The input adapter of the mapping entry that pairs ``torch_name``, or None."""
    entry = _match(torch_name, mapping)
    return entry[2] if entry is not None and len(entry) > 2 else None


def layout(torch_name: str, mapping: list[tuple]):
    """The output layout the mapping entry that pairs ``torch_name`` declares, or None."""
    entry = _match(torch_name, mapping)
    return entry[3] if entry is not None and len(entry) > 3 else None
