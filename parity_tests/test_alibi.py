"""ALiBi (``alibi_slopes``): each head adds ``-slope * |q_pos - k_pos|`` to its logits.

The slopes against transformers' own functions (bloom's ``_get_alibi_slopes``, MPT's
``build_mpt_alibi_tensor``) for 1..40 heads; the term against transformers' bloom and MPT
biases (under causality they differ by a constant per query row, which softmax ignores; bloom's
positions with left padding come from the mask's cumsum); every implementation of both cores
(JAX ``"xla"``, ``"blockwise"`` over many small blocks, the band of a window at default
positions; PyTorch ``"math"``, ``"sdpa"``) against a float64 NumPy oracle whose bias is formed
here, forward and gradients; the modules' option (nnx, linen, torch) against the oracle of
their weights, in decoding (token by token, ragged rows), across frameworks; refusals and bad
input; on 8 devices the ring and sharded heads.

One core shape throughout (that of ``test_softcap_sinks.py``), grouped heads, several query
and key blocks and a padded last block of each.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from mha_jax import testing
from mha_spec import alibi
from parity_tests import cores
from parity_tests.conftest import X64
from parity_tests.test_decode import padded_prompts
from parity_tests.tool import arrays, harness, oracle

B, H, HK, Q, K, D = 2, 4, 2, 7, 9, 8
TOLERANCES = {"float64": 1e-12, "float32": 1e-6}
QUERY_POSITIONS = np.array([[2, 3, 4, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9, 10]])  # a chunk over keys at arange
LENGTHS = np.array([K, 6])
# name -> the call's terms (slopes: "heads" (H,), "batch" (B, H)), and whether a learned bias joins them
CASES = {
    "causal": (dict(is_causal=True), "heads", False),
    "positions+window+lengths+bias": (
        dict(is_causal=True, terms=dict(query_positions=QUERY_POSITIONS, local_window_size=(4, 0),
                                        key_value_seq_lengths=LENGTHS)), "batch", True),
    "band": (dict(is_causal=True, terms=dict(local_window_size=(3, 0))), "heads", False),
    "bidirectional": (dict(), "batch", False),
}
needs_x64 = pytest.mark.skipif(not X64, reason="float64 needs jax_enable_x64")


@pytest.fixture(autouse=True)
def tiny_blocks():
    """Blockwise forward blocks of 4 queries x 3 keys, backward blocks of 2 x 4."""
    with testing.tuned(blocks=(4, 3), backward_blocks=(2, 4)):
        yield


def _alibi_bias(slopes, query_positions, key_positions) -> np.ndarray:
    """The oracle's ALiBi term ``(batch|1, heads, q, k)``, formed here in float64."""
    slopes = np.asarray(slopes, np.float64).reshape(-1, np.shape(slopes)[-1])
    distance = np.abs(np.asarray(query_positions)[:, None, :, None] - np.asarray(key_positions)[:, None, None, :])
    return -slopes[:, :, None, None] * distance


# --- the slopes --------------------------------------------------------------------------------

def _scalar_pow(base: float, exponent: int) -> float:
    """torch's float32 ``pow`` of one element (correctly rounded here, unlike its vectorised loop)."""
    return torch.pow(torch.tensor(base, dtype=torch.float32), torch.tensor(exponent, dtype=torch.int32)).item()


def _same_or_one_ulp_off(ours, theirs, correctly_rounded):
    """Equal, except where transformers' vectorised float32 pow is one ulp from the correctly rounded
    power (this CPU's SIMD loop): there ours is the correctly rounded one."""
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    for i in np.flatnonzero(ours != theirs):
        assert np.abs(np.float64(ours[i]) - theirs[i]) <= np.spacing(theirs[i]), (i, ours[i], theirs[i])
        assert ours[i] == np.float32(correctly_rounded(i)), (i, ours[i])
    return int(np.sum(ours != theirs))


