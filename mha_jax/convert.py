"""Weight conversion between ``mha_torch`` state dicts and Flax parameter trees: pure reshapes and transposes,
so round trips are bitwise (names and shapes in ``docs/checkpoints.md``). Twin of ``mha_torch/convert.py``."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from mha_jax import latent
from mha_spec import layouts

_FLAX_NAMES = (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("out", "out_proj"))
_FLAX_NORMS = (("query_ln", "q_norm"), ("key_ln", "k_norm"))  # flax's normalize_qk LayerNorm scales


def from_torch(state_dict_or_path: Mapping[str, Any] | str | os.PathLike, *, num_heads: int,
               num_kv_heads: int | None = None, layout: str | None = None, mapping: Mapping[str, str] | None = None,
               prefix: str = "", ignore: Sequence[str] = ()) -> dict[str, dict[str, np.ndarray]]:
    """Flax parameters from a PyTorch state dict or a ``.safetensors`` file.

    Returns ``{"query": {"kernel", "bias"}, "key": ..., "value": ..., "out": ...}`` (with ``q_norm``/``k_norm``
    weights also ``query_ln``/``key_ln`` scales; with ``sinks``, ``"sinks"``) of NumPy arrays in the source dtype,
    usable as ``linen`` params or through ``load_weights``.

    ``layout`` names the checkpoint's naming scheme: ``"mha_torch"`` (ours), ``"torch_mha"``
    (``torch.nn.MultiheadAttention``), ``"hf"`` (``q_proj/k_proj/v_proj/o_proj``), ``"bert"``
    (``self.query/self.key/self.value`` and ``output.dense``) or ``"fused_qkv"`` (``qkv_proj/o_proj``), or
    ``"auto"``: the one the keys show (an error naming the likely layouts when they show none or several). Not
    given: the one the keys show when exactly one fits, else ``"mha_torch"``. ``mapping`` instead gives any other
    scheme: projection (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``, ``qkv_proj``, ``kv_proj``) -> name, read
    as ``name.weight``/``name.bias``. Names are relative to ``prefix``; keys under it must be used or named (by
    their start) in ``ignore``. Raises one ValueError listing every missing, unexpected or mis-shaped key.
    """
    return _from_torch(state_dict_or_path, num_heads, num_kv_heads, layout=layout, mapping=mapping, prefix=prefix,
                       ignore=ignore)


def _from_torch(state_dict_or_path: Any, num_heads: int, num_kv_heads: int | None,
                expected: Mapping[str, tuple] | None = None, **naming: Any) -> dict[str, dict[str, np.ndarray]]:
    """``from_torch``; ``expected``: a module's shapes in ``mha_torch`` names."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    state = layouts.read_layout(read_state(state_dict_or_path), num_heads=num_heads, num_kv_heads=num_kv_heads,
                                expected=expected, **naming)
    _check_dtypes(state)
    head_dim = layouts.check_state(state, num_heads, num_kv_heads, expected)
    params: dict[str, dict[str, np.ndarray]] = {}
    for flax_name, torch_name in _FLAX_NAMES:
        weight = state[f"{torch_name}.weight"]
        heads_in = latent.INPUT_AXES.get(flax_name, 1) == 2
        kernel = weight.T.reshape((num_heads, head_dim, -1) if heads_in else (weight.shape[1], -1, head_dim))
        params[flax_name] = {"kernel": np.ascontiguousarray(kernel)}
        bias = state.get(f"{torch_name}.bias")
        if bias is not None:
            params[flax_name]["bias"] = bias if heads_in else bias.reshape(-1, head_dim)
    for flax_name, torch_name in _FLAX_NORMS:
        if f"{torch_name}.weight" in state:
            scale = state[f"{torch_name}.weight"]
            params[flax_name] = {"scale": scale if scale.shape == (head_dim,) else scale.reshape(-1, head_dim)}
    if layouts.SINKS in state:
        params[layouts.SINKS] = state[layouts.SINKS]
    if layouts.GATE in state:  # (heads[ * head_dim], in) -> (in, heads[, head_dim])
        gate = state[layouts.GATE].T
        per_head = gate.shape[1] == num_heads
        params["gate"] = {"kernel": np.ascontiguousarray(gate if per_head else gate.reshape(-1, num_heads, head_dim))}
    return params


