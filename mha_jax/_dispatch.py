"""The implementations' table and the choice: each record says what its kernel takes, refuses and runs.

One lookup (``choose``) picks a record; ``run`` calls its runner, or, for a kernel of one platform, the runner
of the platform the program is lowered for (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from mha_jax import _blockwise, _cudnn, _mesh, _platform, _splash, _tuning, _xla
from mha_spec import arguments


def _how(default=None):
    """A field that says how a kernel runs, not what it takes (no claim of ``test_kernel_records``)."""
    return dataclasses.field(default=default, compare=False, repr=False, metadata={"how": True})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """What one implementation takes; the choice and its error messages are read from these."""

    name: str
    weights: bool = False  # return_weights (only a kernel that forms the weights)
    dropout: bool = True
    soft_cap: bool = True
    sinks: bool = True
    alibi: bool = True  # alibi_slopes (the ALiBi term read on positions)
    forward_mode: bool = False  # jax.jvp, jacfwd, derivatives of derivatives (custom-VJP kernels have none)
    dtypes: tuple[str, ...] = ()  # the query/key/value dtypes it takes; () for every floating dtype
    platform: str | None = None  # the platform it is compiled for; None for every platform
    interpret_elsewhere: bool = False  # on other platforms: Pallas interpret mode (else: an error when lowered)
    ring: bool = False  # runs under ``sequence_axis`` (the ring computes each step itself)
    value_head_dim: bool = True  # a value whose head dim differs from the query's and key's
    residual: bool = True  # return_residual (the logsumexp)
    # per platform where the program is lowered, the kernel it runs (``"flash"``); "default": elsewhere
    per_platform: tuple[tuple[str, str], ...] = ()
    # (query, key, value, **call) -> (output, weights or None, lse or None), in the public layout
    run: Callable | None = _how()
    refuses: Callable | None = _how()  # (spec, dropout=) -> why the kernel cannot express a call's masking, or None


KERNELS = {k.name: k for k in (
    Kernel("xla", weights=True, forward_mode=True, ring=True, run=_xla.run),
    Kernel("blockwise", ring=True, run=_blockwise.run),
    # jax.nn.dot_product_attention requires the value's shape to be the key's
    Kernel("cudnn", dropout=False, soft_cap=False, sinks=False, dtypes=("bfloat16", "float16"), platform="cuda",
           value_head_dim=False, run=_cudnn.run),
    Kernel("splash", dropout=False, alibi=False, platform="tpu", interpret_elsewhere=True,  # its kernel has no bias
           residual=False, run=_splash.run, refuses=_splash.refusal),
    Kernel("flash", per_platform=(("cuda", "cudnn"), ("tpu", "splash"), ("default", "blockwise"))),
)}
IMPLEMENTATIONS = tuple(KERNELS)
DEFAULT = KERNELS["xla"]  # as flax: no behaviour changes when an input grows
_FALLBACK = "blockwise"  # what ``per_platform`` runs where the platform's kernel cannot take the call
_PLATFORM_NAMES = {"cuda": "an NVIDIA GPU", "tpu": "a TPU"}
_AD_TRACERS = ("JVPTracer", "LinearizeTracer")


def record(implementation: str | None) -> Kernel:
    """The record of ``implementation`` (None: the default), its name checked."""
    if implementation is None:
        return DEFAULT
    return KERNELS[arguments.check_implementation(implementation, IMPLEMENTATIONS)]


def choose(implementation, return_weights, dropout, dtype, soft_cap=False, sinks=False, value_dim=False,
           alibi=False, residual=False) -> Kernel:
    """The record of the implementation asked for, after the checks that hold on every platform."""
    kernel = record(implementation)
    if return_weights and not kernel.weights:
        raise ValueError(f"return_weights=True needs implementation='xla', got {implementation!r}")
    if kernel.per_platform:  # what a platform's kernel cannot take is decided where it is lowered
        return kernel
    if kernel.platform is not None and not kernel.interpret_elsewhere:
        dropout = dtype = None  # refused on its platform, after the platform itself (see ``_branch``)
    refused = _refusal(kernel, dropout, dtype, soft_cap, sinks, value_dim, alibi, residual)
    if refused is not None:
        error, message = refused
        raise error(message)
    return kernel


def _refusal(kernel: Kernel, dropout, dtype, soft_cap, sinks, value_dim=False, alibi=False,
             residual=False) -> tuple[type, str] | None:
    """(exception type, message) when ``kernel`` cannot take a call of these options, else None."""
    name = kernel.name
    if residual and not kernel.residual:
        return ValueError, f"implementation={name!r} does not take return_residual=True; use 'xla' or 'blockwise'"
    if value_dim and not kernel.value_head_dim:
        return ValueError, (f"implementation={name!r} does not take a value head dim apart from the key's "
                            "(value's last axis must be key's); use 'xla' or 'blockwise'")
    asked = (("logit_soft_cap", soft_cap, kernel.soft_cap), ("sinks", sinks, kernel.sinks),
             ("alibi_slopes", alibi, kernel.alibi))
    missing = [n for n, given, takes in asked if given and not takes]
    if missing:
        return ValueError, f"implementation={name!r} does not take {' and '.join(missing)}; use 'xla' or 'blockwise'"
    if dropout and not kernel.dropout:
        return ValueError, f"implementation={name!r} does not take dropout here; use 'blockwise' or 'xla'"
    if kernel.dtypes and dtype is not None and jnp.dtype(dtype).name not in kernel.dtypes:
        return TypeError, f"implementation={name!r} needs {' or '.join(kernel.dtypes)} query/key/value, got {dtype}"
    return None


def run(kernel: Kernel, query, key, value, call):
    """(output ``(batch, q_len, heads, v_head_dim)``, weights or None, lse ``(batch, q_len, heads)`` or None) in the
    compute dtype, from ``kernel``'s runner, or the lowering platform's."""
    pairs = kernel.per_platform or ((kernel.platform or "default", kernel.name),)
    if kernel.interpret_elsewhere:
        pairs += (("default", kernel.name),)
    value_dim = value.shape[-1] != key.shape[-1]
    names = {platform: _resolve(kernel.name, name, query.dtype, call, value_dim) for platform, name in pairs}
    everywhere = set(names.values())
    name = everywhere.pop() if len(everywhere) == 1 else None  # a refusal is an (error, message) pair
    if isinstance(name, str) and KERNELS[name].platform is None:
        _tuning.observe("kernel", name)  # one kernel everywhere (it places its own blocks on a mesh)
        return KERNELS[name].run(query, key, value, **call)
    sharded = _sharded_axes(query, key)
    if sharded is not None:  # Pallas and cuDNN kernels are not partitioned: one call per device
        return _per_device(kernel, names, query, key, value, call, *sharded)
    return _lowered(kernel, names, query, key, value, call)


def _lowered(kernel: Kernel, names: dict, query, key, value, call):
    branches = {platform: _branch(platform, name, call) for platform, name in names.items()}
    if "default" not in branches:  # elsewhere, a clear error when (and only when) lowered
        branches["default"] = _unavailable(
            f"implementation={kernel.name!r} needs {_PLATFORM_NAMES[kernel.platform]}; the program is being "
            "lowered for {platform!r}", residual=call["residual"],
        )
    default = branches.pop("default")
    return jax.lax.platform_dependent(query, key, value, default=default, **branches)


def _sharded_axes(query, key):
    """(batch axes, heads axes) where Explicit mesh axes shard the query's batch or heads, else None."""
    if not tuple(getattr(jax.sharding.get_abstract_mesh(), "explicit_axes", ())):
        return None
    q_spec, k_spec = (tuple(jax.typeof(x).sharding.spec) + (None,) * 4 for x in (query, key))
    if not (q_spec[0] or q_spec[2]):
        return None
    if q_spec[1] or q_spec[3] or k_spec[1] or k_spec[3]:
        raise ValueError(
            f"this implementation runs on each device's whole sequences: the query is sharded as {q_spec[:4]} and the "
            f"key as {k_spec[:4]}; shard the batch and heads only (sequence_axis shards the lengths)"
        )
    return q_spec[0], q_spec[2]