def test_bloom_slopes_are_transformers_for_1_to_40_heads():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    off = 0
    for n in range(1, 41):
        theirs = _get_alibi_slopes(n, torch.device("cpu")).numpy()
        ours = alibi.bloom_slopes(n)
        assert len(ours) == n and all(isinstance(s, float) for s in ours)
        power = 2 ** math.floor(math.log2(n))

        def rounded(i, n=n, power=power):  # head i's slope as float32 pow of one element gives it
            base, e = (2 ** (-8 / power), i + 1) if i < power else (2 ** (-4 / power), 2 * (i - power) + 1)
            return _scalar_pow(base, e)

        off += _same_or_one_ulp_off(ours, theirs, rounded)
    assert off <= 9  # at most one slope of a head count, from 32 heads on (2 ** -0.25 to the 15th)


def test_mpt_slopes_are_transformers_for_1_to_40_heads():
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    for bias_max in (8, 6.0, 12.5):
        off = 0
        for n in range(1, 41):
            theirs = -build_mpt_alibi_tensor(n, 2, bias_max)[:, 0, 0].numpy()  # position -1 of 2: -slope
            ours = alibi.mpt_slopes(n, bias_max)
            assert len(ours) == n
            power = 2 ** math.ceil(math.log2(n))
            order = (list(range(1, power, 2)) + list(range(0, power, 2)))[:n] if power != n else list(range(n))
            step = np.float32(bias_max / power)

            def rounded(i, order=order, step=step):
                return np.float32(1.0) / np.float32(2.0 ** np.float64(np.float32(order[i] + 1) * step))

            off += _same_or_one_ulp_off(ours, theirs, rounded)
        assert off == 0 if bias_max == 8 else off <= 40, (bias_max, off)


def test_bad_head_counts_and_module_slopes_fail_by_name():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_heads must be a positive integer"):
            alibi.bloom_slopes(bad)
    with pytest.raises(ValueError, match=r"alibi_slopes must hold num_heads=4 finite numbers, one per query head, "
                                         r"got 3"):
        mha_torch.MultiHeadAttention(16, 4, alibi_slopes=(0.5, 0.25, 0.125))
    with pytest.raises(ValueError, match="alibi_slopes must hold num_heads=4 finite numbers"):
        mha_jax.MultiHeadAttention(4, 16, alibi_slopes=(0.5, 0.25, math.inf, 1.0), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="alibi_slopes must be a sequence of num_heads=4 numbers or None"):
        mha_torch.MultiHeadAttention(16, 4, alibi_slopes="slopes")


# --- the term against transformers' biases ------------------------------------------------------

def _softmax_attention(q, k, v, bias, allowed):
    """float64 PyTorch: transformers' eager attention, ``softmax(q k^T / sqrt(d) + bias)`` over the
    allowed keys."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
    return weights @ v


def _heads_inputs(seed: int = 0, length: int = K):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.normal(size=(B, H, length, D))) for _ in range(3)]


@needs_x64
def test_bloom_alibi_with_left_padding_is_our_term_at_the_masks_positions():
    """bloom's ``slope * k_pos``, positions from the mask's cumsum, equals ours at those positions."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    q, k, v = _heads_inputs()
    valid = torch.from_numpy(np.arange(K)[None] >= np.array([[0], [3]]))  # row 1 left-padded by 3
    theirs_bias = build_alibi_tensor(valid.long(), H, torch.float64).reshape(B, H, 1, K)
    causal = torch.ones(K, K, dtype=torch.bool).tril()
    allowed = causal & valid[:, None, None, :]
    want = _softmax_attention(q, k, v, theirs_bias, allowed)[:, :, 3:]  # padding queries aside
    positions = (valid.long().cumsum(-1) - 1) * valid.long()
    slopes = torch.tensor(alibi.bloom_slopes(H), dtype=torch.float64)
    got_t = mha_torch.dot_product_attention(q, k, v, is_causal=True, mask=valid[:, None, None, :],
                                            query_positions=positions, key_positions=positions, alibi_slopes=slopes)
    got_j = mha_jax.dot_product_attention(*(jnp.asarray(x.numpy().transpose(0, 2, 1, 3)) for x in (q, k, v)),
                                          is_causal=True, mask=jnp.asarray(valid.numpy())[:, None, None, :],
                                          query_positions=positions.numpy(), key_positions=positions.numpy(),
                                          alibi_slopes=jnp.asarray(slopes.numpy()), implementation="blockwise")
    assert max(harness.errors(got_t[:, :, 3:].numpy(), want.numpy())) <= 1e-12
    assert max(harness.errors(np.asarray(got_j).transpose(0, 2, 1, 3)[:, :, 3:], want.numpy())) <= 1e-12
    no_alibi = _softmax_attention(q, k, v, torch.zeros(()), allowed)[:, :, 3:]
    assert max(harness.errors(no_alibi.numpy(), want.numpy())) > 1e-2  # the term matters here


