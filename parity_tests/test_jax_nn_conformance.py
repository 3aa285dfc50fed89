"""``mha_jax.dot_product_attention`` as a drop-in for ``jax.nn.dot_product_attention`` (jax 0.10.2's).

One list of calls (``CASES``), written from jax.nn's docstring and what jax's own tests check (GQA groups,
bias and its gradient, bool masks of every broadcast shape, causality, windows, query and key/value
lengths, unbatched ``(T, N, H)`` inputs, the residual), each made unchanged through jax.nn and through
ours, under ``jax.jit``, by every implementation of ours that takes it: equal to jax.nn within its own
rounding (its softmax is float32 for every dtype: ``JAX_NN``) and to a float64 NumPy oracle (``ORACLE``).
Then: the inputs jax.nn refuses, refused by ours too (``REFUSED``); ``jax.vmap`` of an unbatched call;
gradients; the deliberate differences, each a named test (``DIFFERENCES``); no inf or NaN formed in any
path (``jax.debug_infs``/``jax.debug_nans`` with ``jax.disable_jit()``, so that every primitive is
checked, loops included); flax's decoding with ``is_causal`` (flax #5591) beside ours. The ring cases
need 8 devices (``CI_COMMAND``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mha_jax
from mha_jax.attention import dot_product_attention

B, T, S, N, K, H = 2, 16, 16, 4, 2, 8
JAX_NN = 2e-6  # max |ours - jax.nn| / max |jax.nn|, float64 inputs (jax.nn's softmax is float32)
ORACLE = 1e-12  # max |ours - oracle| / max |oracle|, float64
CI_COMMAND = ("XLA_FLAGS=--xla_force_host_platform_device_count=8 "
              "python -m pytest -q parity_tests/test_jax_nn_conformance.py -k sequence_axis")
IMPLEMENTATIONS = ("xla", "blockwise", "flash")  # "flash" off a GPU and TPU: "blockwise"
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason=f"needs 8 devices; CI runs: {CI_COMMAND}")


def _rng(seed=0):
    return np.random.default_rng(seed)


def _inputs(dtype=np.float64, t=T, s=S, n=N, k=K, seed=0):
    rng = _rng(seed)
    q = rng.normal(size=(B, t, n, H))
    kv = rng.normal(size=(2, B, s, k, H))
    return tuple(jnp.asarray(x, dtype) for x in (q, kv[0], kv[1]))


def _mask(shape, seed=1):
    """A bool mask of ``shape`` (broadcasting to (B, N, T, S)) leaving every query a key (the diagonal)."""
    mask = _rng(seed).random(shape) < 0.6
    return jnp.asarray(mask | np.eye(T, S, dtype=bool).reshape((1,) * (len(shape) - 2) + (T, S)))


def _bias(shape, seed=2):
    return jnp.asarray(_rng(seed).normal(size=shape))


LENGTHS = np.array([11, 16], np.int32)
Q_LENGTHS = np.array([9, 13], np.int32)

# name -> (the keyword arguments of both calls, our implementations that take it beside IMPLEMENTATIONS' ones)
CASES = {
    "plain": (dict(), ("splash",)),
    "causal": (dict(is_causal=True), ("splash",)),
    "scale": (dict(scale=0.3), ()),
    "bias_bnts": (dict(bias=_bias((B, N, T, S))), ()),
    "bias_ts": (dict(bias=_bias((T, S))), ()),
    "bias_1nts": (dict(bias=_bias((1, N, T, S))), ()),
    "bias_b1ts": (dict(bias=_bias((B, 1, T, S))), ()),
    "mask_bnts": (dict(mask=_mask((B, N, T, S))), ()),
    "mask_ts": (dict(mask=_mask((T, S))), ()),
    "mask_b11s_padding": (dict(mask=jnp.asarray(np.arange(S)[None, None, None] < LENGTHS[:, None, None, None])), ()),
    "window_int": (dict(local_window_size=3), ("splash",)),
    "window_pair": (dict(local_window_size=(4, 1)), ()),
    "window_causal": (dict(local_window_size=(3, 0), is_causal=True), ()),
    "key_value_seq_lengths": (dict(key_value_seq_lengths=jnp.asarray(LENGTHS)), ("splash",)),
    "query_seq_lengths": (dict(query_seq_lengths=jnp.asarray(Q_LENGTHS)), ("splash",)),
    "both_lengths_causal": (dict(query_seq_lengths=jnp.asarray(Q_LENGTHS), key_value_seq_lengths=jnp.asarray(LENGTHS),
                                 is_causal=True), ()),
    "everything": (dict(bias=_bias((B, 1, T, S)), mask=_mask((1, N, T, S)), is_causal=True, scale=0.5,
                        query_seq_lengths=jnp.asarray(Q_LENGTHS), key_value_seq_lengths=jnp.asarray(LENGTHS)), ()),
}
RESIDUAL_CASES = ("plain", "causal", "bias_bnts", "mask_bnts", "window_pair", "both_lengths_causal", "everything")


def _oracle(q, k, v, *, bias=None, mask=None, scale=None, is_causal=False, query_seq_lengths=None,
            key_value_seq_lengths=None, local_window_size=None):
    """(output, logsumexp) in float64 NumPy; a query with no key: output 0 (lse None there)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias)
    t, s = logits.shape[2:]
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed &= np.asarray(mask)
    qi, ki = np.arange(t)[:, None], np.arange(s)[None]
    if is_causal:
        allowed &= ki <= qi
    if local_window_size is not None:
        left, right = (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        allowed &= (ki >= qi - left) & (ki <= qi + right)
    if key_value_seq_lengths is not None:
        allowed &= (ki < np.asarray(key_value_seq_lengths)[:, None, None, None])
    if query_seq_lengths is not None:
        allowed &= (qi < np.asarray(query_seq_lengths)[:, None, None, None])
    logits = np.where(allowed, logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    e = np.exp(logits - top)
    total = e.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", e / np.where(total > 0, total, 1), v)
    with np.errstate(divide="ignore"):
        lse = (top + np.log(total))[..., 0].transpose(0, 2, 1)  # (b, t, n)
    return out, lse


def _error(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


def _ours(implementation, **kwargs):
    return jax.jit(functools.partial(dot_product_attention, implementation=implementation, **kwargs))


@functools.cache
def _jax_nn(name: str, dtype: str):
    """jax.nn's output for case ``name`` on ``_inputs`` in ``dtype`` (once for every implementation of ours)."""
    q, k, v = (x.astype(dtype) for x in _inputs())
    return jax.jit(functools.partial(jax.nn.dot_product_attention, **CASES[name][0]))(q, k, v)


def _cases_for(implementation):
    return [name for name, (_, extra) in CASES.items() if implementation in IMPLEMENTATIONS or implementation in extra]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ("splash",))
def test_cases_equal_jax_nn_and_the_oracle(implementation):
    dtype = "float32" if implementation == "splash" else "float64"  # splash: float32 at most, jax.nn's bound
    q, k, v = (x.astype(dtype) for x in _inputs())
    ran = []
    for name in _cases_for(implementation):
        kwargs = CASES[name][0]
        want = _jax_nn(name, dtype)
        got = _ours(implementation, **kwargs)(q, k, v)
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert _error(got, want) < JAX_NN * (10 if implementation == "splash" else 1), name
        if implementation != "splash":
            assert _error(got, _oracle(q, k, v, **kwargs)[0]) < ORACLE, name
        ran.append(name)
    assert len(ran) == len(_cases_for(implementation)) >= 5


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_return_residual_is_jax_nn_logsumexp(implementation):
    """jax.nn's residual: ``(B, T, N)``, the input dtype, natural log of the masked, scaled, biased logits'
    sum of exponentials; a padding query's (no key): -0.7 x float32's largest, as jax.nn's."""
    q, k, v = _inputs()
    for name in RESIDUAL_CASES:
        kwargs = CASES[name][0]
        out, lse = _ours(implementation, return_residual=True, **kwargs)(q, k, v)
        want_out, want_lse = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
        assert lse.shape == want_lse.shape == (B, T, N) and lse.dtype == want_lse.dtype, name
        assert _error(out, want_out) < JAX_NN and _error(lse, want_lse) < JAX_NN, name
        oracle_out, oracle_lse = _oracle(q, k, v, **kwargs)
        live = np.isfinite(oracle_lse)
        assert _error(np.asarray(lse)[live], oracle_lse[live]) < ORACLE, name
        if not live.all():  # padding queries: jax.nn's value exactly
            assert (np.asarray(lse)[~live] == np.asarray(want_lse)[~live]).all(), name


def test_jax_nn_docstring_calls_run_unchanged():
    """Calls written as jax.nn's docstring describes them (``BTNH|TNH``, GQA, ``return_residual``,
    ``query_seq_lengths``), made per example under ``jax.vmap`` too, in float64: equal to jax.nn's; both with
    ``jax.debug_infs`` and ``jax.debug_nans`` on."""
    with jax.debug_infs(True), jax.debug_nans(True):
        _docstring_calls()


def _docstring_calls():
    q, k, v = _inputs()
    for attention in (jax.nn.dot_product_attention, mha_jax.dot_product_attention):
        assert attention(q, k, v).shape == (B, T, N, H)
    # per example: TNH inputs under jax.vmap
    per_example = [jax.vmap(lambda q, k, v, f=f: f(q, k, v, is_causal=True))(q, k, v)
                   for f in (jax.nn.dot_product_attention, mha_jax.dot_product_attention)]
    assert _error(per_example[1], per_example[0]) < JAX_NN
    assert _error(per_example[1], _oracle(q, k, v, is_causal=True)[0]) < ORACLE
    # the residual (logsumexp), BTN
    ours = mha_jax.dot_product_attention(q, k, v, return_residual=True)
    theirs = jax.nn.dot_product_attention(q, k, v, return_residual=True)
    assert all(_error(a, b) < JAX_NN for a, b in zip(ours, theirs))
    # padding queries: their rows 0
    lengths = jnp.asarray(Q_LENGTHS)
    ours = mha_jax.dot_product_attention(q, k, v, query_seq_lengths=lengths)
    theirs = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lengths)
    assert _error(ours, theirs) < JAX_NN
    for b, n in enumerate(Q_LENGTHS):
        assert (np.asarray(ours)[b, n:] == 0).all() and (np.asarray(theirs)[b, n:] == 0).all()
    # positional bias and mask, as jax.nn's order: query, key, value, bias, mask
    bias, mask = _bias((B, N, T, S)), _mask((B, N, T, S))
    assert _error(mha_jax.dot_product_attention(q, k, v, bias, mask),
                  jax.nn.dot_product_attention(q, k, v, bias, mask)) < JAX_NN


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unbatched_inputs_and_vmap(implementation):
    """``(T, N, H)`` inputs (masks and biases broadcasting to ``(N, T, S)``): one example, rank-3 results;
    under ``jax.vmap`` over the examples, the batched call's."""
    q, k, v = _inputs()
    bias, mask = _bias((N, T, S)), _mask((T, S))
    lengths = jnp.asarray(LENGTHS[:1])
    one = _ours(implementation, bias=bias, mask=mask, is_causal=True, key_value_seq_lengths=lengths,
                return_residual=True)(q[0], k[0], v[0])
    want = jax.nn.dot_product_attention(q[0], k[0], v[0], bias, mask, is_causal=True, key_value_seq_lengths=lengths,
                                        return_residual=True)
    assert one[0].shape == (T, N, H) and one[1].shape == (T, N)
    assert _error(one[0], want[0]) < JAX_NN and _error(one[1], want[1]) < JAX_NN
    mapped = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, bias, mask, is_causal=True,
                                                            implementation=implementation))(q, k, v)
    batched = dot_product_attention(q, k, v, bias[None], mask, is_causal=True, implementation=implementation)
    assert _error(mapped, batched) < ORACLE


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_vmap_over_a_per_example_bias_and_its_gradient(implementation):
    """A bias mapped with the examples (``in_axes=(0, 0, 0, 0, None)``, the mask shared): outputs and the
    gradients of query and bias equal jax.nn's mapped the same way."""
    q, k, v = _inputs()
    bias, mask = _bias((B, N, T, S)), _mask((1, T, S))
    cotangent = jnp.asarray(_rng(4).normal(size=(B, T, N, H)))

    def run(f):
        mapped = jax.vmap(f, in_axes=(0, 0, 0, 0, None))
        return jax.value_and_grad(lambda q, b: (mapped(q, k, v, b, mask) * cotangent).sum(), argnums=(0, 1))(q, bias)
    (ours, (dq, dbias)) = run(functools.partial(dot_product_attention, implementation=implementation))
    (theirs, (dq_nn, dbias_nn)) = run(jax.nn.dot_product_attention)
    assert _error(ours, theirs) < JAX_NN
    assert _error(dq, dq_nn) < 10 * JAX_NN and _error(dbias, dbias_nn) < 10 * JAX_NN


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_equal_jax_nn(implementation):
    """The gradient of query, key, value and bias (jax's testDotProductAttentionBiasGradient's subject), with
    every term of jax.nn's at once and padding queries (no gradient through them)."""
    q, k, v = _inputs()
    kwargs = dict(CASES["everything"][0])
    bias = kwargs.pop("bias")
    cotangent = jnp.asarray(_rng(3).normal(size=(B, T, N, H)))

    def loss(f, q, k, v, bias):
        return (f(q, k, v, bias, **kwargs) * cotangent).sum()
    ours = jax.grad(functools.partial(loss, functools.partial(dot_product_attention, implementation=implementation)),
                    argnums=(0, 1, 2, 3))(q, k, v, bias)
    theirs = jax.grad(functools.partial(loss, jax.nn.dot_product_attention), argnums=(0, 1, 2, 3))(q, k, v, bias)
    reference = jax.grad(functools.partial(loss, functools.partial(dot_product_attention, implementation="xla")),
                         argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, a, b, c in zip("qkvb", ours, theirs, reference):
        assert _error(a, b) < 10 * JAX_NN, name
        assert _error(a, c) < ORACLE, name
    dq = np.asarray(ours[0])
    for b, n in enumerate(Q_LENGTHS):
        assert (dq[b, n:] == 0).all()


# --- what jax.nn refuses, ours refuses (naming the argument) -------------------------------------------------

def _refused_cases():
    q, k, v = _inputs()
    return {
        "value_shape": (dict(query=q, key=k, value=v[:, :-1]), "value"),
        "head_dim": (dict(query=q[..., :-1], key=k, value=v), "head_dim"),
        "heads_not_multiple": (dict(query=q, key=k[:, :, :1].repeat(3, 2), value=v[:, :, :1].repeat(3, 2)), "heads"),
        "batch": (dict(query=q, key=k[:1], value=v[:1]), "batch"),
        "dtypes": (dict(query=q, key=k.astype(np.float32), value=v.astype(np.float32)), "dtype"),
        "rank_5": (dict(query=q[None], key=k[None], value=v[None]), r"rank 3 \(one example\) or 4"),
        "mask_rank_5": (dict(query=q, key=k, value=v, mask=jnp.ones((1, B, N, T, S), bool)), "mask"),
        "bias_rank_5": (dict(query=q, key=k, value=v, bias=jnp.ones((1, B, N, T, S))), "bias"),
        "mask_shape": (dict(query=q, key=k, value=v, mask=jnp.ones((B, N, T, S + 1), bool)), "mask"),
        "kv_lengths_shape": (dict(query=q, key=k, value=v, key_value_seq_lengths=jnp.ones(B + 1, np.int32)),
                             "key_value_seq_lengths"),
        "q_lengths_shape": (dict(query=q, key=k, value=v, query_seq_lengths=jnp.ones(B + 1, np.int32)),
                            "query_seq_lengths"),
        "implementation": (dict(query=q, key=k, value=v, implementation="foo"), "implementation"),
    }


def test_what_jax_nn_refuses_ours_refuses():
    cases = _refused_cases()
    for name, (kwargs, named) in cases.items():
        with pytest.raises((ValueError, TypeError)):  # jax.nn's: its own check, or broadcasting's
            jax.nn.dot_product_attention(**kwargs)
        with pytest.raises((ValueError, TypeError), match=named):
            dot_product_attention(**kwargs)
        assert name
    assert len(cases) == 12


# --- deliberate differences, each named ----------------------------------------------------------------------

DIFFERENCES = (
    "fully_masked_row_gives_zero", "float64_computed_in_float64", "mask_of_any_dtype", "lengths_of_any_int_dtype",
    "lengths_out_of_range_refused", "rank_2_and_mixed_ranks_refused", "value_head_dim_may_differ",
    "float16_residual_of_no_key_finite",
)


def test_difference_fully_masked_row_gives_zero():
    """A query with no key: ours 0 (output and gradient), jax.nn's the mean of the values."""
    q, k, v = _inputs()
    mask = np.ones((B, N, T, S), bool)
    mask[:, :, 3] = False
    for implementation in IMPLEMENTATIONS:
        ours = dot_product_attention(q, k, v, mask=jnp.asarray(mask), implementation=implementation)
        assert (np.asarray(ours)[:, 3] == 0).all()
    theirs = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask))
    groups = N // K
    mean = np.repeat(np.asarray(v).mean(axis=1), groups, axis=1)  # (B, N, H)
    assert _error(np.asarray(theirs)[:, 3], mean) < JAX_NN


