"""Mesh helpers of the kernels: the Explicit axes a PartitionSpec names, a function run per device."""

from __future__ import annotations

import jax
from jax import lax


def axes_of(entry) -> tuple:
    """The mesh axis names of one entry of a PartitionSpec (None, a name or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def names(entry) -> tuple:
    """The names of the mesh axes of more than one device in one entry of a PartitionSpec."""
    sizes = jax.sharding.get_abstract_mesh().shape
    return tuple(a for a in axes_of(entry) if sizes[a] > 1)


def per_device(run, args: tuple, specs: tuple, out_specs, check_vma: bool = True):
    """``run(*args)`` in ``jax.shard_map`` over the mesh's Explicit axes, ``args`` resharded to ``specs``."""
    def placed(x, spec):
        return x if jax.typeof(x).sharding.spec == spec else jax.sharding.reshard(x, spec)
    args = jax.tree.map(placed, args, specs)
    explicit = set(jax.sharding.get_abstract_mesh().explicit_axes)
    return jax.shard_map(run, in_specs=specs, out_specs=out_specs, axis_names=explicit, check_vma=check_vma)(*args)


def to_varying(x, axes: tuple[str, ...]):
    """``x`` cast to varying over the manual mesh ``axes`` (``jax.lax.pcast``; ``pvary`` in older jax)."""
    return lax.pcast(x, axes, to="varying") if hasattr(lax, "pcast") else lax.pvary(x, axes)


def vma(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``jax.shard_map``)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # in older jax, the aval's ``vma``
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())