@needs_x64
def test_mpt_alibi_is_our_term_under_causality():
    """MPT's ``slope * (k_pos - (K - 1))`` over the last ``Q`` queries of ``K`` keys equals ours."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    q, k, v = _heads_inputs(1)
    q = q[:, :, K - Q:]
    theirs_bias = build_mpt_alibi_tensor(H, K, 8).to(torch.float64)[None]  # (1, H, 1, K)
    allowed = torch.ones(Q, K, dtype=torch.bool).tril(K - Q)
    want = _softmax_attention(q, k, v, theirs_bias, allowed)
    slopes = torch.tensor(alibi.mpt_slopes(H), dtype=torch.float64)
    positions = torch.arange(K - Q, K)
    for implementation in ("math", "sdpa"):
        got = mha_torch.dot_product_attention(q, k, v, is_causal=True, query_positions=positions,
                                              alibi_slopes=slopes, implementation=implementation)
        assert max(harness.errors(got.numpy(), want.numpy())) <= 1e-12, implementation


# --- every implementation against the oracle ----------------------------------------------------

def _inputs(dtype: str, slopes_kind: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    drawn = dict(q=rng.normal(size=(B, H, Q, D)) * 1.4, k=rng.normal(size=(B, HK, K, D)) * 1.4,
                 v=rng.normal(size=(B, HK, K, D)), d_out=rng.normal(size=(B, H, Q, D)),
                 bias=rng.normal(size=(1, H, Q, K)) * 0.5,
                 slopes=rng.uniform(0.05, 0.8, size=(H,) if slopes_kind == "heads" else (B, H)))
    return {name: arrays.rounded(x, dtype) for name, x in drawn.items()}


def _oracle(case: str, x: dict) -> dict:
    call, _, learned = CASES[case]
    terms = call.get("terms", {})
    qp = terms.get("query_positions", np.arange(Q)[None])
    bias = _alibi_bias(x["slopes"], qp, np.arange(K)[None])
    att = oracle.Attention(bias=bias + x["bias"] if learned else bias, is_causal=call.get("is_causal", False),
                           query_positions=terms.get("query_positions"), window=terms.get("local_window_size"),
                           lengths=terms.get("key_value_seq_lengths"))
    out, weights, cache = oracle.attention(x["q"], x["k"], x["v"], att)
    g = oracle.attention_grads(cache, x["d_out"])
    return {"out": out, "weights": weights, "grads": (g["query"], g["key"], g["value"]),
            "d_bias": g["logits"].sum(axis=0, keepdims=True) if learned else None}


def _run(framework: str, implementation: str, case: str, x: dict, dtype: str) -> dict:
    call, _, learned = CASES[case]
    terms = dict(call.get("terms", {}), alibi_slopes=x["slopes"])
    return cores.run_core(framework, x["q"], x["k"], x["v"], x["d_out"], dtype=dtype, implementation=implementation,
                          is_causal=call.get("is_causal", False), bias=x["bias"] if learned else None, terms=terms)


def _worst(got: dict, want: dict) -> float:
    pairs = [(got["out"], want["out"])] + list(zip(got["grads"], want["grads"]))
    pairs += [(got[n], want[n]) for n in ("weights", "d_bias") if got[n] is not None and want[n] is not None]
    return max(max(harness.errors(a, b)) for a, b in pairs)


@pytest.mark.parametrize("case, dtype", [("causal", "float64"), ("causal", "float32"),
                                         ("positions+window+lengths+bias", "float64"),
                                         ("positions+window+lengths+bias", "float32"), ("band", "float64"),
                                         ("bidirectional", "float32")])
def test_every_implementation_matches_the_oracle(case, dtype):
    if dtype == "float64" and not X64:
        pytest.skip("float64 needs jax_enable_x64")
    x = _inputs(dtype, CASES[case][1])
    want = _oracle(case, x)
    plain = _oracle(case, dict(x, slopes=np.zeros_like(x["slopes"])))
    assert max(harness.errors(plain["out"], want["out"])) > 1e-2  # the term matters here
    for framework, implementation in (("jax", "xla"), ("jax", "blockwise"), ("torch", "math"), ("torch", "sdpa")):
        worst = _worst(_run(framework, implementation, case, x, dtype), want)
        assert worst <= TOLERANCES[dtype], (framework, implementation, worst)


def test_a_window_at_default_positions_runs_as_bands_with_the_term():
    """The band reads the term on positions relative to each band's first query."""
    x = _inputs("float32", "heads", seed=3)
    q, k, v = (jnp.asarray(x[n].transpose(0, 2, 1, 3)) for n in ("q", "k", "v"))
    with testing.observed() as seen:
        got = mha_jax.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0),
                                            implementation="blockwise", alibi_slopes=jnp.asarray(x["slopes"]))
    assert "band" in [event for event, _ in seen]
    want = _oracle("band", x)["out"].transpose(0, 2, 1, 3)
    assert max(harness.errors(np.asarray(got), want)) <= TOLERANCES["float32"]


