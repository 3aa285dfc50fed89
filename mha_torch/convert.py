"""Loading weights into ``mha_torch.MultiHeadAttention``, and ``torch.nn.MultiheadAttention`` both ways.
Twin of ``mha_jax/convert.py``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mha_spec import layouts
from mha_torch.module import MultiHeadAttention


def load_weights(module: torch.nn.Module, state_dict_or_path: Mapping[str, Any] | str | os.PathLike, *,
                 layout: str | None = None, mapping: Mapping[str, str] | None = None, prefix: str = "",
                 ignore: Sequence[str] = ()) -> None:
    """Copy weights into ``module`` in place (cast to its parameter dtypes).

    ``layout``, ``mapping``, ``prefix``, ``ignore``: the checkpoint's naming scheme, as in ``mha_jax.from_torch``.
    Raises one ValueError listing every missing, unexpected or mis-shaped key.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be an mha_torch.MultiHeadAttention, got {type(module).__name__} "
                        f"from {type(module).__module__}")
    current = module.state_dict()
    expected = {k: tuple(v.shape) for k, v in current.items()}
    if getattr(module, "latent", None) is not None:  # transformers' names (layout "mla")
        state = layouts.read_latent(read_state(state_dict_or_path), layout=layout, mapping=mapping, prefix=prefix,
                                    ignore=ignore, expected=expected)
    else:
        state = layouts.read_layout(read_state(state_dict_or_path), layout=layout, mapping=mapping, prefix=prefix,
                                    ignore=ignore, num_heads=getattr(module, "num_heads", None),
                                    num_kv_heads=getattr(module, "num_kv_heads", None), expected=expected)
    _check_dtypes(state)
    with torch.no_grad():
        for name, tensor in state.items():
            current[name].copy_(tensor)


def from_torch_mha(module: torch.nn.MultiheadAttention) -> MultiHeadAttention:
    """An ``mha_torch.MultiHeadAttention`` computing what ``module`` computes, with its weights.

    Takes ``embed_dim``, ``num_heads``, ``kdim``, ``vdim``, ``bias``, ``dropout``, dtype, device and training mode.
    The result is batch-first whatever ``module.batch_first`` says; give it masks translated by
    ``mask_from_torch_mha``. ``add_bias_kv`` and ``add_zero_attn`` have no counterpart here: a ValueError.
    """
    if not isinstance(module, torch.nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
    unsupported = [name for name, on in (("add_bias_kv=True", module.bias_k is not None),
                                         ("add_zero_attn=True", module.add_zero_attn)) if on]
    if unsupported:
        raise ValueError(f"module has {' and '.join(unsupported)}, which mha_torch.MultiHeadAttention does not have")
    weight = module.out_proj.weight
    ours = MultiHeadAttention(module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim,
                              bias=module.in_proj_bias is not None, dropout=module.dropout, device=weight.device,
                              dtype=weight.dtype)
    load_weights(ours, module.state_dict(), layout="torch_mha")
    return ours.train(module.training)


def to_torch_mha(module: MultiHeadAttention) -> torch.nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention(batch_first=True)`` with ``module``'s weights.

    Possible when ``num_kv_heads == num_heads`` and ``qkv_dim == out_dim == embed_dim``, else a ValueError. Give it
    masks translated by ``mask_to_torch_mha``; its fully masked rows are NaN, where ours are 0.
    """
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(f"module must be an mha_torch.MultiHeadAttention, got {type(module).__name__}")
    problems = [f"{name}={getattr(module, name)} differs from {other}={getattr(module, other)}"
                for name, other in (("num_kv_heads", "num_heads"), ("qkv_dim", "embed_dim"), ("out_dim", "embed_dim"))
                if getattr(module, name) != getattr(module, other)]
    if module.alibi_slopes is not None:
        problems.append("alibi_slopes is set (it has no ALiBi)")
    if problems:
        raise ValueError("torch.nn.MultiheadAttention cannot hold this module: " + "; ".join(problems))
    weight = module.q_proj.weight
    theirs = torch.nn.MultiheadAttention(module.embed_dim, module.num_heads, dropout=module.dropout,
                                         bias=module.q_proj.bias is not None, kdim=module.kdim, vdim=module.vdim,
                                         batch_first=True, device=weight.device, dtype=weight.dtype)
    ours = module.state_dict()
    state = {"out_proj.weight": ours["out_proj.weight"]}
    if theirs._qkv_same_embed_dim:  # it fuses the three input weights exactly when their shapes agree
        state["in_proj_weight"] = torch.cat([ours[f"{p}.weight"] for p in layouts.PROJECTIONS[:3]])
    else:
        state.update({f"{p}_weight": ours[f"{p}.weight"] for p in layouts.PROJECTIONS[:3]})
    if theirs.in_proj_bias is not None:
        state["in_proj_bias"] = torch.cat([ours[f"{p}.bias"] for p in layouts.PROJECTIONS[:3]])
        state["out_proj.bias"] = ours["out_proj.bias"]
    theirs.load_state_dict(state)  # strict: every key of theirs is set
    return theirs.train(module.training)


def _check_dtypes(state: dict[str, torch.Tensor]) -> None:
    """Every weight real floating-point: a cast would drop an imaginary part or hide a wrong file."""
    for k, v in state.items():
        if not v.is_floating_point():
            raise TypeError(f"{k!r} must be real floating-point, got dtype {str(v.dtype).removeprefix('torch.')}")


def read_state(state_dict_or_path: Any) -> dict[str, torch.Tensor]:
    """Name -> tensor (a copy: nothing the caller passed is shared or modified)."""
    return layouts.read_checkpoint(state_dict_or_path, _load_file, _numeric)


def _load_file(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return dict(load_file(path))


def _numeric(name: str, value: Any) -> torch.Tensor:
    """A tensor copy of an array-like; NumPy bfloat16 (ml_dtypes) by its bit pattern."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    try:
        array = np.asarray(value)
        if array.dtype.name == "bfloat16":  # torch cannot read ml_dtypes' bfloat16; the bits agree
            return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.array(array, copy=True))
    except (TypeError, ValueError) as error:
        raise ValueError(f"state_dict: {name!r} is not a numeric array: {error}") from None
