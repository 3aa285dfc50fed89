"""Regression tests for defects that property-based testing found, or trying the packages as
a user would. Each failed before its fix; each docstring gives the symptom seen and the fix
that was made.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from parity_tests import cores
from parity_tests.tool import harness, oracle


def test_blockwise_accepts_length_one():
    """Symptom: ``mha_jax.dot_product_attention(..., implementation="blockwise")`` raises
    ``TypeError: cannot reshape array of shape (1, 1, 2, 1, 4) ... into shape (1, 1, 2, 1, 8, 4)``
    whenever q_len or kv_len is 1, and so does the default implementation when decoding one
    query against >= 65536 keys (it picks "blockwise").

    Fix: ``mha_jax/_blockwise.py``, ``_prepare``: ``_pad`` leaves axes of size 1 alone (right
    for broadcast mask axes), so q/k/v of length 1 are never padded to a whole block. Pad q, k
    and v unconditionally (e.g. a ``_pad(x, axis, size, broadcast=False)`` flag used for the
    masks only)."""
    rng = np.random.default_rng(0)
    for q_len, kv_len in ((1, 3), (3, 1), (1, 1)):
        q, k, v = (rng.normal(size=(1, 2, q_len, 4)), rng.normal(size=(1, 1, kv_len, 4)),
                   rng.normal(size=(1, 1, kv_len, 4)))
        d_out = rng.normal(size=q.shape)
        want, _, cache = oracle.attention(q, k, v, oracle.Attention())
        got = cores.run_core("jax", q, k, v, d_out, implementation="blockwise")
        assert max(harness.errors(got["out"], want)) <= 1e-13
        for g, w in zip(got["grads"], oracle.attention_grad(cache, d_out)):
            assert max(harness.errors(g, w)) <= 1e-12
    decode = mha_jax.dot_product_attention(jnp.ones((1, 1, 1, 8)), jnp.ones((1, 65536, 1, 8)),
                                           jnp.ones((1, 65536, 1, 8)))
    assert decode.shape == (1, 1, 1, 8)


def test_zero_head_dim_is_a_named_error():
    """Symptom: query/key/value with head_dim 0 raise ``ZeroDivisionError: float division by
    zero`` (from the default scale) in both frameworks: no argument named.

    Fix: ``_checks.check_attention_inputs`` in ``mha_jax`` and ``mha_torch``: reject
    ``head_dim == 0`` with ``ValueError("query, key and value need head_dim >= 1, got query
    (...)")``."""
    for call in (
        lambda: mha_jax.dot_product_attention(jnp.zeros((2, 3, 4, 0)), jnp.zeros((2, 5, 4, 0)),
                                              jnp.zeros((2, 5, 4, 0))),
        lambda: mha_torch.dot_product_attention(torch.zeros(2, 4, 3, 0), torch.zeros(2, 4, 5, 0),
                                                torch.zeros(2, 4, 5, 0)),
    ):
        with pytest.raises(ValueError, match="head_dim"):
            call()


def test_empty_key_sequence_behaves_alike():
    """Symptom: with kv_len 0 the four implementations disagree: JAX "xla" raises
    ``ValueError: zero-size array to reduction operation max``, JAX "blockwise" an
    ``IndexError``, PyTorch "math" ``IndexError: amax(): Expected reduction dim -1 to have
    non-zero size``, PyTorch "sdpa" returns zeros. The JAX module also fails on a length-0
    self-attention input that the PyTorch module accepts.

    Expected (the README's rule for a query that may attend to no key, and SDPA's answer):
    outputs of 0. Fix: in both cores' ``dot_product_attention``, when ``kv_len == 0`` return
    zeros of the query's shape (and zero weights) before choosing an implementation.
    (Rejecting kv_len 0 with a ValueError naming ``key`` in ``check_attention_inputs`` would do
    too, if both frameworks and the modules do it alike; then change this test.)"""
    q, k = np.ones((1, 2, 3, 4)), np.ones((1, 2, 0, 4))
    for fw, impls in cores.IMPLEMENTATIONS.items():
        for impl in impls:
            got = cores.run_core(fw, q, k, k, np.ones(q.shape), implementation=impl)
            assert got["out"].shape == q.shape and np.all(got["out"] == 0), (fw, impl)
    module = mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
    assert module(jnp.zeros((2, 0, 16))).shape == (2, 0, 16)
    assert mha_torch.MultiHeadAttention(16, 4)(torch.zeros(2, 0, 16)).shape == (2, 0, 16)


def test_module_inputs_of_different_dtypes_fail_alike():
    """Symptom: ``inputs_q`` float32 with ``inputs_k`` float64 gives, in JAX, ``TypeError:
    query, key and value must share one dtype`` (the core's names, not the module's), in
    PyTorch ``RuntimeError: mat1 and mat2 must have the same dtype`` from ``F.linear``.

    Fix: the modules' ``_check_inputs`` (``mha_jax/_layer.py``, ``mha_torch/module.py``), through
    ``mha_spec.arguments.check_inputs_agree``: require one dtype for the three inputs,
    ``TypeError("inputs_q, inputs_k and inputs_v must share one dtype, got float32, float64,
    float64")`` (``query, key and value`` in PyTorch)."""
    x = np.zeros((2, 3, 16), np.float32)
    cases = (
        (lambda: mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))(jnp.asarray(x), jnp.asarray(x, jnp.float64)),
         "inputs_k"),
        (lambda: mha_torch.MultiHeadAttention(16, 4)(torch.from_numpy(x), torch.from_numpy(x).double()), "key"),
    )
    for call, name in cases:
        with pytest.raises(TypeError, match=f"{name}.*must share one dtype"):
            call()


