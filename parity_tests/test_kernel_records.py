"""Each kernel record against its kernel: what ``mha_jax.dot_product_attention`` says an
implementation takes (dropout, a logit soft-cap, sinks, ALiBi slopes, the weights, the residual, forward-mode
derivatives, dtypes, the platform it is compiled for, the kernel each platform runs, the ring) is exactly what
that kernel receives and honours. A claim is checked by running the kernel on this CPU where it
runs here (the TPU kernel in Pallas interpret mode) against the float64 oracle, or by lowering its
program for its platform and reading the kernel call in it; a refusal must be raised, by name, where
the record says the kernel refuses. A claim of dropout is false if the output does not depend on
the dropout key.

The records are read as the one table of dataclass records, keyed by implementation name, that
``mha_jax.attention`` chooses from; every field of a record is a claim checked here.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import PartitionSpec as P

import mha_jax
from mha_jax import attention
from mha_jax.testing import dispatch
from parity_tests.conftest import X64
from parity_tests.tool import harness, oracle

B, Q, K, H, HK, D = 2, 12, 8, 4, 2, 8
CLAIMS = {"name", "weights", "dropout", "soft_cap", "sinks", "alibi", "forward_mode", "dtypes", "platform",
          "interpret_elsewhere", "ring", "per_platform", "value_head_dim", "residual"}
# The custom call that shows each platform kernel in a program (the others are computed by XLA's
# own operations).
KERNEL_CALLS = {"cudnn": "__cudnn$fmha", "splash": "tpu_custom_call"}
PLATFORM_WORDS = {"cuda": "an NVIDIA GPU", "tpu": "a TPU"}
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward", "__cudnn$fmhaScaleBiasSoftmax",
               "__cudnn$fmhaScaleBiasSoftmaxBackward")
TOL = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 2e-2, "float16": 5e-3}


def _records() -> dict:
    """The kernel records: the one dict of the dispatch whose keys are the implementations
    ``mha_jax.attention`` names and whose values are dataclass instances."""
    tables = [v for v in vars(dispatch).values() if isinstance(v, dict) and tuple(v) == attention.IMPLEMENTATIONS
              and all(dataclasses.is_dataclass(r) for r in v.values())]
    assert len(tables) == 1, f"{len(tables)} tables of kernel records in mha_jax's dispatch"
    return tables[0]


RECORDS = _records()
NAMES = list(RECORDS)


def _runs_here(record) -> bool:
    """Whether the kernel runs on this CPU: compiled for every platform, or interpreted off its own."""
    return record.platform is None or record.interpret_elsewhere


def _dtype(record) -> str:
    return record.dtypes[0] if record.dtypes else "float32"


def _inputs(dtype: str = "float32", scale: float = 1.0, seed: int = 0):
    """query ``(B, Q, H, D)``, key and value ``(B, K, HK, D)``, standard normal times ``scale``."""
    rng = np.random.default_rng(seed)
    q = scale * rng.normal(size=(B, Q, H, D))
    k, v = scale * rng.normal(size=(2, B, K, HK, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _oracle(q, k, v, **terms) -> tuple[np.ndarray, np.ndarray]:
    """(output ``(B, Q, H, D)``, weights ``(B, H, Q, K)``) of the float64 oracle."""
    q, k, v = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v))
    out, weights, _ = oracle.attention(q, k, v, oracle.Attention(**terms))
    return out.transpose(0, 2, 1, 3), weights


def _close(got, want, dtype: str) -> None:
    assert max(harness.errors(np.asarray(got, np.float64), want)) <= TOL[dtype]


def _program(fn, args, platform: str) -> str:
    """``fn`` exported for ``platform`` (lowered on this host): its StableHLO text."""
    disabled = [export.DisabledSafetyCheck.custom_call(name) for name in CUDNN_CALLS]
    return export.export(jax.jit(fn), platforms=(platform,), disabled_checks=disabled)(*args).mlir_module()


def _kernels_in(text: str) -> set[str]:
    """The platform kernels (``KERNEL_CALLS``' names) a program holds."""
    return {name for name, call in KERNEL_CALLS.items() if call in text}


def _lowered(name: str, fn, args):
    """``fn`` run on this CPU where the kernel runs here, else its program for its platform."""
    record = RECORDS[name]
    return jax.jit(fn)(*args) if _runs_here(record) else _program(fn, args, record.platform)


def _attention(name: str, **kw):
    return lambda q, k, v: mha_jax.dot_product_attention(q, k, v, implementation=name, **kw)


def test_every_field_of_a_record_is_a_claim_checked_here():
    """Every field but those that say how the kernel runs (its runner, its refusal of a call's masking)."""
    for record in RECORDS.values():
        assert {f.name for f in dataclasses.fields(record) if not f.metadata.get("how")} == CLAIMS, record
        assert (record.run is None) == bool(record.per_platform), record  # a record runs, or names who does


@pytest.mark.parametrize("name", NAMES)
def test_dropout_is_honoured_where_claimed_and_refused_elsewhere(name):
    record, args = RECORDS[name], _inputs(_dtype(RECORDS[name]))

    def drop(q, k, v, key):
        return mha_jax.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key, implementation=name)

    keep = np.random.default_rng(1).random((B, H, Q, K)) >= 0.5
    by_mask = _attention(name, dropout_rate=0.5, dropout_mask=jnp.asarray(keep))
    if not record.dropout:
        for fn, more in ((drop, (jax.random.key(0),)), (by_mask, ())):
            with pytest.raises(ValueError, match=re.escape(f"implementation={name!r} does not take dropout")):
                _lowered(name, fn, args + more)
        return
    if not _runs_here(record):
        _lowered(name, drop, args + (jax.random.key(0),))
        return
    first, again, other = (jax.jit(drop)(*args, jax.random.key(s)) for s in (0, 0, 1))
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other), "the output does not depend on the dropout key"
    _close(jax.jit(by_mask)(*args), _oracle(*args, keep=keep, dropout_rate=0.5)[0], _dtype(record))