def test_difference_float64_computed_in_float64():
    """Float64 inputs: ours computed in float64 (the oracle's to 1e-12), jax.nn's softmax in float32."""
    q, k, v = _inputs()
    kwargs = CASES["everything"][0]
    oracle = _oracle(q, k, v, **kwargs)[0]
    assert _error(dot_product_attention(q, k, v, **kwargs), oracle) < ORACLE
    assert _error(jax.nn.dot_product_attention(q, k, v, **kwargs), oracle) > 1e3 * ORACLE


def test_difference_mask_of_any_dtype():
    """A mask of any dtype, nonzero = attend (flax's float 0/1 masks): jax.nn takes bool only."""
    q, k, v = _inputs()
    mask = _mask((B, N, T, S))
    with pytest.raises(ValueError, match="mask dtype"):
        jax.nn.dot_product_attention(q, k, v, mask=mask.astype(np.float32))
    for dtype in (np.float32, np.int32):
        assert _error(dot_product_attention(q, k, v, mask=mask.astype(dtype)), _oracle(q, k, v, mask=mask)[0]) < ORACLE


def test_difference_lengths_of_any_int_dtype():
    """Lengths of any integer dtype (under x64 ``jnp.asarray([3, 4])`` is int64): jax.nn takes int32 only."""
    q, k, v = _inputs()
    lengths = jnp.asarray(LENGTHS.astype(np.int64))
    with pytest.raises(ValueError, match="int32"):
        jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
    want = _oracle(q, k, v, key_value_seq_lengths=LENGTHS, query_seq_lengths=Q_LENGTHS)[0]
    got = dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                query_seq_lengths=jnp.asarray(Q_LENGTHS, np.int64))
    assert _error(got, want) < ORACLE