def test_the_slopes_get_no_gradient_and_refusals_name_the_argument():
    x = _inputs("float32", "heads")
    q, k, v = (jnp.asarray(x[n].transpose(0, 2, 1, 3)) for n in ("q", "k", "v"))
    for implementation in ("xla", "blockwise"):
        grad = jax.grad(lambda s, i=implementation: mha_jax.dot_product_attention(
            q, k, v, alibi_slopes=s, implementation=i).sum())(jnp.asarray(x["slopes"]))
        assert not np.any(np.asarray(grad))
    slopes = torch.from_numpy(x["slopes"]).requires_grad_(True)
    out = mha_torch.dot_product_attention(*(torch.from_numpy(x[n]) for n in ("q", "k", "v")), alibi_slopes=slopes)
    assert not out.requires_grad
    with pytest.raises(ValueError, match=r"implementation='splash' does not take alibi_slopes; use 'xla' or "
                                         r"'blockwise'"):
        mha_jax.dot_product_attention(q, k, v, alibi_slopes=jnp.asarray(x["slopes"]), implementation="splash")


@pytest.mark.parametrize("bad, error, message", [
    (np.ones(3), ValueError, r"alibi_slopes must have shape \(heads,\) = \(4,\) or \(batch, heads\) = \(2, 4\), one "
                             r"slope per query head, got \(3,\)"),
    (np.ones((1, 4, 1)), ValueError, r"alibi_slopes must have shape .* got \(1, 4, 1\)"),
    (np.ones((2, 4), np.int32), TypeError, r"alibi_slopes must be a real floating-point array, got dtype int32 with "
                                           r"shape \(2, 4\)"),
])
def test_bad_slopes_fail_alike_in_both_twins(bad, error, message):
    x = _inputs("float32", "heads")
    with pytest.raises(error, match=message):
        mha_jax.dot_product_attention(*(jnp.asarray(x[n].transpose(0, 2, 1, 3)) for n in ("q", "k", "v")),
                                      alibi_slopes=jnp.asarray(bad))
    with pytest.raises(error, match=message):
        mha_torch.dot_product_attention(*(torch.from_numpy(x[n]) for n in ("q", "k", "v")),
                                        alibi_slopes=torch.from_numpy(bad))


# --- the modules' option ------------------------------------------------------------------------

E, T = 16, 10
SLOPES = alibi.bloom_slopes(H)


