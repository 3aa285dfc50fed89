"""Argument checks of the functional core and the modules: ``mha_spec.arguments.ArrayChecks`` over JAX arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mha_spec import arguments


def dtype_kind(x) -> str:
    """'float', 'complex', 'int', 'bool' or 'other' for an array's dtype."""
    dtype = np.dtype(x.dtype)
    for kind, base in (("float", jnp.floating), ("complex", jnp.complexfloating), ("bool", jnp.bool_),
                       ("int", jnp.integer)):
        if jnp.issubdtype(dtype, base):
            return kind
    return "other"


def concrete(x) -> bool:
    """Whether ``x``'s values can be read here: not a tracer, nor a global array with other processes' shards."""
    return not isinstance(x, jax.core.Tracer) and getattr(x, "is_fully_addressable", True)


CHECKS = arguments.ArrayChecks(
    array="an array", is_array=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"), kind=dtype_kind,
    dtype=lambda x: x.dtype, values=lambda x: np.asarray(x) if concrete(x) else None, heads_first=False,
)
require_array, require_float, require_int = CHECKS.require_array, CHECKS.require_float, CHECKS.require_int
check_attention_inputs, check_sequence, check_lengths, check_dropout_mask, check_unbatched = (
    CHECKS.check_attention_inputs, CHECKS.check_sequence, CHECKS.check_lengths, CHECKS.check_dropout_mask,
    CHECKS.check_unbatched)
