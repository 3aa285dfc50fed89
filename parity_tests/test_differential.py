"""Differential tests: drawn calls of ``mha_jax.dot_product_attention`` through every
implementation that runs on this CPU (``"xla"``, ``"blockwise"``, the TPU kernel ``"splash"`` in
Pallas interpret mode, the ring over 2 devices where there are 2) and of ``mha_torch``'s core, and
drawn decodings through each layer's cache (the nnx module's and ``mha_torch``'s, token by token,
in chunks, all at once), each against the float64 oracle: outputs, and the gradients of the
query, key, value and sinks. An implementation that cannot express a call must refuse it by name.

The draws come from small fixed sets of shapes (``strategies.calls``, ``strategies.decodings``):
each new shape compiles anew. Named tests pin the calls on which a one-line slip in a kernel's
reachability or key lengths shows, whatever Hypothesis draws.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from jax.sharding import PartitionSpec as P

import mha_jax
import mha_torch
from parity_tests import cores, strategies
from parity_tests.conftest import X64
from parity_tests.strategies import Call, Decoding
from parity_tests.tool import harness

FWD_TOL, GRAD_TOL = harness.TOLERANCES["float32"]
RING_DEVICES = 2


def _splash_refusal(call: Call) -> str | None:
    """What the TPU kernel is documented to refuse of ``call`` (its name in the message), else None."""
    if call.dropout:
        return "dropout"
    if call.chunk and (not call.is_causal or call.window is not None):
        return "attention_chunk_size without is_causal or with local_window_size"
    return None


def _torch_implementations(call: Call) -> tuple[str, ...]:
    """``F.scaled_dot_product_attention`` takes neither a dropout mask nor a soft-cap;
    ``cores.run_core`` passes ``attention_chunk_size`` to PyTorch as a tensor, which it refuses."""
    if call.chunk:
        return ()
    return ("math",) if call.dropout or call.soft_cap is not None else ("math", "sdpa")


def _assert_matches(name: str, got: dict, want: dict) -> None:
    """Output (and which rows are 0: queries that see no key) and gradients against the oracle."""
    assert max(harness.errors(got["out"], want["out"])) <= FWD_TOL, (name, "out", harness.errors(got["out"],
                                                                                                 want["out"]))
    assert np.array_equal(got["out"] == 0, want["out"] == 0), (name, "rows of 0")
    for g, grad in zip(got["grads"], ("query", "key", "value")):
        assert max(harness.errors(g, want[grad])) <= GRAD_TOL, (name, grad)
    if got["d_sinks"] is not None:
        assert max(harness.errors(got["d_sinks"], want["sinks"])) <= GRAD_TOL, (name, "sinks")


def _oracle(inputs, att) -> dict:
    from parity_tests.tool import oracle

    q, k, v, d_out = inputs
    out, _, cache = oracle.attention(q, k, v, att)
    return {"out": out, **oracle.attention_grads(cache, d_out)}


def check_call(call: Call) -> None:
    """Every implementation against the oracle on ``call``; splash's refusals by name."""
    inputs, kwargs, att = strategies.build_call(call)
    want = _oracle(inputs, att)
    for name in ("xla", "blockwise"):
        _assert_matches(name, cores.run_core("jax", *inputs, dtype="float32", implementation=name, **kwargs), want)
    refusal = _splash_refusal(call)
    if refusal is not None:
        with pytest.raises(ValueError, match=re.escape(f"implementation='splash' does not take {refusal}")):
            cores.run_core("jax", *inputs, dtype="float32", implementation="splash", **kwargs)
    else:
        got = cores.run_core("jax", *inputs, dtype="float32", implementation="splash", **kwargs)
        _assert_matches("splash", got, want)
    for name in _torch_implementations(call):
        _assert_matches(f"torch {name}", cores.run_core("torch", *inputs, dtype="float32", implementation=name,
                                                        **kwargs), want)
    if jax.device_count() >= RING_DEVICES:
        _assert_matches("ring", _run_ring(inputs, kwargs), want)


def _run_ring(inputs, kwargs) -> dict:
    """``cores.run_core``'s results for the ring: the lengths sharded over a mesh of 2 devices."""
    q, k, v, d_out = (jnp.asarray(x, jnp.float32).transpose(0, 2, 1, 3) for x in inputs)
    terms = dict(kwargs["terms"])
    window, chunk = terms.pop("local_window_size", None), terms.pop("attention_chunk_size", None)
    terms = {n: jnp.asarray(x) for n, x in terms.items()}
    sinks = None if kwargs["sinks"] is None else jnp.asarray(kwargs["sinks"], jnp.float32)
    keep = None if kwargs["dropout_mask"] is None else jnp.asarray(kwargs["dropout_mask"])

    def f(q, k, v, sinks):
        return mha_jax.dot_product_attention(
            q, k, v, is_causal=kwargs["is_causal"], local_window_size=window, attention_chunk_size=chunk, **terms,
            logit_soft_cap=kwargs["logit_soft_cap"], sinks=sinks, dropout_rate=kwargs["dropout_rate"],
            dropout_mask=keep, sequence_axis="seq")

    mesh = jax.make_mesh((RING_DEVICES,), ("seq",), devices=jax.devices()[:RING_DEVICES])
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, P(None, "seq")) for x in (q, k, v, d_out)]
        out, back = jax.vjp(f, *placed[:3], sinks)
        grads = back(placed[3])
    as_numpy = lambda x: np.asarray(x, np.float64).transpose(0, 2, 1, 3)  # noqa: E731
    return {"out": as_numpy(out), "grads": tuple(as_numpy(g) for g in grads[:3]),
            "d_sinks": None if sinks is None else np.asarray(grads[3], np.float64)}


