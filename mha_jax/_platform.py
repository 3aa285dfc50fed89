"""A kernel lowered for its own platform only (``on``), inside a program lowered for several.

The JAX internals this package uses are here alone, named in ``INTERNALS`` for ``JAX_VERSION``.
"""

from __future__ import annotations

import contextlib
import importlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import batching, mlir

JAX_VERSION = "0.10.2"
_SPLASH = "jax.experimental.pallas.ops.tpu.splash_attention."
# each JAX internal module used, and what is used of it
INTERNALS = {
    "jax._src.interpreters.partial_eval": ("convert_constvars_jaxpr",),
    "jax._src.cudnn.fused_attention_stablehlo": ("check_cudnn_version", "cuda_versions"),
    # what ``_splash.kernel`` builds splash's kernel from that ``splash_attention`` does not export
    _SPLASH + "splash_attention_kernel": ("SplashAttentionKernel", "DEFAULT_MASK_VALUE"),
    _SPLASH + "splash_attention_mask": ("ChunkedCausalMask",),
    _SPLASH + "splash_attention_mask_info": ("process_mask", "process_mask_dkv"),
}


def jax_internal(module: str, internals: dict[str, tuple[str, ...]] = INTERNALS):
    """JAX's internal ``module``; an ImportError naming what moved if it lacks what ``internals`` lists."""
    try:
        found = importlib.import_module(module)
    except ImportError:
        found = None
    missing = [name for name in internals[module] if not hasattr(found, name)]
    if missing:
        raise ImportError(
            f"mha_jax uses JAX's internal {module}: {', '.join(missing)}, written for jax {JAX_VERSION}; "
            f"jax {jax.__version__} has moved or removed it (mha_jax/_platform.py is where to adapt it)"
        )
    return found


convert_constvars_jaxpr = jax_internal("jax._src.interpreters.partial_eval").convert_constvars_jaxpr

_lowered_p = Primitive("mha_lowered_for")
_lowered_p.multiple_results = True
_lowered_p.def_abstract_eval(lambda *args, jaxpr, platform: [v.aval for v in jaxpr.jaxpr.outvars])
_lowered_p.def_impl(lambda *args, jaxpr, platform: jax.jit(jaxpr_as_fun(jaxpr))(*args))


def _lowering(ctx, *args, jaxpr, platform):
    module = ctx.module_context if platform is None else ctx.module_context.replace(platforms=(platform,))
    outs, tokens = mlir.jaxpr_subcomp(
        module, jaxpr.jaxpr, ctx.name_stack, ctx.tokens_in, (), *args, dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering, outer_traceback=ctx.traceback,
    )
    ctx.set_tokens_out(tokens)
    return outs


mlir.register_lowering(_lowered_p, _lowering)


def _batched(args, dims, *, jaxpr, platform):
    fn = jax.vmap(jaxpr_as_fun(jaxpr), in_axes=dims)
    return _bind(platform, fn, args, x32=False), [0] * len(jaxpr.jaxpr.outvars)


batching.primitive_batchers[_lowered_p] = _batched


_SPEC_ARRAYS = ("allowed", "bias", "query_positions", "key_positions", "query_segment_ids", "key_segment_ids",
                "lengths", "alibi_slopes", "query_lengths")


def spec_arrays(spec) -> dict:
    """The arrays of a parsed ``masks.Spec`` (None where absent), to pass to ``on``."""
    return {name: getattr(spec, name) for name in _SPEC_ARRAYS}


def _context(x32: bool):
    """With ``x32``, 32-bit defaults while tracing (the TPU kernel mixes int32 with Python ints)."""
    return jax.enable_x64(False) if x32 and jax.config.jax_enable_x64 else contextlib.nullcontext()


def _bind(platform: str, fn, args, x32: bool):
    """``fn(*args)`` as one primitive lowered for ``platform``."""
    flat, tree = jax.tree.flatten(args)
    with _context(x32):
        closed, shapes = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
    jaxpr = ClosedJaxpr(convert_constvars_jaxpr(closed.jaxpr), ())
    outs = _lowered_p.bind(*closed.consts, *flat, jaxpr=jaxpr, platform=platform)
    return jax.tree.unflatten(jax.tree.structure(shapes), outs)


def on(platform: str | None, fn, *args, x32: bool = False):
    """``fn(*args)`` with its forward and backward lowered for ``platform`` only (None: the program's platforms).
    Differentiable in ``args``: pass every array ``fn`` depends on."""
    flat, tree = jax.tree.flatten(args)

    def converted(*xs):
        return fn(*jax.tree.unflatten(tree, xs))
    pullback_tree = []

    @jax.custom_vjp
    def call(*xs):
        return _bind(platform, converted, xs, x32)

    def forward(*xs):
        def run(*xs):
            with _context(x32):
                out, pullback = jax.vjp(converted, *xs)
            leaves, structure = jax.tree.flatten(pullback)
            pullback_tree[:] = [structure]
            return out, leaves

        return _bind(platform, run, xs, x32)
    inexact = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in flat]
    shapes = [jnp.shape(x) for x in flat]

    def backward(leaves, cotangent):
        def run(leaves, cotangent):  # the cotangents of the floating inputs (the others' are float0)
            with _context(x32):
                grads = jax.tree.unflatten(pullback_tree[0], leaves)(cotangent)
            return [g for g, keep in zip(grads, inexact) if keep]

        grads = iter(_bind(platform, run, (leaves, cotangent), x32))
        return tuple(next(grads) if keep else np.zeros(x, jax.dtypes.float0) for keep, x in zip(inexact, shapes))
    call.defvjp(forward, backward)
    return call(*flat)


@contextlib.contextmanager
def cudnn_traced_anywhere():
    """Let ``jax.nn.dot_product_attention(implementation="cudnn")`` be traced on a host without CUDA."""
    fused = jax_internal("jax._src.cudnn.fused_attention_stablehlo")
    if fused.cuda_versions is not None:
        yield
        return
    ask = fused.check_cudnn_version
    fused.check_cudnn_version = lambda: 90000  # cuDNN 9.0, the least jax's cuDNN attention supports
    try:
        yield
    finally:
        fused.check_cudnn_version = ask