# ALiBi's slopes (rounded to float32) and the bias they make at default positions, as the oracle adds it
SLOPES = np.float32(np.random.default_rng(3).uniform(0.1, 1.0, size=H)).astype(np.float64)
ALIBI_BIAS = -SLOPES[:, None, None] * np.abs(np.arange(Q)[:, None] - np.arange(K)[None, :])


@pytest.mark.parametrize("term", ["soft_cap", "sinks", "alibi"])
@pytest.mark.parametrize("name", NAMES)
def test_logit_terms_are_honoured_where_claimed_and_refused_elsewhere(name, term):
    """Logits three times the usual size, so that a soft-cap of 2 changes them."""
    record, args = RECORDS[name], _inputs(_dtype(RECORDS[name]), scale=3.0)
    sinks = np.random.default_rng(2).normal(size=H)
    given = {"soft_cap": dict(logit_soft_cap=2.0), "sinks": dict(sinks=jnp.asarray(sinks, _dtype(record))),
             "alibi": dict(alibi_slopes=jnp.asarray(SLOPES, _dtype(record)))}[term]
    fn = _attention(name, **given)
    if not getattr(record, term):
        argument = {"soft_cap": "logit_soft_cap", "sinks": "sinks", "alibi": "alibi_slopes"}[term]
        with pytest.raises(ValueError, match=re.escape(f"implementation={name!r} does not take {argument}")):
            _lowered(name, fn, args)
        return
    if not _runs_here(record):
        _lowered(name, fn, args)
        return
    want, _ = _oracle(*args, **{"soft_cap": dict(soft_cap=2.0), "sinks": dict(sinks=sinks),
                                "alibi": dict(bias=ALIBI_BIAS[None])}[term])
    assert not np.allclose(want, _oracle(*args)[0], atol=1e-3)  # the term matters here
    _close(jax.jit(fn)(*args), want, _dtype(record))


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_returned_where_claimed_and_refused_elsewhere(name):
    record, args = RECORDS[name], _inputs(_dtype(RECORDS[name]))
    fn = _attention(name, return_weights=True)
    if not record.weights:
        with pytest.raises(ValueError, match=re.escape("return_weights=True needs implementation='xla'")):
            _lowered(name, fn, args)
        return
    out, weights = jax.jit(fn)(*args)
    want, want_weights = _oracle(*args)
    _close(out, want, _dtype(record))
    _close(weights, want_weights, _dtype(record))


