"""Programs for GPUs and TPUs, lowered on a CPU host: the attention cores (forward and gradient),
the nnx module's training step and its decoding step export with ``jax.export`` for
``("cpu", "cuda", "tpu")``, the platform's kernel chosen where the program is lowered. Each
program is deserialized and run on the CPU with the direct result; the ``cuda`` program of the GPU
path holds cuDNN's fused attention (forward and backward custom calls), the ``tpu`` program the
Pallas TPU kernel's; every custom call is on an explicit list, and no program holds a host
callback or a float64 array. Symbolic batch and length export for the implementations that take
them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import mha_jax

PLATFORMS = ("cpu", "cuda", "tpu")
CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")  # forward and backward, no mask
CUDNN_MASKED = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")  # a mask, as a bias
PALLAS_TPU = "tpu_custom_call"
# Every custom call a program of this package may hold: the fused kernels, and JAX's own markers
# of shardings and of symbolic shape checks.
ALLOWED_CALLS = {*CUDNN, *CUDNN_MASKED, PALLAS_TPU, "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
                 "shape_assertion"}
# cuDNN's calls have no stability promise (a program runs with the jax that made it)
DISABLED = [export.DisabledSafetyCheck.custom_call(name) for name in CUDNN + CUDNN_MASKED]
B, T, H, KV, D = 2, 128, 4, 2, 64
TOL = {"float32": 2e-6, "bfloat16": 1e-2}


def _inputs(dtype="float32", length=T):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, length, H, D))
    k, v = rng.normal(size=(2, B, length, KV, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _core(implementation, **kw):
    def forward(q, k, v):
        return mha_jax.dot_product_attention(q, k, v, implementation=implementation, **kw)

    def gradient(q, k, v):
        return jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)

    return forward, gradient


def _export(fn, args, platforms=PLATFORMS):
    """Exported, serialized and read back, as a program shipped to another machine."""
    exported = export.export(jax.jit(fn), platforms=platforms, disabled_checks=DISABLED)(*args)
    return export.deserialize(exported.serialize())


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w$.]+)", text)) | set(re.findall(r'call_target_name = "([^"]+)"', text))


def _check_program(text: str) -> set[str]:
    """The custom calls of a StableHLO program, after checking them against the list and that
    there is neither a host callback nor a float64 array (a float64 scalar may be a constant)."""
    calls = _custom_calls(text)
    assert calls <= ALLOWED_CALLS, calls - ALLOWED_CALLS
    assert "callback" not in text.lower()
    assert not re.search(r"tensor<(\d+x)+f64>", text), re.search(r"tensor<(\d+x)+f64>", text)
    return calls


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if not jnp.issubdtype(w.dtype, jnp.floating):  # a cache's index
            np.testing.assert_array_equal(g, w)
            continue
        tol = TOL[jnp.dtype(w.dtype).name]
        scale = max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))), 1.0)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=tol * scale, rtol=0)


@pytest.mark.parametrize("implementation,dtype", [("xla", "float32"), ("blockwise", "float32"), ("flash", "bfloat16")])
@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(key_value_seq_lengths=jnp.array([T, 100]))],
                         ids=["causal", "lengths"])
def test_core_exports_for_every_platform_and_runs_back_on_cpu(implementation, dtype, kw):
    args = _inputs(dtype)
    for fn in _core(implementation, **kw):
        program = _export(fn, args)
        calls = _check_program(program.mlir_module())
        _close(program.call(*args), jax.jit(fn)(*args))
        if implementation == "flash":  # each platform's kernel, in one program
            assert set(CUDNN) | {PALLAS_TPU} <= calls if fn.__name__ == "gradient" else {CUDNN[0], PALLAS_TPU} <= calls
        else:
            assert calls <= {"Sharding", "shape_assertion"}


def test_each_platform_program_holds_its_kernel():
    """Lowered for one platform at a time: cuDNN forward and backward for cuda, the Pallas kernel
    for tpu, neither for cpu (``"flash"`` runs ``"blockwise"`` there)."""
    args = _inputs("bfloat16")
    _, gradient = _core("flash", is_causal=True)
    calls = {p: _check_program(_export(gradient, args, (p,)).mlir_module()) for p in PLATFORMS}
    assert set(CUDNN) <= calls["cuda"] and PALLAS_TPU not in calls["cuda"]
    assert PALLAS_TPU in calls["tpu"] and not calls["tpu"] & set(CUDNN)
    assert not calls["cpu"] & (set(CUDNN) | {PALLAS_TPU})
    _, by_name = _core("cudnn", is_causal=True)
    assert set(CUDNN) <= _check_program(_export(by_name, args, ("cuda",)).mlir_module())


def test_kernel_of_another_platform_fails_by_name_when_lowered():
    """``"cudnn"`` traces anywhere and fails, naming the GPU and the target, only where its
    program is lowered for another platform (run on this CPU, or exported for a TPU)."""
    args = _inputs("bfloat16")
    forward, _ = _core("cudnn")
    cpu = jax.devices("cpu")[0]  # the host's CPU, also where a GPU is the default device
    with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU; the program is being lowered for 'cpu'"):
        jax.jit(forward)(*jax.device_put(args, cpu))
    with pytest.raises(ValueError, match="needs an NVIDIA GPU; the program is being lowered for 'tpu'"):
        _export(forward, args, ("tpu",))


def test_flash_takes_the_portable_kernel_where_the_chip_kernel_cannot():
    """float32 (cuDNN takes bfloat16/float16) and a bias (the TPU kernel takes none): ``"flash"``
    runs ``"blockwise"`` on those platforms, and says so in no custom call."""
    q, k, v = _inputs("float32")
    bias = jnp.zeros((1, H, T, T), jnp.float32)
    def forward(q, k, v):
        return mha_jax.dot_product_attention(q, k, v, bias=bias, implementation="flash")

    program = _export(forward, (q, k, v))
    assert _check_program(program.mlir_module()) <= {"Sharding"}


def _module(implementation, dtype):
    return mha_jax.MultiHeadAttention(H, H * D, num_kv_heads=KV, implementation=implementation, param_dtype=dtype,
                                      dtype=dtype, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("implementation,dtype", [("blockwise", jnp.float32), ("flash", jnp.bfloat16)])
def test_module_training_step_exports(implementation, dtype):
    model = _module(implementation, dtype)
    graphdef, state = nnx.split(model, nnx.Param)
    params, tree = jax.tree.flatten(state)  # plain arrays: what a serialized program takes
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, T, H * D)), dtype)

    def train_step(params, x):
        def loss(params):
            model = nnx.merge(graphdef, jax.tree.unflatten(tree, params))
            return jnp.mean(model(x, is_causal=True).astype(jnp.float32) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return value, [p - 0.1 * g for p, g in zip(params, grads)]

    program = _export(train_step, (params, x))
    calls = _check_program(program.mlir_module())
    if implementation == "flash":
        assert set(CUDNN) | {PALLAS_TPU} <= calls
    _close(program.call(params, x), jax.jit(train_step)(params, x))


def test_module_decoding_step_exports():
    """A decoding step (one token over a cache) with ``"flash"`` for every platform: its
    positions are arrays, which the TPU kernel does not take, so the tpu program runs
    ``"blockwise"``; cuDNN takes them as a mask."""
    model = _module("flash", jnp.bfloat16)
    model.init_cache((B, T, H * D), jnp.bfloat16)
    graphdef, state = nnx.split(model)
    state, tree = jax.tree.flatten(state)
    token = jnp.asarray(np.random.default_rng(2).normal(size=(B, 1, H * D)), jnp.bfloat16)

    def decode_step(state, token):
        model = nnx.merge(graphdef, jax.tree.unflatten(tree, state))
        return model(token, decode=True, is_causal=True), jax.tree.leaves(nnx.state(model))

    program = _export(decode_step, (state, token))
    assert CUDNN_MASKED[0] in _check_program(program.mlir_module())
    _close(program.call(state, token), jax.jit(decode_step)(state, token))


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
def test_symbolic_batch_and_length_export(implementation):
    """One program for every batch and length (``jax.export.symbolic_shape``), forward and
    gradient, run back at two sizes."""
    batch, length = export.symbolic_shape("b, n")
    specs = [jax.ShapeDtypeStruct((batch, length, h, 16), jnp.float32) for h in (H, KV, KV)]
    for fn in _core(implementation, is_causal=True):
        exported = export.export(jax.jit(fn), platforms=PLATFORMS)(*specs)
        program = export.deserialize(exported.serialize())
        _check_program(program.mlir_module())
        for b, n in ((1, 37), (3, 130)):
            rng = np.random.default_rng(n)
            args = [jnp.asarray(rng.normal(size=(b, n, h, 16)), jnp.float32) for h in (H, KV, KV)]
            _close(program.call(*args), jax.jit(fn)(*args))