def test_difference_lengths_out_of_range_refused():
    """Lengths outside [0, len] (where their values are known): ours refuses, jax.nn runs."""
    q, k, v = _inputs()
    for name, length in (("key_value_seq_lengths", S), ("query_seq_lengths", T)):
        lengths = jnp.asarray([1, length + 1], np.int32)
        jax.nn.dot_product_attention(q, k, v, **{name: lengths})
        with pytest.raises(ValueError, match=f"{name} must lie in"):
            dot_product_attention(q, k, v, **{name: lengths})


def test_difference_rank_2_and_mixed_ranks_refused():
    """jax.nn reads a rank-2 query ``(T, H)`` as ``(1, 1, T, H)`` (T heads of one query) and mixes a rank-3 query
    with rank-4 keys of batch 1; ours refuses both, naming the ranks."""
    q, k, v = _inputs()
    assert jax.nn.dot_product_attention(q[0, :, 0], k[0, :, 0], v[0, :, 0]).shape == (T, H)
    assert jax.nn.dot_product_attention(q[0], k[:1], v[:1]).shape == (T, N, H)
    with pytest.raises(ValueError, match=r"query must have rank 3 \(one example\) or 4"):
        dot_product_attention(q[0, :, 0], k[0, :, 0], v[0, :, 0])
    with pytest.raises(ValueError, match="all have rank 4 or all rank 3"):
        dot_product_attention(q[0], k[:1], v[:1])