def _per_device(kernel: Kernel, names, query, key, value, call, batch, heads):
    """``_lowered`` inside ``jax.shard_map`` over the mesh's Explicit axes (per device: its examples and heads)."""
    spec, b = call["spec"], call["spec"].shape[0]
    arrays = _platform.spec_arrays(spec)
    specs = {n: None if x is None else P(batch if x.shape[0] == b else None, *(None,) * (x.ndim - 1))
             for n, x in arrays.items()}
    for n in ("allowed", "bias"):  # (batch|1, heads|1, q, k): heads too
        if arrays[n] is not None:
            arrays[n] = x = arrays[n].reshape((1,) * (4 - arrays[n].ndim) + arrays[n].shape)
            specs[n] = P(batch if x.shape[0] == b else None, heads if x.shape[1] > 1 else None, None, None)
    if arrays["alibi_slopes"] is not None:  # (batch|1, heads): heads too
        specs["alibi_slopes"] = P(batch if arrays["alibi_slopes"].shape[0] == b else None, heads)
    layout, sinks = P(batch, None, heads, None), call["sinks"]
    out_specs = (layout, None, P(batch, None, heads) if call["residual"] else None)

    def local(q, k, v, arrays, sinks):
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        here = dict(call, spec=dataclasses.replace(spec, shape=shape, **arrays), sinks=sinks)
        return _lowered(kernel, names, q, k, v, here)
    specs = (layout, layout, layout, specs, None if sinks is None else P(heads))
    return _mesh.per_device(local, (query, key, value, arrays, sinks), specs, out_specs, check_vma=False)


