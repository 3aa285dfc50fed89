"""Module-level behaviour: parameter trees, nnx vs linen, jit vs eager, dropout and modes."""

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch
from parity_tests.tool import harness

SHAPES = lambda tree: jax.tree.map(lambda a: tuple(a.shape), tree)  # noqa: E731


@pytest.mark.parametrize("use_bias", [True, False])
def test_nnx_tree_is_flax_nnx_tree(use_bias):
    kw = dict(qkv_features=24, out_features=12, in_kv_features=10, use_bias=use_bias, rngs=nnx.Rngs(0))
    ours = nnx.state(mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, **kw), nnx.Param)
    theirs = nnx.state(nnx.MultiHeadAttention(4, 16, num_kv_heads=2, decode=False, **kw), nnx.Param)
    assert SHAPES(nnx.to_pure_dict(ours)) == SHAPES(nnx.to_pure_dict(theirs))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)


@pytest.mark.parametrize("use_bias", [True, False])
def test_linen_tree_is_flax_linen_tree(use_bias):
    x, y = jnp.ones((2, 5, 16)), jnp.ones((2, 7, 10))
    kw = dict(qkv_features=24, out_features=12, use_bias=use_bias)
    ours = mha_jax.linen.MultiHeadDotProductAttention(4, **kw).init(jax.random.key(0), x, y)
    theirs = flax.linen.MultiHeadDotProductAttention(4, **kw).init(jax.random.key(0), x, y)
    assert SHAPES(ours) == SHAPES(theirs)


@pytest.mark.parametrize("mask", ["padding+causal", "dropout"])
@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_nnx_and_linen_agree_exactly(mask, dtype):
    case = harness.Case(harness.CONFIGS["cross-gqa"], mask, dtype)
    data = harness.make_data(case)
    nnx_result = harness.run_jax(case, data)
    linen_result = harness.run_jax(case, data, module="linen")
    for key in ("out", "weights"):
        np.testing.assert_array_equal(nnx_result[key], linen_result[key])
    for name, g in nnx_result["grads"].items():
        np.testing.assert_array_equal(g, linen_result["grads"][name], err_msg=name)


@pytest.mark.parametrize("dtype", harness.DTYPES)
def test_module_jit_matches_eager(dtype):
    case = harness.Case(harness.CONFIGS["self"], "padding+causal", dtype)
    data = harness.make_data(case)
    eager, jitted = harness.run_jax(case, data), harness.run_jax(case, data, jit=True)
    tol, grad_tol = harness.TOLERANCES[dtype]
    assert max(harness.errors(jitted["out"], eager["out"])) <= tol
    for name in eager["grads"]:
        assert max(harness.grad_errors(name, jitted["grads"][name], eager["grads"])) <= grad_tol, name


def test_jit_grid_passes_parity():
    """One case per dtype through the whole comparison with the JAX side jitted."""
    for dtype in harness.DTYPES:
        result = harness.run_case(harness.Case(harness.CONFIGS["cross-gqa"], "fully-masked", dtype), jit=True)
        assert result.passed, dtype


def test_nnx_dropout_follows_mode_and_rngs():
    model = mha_jax.MultiHeadAttention(4, 16, dropout_rate=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 16))
    with pytest.raises(ValueError, match="deterministic"):
        model(x)
    model.eval()  # no dropout: the output of the same weights built without dropout
    plain = mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(x), plain(x))
    model.train()
    a, b = model(x, return_weights=True)[1], model(x, return_weights=True)[1]
    assert not np.array_equal(a, b)  # the stream advances
    c = model(x, rngs=nnx.Rngs(dropout=7), return_weights=True)[1]
    d = model(x, rngs=nnx.Rngs(dropout=7), return_weights=True)[1]
    np.testing.assert_array_equal(c, d)
    assert 0.3 < float(jnp.mean(c == 0)) < 0.7


def test_linen_dropout_uses_the_dropout_collection():
    model = mha_jax.linen.MultiHeadDotProductAttention(4, dropout_rate=0.5)
    x = jnp.ones((2, 6, 16))
    params = model.init(jax.random.key(0), x, deterministic=True)
    run = lambda key: model.apply(params, x, deterministic=False, rngs={"dropout": key}, return_weights=True)[1]  # noqa: E731
    np.testing.assert_array_equal(run(jax.random.key(3)), run(jax.random.key(3)))
    assert not np.array_equal(run(jax.random.key(3)), run(jax.random.key(4)))


def test_torch_dropout_follows_training_mode():
    model = mha_torch.MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    w_train = model(x, need_weights=True)[1]
    assert float((w_train == 0).double().mean()) > 0.3
    model.eval()  # no dropout: the output of the same weights built without dropout
    plain = mha_torch.MultiHeadAttention(16, 4).eval()
    plain.load_state_dict(model.state_dict())
    assert torch.equal(model(x), plain(x))


def test_modules_default_self_attention_and_value_from_key():
    """inputs_k defaults to inputs_q and inputs_v to inputs_k, in both frameworks."""
    jm = mha_jax.MultiHeadAttention(4, 16, rngs=nnx.Rngs(0))
    tm = mha_torch.MultiHeadAttention(16, 4).double()
    mha_torch.load_weights(tm, mha_jax.to_torch(jm))
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(2, 3, 16)).astype(np.float32)
    jx, jy = jnp.asarray(x), jnp.asarray(y)
    np.testing.assert_array_equal(jm(jx), jm(jx, jx, jx))
    np.testing.assert_array_equal(jm(jx, jy), jm(jx, jy, jy))
    tm = tm.float()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    assert torch.equal(tm(tx), tm(tx, tx, tx)) and torch.equal(tm(tx, ty), tm(tx, ty, ty))
    np.testing.assert_allclose(np.asarray(jm(jx, jy)), tm(tx, ty).detach().numpy(), rtol=0, atol=1e-5)