@settings(max_examples=strategies.examples(8), deadline=None)
@given(strategies.calls())
def test_drawn_calls_match_the_oracle_in_every_implementation(call):
    check_call(call)


def test_window_behind_with_more_queries_than_keys():
    """The last queries (past the last key) still reach the keys behind them: a window's two
    sides read the wrong way round leave those rows empty in a kernel that works out which rows
    see a key."""
    check_call(Call(q_len=12, kv_len=8, window=(3, 0)))


def test_key_lengths_inside_the_keys():
    """Key lengths strictly between 0 and the number of keys: the key at index ``length`` is
    the first one not seen."""
    check_call(Call(q_len=8, kv_len=12, lengths=True, seed=1))


def test_chunk_past_the_last_key():
    """Causal chunks of 4 over 12 queries and 8 keys: the last chunk's queries see no key, so
    their rows are 0."""
    call = Call(q_len=12, kv_len=8, is_causal=True, chunk=True)
    inputs, kwargs, att = strategies.build_call(call)
    want = _oracle(inputs, att)
    assert not want["out"][:, :, 8:].any()
    _assert_matches("splash", cores.run_core("jax", *inputs, dtype="float32", implementation="splash", **kwargs), want)


# --- decoding -----------------------------------------------------------------------------------

E, H, T = 16, 4, 8


def _decode_oracle(decoding: Decoding) -> tuple[dict, np.ndarray]:
    """(the torch-named weights, the oracle's causal full pass over the 8 tokens ``(batch, T, E)``)."""
    config = harness.Config("decode", batch=2, q_len=T, kv_len=T, in_features=E, num_heads=H,
                            num_kv_heads=decoding.kv_heads)
    case = harness.Case(config, "causal", "float64")
    data = harness.make_data(case, seed=decoding.seed % 2**16)
    data.attention.window = decoding.window
    return data, harness.run_oracle(case, data)["out"]


def _decode_jax(decoding: Decoding, data) -> np.ndarray:
    layer = mha_jax.MultiHeadAttention(H, E, num_kv_heads=decoding.kv_heads, param_dtype=jnp.float64,
                                       rngs=nnx.Rngs(0))
    mha_jax.load_weights(layer, data.params)
    layer.init_cache((2, T, E), jnp.float64)
    x, outs, t = jnp.asarray(data.xq), [], 0
    for n in decoding.steps:
        outs.append(layer(x[:, t:t + n], decode=True, is_causal=True, local_window_size=decoding.window))
        t += n
    return np.asarray(jnp.concatenate(outs, axis=1))


def _decode_torch(decoding: Decoding, data) -> np.ndarray:
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=decoding.kv_heads, dtype=torch.float64).eval()
    mha_torch.load_weights(twin, {n: torch.from_numpy(np.array(p)) for n, p in data.params.items()})
    cache = mha_torch.KVCache(2, T, decoding.kv_heads, E // H, dtype=torch.float64)
    x, outs, t = torch.from_numpy(np.array(data.xq)), [], 0
    with torch.no_grad():
        for n in decoding.steps:
            outs.append(twin(x[:, t:t + n], cache=cache, is_causal=True, local_window_size=decoding.window))
            t += n
    return torch.cat(outs, dim=1).numpy()


@pytest.mark.skipif(not X64, reason="float64 decoding needs jax_enable_x64")
@settings(max_examples=strategies.examples(4), deadline=None)
@given(strategies.decodings())
def test_drawn_decodings_match_the_full_pass_of_the_oracle(decoding):
    data, want = _decode_oracle(decoding)
    tol = harness.TOLERANCES["float64"][0]
    for name, decode in (("nnx", _decode_jax), ("torch", _decode_torch)):
        assert max(harness.errors(decode(decoding, data), want)) <= tol, name


def test_torch_decoding_in_training_draws_dropout_from_the_seed():
    """A layer in training with dropout decodes token by token with dropout on every step: the
    outputs follow the seed (the same seed, the same outputs) and differ from evaluation's."""
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=2, dropout=0.5, dtype=torch.float64)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, T, E)))

    def decode(seed: int | None) -> torch.Tensor:
        twin.train(seed is not None)
        torch.manual_seed(0 if seed is None else seed)
        cache = mha_torch.KVCache(2, T, 2, E // H, dtype=torch.float64)
        with torch.no_grad():
            return torch.cat([twin(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(T)], dim=1)

    first, again, other, evaluated = decode(1), decode(1), decode(2), decode(None)
    assert torch.equal(first, again)
    for t in range(1, T):  # every step after the first (whose one key's weight is 1 or 0 either way)
        assert not torch.allclose(first[:, t], other[:, t]), t
        assert not torch.allclose(first[:, t], evaluated[:, t]), t