def test_difference_value_head_dim_may_differ():
    """A value head dim apart from the key's (multi-head latent attention): jax.nn refuses it."""
    q, k, v = _inputs()
    v = jnp.concatenate([v, v], axis=-1)
    with pytest.raises(ValueError, match="value shape"):
        jax.nn.dot_product_attention(q, k, v)
    assert _error(dot_product_attention(q, k, v), _oracle(q, k, v)[0]) < ORACLE


def test_difference_float16_residual_of_no_key_finite():
    """A padding query's residual in float16: ours float16's lowest finite, jax.nn's overflows to -inf."""
    q, k, v = (x.astype(np.float16) for x in _inputs())
    lengths = jnp.asarray(Q_LENGTHS)
    ours = dot_product_attention(q, k, v, query_seq_lengths=lengths, return_residual=True)[1]
    theirs = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lengths, return_residual=True)[1]
    assert np.isneginf(np.asarray(theirs)[0, Q_LENGTHS[0]:]).all()
    assert (np.asarray(ours)[0, Q_LENGTHS[0]:] == np.finfo(np.float16).min).all()


def test_every_difference_is_a_named_test():
    names = {name[len("test_difference_"):] for name in globals() if name.startswith("test_difference_")}
    assert names == set(DIFFERENCES)


# --- no inf, no NaN inside any path ---------------------------------------------------------------------------

