"""Bad input fails alike in both frameworks: the same exception type, a message naming the
argument and the shapes, and nothing the caller passed is modified."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_torch

B, H, Q, K, D = 2, 4, 3, 5, 8


def _core(layout_jax: bool, q=(B, Q, H, D), k=(B, K, H, D), v=None, dtype="float32", **kw):
    """Call a functional core with JAX-layout shapes (transposed for torch)."""
    v = k if v is None else v
    if layout_jax:
        arrays = [jnp.zeros(s, dtype=dtype) if s is not None else None for s in (q, k, v)]
        for name in ("mask", "dropout_mask"):
            if isinstance(kw.get(name), np.ndarray):
                kw[name] = jnp.asarray(kw[name])
        if "dropout_p" in kw:
            kw["dropout_rate"] = kw.pop("dropout_p")
        return mha_jax.dot_product_attention(*arrays, **kw)
    swap = lambda s: s if len(s) != 4 else (s[0], s[2], s[1], s[3])  # noqa: E731
    arrays = [torch.zeros(swap(s), dtype=getattr(torch, dtype)) for s in (q, k, v)]
    for name in ("mask", "dropout_mask"):
        if isinstance(kw.get(name), np.ndarray):
            kw[name] = torch.from_numpy(kw[name])
    return mha_torch.dot_product_attention(*arrays, **kw)


CORE_CASES = {
    "query rank 3": (dict(q=(B, Q, H * D)), ValueError, "query must have rank 4"),
    "key rank 5": (dict(k=(B, K, H, D, 1)), ValueError, "key must have rank 4"),
    "value shape differs from key": (dict(v=(B, K + 1, H, D)), ValueError, "key and value must have the same shape"),
    "batch mismatch": (dict(k=(B + 1, K, H, D)), ValueError, "must match query"),
    "head_dim mismatch": (dict(k=(B, K, H, D + 1)), ValueError, "must match query"),
    "kv heads do not divide heads": (dict(k=(B, K, 3, D)), ValueError, "key/value heads (3) must divide query heads (4)"),
    "integer inputs": (dict(dtype="int32"), TypeError, "query must be a real floating-point array"),
    "complex inputs": (dict(dtype="complex64"), TypeError, "query must be a real floating-point array"),
    "mask does not broadcast": (dict(mask=np.ones((B, 3, Q, K), bool)), ValueError, "mask of shape (2, 3, 3, 5) does not broadcast"),
    "mask rank 5": (dict(mask=np.ones((1, B, H, Q, K), bool)), ValueError, "mask of shape (1, 2, 4, 3, 5)"),
    "mask complex": (dict(mask=np.ones((Q, K), np.complex64)), TypeError, "mask must be bool, integer or real floating"),
    "mask transposed": (dict(mask=np.ones((K, Q), bool)), ValueError, "mask of shape (5, 3) does not broadcast"),
    "dropout rate 1": (dict(dropout_p=1.0), ValueError, "must be in [0, 1)"),
    "dropout mask float": (dict(dropout_p=0.1, dropout_mask=np.ones((Q, K), np.float32)), TypeError, "dropout_mask must be bool"),
    "dropout mask shape": (dict(dropout_p=0.1, dropout_mask=np.ones((Q, Q), bool)), ValueError, "dropout_mask of shape (3, 3)"),
}


@pytest.mark.parametrize("name", list(CORE_CASES))
def test_core_rejects_alike(name):
    kwargs, error, message = CORE_CASES[name]
    for layout_jax in (True, False):
        with pytest.raises(error) as info:
            _core(layout_jax, **dict(kwargs))
        assert message in str(info.value), (layout_jax, str(info.value))


def test_jax_dropout_without_rng_is_named():
    with pytest.raises(ValueError, match="dropout_rng"):
        _core(True, dropout_p=0.2)


def _jax_module(**kw):
    return mha_jax.MultiHeadAttention(kw.pop("num_heads", 4), kw.pop("in_features", 16), rngs=nnx.Rngs(0), **kw)


def _torch_module(**kw):
    rename = {"in_features": "embed_dim", "qkv_features": "qkv_dim", "in_kv_features": "kdim"}
    kw = {rename.get(k, k): v for k, v in kw.items()}
    return mha_torch.MultiHeadAttention(kw.pop("embed_dim", 16), kw.pop("num_heads", 4), **kw)


CONSTRUCTOR_CASES = {
    "heads do not divide features": (dict(num_heads=5), "num_heads (5) must divide"),
    "kv heads do not divide heads": (dict(num_kv_heads=3), "num_kv_heads (3) must divide num_heads (4)"),
    "zero heads": (dict(num_heads=0), "num_heads must be a positive integer"),
    "qkv features not divisible": (dict(qkv_features=18), "num_heads (4) must divide"),
    "negative features": (dict(in_features=-4), "must be a positive integer"),
    "dropout rate above 1": (dict(dropout_rate=1.5), "dropout"),
}


@pytest.mark.parametrize("name", list(CONSTRUCTOR_CASES))
def test_constructors_reject_alike(name):
    kwargs, message = CONSTRUCTOR_CASES[name]
    torch_kwargs = {("dropout" if k == "dropout_rate" else k): v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=None) as a:
        _jax_module(**kwargs)
    with pytest.raises(ValueError) as b:
        _torch_module(**torch_kwargs)
    for info in (a, b):
        assert message in str(info.value), str(info.value)


CALL_CASES = {
    # name: (query shape, key shape or None, error, words naming the argument)
    "query features": ((B, Q, 12), None, ValueError, "has 12 features"),
    "key features": ((B, Q, 16), (B, K, 10), ValueError, "has 10 features"),
    "query rank 2": ((Q, 16), None, ValueError, "must have rank 3"),
    "batch differs": ((B, Q, 16), (B + 1, K, 16), ValueError, "must share the batch size"),
}
NAMES = {True: ("inputs_q", "inputs_k"), False: ("query", "key")}


@pytest.mark.parametrize("name", list(CALL_CASES))
def test_module_calls_reject_alike(name):
    q_shape, k_shape, error, message = CALL_CASES[name]
    for is_jax, module, zeros in (
        (True, _jax_module(), lambda s: jnp.zeros(s)),
        (False, _torch_module(), lambda s: torch.zeros(s)),
    ):
        args = [zeros(q_shape)] + ([zeros(k_shape)] if k_shape else [])
        with pytest.raises(error) as info:
            module(*args)
        text = str(info.value)
        assert message in text and any(n in text for n in NAMES[is_jax]), text


def test_module_rejects_integer_inputs_and_bad_masks_alike():
    jm, tm = _jax_module(), _torch_module()
    for call in (lambda: jm(jnp.zeros((B, Q, 16), jnp.int32)), lambda: tm(torch.zeros(B, Q, 16, dtype=torch.int32))):
        with pytest.raises(TypeError, match="must be a real floating-point array"):
            call()
    for call in (
        lambda: jm(jnp.zeros((B, Q, 16)), mask=jnp.ones((B, 3, Q, Q), bool)),
        lambda: tm(torch.zeros(B, Q, 16), mask=torch.ones(B, 3, Q, Q, dtype=torch.bool)),
    ):
        with pytest.raises(ValueError, match=r"mask of shape \(2, 3, 3, 3\) does not broadcast to .* \(2, 4, 3, 3\)"):
            call()


def test_mask_helpers_reject_alike():
    for helper, zeros in ((mha_jax.padding_mask, jnp.zeros), (mha_torch.padding_mask, torch.zeros)):
        with pytest.raises(ValueError, match="valid must have rank 2"):
            helper(zeros((2, 3, 4)))
    for helper in (mha_jax.causal_mask, mha_torch.causal_mask):
        with pytest.raises(ValueError, match="q_len must be a positive integer"):
            helper(0, 4)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, Q, 16)).astype(np.float32)
    mask = rng.random((B, 1, Q, Q)) < 0.5
    tx, tmask = torch.from_numpy(x.copy()), torch.from_numpy(mask.copy())
    _torch_module()(tx, mask=tmask, need_weights=True)
    assert np.array_equal(tx.numpy(), x) and np.array_equal(tmask.numpy(), mask)
    jx = x.copy()
    _jax_module()(jnp.asarray(jx), mask=jnp.asarray(mask))
    assert np.array_equal(jx, x)