def test_torch_module_names_inputs_of_another_dtype_than_its_parameters():
    """Symptom: a float64 (or bfloat16) input to a float32 ``mha_torch.MultiHeadAttention``
    raises ``RuntimeError: mat1 and mat2 must have the same dtype, but got Double and Float``
    from ``F.linear``, naming neither the input nor the module, in the forward and in both
    decoding paths (the one-token step and the general one).

    Fix: ``mha_torch/module.py``, ``_check_parameter_dtype``, called once the inputs are checked:
    ``TypeError("query (shape (2, 3, 16)) has dtype torch.float64 but the module's parameters
    are torch.float32: ...")``; under autocast, which casts inputs and weights, none. The JAX
    module promotes instead, as flax's ``nnx.Linear`` does."""
    module = mha_torch.MultiHeadAttention(16, 4)
    x = torch.zeros(2, 3, 16)
    calls = {
        "forward": lambda x: module(x),
        "one-token decode": lambda x: module(x[:, :1], cache=mha_torch.KVCache(2, 8, 4, 4, dtype=x.dtype)),
        "chunk decode": lambda x: module(x, cache=mha_torch.KVCache(2, 8, 4, 4, dtype=x.dtype)),
    }
    for name, call in calls.items():
        for dtype in (torch.float64, torch.bfloat16):
            with torch.no_grad(), pytest.raises(TypeError, match=rf"query \(shape .*\) has dtype {dtype} "
                                                                 r"but the module's parameters are torch.float32"):
                call(x.to(dtype))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert call(x.to(torch.bfloat16)).dtype == torch.bfloat16, name
    with pytest.raises(TypeError, match=r"query \(shape \(4, 2, 3, 16\)\) has dtype torch.float64"):  # the shape given
        module(torch.zeros(4, 2, 3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="query must be a real floating-point array"):  # not a float: named as before
        module(torch.zeros(2, 3, 16, dtype=torch.int64))
    assert module(x).dtype == torch.float32  # in the parameters' dtype, as before


def test_to_torch_names_what_is_wrong_with_a_tree():
    """Symptom: ``mha_jax.to_torch`` raises a bare ``KeyError: 'kernel'`` for a projection
    without a kernel, and silently returns a state dict that fits no module when the
    projections disagree (here a key kernel of head_dim 3 beside a query of head_dim 4).

    Fix: ``mha_jax/convert.py``, ``to_torch``: list projections lacking ``kernel`` among the
    problems it already collects, and check the state dict it builds with ``layouts.check_state``
    (heads and kv heads read from the query and key kernels), raising one ValueError that
    starts with ``params``."""
    params = mha_jax.from_torch(mha_torch.MultiHeadAttention(16, 4).state_dict(), num_heads=4)
    no_kernel = dict(params, query={"bias": params["query"]["bias"]})
    mismatched = dict(params, key={"kernel": np.zeros((16, 4, 3)), "bias": np.zeros((4, 3))})
    for tree in (no_kernel, mismatched):
        with pytest.raises(ValueError, match="params"):
            mha_jax.to_torch(tree)


def test_load_weights_names_an_entry_that_is_not_an_array():
    """Symptom: a state dict entry that is not numeric (None, a string) makes
    ``mha_torch.load_weights`` raise ``TypeError: can't convert np.ndarray of type
    numpy.object_`` naming no key, where ``mha_jax.from_torch`` raises ``ValueError:
    state_dict: 'q_proj.weight' has shape (), expected rank 2``.

    Fix: ``mha_torch/convert.py``, ``read_state``: convert each entry inside a try and raise
    ``ValueError(f"state_dict: {key!r} is not a numeric array: ...")``, as the JAX side does."""
    module = mha_torch.MultiHeadAttention(16, 4)
    for bad in (None, "weights"):
        state = dict(module.state_dict(), **{"q_proj.weight": bad})
        with pytest.raises(ValueError, match="q_proj.weight"):
            mha_jax.from_torch(state, num_heads=4)
        with pytest.raises(ValueError, match="q_proj.weight"):
            mha_torch.load_weights(module, state)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_padding_garbage_reaches_no_parameter_gradient(poison):
    """Symptom: NaN/Inf in the padded rows of ``inputs_k``/``inputs_v`` stay out of the
    outputs and input gradients (``test_robustness``) but reach the gradients of the key and
    value projection weights, in both frameworks: the core zeroes the padded keys' cotangent,
    and the projection's weight gradient sums ``0 * NaN`` over positions. One optimiser step
    then turns the weights to NaN.

    Fix: in ``mha_jax/_layer.py`` (``prepare``, for the nnx and linen modules) and
    ``mha_torch/module.py`` (``forward``): before projecting, zero the rows of ``inputs_k`` and
    ``inputs_v`` that no query of any head may attend to (the same reduction of mask and
    causality as the cores, over all heads: ``masks.zero_unused_inputs``)."""
    config = harness.Config("pad", q_len=4, kv_len=6, in_kv_features=10, num_heads=4, num_kv_heads=2)
    case = harness.Case(config, "padding", "float64")
    data = harness.make_data(case, seed=1)
    for x in (data.xk, data.xv):
        x[~data.padding_valid] = poison
    for name, result in (("jax", harness.run_jax(case, data)), ("torch", harness.run_torch(case, data))):
        bad = [p for p, g in result["grads"].items() if not np.all(np.isfinite(g))]
        assert not bad, f"{name}: non-finite gradients of {bad}"


def test_scale_and_dropout_rate_are_checked_by_name():
    """Symptom: ``scale="half"`` (or ``dropout_rate``/``dropout_p="a tenth"``) raises
    ``ValueError: could not convert string to float: 'half'`` naming no argument, and
    ``scale=nan`` silently gives NaN outputs, in both frameworks.

    Fix: ``_checks`` in both packages: a ``check_scale`` (a finite real number, else
    ``TypeError``/``ValueError`` naming ``scale``), and ``check_dropout_rate`` catching the
    failed ``float()`` to name the argument."""
    q, t = jnp.zeros((1, 2, 1, 4)), torch.zeros(1, 1, 2, 4)
    for call, name, bad_values in (
        (lambda s: mha_jax.dot_product_attention(q, q, q, scale=s), "scale", ("half", float("nan"))),
        (lambda s: mha_torch.dot_product_attention(t, t, t, scale=s), "scale", ("half", float("nan"))),
        (lambda s: mha_jax.dot_product_attention(q, q, q, dropout_rate=s, dropout_rng=jax.random.key(0)),
         "dropout_rate", ("a tenth",)),
        (lambda s: mha_torch.dot_product_attention(t, t, t, dropout_p=s), "dropout_p", ("a tenth",)),
    ):
        for bad in bad_values:
            with pytest.raises((TypeError, ValueError), match=name):
                call(bad)


def test_is_causal_must_be_a_bool_in_both_frameworks():
    """Symptom: a mask passed as ``is_causal`` (an easy slip) raises ``ValueError: The truth
    value of an array ... is ambiguous`` in JAX but ``RuntimeError: Boolean value of Tensor
    ... is ambiguous`` in PyTorch: different types, neither names ``is_causal``.

    Fix: both cores (and modules) check ``isinstance(is_causal, (bool, np.bool_))`` first:
    ``TypeError("is_causal must be a bool, got Array")``."""
    q, t = jnp.zeros((1, 3, 1, 4)), torch.zeros(1, 1, 3, 4)
    for call in (
        lambda: mha_jax.dot_product_attention(q, q, q, is_causal=jnp.ones((3, 3), bool)),
        lambda: mha_torch.dot_product_attention(t, t, t, is_causal=torch.ones(3, 3, dtype=torch.bool)),
    ):
        with pytest.raises(TypeError, match="is_causal"):
            call()


def test_feature_sizes_reject_bool_alike():
    """Symptom: ``mha_jax.MultiHeadAttention(1, True, ...)`` builds a module of 1 feature
    while ``mha_torch.MultiHeadAttention(True, 1)`` fails inside ``nn.Linear`` with a
    ``TypeError`` about ``empty()``.

    Fix: ``_checks.check_heads`` in both packages: reject ``bool`` feature sizes as it already
    does for head counts (``ValueError: in_features must be a positive integer, got True``)."""
    with pytest.raises(ValueError, match="in_features must be a positive integer"):
        mha_jax.MultiHeadAttention(1, True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="embed_dim must be a positive integer"):
        mha_torch.MultiHeadAttention(True, 1)


def test_loaders_name_a_module_of_the_wrong_kind():
    """Symptom: ``mha_jax.load_weights(torch_module, ...)`` raises ``TypeError: params
    must be a mapping or an nnx module`` (an argument it does not have), and
    ``mha_torch.load_weights(flax_module, ...)`` an ``AttributeError`` about ``state_dict``.

    Fix: ``load_weights`` (``mha_jax/convert.py``) and ``load_weights``
    (``mha_torch/convert.py``) check their ``module`` first: ``TypeError("module must be an
    mha_jax.MultiHeadAttention, got MultiHeadAttention from mha_torch.module")`` and the twin."""
    torch_module = mha_torch.MultiHeadAttention(16, 4)
    flax_module = mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
    state = torch_module.state_dict()
    with pytest.raises(TypeError, match="module must be"):
        mha_jax.load_weights(torch_module, state)
    with pytest.raises(TypeError, match="module must be"):
        mha_torch.load_weights(flax_module, state)