def _rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _qk_norm_after_rotary_oracle(x, wq, wk, wv, wo, scale_q, scale_k, heads, kv_heads, eps, values=False):
    """float64 NumPy: causal self-attention of ``x`` ``(batch, len, features)``, queries and keys rotated (halves,
    base 10000, float32 frequencies) and then RMS-normed per head times their scale ``(head_dim,)``; with ``values``
    the values RMS-normed per head."""
    def heads_of(w, n):
        return (x @ w).reshape(*x.shape[:2], n, -1)
    q, k, v = heads_of(wq, heads), heads_of(wk, kv_heads), heads_of(wv, kv_heads)
    d = q.shape[-1]
    inv_freq = np.float32(1.0) / np.float32(10000.0) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    angles = np.arange(x.shape[1])[:, None] * inv_freq.astype(np.float64)[None]  # float32 frequencies, as torch's
    cos, sin = (np.concatenate([f(angles)] * 2, -1)[None, :, None] for f in (np.cos, np.sin))

    def rotated_normed(t, scale):
        t = t * cos + np.concatenate([-t[..., d // 2:], t[..., :d // 2]], -1) * sin
        return t / np.sqrt(np.mean(t * t, -1, keepdims=True) + eps) * scale
    q, k = rotated_normed(q, scale_q), rotated_normed(k, scale_k)
    v = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) if values else v
    k, v = (np.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    logits = np.where(np.tril(np.ones((x.shape[1],) * 2, bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    out = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)
    return out.reshape(*x.shape[:2], -1) @ wo


@pytest.mark.parametrize("values", [False, True], ids=["qk", "qk-and-values"])
def test_a_qk_norm_after_the_rotary_embedding_equals_the_oracle_in_nnx_linen_and_torch_and_decodes(values):
    """``QKNorm(after_rotary=True)`` (HunYuan's): the rotated queries and keys normed, with a scale per feature the
    rotation does not commute with; nnx, linen and the PyTorch twin equal the NumPy oracle, decoding one token at a
    time equals the whole sequence; normed before the rotation the output differs. ``value_norm`` (Gemma 3n's): the
    values RMS-normed per head too."""
    heads, kv_heads, features, length = 4, 2, 16, 5
    norm = mha_jax.QKNorm("rms", eps=1e-6, after_rotary=True, value_norm=values)
    ours = mha_jax.MultiHeadAttention(heads, features, num_kv_heads=kv_heads, use_bias=False, normalize_qk=norm,
                                      rotary=mha_jax.RotaryEmbedding(features // heads), param_dtype=jnp.float64,
                                      rngs=nnx.Rngs(0))
    for i, ln in enumerate((ours.query_ln, ours.key_ln)):
        ln.scale.set_value(ln.scale[...] + jnp.linspace(-0.6, 0.9, ln.scale.size) * (1 + i))
    x = np.random.default_rng(0).normal(size=(2, length, features))
    flat = {name: np.asarray(getattr(ours, name).kernel[...]).reshape(features, -1) for name in ("query", "key",
                                                                                                "value")}
    expected = _qk_norm_after_rotary_oracle(
        x, flat["query"], flat["key"], flat["value"], np.asarray(ours.out.kernel[...]).reshape(-1, features),
        np.asarray(ours.query_ln.scale[...]), np.asarray(ours.key_ln.scale[...]), heads, kv_heads, 1e-6, values)
    out = ours(jnp.asarray(x), is_causal=True)
    assert _rel(out, expected) < 1e-12
    linen_module = mha_jax.linen.MultiHeadDotProductAttention(
        heads, num_kv_heads=kv_heads, use_bias=False, normalize_qk=norm, param_dtype=jnp.float64,
        rotary=mha_jax.RotaryEmbedding(features // heads))
    params = {"params": nnx.to_pure_dict(nnx.state(ours, nnx.Param))}
    assert _rel(linen_module.apply(params, jnp.asarray(x), is_causal=True), expected) < 1e-12
    twin = mha_torch.MultiHeadAttention(features, heads, num_kv_heads=kv_heads, bias=False, normalize_qk=norm,
                                        rotary=mha_torch.RotaryEmbedding(features // heads), dtype=torch.float64)
    mha_torch.load_weights(twin, mha_jax.to_torch(ours))
    with torch.no_grad():
        assert _rel(twin(torch.from_numpy(x), is_causal=True).numpy(), expected) < 1e-12
        cache = mha_torch.KVCache(2, length, kv_heads, features // heads, dtype=torch.float64)
        steps = [twin(torch.from_numpy(x[:, t:t + 1]), cache=cache, is_causal=True) for t in range(length)]
    assert _rel(torch.cat(steps, 1).numpy(), expected) < 1e-12
    ours.init_cache((2, length, features), jnp.float64)
    steps = [ours(jnp.asarray(x[:, t:t + 1]), decode=True, is_causal=True) for t in range(length)]
    assert _rel(jnp.concatenate(steps, 1), expected) < 1e-12
    before = mha_jax.MultiHeadAttention(heads, features, num_kv_heads=kv_heads, use_bias=False,
                                        normalize_qk=mha_jax.QKNorm("rms", eps=1e-6, value_norm=values),
                                        rotary=mha_jax.RotaryEmbedding(features // heads), param_dtype=jnp.float64,
                                        rngs=nnx.Rngs(0))
    nnx.update(before, nnx.state(ours, nnx.Param))
    assert _rel(before(jnp.asarray(x), is_causal=True), expected) > 1e-3
    with pytest.raises(ValueError, match="after_rotary=True needs per_head=True"):
        mha_jax.QKNorm("rms", per_head=False, after_rotary=True)
