"""Module names on both sides, in one spelling: PyTorch's dotted paths.

nnx paths (``('layers', 0, 'mlp')``, printed ``layers[0].mlp`` or ``layers.0.mlp``) and linen paths
(``('layers_0', 'mlp')``) become ``layers.0.mlp``; a PyTorch name is paired with the JAX module of
the same name after ``mapping`` (regular expressions on the PyTorch name, first match wins;
a replacement of None leaves the module out) has renamed it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

Mapping_ = Mapping[str, "str | None"]


def normalize(name: str | Iterable) -> str:
    """``layers[0].mlp``, ``layers.0.mlp`` or a path tuple ``('layers', 0, 'mlp')`` as ``layers.0.mlp``."""
    if not isinstance(name, str):
        name = ".".join(str(part) for part in name)
    return re.sub(r"\[(\d+)\]", r".\1", name).strip(".")


def linen(path: Iterable[str]) -> str:
    """A linen module path (``('layers_0', 'mlp')``) as ``layers.0.mlp``: a list attribute's
    ``name_N`` is element ``N`` of ``name``."""
    return ".".join(re.sub(r"^(.+)_(\d+)$", r"\1.\2", part) for part in path)


def check_mapping(mapping: Mapping_ | None) -> list[tuple[re.Pattern, str | None]]:
    """The mapping compiled, in order; a pattern that is not a regular expression is an error naming it."""
    compiled = []
    for pattern, replacement in (mapping or {}).items():
        try:
            compiled.append((re.compile(pattern), replacement))
        except re.error as error:
            raise ValueError(f"mapping: {pattern!r} is not a regular expression ({error})") from None
        if replacement is not None and not isinstance(replacement, str):
            raise TypeError(f"mapping: the replacement of {pattern!r} must be a string or None, got {replacement!r}")
    return compiled


def jax_name(torch_name: str, mapping: list[tuple[re.Pattern, str | None]]) -> str | None:
    """The JAX module name paired with ``torch_name``: the first pattern that matches the whole
    name renames it (None: unpaired); no match: the same name."""
    for pattern, replacement in mapping:
        if pattern.fullmatch(torch_name):
            return None if replacement is None else normalize(pattern.sub(replacement, torch_name))
    return torch_name