def _forms():
    """Every masking form of ours, with the implementations of ours that take it."""
    lengths, q_lengths = jnp.asarray([0, 11], np.int32), jnp.asarray(Q_LENGTHS)  # row 0: no key at all
    segments = jnp.asarray(np.repeat(np.arange(4), 4)[None])
    fully = np.ones((B, N, T, S), bool)
    fully[:, :, 3] = False
    every, kernel = IMPLEMENTATIONS, IMPLEMENTATIONS + ("splash",)
    return {
        "causal": (dict(is_causal=True), kernel),
        "window": (dict(local_window_size=(3, 1)), kernel),
        "window_band": (dict(local_window_size=(3, 0), is_causal=True), kernel),  # blockwise: bands
        "segments": (dict(query_segment_ids=segments, key_segment_ids=segments), kernel),
        "lengths_empty_row": (dict(key_value_seq_lengths=lengths, query_seq_lengths=q_lengths), kernel),
        "chunks": (dict(is_causal=True, attention_chunk_size=4), kernel),
        "mask_fully_masked_row": (dict(mask=jnp.asarray(fully)), every),
        "bias_and_mask": (dict(bias=_bias((B, N, T, S)), mask=_mask((B, 1, T, S))), every),
        "sinks_empty_row": (dict(sinks=jnp.ones(N), key_value_seq_lengths=lengths, is_causal=True), kernel),
        "soft_cap": (dict(logit_soft_cap=2.0, mask=jnp.asarray(fully)), every),
        "alibi": (dict(alibi_slopes=jnp.linspace(0.1, 1.0, N), is_causal=True,
                       key_value_seq_lengths=lengths), every),
        "bias_floor": (dict(bias=jnp.full((T, S), np.finfo(np.float32).min, np.float32).astype(np.float64)), every),
    }


