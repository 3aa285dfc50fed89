"""A Flax port's modules around the attention, loaded from transformers' state dict."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx


def load_modules(model: nnx.Module, state: Mapping, param_dtype=None, key: Callable[[str], str] = str) -> None:
    """Every ``nnx.Embed``, ``nnx.Linear``, ``nnx.LayerNorm`` and ``nnx.RMSNorm`` of ``model`` from
    ``state`` (transformers' names -> arrays), in ``param_dtype`` when given: a Linear's ``weight``
    is the transposed ``kernel``, a norm's the ``scale``; ``key``: a module's path -> its name there."""
    def put(variable, value):
        variable.set_value(jnp.asarray(value, param_dtype))

    for path, module in nnx.iter_modules(model):
        name = key(".".join(map(str, path)))
        if isinstance(module, nnx.Embed):
            put(module.embedding, state[f"{name}.weight"])
        elif isinstance(module, nnx.Linear):
            put(module.kernel, np.asarray(state[f"{name}.weight"]).T)
        elif isinstance(module, (nnx.LayerNorm, nnx.RMSNorm)):
            put(module.scale, state[f"{name}.weight"])
        if getattr(module, "bias", None) is not None and isinstance(module, (nnx.Linear, nnx.LayerNorm)):
            put(module.bias, state[f"{name}.bias"])
