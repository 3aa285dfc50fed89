"""The blockwise implementation across many small blocks (odd lengths, padded last blocks,
causal skipping, grouped heads, every mask form, bias gradients) against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from mha_jax import _blockwise
from parity_tests import harness, oracle

B, H, HK, Q, K, D = 2, 6, 2, 9, 11, 5


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Forward blocks of 4 queries x 3 keys (3 x 4 blocks), backward blocks of 2 x 4 (5 x 3):
    the last of each padded, and the backward re-blocked."""
    monkeypatch.setattr(_blockwise, "block_sizes", lambda *shape: (4, 3))
    monkeypatch.setattr(_blockwise, "backward_block_sizes", lambda *shape: (2, 4))


def _case(name, rng):
    """(mask, is_causal, keep) of a named case."""
    return {
        "none": (None, False, None),
        "causal": (None, True, None),
        "bool+causal": (rng.random((B, H, Q, K)) < 0.6, True, None),
        "padding-float": (np.where(rng.random((B, 1, 1, K)) < 0.7, 0.0, -np.inf), False, None),
        "bias-per-head+causal": (rng.normal(size=(1, H, Q, K)), True, None),
        "bias-keys": (rng.normal(size=(K,)), False, None),
        "dropout-mask+causal": (None, True, rng.random((B, H, Q, K)) < 0.7),
        "fully-masked": (np.concatenate([np.zeros((1, H, Q, K), bool), rng.random((1, H, Q, K)) < 0.5]), False, None),
    }[name]


CASES = ["none", "causal", "bool+causal", "padding-float", "bias-per-head+causal", "bias-keys",
         "dropout-mask+causal", "fully-masked"]


@pytest.mark.parametrize("name", CASES)
def test_blockwise_matches_oracle_across_blocks(name, tiny_blocks):
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(B, H, Q, D)), rng.normal(size=(B, HK, K, D)), rng.normal(size=(B, HK, K, D))
    mask, causal, keep = _case(name, rng)
    rate = 0.3 if keep is not None else 0.0
    want, _, cache = oracle.attention(q, k, v, oracle.Attention(mask=mask, is_causal=causal, keep=keep, dropout_rate=rate))
    d_out = rng.normal(size=want.shape)
    want_grads = oracle.attention_grad(cache, d_out)
    T = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3))  # noqa: E731

    def f(q, k, v, m):
        return mha_jax.dot_product_attention(
            q, k, v, mask=m, is_causal=causal, dropout_rate=rate,
            dropout_mask=None if keep is None else jnp.asarray(keep), implementation="blockwise")

    m = None if mask is None else jnp.asarray(mask)
    out, vjp = jax.vjp(f, T(q), T(k), T(v), m)
    grads = vjp(T(d_out))
    assert max(harness.errors(np.asarray(out).transpose(0, 2, 1, 3), want)) <= 1e-13
    for got, w in zip(grads[:3], want_grads):
        assert max(harness.errors(np.asarray(got).transpose(0, 2, 1, 3), w)) <= 1e-12
    if mask is not None and mask.dtype.kind == "f" and np.isfinite(mask).all():
        # a learned bias gets its gradient: dS summed over the axes the bias broadcasts along
        *_, probs, drop, _, _, groups = cache
        d_w = np.einsum("bhqd,bhkd->bhqk", d_out, np.repeat(v, groups, axis=1)) * drop
        ds = probs * (d_w - (d_w * probs).sum(-1, keepdims=True))
        lead = ds.ndim - mask.ndim
        axes = tuple(range(lead)) + tuple(lead + a for a in range(mask.ndim) if mask.shape[a] == 1)
        want_bias = ds.sum(axis=axes, keepdims=True).reshape(mask.shape)
        assert max(harness.errors(np.asarray(grads[3]), want_bias)) <= 1e-12


def test_causal_skips_empty_blocks():
    """With causal masking the query blocks visit only the key blocks up to the diagonal."""
    cfg = _blockwise._Config(4, 4, 16, 16, True, 1.0, 1.0, 0.0, None)
    assert [int(_blockwise._key_blocks(cfg, i)) for i in range(4)] == [1, 2, 3, 4]
    wide = _blockwise._Config(4, 2, 6, 16, True, 1.0, 1.0, 0.0, None)  # keys past the last query
    assert [int(_blockwise._key_blocks(wide, i)) for i in range(2)] == [2, 3]


def test_dropout_rng_backward_uses_the_forward_mask(tiny_blocks):
    """The backward pass regenerates each block's dropout mask: a directional derivative by
    central differences in float64 agrees with the VJP."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=s)) for s in ((B, Q, H, D), (B, K, HK, D), (B, K, HK, D)))
    key = jax.random.key(5)
    f = lambda q: mha_jax.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, dropout_rate=0.4, dropout_rng=key, implementation="blockwise")
    direction, d_out = jnp.asarray(rng.normal(size=q.shape)), jnp.asarray(rng.normal(size=(B, Q, H, D)))
    out, vjp = jax.vjp(f, q)
    analytic = float(jnp.vdot(vjp(d_out)[0], direction))
    eps = 1e-6
    numeric = float(jnp.vdot(f(q + eps * direction) - f(q - eps * direction), d_out)) / (2 * eps)
    assert abs(analytic - numeric) <= 1e-7 * abs(analytic)
    assert np.array_equal(out, f(q))  # the same key, the same mask
    dropped = jnp.mean(f(q) == mha_jax.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise"))
    assert dropped < 0.5  # dropout really acted


def test_auto_choice():
    q = jnp.zeros((1, 512, 2, 8))
    f32 = jnp.float32
    assert mha_jax.attention._choose(None, False, 512 * 512, False, f32) == "blockwise"
    assert mha_jax.attention._choose(None, True, 512 * 512, False, f32) == "xla"
    assert mha_jax.attention._choose(None, False, 16 * 16, False, f32) == "xla"
    with pytest.raises(ValueError, match="return_weights=True needs implementation='xla'"):
        mha_jax.dot_product_attention(q, q, q, return_weights=True, implementation="blockwise")
    with pytest.raises(ValueError, match="implementation must be one of"):
        mha_jax.dot_product_attention(q, q, q, implementation="flash")
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            mha_jax.dot_product_attention(q, q, q, implementation="cudnn")