@functools.cache
def _modules(dtype: str):
    """Our nnx module with ALiBi, its torch twin (weights through ``to_torch``/``load_weights``), its
    state dict and the inputs ``(B, T, E)``."""
    layer = mha_jax.MultiHeadAttention(H, E, num_kv_heads=HK, param_dtype=jnp.dtype(dtype), alibi_slopes=SLOPES,
                                       rngs=nnx.Rngs(0))
    state = mha_jax.to_torch(layer)
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=HK, alibi_slopes=SLOPES, dtype=getattr(torch, dtype))
    mha_torch.load_weights(twin, state)
    x = np.random.default_rng(5).normal(size=(B, T, E)).astype(dtype)
    return layer, twin.eval(), state, x


def _module_oracle(state, x, slopes=SLOPES) -> np.ndarray:
    """The float64 oracle of the module's weights, causal, ALiBi at default positions."""
    positions = np.arange(x.shape[1])[None]
    att = oracle.Attention(is_causal=True, bias=_alibi_bias(slopes, positions, positions))
    params = {n: np.asarray(p, np.float64) for n, p in state.items()}
    return oracle.mha(params, *(np.asarray(x, np.float64),) * 3, att, num_heads=H, num_kv_heads=HK)["out"]


@nnx.jit
def _step(layer, x):
    return layer(x, decode=True, is_causal=True)


def _decode_jax(layer, x, chunks):
    layer.init_cache((B, T, E), x.dtype)
    outs, t = [], 0
    for n in chunks:
        outs.append(_step(layer, x[:, t:t + n]))
        t += n
    return np.concatenate(outs, axis=1)