def _resolve(asked: str, name: str, dtype, call, value_dim=False):
    """The kernel name to run for ``asked`` on ``name``'s platform, or a refusal ``(exception type, message)``."""
    spec, kernel, dropout = call["spec"], KERNELS[name], call["rng"] is not None or call["keep"] is not None
    refused = _refusal(kernel, dropout, dtype, call["soft_cap"] is not None, call["sinks"] is not None, value_dim,
                       spec.alibi_slopes is not None, call["residual"])
    if asked != name:  # "flash": the platform's kernel where it takes the call
        if refused is not None or (kernel.refuses is not None and kernel.refuses(spec, dropout=False) is not None):
            return _FALLBACK
        return name
    if refused is not None:
        return refused
    why = None if kernel.refuses is None else kernel.refuses(spec, dropout=dropout)
    if why is not None:
        raise ValueError(f"implementation={name!r} does not take {why}; use 'xla' or 'blockwise'")
    return name


def _branch(platform: str, name, call):
    """The function run on ``platform``: ``name``'s kernel, or a refusal when lowered."""
    if isinstance(name, tuple):
        return _unavailable(name[1].replace("{", "{{").replace("}", "}}"), name[0], call["residual"])
    kernel = KERNELS[name]
    _tuning.observe("kernel", name)
    run = kernel.run
    if kernel.interpret_elsewhere:  # Pallas interpret mode off its platform
        run = functools.partial(run, interpret=platform != kernel.platform)
    return lambda q, k, v: jax.tree.map(lambda x: x.astype(call["compute"]), run(q, k, v, **call))


# Stands for a kernel off its platform: traces as the identity, fails with its message only when lowered.
_unavailable_p = Primitive("mha_kernel_unavailable")
_unavailable_p.def_abstract_eval(lambda x, **_: x)
ad.defjvp(_unavailable_p, lambda t, x, **_: t)
batching.primitive_batchers[_unavailable_p] = lambda args, dims, **kw: (_unavailable_p.bind(*args, **kw), dims[0])
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _refuse_lowering(ctx, x, *, message, error):
    platforms = getattr(ctx.module_context, "platforms", None) or ("this platform",)
    raise _ERRORS[error](message.format(platform=platforms[0] if len(platforms) == 1 else platforms))


def _refuse_running(x, *, message, error):  # run eagerly (outside jit), on the default backend's devices
    raise _ERRORS[error](message.format(platform=jax.default_backend()))


mlir.register_lowering(_unavailable_p, _refuse_lowering)
_unavailable_p.def_impl(_refuse_running)


def _unavailable(message: str, error: type = ValueError, residual: bool = False):
    """A branch that fails with ``message`` (``{platform}`` filled in) where it is lowered."""
    def branch(query, key, value):
        compute = jnp.promote_types(query.dtype, jnp.float32)
        # stands for the output (batch, q_len, heads, v_head_dim), as the kernel's branch gives it
        out = jnp.broadcast_to(query[..., :1], query.shape[:3] + value.shape[3:]).astype(compute)
        out = _unavailable_p.bind(out, message=message, error=error.__name__)
        return out, None, out[..., 0] if residual else None
    return branch


def check_derivatives(kernel: Kernel, *arrays) -> None:
    """Refuse forward mode or a second derivative of a custom-VJP kernel (seen on the traced inputs)."""
    if kernel.forward_mode:
        return
    for x in arrays:
        kinds = []
        while isinstance(x, jax.core.Tracer):
            kinds.append(type(x).__name__)
            x = getattr(x, "primal", getattr(x, "val", None))
        if "JVPTracer" in kinds or sum(kind in _AD_TRACERS for kind in kinds) > 1:
            raise NotImplementedError(
                f"implementation={kernel.name!r} has first-order reverse-mode derivatives only "
                "(jax.grad, jax.vjp); forward mode (jax.jvp, jacfwd, hessian) and derivatives of "
                "derivatives need implementation='xla'"
            )