def _checked(f, *args):
    """``f(*args)`` with every primitive's output checked for inf and NaN (``disable_jit``: loops' bodies too)."""
    with jax.debug_infs(True), jax.debug_nans(True), jax.disable_jit():
        return f(*args)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ("splash",))
def test_no_inf_or_nan_in_any_path(implementation):
    q, k, v = (x.astype(np.float32) for x in _inputs())
    ran = []
    for name, (kwargs, implementations) in _forms().items():
        if implementation not in implementations:
            continue
        kwargs = {n: x.astype(np.float32) if hasattr(x, "dtype") and x.dtype == np.float64 else x
                  for n, x in kwargs.items()}

        def loss(q, k, v, kwargs=kwargs):
            return dot_product_attention(q, k, v, implementation=implementation, **kwargs).sum()
        _checked(loss, q, k, v)
        _checked(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
        ran.append(name)
    assert len(ran) >= 7


def test_the_check_catches_an_inf():
    """``_checked`` trips on an inf formed inside (here, jax.nn's own softmax under ``disable_jit``)."""
    q, k, v = (x.astype(np.float32) for x in _inputs())
    with pytest.raises(FloatingPointError):
        _checked(functools.partial(jax.nn.dot_product_attention, is_causal=True), q, k, v)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_finite_bias_excludes_no_key(implementation):
    """A row whose bias is float32's lowest finite everywhere (an additive mask, as transformers makes them)
    still attends: the mean of the values, as in jax.nn; only a mask or ``-inf`` excludes a key."""
    q, k, v = (x.astype(np.float32) for x in _inputs())
    bias = np.zeros((T, S), np.float32)
    bias[5] = np.finfo(np.float32).min
    got = dot_product_attention(q, k, v, bias=jnp.asarray(bias), implementation=implementation)
    want = jax.nn.dot_product_attention(q, k, v, bias=jnp.asarray(bias))
    assert _error(got, want) < 1e-5
    assert _error(np.asarray(got)[:, 5], np.repeat(np.asarray(v).mean(axis=1), N // K, axis=1)) < 1e-5


def test_user_inf_bias_trips_as_in_jax_nn():
    """A user's ``-inf`` in a bias is theirs: it excludes the key, and ``jax.debug_infs`` trips on it (jax.nn's
    too: the array holding it is checked when it reaches JAX)."""
    q, k, v = (x.astype(np.float32) for x in _inputs())
    bias = np.zeros((T, S), np.float32)
    bias[:, 2] = -np.inf
    got = dot_product_attention(q, k, v, bias=jnp.asarray(bias))
    assert _error(got, _oracle(q, k, v, mask=np.isfinite(bias))[0]) < 1e-6
    for attention in (jax.nn.dot_product_attention, dot_product_attention):
        with jax.debug_infs(True), pytest.raises(FloatingPointError):
            attention(q, k, v, bias=bias)


# --- ring attention (8 devices) ------------------------------------------------------------------------------

@needs_8
def test_sequence_axis_cases_equal_jax_nn_and_no_inf():
    """The ring (``sequence_axis`` over 8 devices): jax.nn's cases, and no inf or NaN in its outputs and
    gradients under ``jax.debug_infs``/``jax.debug_nans`` (eager: the ring is one program, checked whole)."""
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    q, k, v = _inputs()
    with jax.set_mesh(mesh):
        for name in ("query_seq_lengths", "everything"):
            kwargs = CASES[name][0]
            got = dot_product_attention(q, k, v, sequence_axis="seq", **kwargs)
            assert _error(got, _jax_nn(name, "float64")) < JAX_NN, name
            assert _error(got, _oracle(q, k, v, **kwargs)[0]) < ORACLE, name
        q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
        forms = _forms()
        for name in ("lengths_empty_row", "mask_fully_masked_row", "sinks_empty_row"):
            kwargs = {n: x.astype(np.float32) if hasattr(x, "dtype") and x.dtype == np.float64 else x
                      for n, x in forms[name][0].items()}

            def loss(q, k, v, kwargs=kwargs):
                return dot_product_attention(q, k, v, sequence_axis="seq", **kwargs).sum()
            with jax.debug_infs(True), jax.debug_nans(True):
                loss(q32, k32, v32)
                jax.grad(loss, argnums=(0, 1, 2))(q32, k32, v32)


# --- decoding with is_causal: flax #5591 ----------------------------------------------------------------------

def test_decode_step_sees_every_cached_key_with_is_causal():
    """A decoding step at position t with ``is_causal=True`` sees keys 0..t: ours equals the full causal pass.
    flax's nnx.MultiHeadAttention applies ``is_causal`` to the (1, max_length) step as if the token were at 0:
    it sees key 0 only, unlike its own full pass."""
    features, length = 8, 6
    x = jnp.asarray(_rng(4).normal(size=(1, length, features)), jnp.float32)
    ours = mha_jax.MultiHeadAttention(2, features, rngs=nnx.Rngs(0))
    full = ours(x, is_causal=True)
    ours.init_cache((1, length, features), jnp.float32)
    steps = jnp.concatenate([ours(x[:, t:t + 1], decode=True, is_causal=True) for t in range(length)], axis=1)
    assert _error(steps, full) < 1e-6

    flax = nnx.MultiHeadAttention(2, features, decode=False, rngs=nnx.Rngs(0))
    flax_full = flax(x, mask=nnx.make_causal_mask(jnp.ones((1, length))))
    flax.init_cache((1, length, features), jnp.float32)
    flax_steps = jnp.concatenate([flax(x[:, t:t + 1], decode=True, is_causal=True) for t in range(length)], axis=1)
    assert _error(flax_steps[:, 0], flax_full[:, 0]) < 1e-6  # step 0: key 0 is all there is
    assert _error(flax_steps[:, 1:], flax_full[:, 1:]) > 1e-2  # later steps: key 0 alone, not keys 0..t