def to_torch(params: Any) -> dict[str, np.ndarray]:
    """``mha_torch`` state dict (NumPy arrays) from Flax parameters.

    ``params``: the nested dict ``from_torch`` returns, linen variables (``{"params": ...}``), an ``nnx.State``,
    an nnx module (``mha_jax.MultiHeadAttention`` or ``flax.nnx.MultiHeadAttention``), or a flax ``.msgpack``
    or dot-named ``.safetensors`` file of them.
    """
    if isinstance(params, (str, os.PathLike)):
        params = _read_params(params)
    tree = _params_dict(params)
    if latent.is_latent_tree(tree):
        return latent.to_torch_state(tree, _to_numpy)
    problems = [f"missing {name!r}" for name, _ in _FLAX_NAMES if name not in tree]
    known = dict(_FLAX_NAMES + _FLAX_NORMS)
    problems += [f"unexpected {name!r}" for name in tree if name not in known and name not in (layouts.SINKS, "gate")]
    problems += [f"{name!r} has no 'scale'" for name, _ in _FLAX_NORMS if name in tree and "scale" not in tree[name]]
    problems += [f"{name!r} has no 'kernel'" for name, _ in _FLAX_NAMES if name in tree and "kernel" not in tree[name]]
    if problems:
        raise ValueError("params is not an attention parameter tree: " + "; ".join(problems))
    state = {name: np.ascontiguousarray(_to_numpy(array).reshape(shape).T) for name, array, shape in _flat(tree)}
    if layouts.SINKS in tree:
        state[layouts.SINKS] = _to_numpy(tree[layouts.SINKS])
    try:  # the projections must fit one module: heads from the query kernel, kv heads from the key's
        layouts.check_state(state, tree["query"]["kernel"].shape[1], tree["key"]["kernel"].shape[1])
    except ValueError as error:
        raise ValueError(f"params do not form one attention layer: {error}") from None
    return state


def load_weights(module: Any, state_dict_or_path: Mapping[str, Any] | str | os.PathLike, *,
                 layout: str | None = None, mapping: Mapping[str, str] | None = None, prefix: str = "",
                 ignore: Sequence[str] = ()) -> None:
    """Update an ``mha_jax.MultiHeadAttention`` in place from a PyTorch state dict or file.

    ``layout``, ``mapping``, ``prefix``, ``ignore``: as ``from_torch``. Values are cast to the module's
    parameter dtypes; one ValueError lists every missing, unexpected or mis-shaped key.
    """
    if not isinstance(module, nnx.Module) or not hasattr(module, "num_kv_heads"):
        raise TypeError(f"module must be an mha_jax.MultiHeadAttention, got {type(module).__name__} from "
                        f"{type(module).__module__}")
    if getattr(module, "latent", None) is not None:  # transformers' names (layout "mla")
        state = layouts.read_latent(read_state(state_dict_or_path), layout=layout, mapping=mapping, prefix=prefix,
                                    ignore=ignore, expected=latent.torch_shapes(_params_dict(module)))
        _check_dtypes(state)
        latent.load_state(module, state)
        return
    params = _from_torch(state_dict_or_path, module.num_heads, module.num_kv_heads, _torch_shapes(module),
                         layout=layout, mapping=mapping, prefix=prefix, ignore=ignore)
    for path, array in traverse_util.flatten_dict(params).items():  # ("query", "kernel"), ..., ("sinks",)
        variable = functools.reduce(getattr, path, module)
        variable.set_value(jnp.asarray(array, dtype=variable.get_value().dtype))


def _torch_shapes(module: nnx.Module) -> dict[str, tuple[int, ...]]:
    """The module's parameter shapes under ``mha_torch`` names (``to_torch``'s reshapes, no copy)."""
    tree = _params_dict(module)
    shapes = {name: shape[::-1] for name, _, shape in _flat(tree)}
    return shapes | ({layouts.SINKS: tuple(tree[layouts.SINKS].shape)} if tree.get(layouts.SINKS) is not None else {})


