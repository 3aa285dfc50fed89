"""Multi-head latent attention (``mha_spec.latent``) of ``mha_jax.MultiHeadAttention``, length first; twin of
``mha_torch/latent.py``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mha_jax import masks
from mha_spec.latent import Latent, RopePart
from mha_spec.rotary import rotate_at


class RMSNorm(nnx.Module):
    """transformers' ``DeepseekV3RMSNorm`` over the last axis: ``scale`` ``(features,)``, ones at first."""

    def __init__(self, features: int, latent: Latent, param_dtype, rngs: nnx.Rngs):
        self.latent = latent
        self.scale = nnx.Param(nnx.initializers.ones_init()(rngs.params(), (features,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(self.latent, x, self.scale[...])


def rms_norm(latent: Latent, x: jax.Array, scale: jax.Array) -> jax.Array:
    """``latent``'s RMSNorm of ``x`` ``(..., features)`` with ``scale`` ``(features,)`` (nnx's and linen's)."""
    return latent.rms_norm(x, scale, _mean_last, jax.lax.rsqrt, _cast)


def _mean_last(x: jax.Array) -> jax.Array:
    return x.mean(axis=-1, keepdims=True)


def _cast(x: jax.Array, like: jax.Array | None) -> jax.Array:
    """``x`` in float32 or wider (``like`` None), else in ``like``'s dtype."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32) if like is None else like.dtype)


def make_projections(module: nnx.Module, latent: Latent, features: tuple[int, int], num_heads: int,
                     linear: Callable[..., nnx.Module], param_dtype, rngs: nnx.Rngs) -> None:
    """The latent module's parameters but the output projection: ``query`` or ``q_a_proj``/``q_a_layernorm``/
    ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``. ``features``: (``in_features``,
    ``in_kv_features``); ``linear(in, out, use_bias=)`` makes a projection."""
    in_features, in_kv_features = features
    queries = (num_heads, latent.qk_head_dim)
    if latent.q_lora_rank is None:
        module.query = linear(in_features, queries, use_bias=False)
    else:
        module.q_a_proj = linear(in_features, latent.q_lora_rank)
        module.q_a_layernorm = RMSNorm(latent.q_lora_rank, latent, param_dtype, rngs)
        module.q_b_proj = linear(latent.q_lora_rank, queries, use_bias=False)
    module.kv_a_proj_with_mqa = linear(in_kv_features, latent.cache_dim)
    module.kv_a_layernorm = RMSNorm(latent.kv_lora_rank, latent, param_dtype, rngs)
    module.kv_b_proj = linear(latent.kv_lora_rank, (num_heads, latent.kv_b_features), use_bias=False)


def rope_part(rotary, latent: Latent) -> RopePart | None:
    """``rotary`` on the rope part of each head (``mha_spec.latent.RopePart``), None without one."""
    return None if rotary is None else RopePart(rotary, latent, functools.partial(jnp.concatenate, axis=-1))


def project_query(module: nnx.Module, x: jax.Array) -> jax.Array:
    """Queries ``(batch, q_len, heads, qk_head_dim)`` of ``x`` ``(batch, q_len, in_features)``."""
    if module.latent.q_lora_rank is None:
        return module.query(x)
    return module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))


def project_latent(module: nnx.Module, x: jax.Array) -> jax.Array:
    """Cache entries ``(batch, kv_len, 1, cache_dim)`` of ``x``: the normed latent, then the unrotated rope key."""
    rank = module.latent.kv_lora_rank
    compressed = module.kv_a_proj_with_mqa(x)
    entries = jnp.concatenate([module.kv_a_layernorm(compressed[..., :rank]), compressed[..., rank:]], axis=-1)
    return entries[:, :, None]


def expand(module: nnx.Module, entries: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
    """Keys ``(batch, kv_len, heads, qk_head_dim)`` and values ``(batch, kv_len, heads, v_head_dim)`` of the
    rotated entries ``(batch, kv_len, 1, cache_dim)``."""
    latent = module.latent
    batch, kv_len, _, _ = entries.shape
    lifted = module.kv_b_proj(entries[:, :, 0, :latent.kv_lora_rank])
    k_nope, values = lifted[..., :latent.qk_nope_head_dim], lifted[..., latent.qk_nope_head_dim:]
    k_rope = jnp.broadcast_to(entries[..., latent.kv_lora_rank:], (batch, kv_len, heads, latent.qk_rope_head_dim))
    return jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), values


def attention_inputs(module: nnx.Module, query: jax.Array, entries: jax.Array, spec: masks.Spec):
    """Queries, keys and values (``expand``) with their rope parts rotated at ``spec``'s positions."""
    query, entries = rotate_at(rope_part(module.rotary, module.latent), query, entries, *masks.positions(spec))
    return (query, *expand(module, entries, query.shape[2]))


def _kv_b_heads(module: nnx.Module) -> tuple[jax.Array, jax.Array]:
    """``kv_b_proj``'s key half ``(kv_lora_rank, heads, qk_nope_head_dim)`` and value half ``(..., v_head_dim)``."""
    kernel = module.kv_b_proj.kernel[...]
    nope = module.latent.qk_nope_head_dim
    return kernel[..., :nope], kernel[..., nope:]


def absorb_query(module: nnx.Module, query: jax.Array) -> jax.Array:
    """Rotated queries ``(batch, n, heads, qk_head_dim)`` as the absorbed step's ``(batch, n, heads, cache_dim)``."""
    w_key = _kv_b_heads(module)[0].astype(query.dtype)
    nope = module.latent.qk_nope_head_dim
    absorbed = jnp.einsum("bnhd,rhd->bnhr", query[..., :nope], w_key, precision=module.precision)
    return jnp.concatenate([absorbed, query[..., nope:]], axis=-1)


def lift_output(module: nnx.Module, out: jax.Array) -> jax.Array:
    """The absorbed step's outputs ``(batch, n, heads, kv_lora_rank)`` as ``(batch, n, heads, v_head_dim)``."""
    w_value = _kv_b_heads(module)[1].astype(out.dtype)
    return jnp.einsum("bnhr,rhv->bnhv", out, w_value, precision=module.precision)


def cached_keys(cache: jax.Array, latent: Latent, dtype) -> tuple[jax.Array, jax.Array]:
    """The absorbed step's keys ``(batch, max_length, 1, cache_dim)`` and values (their first ``kv_lora_rank``)."""
    keys = cache.astype(dtype)
    return keys, keys[..., :latent.kv_lora_rank]


# --- the parameter tree in mha_torch's names: a weight (out, in) is the kernel's transpose, input axes flattened

_TORCH_NAMES = {"query": "q_proj", "out": "out_proj"}  # the other projections and norms keep their names
# the leading axes of a Flax kernel that are its inputs: the output projection's (heads, head_dim, out)
INPUT_AXES = {"out": 2}  # every other kernel: 1, (in, heads[, head_dim])


def is_latent_tree(tree: Mapping[str, Any]) -> bool:
    """Whether a parameter tree (``mha_jax.convert``'s) is a latent module's."""
    return "kv_b_proj" in tree


def to_torch_state(tree: Mapping[str, Any], to_numpy: Callable[[Any], np.ndarray]) -> dict[str, np.ndarray]:
    """A latent module's parameter tree as ``mha_torch`` names -> NumPy arrays (``to_numpy`` copies)."""
    state = {}
    for name, entry in tree.items():
        torch_name = _TORCH_NAMES.get(name, name)
        if not isinstance(entry, Mapping):  # sinks
            state[torch_name] = to_numpy(entry)
            continue
        if "kernel" in entry:
            kernel = to_numpy(entry["kernel"])
            inputs = int(np.prod(kernel.shape[:INPUT_AXES.get(name, 1)]))
            state[f"{torch_name}.weight"] = np.ascontiguousarray(kernel.reshape(inputs, -1).T)
        if "bias" in entry:
            state[f"{torch_name}.bias"] = to_numpy(entry["bias"]).reshape(-1)
        if "scale" in entry:
            state[f"{torch_name}.weight"] = to_numpy(entry["scale"])
    return state


def torch_shapes(tree: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """A latent module's parameter shapes under ``mha_torch`` names."""
    zeros = functools.partial(np.broadcast_to, np.float32(0))  # arrays of the shapes, no copy of the values
    return {name: array.shape for name, array in to_torch_state(tree, lambda x: zeros(tuple(x.shape))).items()}


def load_state(module: nnx.Module, state: Mapping[str, Any]) -> None:
    """Set a latent module's parameters from ``state`` (``mha_torch`` names -> arrays), cast to their dtypes."""
    names = {torch: flax for flax, torch in _TORCH_NAMES.items()}
    for key, array in state.items():
        torch_name, _, part = key.rpartition(".")
        if not torch_name:  # sinks
            module.sinks.set_value(jnp.asarray(array, dtype=module.sinks.get_value().dtype))
            continue
        layer = getattr(module, names.get(torch_name, torch_name))
        attribute = {"weight": "kernel" if hasattr(layer, "kernel") else "scale", "bias": "bias"}[part]
        variable = getattr(layer, attribute)
        shape = variable.get_value().shape
        value = np.asarray(array)
        if attribute == "kernel":  # (out, in) -> the kernel's input axes, then its output axes
            value = value.T
        variable.set_value(jnp.asarray(value.reshape(shape), dtype=variable.get_value().dtype))