@pytest.mark.parametrize("name", NAMES)
def test_the_residual_is_returned_where_claimed_and_refused_elsewhere(name):
    record, args = RECORDS[name], _inputs(_dtype(RECORDS[name]))
    fn = _attention(name, return_residual=True)
    if not record.residual:
        with pytest.raises(ValueError, match=re.escape(f"implementation={name!r} does not take return_residual")):
            _lowered(name, fn, args)
        return
    if not _runs_here(record):
        assert _kernels_in(_lowered(name, fn, args)) == {name}
        return
    out, lse = jax.jit(fn)(*args)
    q, k = (np.asarray(x, np.float64) for x in args[:2])
    logits = np.einsum("bqhd,bkhd->bqhk", q, np.repeat(k, H // HK, axis=2)) / np.sqrt(D)
    top = logits.max(axis=-1)
    _close(out, _oracle(*args)[0], _dtype(record))
    _close(lse, top + np.log(np.exp(logits - top[..., None]).sum(axis=-1)), _dtype(record))


@pytest.mark.skipif(not X64, reason="the finite differences are taken in float64")
@pytest.mark.parametrize("name", NAMES)
def test_forward_mode_where_claimed_and_refused_elsewhere(name):
    """Claimed: ``jax.jvp``'s tangent is the central difference of the output (float64, step
    1e-5); else ``jax.jvp`` raises, naming reverse mode."""
    record = RECORDS[name]
    dtype = "float64" if _runs_here(record) else _dtype(record)
    args, tangents = _inputs(dtype), _inputs(dtype, seed=3)
    fn = _attention(name)

    def jvp(*a):
        return jax.jvp(fn, a[:3], a[3:])

    if not record.forward_mode:
        with pytest.raises(NotImplementedError, match="first-order reverse-mode derivatives only"):
            _lowered(name, jvp, args + tangents)
        return
    _, tangent = jax.jit(jvp)(*args, *tangents)
    step = 1e-5
    ahead, behind = (fn(*(x + s * t for x, t in zip(args, tangents))) for s in (step, -step))
    np.testing.assert_allclose(tangent, (ahead - behind) / (2 * step), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_dtypes_are_taken_where_claimed_and_refused_elsewhere(name):
    """Every floating dtype where the record names none; else each one named (the platform's
    kernel in its program) and float32 refused, naming them."""
    record = RECORDS[name]
    if not record.dtypes:
        for dtype in ("float32", "bfloat16"):
            args = _inputs(dtype)
            _close(jax.jit(_attention(name))(*args), _oracle(*args)[0], dtype)
        return
    for dtype in record.dtypes:
        assert _kernels_in(_program(_attention(name), _inputs(dtype), record.platform)) == {name}, dtype
    wanted = " or ".join(record.dtypes)
    with pytest.raises(TypeError, match=re.escape(f"implementation={name!r} needs {wanted} query/key/value")):
        _lowered(name, _attention(name), _inputs("float32"))


@pytest.mark.parametrize("name", NAMES)
def test_the_platform_is_the_one_the_record_names(name):
    """No platform: portable (no platform kernel in a program for a GPU or a TPU). A platform:
    its kernel in the program for it; off it, interpreted (against the oracle) where the record
    says so, else refused by name where the program is lowered."""
    record = RECORDS[name]
    args = _inputs(_dtype(record))
    fn = _attention(name, is_causal=True)
    if record.platform is None:
        if not record.per_platform:
            assert not any(_kernels_in(_program(fn, args, p)) for p in PLATFORM_WORDS)
        return
    assert _kernels_in(_program(fn, args, record.platform)) == {name}
    if record.interpret_elsewhere:
        _close(jax.jit(fn)(*args), _oracle(*args, is_causal=True)[0], _dtype(record))
    else:
        message = f"implementation={name!r} needs {PLATFORM_WORDS[record.platform]}; the program is being lowered"
        with pytest.raises(ValueError, match=re.escape(message)):
            jax.jit(fn)(*jax.device_put(args, jax.devices("cpu")[0]))


PER_PLATFORM = [(name, platform, kernel) for name in NAMES for platform, kernel in RECORDS[name].per_platform]


@pytest.mark.parametrize("name, platform, kernel", PER_PLATFORM)
def test_each_platform_runs_the_kernel_the_record_names(name, platform, kernel):
    """In the platform's program, its kernel where it takes the call; with dropout, that kernel
    only if its record claims dropout (else the portable kernel, which draws it)."""
    target = "cpu" if platform == "default" else platform
    args = _inputs(_dtype(RECORDS[kernel]))
    named = {kernel} if kernel in KERNEL_CALLS else set()
    assert _kernels_in(_program(_attention(name, is_causal=True), args, target)) == named

    def drop(q, k, v, key):
        return mha_jax.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key, implementation=name)

    claimed = named if RECORDS[kernel].dropout else set()
    assert _kernels_in(_program(drop, args + (jax.random.key(0),), target)) == claimed


def _value_head_dim_inputs(dtype: str):
    """query ``(B, Q, H, D)``, key ``(B, K, HK, D)`` and a value ``(B, K, HK, 4)``: a head dim of its own."""
    q, k, _ = _inputs(dtype)
    return q, k, jnp.asarray(np.random.default_rng(4).normal(size=(B, K, HK, 4)), dtype)


@pytest.mark.parametrize("name", NAMES)
def test_a_value_head_dim_of_its_own_is_taken_where_claimed_and_refused_elsewhere(name):
    """Claimed: the output ``(B, Q, H, 4)`` against the oracle where the kernel runs here, else the
    kernel in its platform's program; else a refusal naming it."""
    record = RECORDS[name]
    args, fn = _value_head_dim_inputs(_dtype(record)), _attention(name, is_causal=True)
    if not record.value_head_dim:
        with pytest.raises(ValueError, match=re.escape(f"implementation={name!r} does not take a value head dim")):
            _lowered(name, fn, args)
        return
    if not _runs_here(record):
        assert _kernels_in(_program(fn, args, record.platform)) == {name}
        return
    _close(jax.jit(fn)(*args), _oracle(*args, is_causal=True)[0], _dtype(record))


@pytest.mark.parametrize("name, platform, kernel", PER_PLATFORM)
def test_each_platform_takes_a_value_head_dim_where_its_kernel_does(name, platform, kernel):
    """In the platform's program, its kernel where that kernel's record claims a value head dim of
    its own, else the portable kernel."""
    target = "cpu" if platform == "default" else platform
    args = _value_head_dim_inputs(_dtype(RECORDS[kernel]))
    named = {kernel} if kernel in KERNEL_CALLS and RECORDS[kernel].value_head_dim else set()
    assert _kernels_in(_program(_attention(name, is_causal=True), args, target)) == named


def test_the_tpu_kernel_receives_no_dropout():
    """JAX's splash kernel has no dropout input: a call with dropout, lowered for a TPU, holds
    no TPU kernel (``"flash"`` runs the portable kernel there, which draws it)."""
    def drop(q, k, v, key):
        return mha_jax.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=key, implementation="flash")

    assert not _kernels_in(_program(drop, _inputs() + (jax.random.key(0),), "tpu"))


@pytest.mark.skipif(jax.device_count() < 2, reason="a ring needs 2 devices")
@pytest.mark.parametrize("name", NAMES)
def test_the_ring_runs_where_claimed_and_refuses_elsewhere(name):
    """Over 2 devices: the ring gives the output on one device where claimed; else a refusal
    naming the implementation."""
    record, args = RECORDS[name], _inputs(_dtype(RECORDS[name]))
    mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2])
    ring = _attention(name, is_causal=True, sequence_axis="seq")
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, P(None, "seq")) for x in args]
        if not record.ring:
            with pytest.raises(ValueError, match=rf"sequence_axis='seq' does not take implementation={name!r}"):
                jax.jit(ring)(*placed)
            return
        got = jax.jit(ring)(*placed)
    _close(got, _oracle(*args, is_causal=True)[0], _dtype(record))