def _decode_torch(twin, x, chunks):
    cache = mha_torch.KVCache(B, T, HK, E // H, dtype=x.dtype)
    outs, t = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(twin(x[:, t:t + n], cache=cache, is_causal=True).numpy())
            t += n
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_modules_apply_the_slopes_at_the_call_and_in_decoding(dtype):
    """float64: nnx (xla, blockwise, decoding), linen, torch (the call, decoding); float32: the calls."""
    if dtype == "float64" and not X64:
        pytest.skip("float64 needs jax_enable_x64")
    layer, twin, state, x = _modules(dtype)
    want = _module_oracle(state, x)
    xj, xt = jnp.asarray(x), torch.from_numpy(x)
    with torch.no_grad():
        results = {"nnx": layer(xj, is_causal=True), "torch": twin(xt, is_causal=True).numpy()}
    if dtype == "float64":
        blockwise = nnx.clone(layer)
        blockwise.implementation = "blockwise"
        results["nnx blockwise"] = blockwise(xj, is_causal=True)
        flax_fn = nnx.clone(layer)  # the term reaches a flax attention_fn as a dense bias
        flax_fn.attention_fn = nnx.dot_product_attention
        results["nnx attention_fn"] = flax_fn(xj, is_causal=True)
        chunks = [4, 1, 1, 4]  # steps of one token and of several
        results["nnx decoding"] = _decode_jax(layer, xj, chunks)
        results["torch decoding"] = _decode_torch(twin, xt, chunks)
        params = {"params": {n: nnx.to_pure_dict(nnx.state(getattr(layer, n), nnx.Param))
                             for n in ("query", "key", "value", "out")}}
        lin = mha_jax.linen.MultiHeadDotProductAttention(H, num_kv_heads=HK, alibi_slopes=SLOPES,
                                                         param_dtype=jnp.float64)
        results["linen"] = lin.apply(params, xj, xj, is_causal=True)
    for name, got in results.items():  # flax's own function is not float64-exact (as without the term)
        tolerance = TOLERANCES["float32" if name == "nnx attention_fn" else dtype]
        assert max(harness.errors(np.asarray(got, np.float64), want)) <= tolerance, name
    plain = _module_oracle(state, x, slopes=np.zeros(H))
    assert max(harness.errors(plain, want)) > 1e-2  # the term matters here


@needs_x64
def test_ragged_rows_decode_at_their_own_positions_in_both_twins():
    """Left-padded prompts (6 and 3 real tokens) prefilled at their positions, then 3 tokens each:
    each row as the oracle of that row alone."""
    layer, twin, state, x = _modules("float64")
    lengths = np.array([6, 3])
    prompts, real, pos = padded_prompts(x, lengths, 6)
    layer.init_cache((B, T, E), jnp.float64)
    cache = mha_torch.KVCache(B, T, HK, E // H, dtype=torch.float64)
    out_j = [np.asarray(layer(jnp.asarray(prompts), decode=True, is_causal=True, query_positions=jnp.asarray(pos)))]
    with torch.no_grad():
        out_t = [twin(torch.from_numpy(prompts), cache=cache, is_causal=True, query_positions=torch.from_numpy(pos))]
        for i in range(3):
            out_j.append(np.asarray(layer(jnp.asarray(x[:, 6 + i:7 + i]), decode=True, is_causal=True)))
            out_t.append(twin(torch.from_numpy(x[:, 6 + i:7 + i]), cache=cache, is_causal=True))
    out_t = [o.numpy() for o in out_t]
    for b, n in enumerate(lengths):
        alone = np.concatenate([x[b:b + 1, :n], x[b:b + 1, 6:9]], axis=1)
        want = _module_oracle(state, alone)[0]
        for outs in (out_j, out_t):
            got = np.concatenate([outs[0][b, real[b]]] + [o[b] for o in outs[1:]])
            assert max(harness.errors(got, want)) <= 1e-12, b


def test_torch_nn_multihead_attention_cannot_hold_the_option():
    with pytest.raises(ValueError, match=r"alibi_slopes is set \(it has no ALiBi\)"):
        mha_torch.to_torch_mha(mha_torch.MultiHeadAttention(16, 4, alibi_slopes=SLOPES))


# --- 8 devices: the ring and sharded heads --------------------------------------------------------

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS="
                             "--xla_force_host_platform_device_count=8)")
L = 32


@needs_8
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_ring_and_sharded_heads_take_the_term(dtype):
    """Ring attention over 4 devices beside heads over 2, and the blockwise core with its heads sharded
    over 8 / its batch over 2 (Explicit axes), against one device: forward and gradients."""
    if dtype == "float64" and not X64:
        pytest.skip("float64 needs jax_enable_x64")
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.normal(size=(2, L, 8, D)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(2, L, 8, D)), dtype) for _ in range(2))
    slopes = jnp.asarray(alibi.bloom_slopes(8), dtype)
    positions = np.arange(L)[None] + np.array([[0], [5]])

    def f(q, k, v, **kw):
        out = mha_jax.dot_product_attention(q, k, v, is_causal=True, query_positions=positions,
                                            key_positions=positions, alibi_slopes=slopes, **kw)
        return (out * jnp.cos(out)).sum()

    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
    mesh = jax.make_mesh((2, 4), ("heads", "seq"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, P(None, "seq", "heads")) for x in (q, k, v)]
        ring = jax.jit(jax.value_and_grad(functools.partial(f, sequence_axis="seq"), argnums=(0, 1, 2)))(*args)
    mesh = jax.make_mesh((8,), ("heads",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        args = [jax.device_put(x, P(None, None, "heads")) for x in (q, k, v)]
        heads = jax.jit(jax.value_and_grad(functools.partial(f, implementation="blockwise"), argnums=(0, 1, 2)))(*args)
    for got in (ring, heads):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.abs(a - b).max() / np.abs(b).max() <= TOLERANCES[dtype]


@needs_8
def test_a_module_with_sharded_heads_takes_the_option():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    layer, _, state, x = _modules("float32")
    mesh = jax.make_mesh((2, 4), ("heads", "rest"), axis_types=(AxisType.Explicit,) * 2)  # HK = 2 heads
    with jax.set_mesh(mesh):
        sharded = nnx.clone(layer)
        sharded.implementation = "blockwise"
        xs = jax.device_put(jnp.asarray(x), P())
        got = nnx.jit(lambda m, x: m(x, is_causal=True, qkv_sharding=P(None, None, "heads", None)))(sharded, xs)
    assert max(harness.errors(np.asarray(got, np.float64), _module_oracle(state, x))) <= TOLERANCES["float32"]
