"""Loading weights into ``mha_torch.MultiHeadAttention``.

Twin of ``mha_jax/convert.py``: reads any mapping of name to array-like (torch tensors, NumPy
arrays, bfloat16 ones from ``mha_jax.to_torch`` included) or a ``.safetensors`` file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj")


def load_weights(module: torch.nn.Module, state_dict_or_path: Mapping[str, Any] | str | os.PathLike) -> None:
    """Copy weights into ``module`` in place (cast to its parameter dtypes).

    Raises one ValueError listing every missing, unexpected or mis-shaped key.
    """
    state = _read_state(state_dict_or_path)
    current = module.state_dict()
    problems = [f"missing key {k!r}" for k in current if k not in state]
    problems += [f"unexpected key {k!r}" for k in state if k not in current]
    problems += [
        f"{k!r} has shape {tuple(v.shape)}, the module expects {tuple(current[k].shape)}"
        for k, v in state.items()
        if k in current and tuple(v.shape) != tuple(current[k].shape)
    ]
    if problems:
        raise ValueError("state_dict does not fit the module: " + "; ".join(problems))
    with torch.no_grad():
        for name, tensor in state.items():
            current[name].copy_(tensor)


def _read_state(state_dict_or_path: Any) -> dict[str, torch.Tensor]:
    """Name -> tensor (a copy: nothing the caller passed is shared or modified)."""
    if isinstance(state_dict_or_path, (str, os.PathLike)):
        from safetensors.torch import load_file  # a light import, only when a file is given

        path = os.fspath(state_dict_or_path)
        if not path.endswith(".safetensors"):
            raise ValueError(f"state_dict_or_path must be a .safetensors file, got {path!r}")
        try:
            return dict(load_file(path))
        except Exception as error:  # safetensors raises its own types for bad headers
            raise ValueError(f"state_dict_or_path {path!r} is not a readable safetensors file: {error}") from error
    if not isinstance(state_dict_or_path, Mapping):
        raise TypeError(
            "state_dict_or_path must be a mapping of name to array or a .safetensors path, "
            f"got {type(state_dict_or_path).__name__}"
        )
    return {str(k): _to_tensor(v) for k, v in state_dict_or_path.items()}


def _to_tensor(x: Any) -> torch.Tensor:
    """A tensor copy of an array-like; NumPy bfloat16 (ml_dtypes) by its bit pattern."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    array = np.asarray(x)
    if array.dtype.name == "bfloat16":  # torch cannot read ml_dtypes' bfloat16; the bits agree
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))