def _flat(tree: dict) -> list[tuple[str, Any, tuple[int, ...]]]:
    """``(mha_torch name, array, shape)`` per projection and norm: the array reshaped to ``shape``, transposed."""
    flat = []
    for flax_name, torch_name in _FLAX_NAMES:
        shape = np.shape(tree[flax_name]["kernel"])
        if len(shape) != 3:
            raise ValueError(f"params[{flax_name!r}]['kernel'] must have rank 3, got shape {shape}")
        inputs = latent.INPUT_AXES.get(flax_name, 1)
        rows = (math.prod(shape[:inputs]), math.prod(shape[inputs:]))
        flat.append((f"{torch_name}.weight", tree[flax_name]["kernel"], rows))
        if "bias" in tree[flax_name]:
            bias = tree[flax_name]["bias"]
            flat.append((f"{torch_name}.bias", bias, (math.prod(np.shape(bias)),)))
    for flax_name, torch_name in _FLAX_NORMS:
        if flax_name in tree:
            scale = tree[flax_name]["scale"]
            flat.append((f"{torch_name}.weight", scale, (math.prod(np.shape(scale)),)))
    if tree.get("gate") is not None:  # (in, heads[, head_dim]) -> (heads[ * head_dim], in) once transposed
        shape = np.shape(tree["gate"]["kernel"])
        flat.append((layouts.GATE, tree["gate"]["kernel"], (shape[0], math.prod(shape[1:]))))
    return flat


def _params_dict(params: Any) -> dict:
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if isinstance(params, Mapping) and set(params) == {"params"}:
        params = params["params"]
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping or an nnx module, got {type(params).__name__}")
    return {k: v if k == layouts.SINKS else dict(v) for k, v in params.items()}


def read_state(state_dict_or_path: Any) -> dict[str, np.ndarray]:
    """Name -> NumPy array (a copy: nothing the caller passed is shared or modified)."""
    return layouts.read_checkpoint(state_dict_or_path, _load_file, _numeric)


def _load_file(path: str) -> dict[str, np.ndarray]:
    from safetensors.flax import load_file  # bfloat16 too, unlike NumPy's reader
    return {k: np.array(v) for k, v in load_file(path).items()}


def _numeric(name: str, value: Any) -> np.ndarray:
    array = _to_numpy(value)
    # objects and strings; kind "V" holds bfloat16 as well as structured records
    if array.dtype.kind in "OUSV" and not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"state_dict: {name!r} is not a numeric array: got {type(value).__name__}")
    return array


def _read_params(path: str | os.PathLike) -> dict:
    """A nested parameter dict from a flax msgpack or a dot-named ``.safetensors`` file."""
    path = os.fspath(path)
    if path.endswith((".msgpack", ".safetensors")) and not os.path.exists(path):
        raise FileNotFoundError(f"params {path!r} does not exist")
    try:
        if path.endswith(".msgpack"):
            from flax.serialization import msgpack_restore
            with open(path, "rb") as f:
                return msgpack_restore(f.read())
        if path.endswith(".safetensors"):
            from safetensors.numpy import load_file
            return traverse_util.unflatten_dict({tuple(k.split(".")): array for k, array in load_file(path).items()})
    except OSError:  # a missing or unreadable file keeps its own, already clear, error
        raise
    except Exception as error:  # msgpack and safetensors raise their own types for bad bytes
        raise ValueError(f"params {path!r} is not a readable parameter file: {error}") from error
    raise ValueError(f"params must be a .msgpack or .safetensors file, got {path!r}")


def _to_numpy(x: Any) -> np.ndarray:
    """A NumPy copy of an array-like; CPU torch tensors by duck typing (bfloat16 included)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16 of torch's; widening is exact
            return x.float().numpy().astype(jnp.bfloat16)
        return x.numpy().copy()
    return np.array(x, copy=True)


def _check_dtypes(state: dict[str, np.ndarray]) -> None:
    """Every weight real floating-point: a cast would drop an imaginary part or hide a wrong file."""
    for k, v in state.items():
        if not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"{k!r} must be real floating-point, got dtype {v.dtype}")
