"""Each foreign implementation is an oracle: random weights go into it, are converted, and our
modules in both frameworks must give its output under padding, causal and arbitrary masks, the
masks translated to its convention.

Rows that may attend to no key are where the anchors disagree; each test asserts what its
anchor does there (0, the mean of V, NaN) and that ours gives 0 (a module's output row is then
its output bias). Tolerances: relative error, float64 1e-12, float32 1e-6, except where an
anchor computes float64 in float32 (``jax.nn.dot_product_attention``, and so
``flax.nnx.MultiHeadAttention`` without ``sow_weights``): there we compare at the precision it
delivers, 1e-6, and assert that it loses precision, so that a fix upstream shows up here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import linen, nnx

import mha_jax
import mha_torch
from parity_tests.tool.harness import errors
from parity_tests.tool.sources import fused_qkv_attention

TOL = {"float64": 1e-12, "float32": 1e-6}
DTYPES = list(TOL)
B, H, KV_HEADS = 2, 4, 2
E, Q, K = 16, 6, 6  # self-attention
CQ, CK, KDIM = 5, 7, 10  # cross-attention / functional cores
D = E // H
MASKS = ["padding", "causal", "bool", "fully-masked"]


# --- helpers -------------------------------------------------------------------------------


def allowed_mask(kind: str, q_len: int, kv_len: int, seed: int = 0) -> np.ndarray:
    """(B, H, q_len, kv_len) bool, True = attend, in our convention."""
    rng = np.random.default_rng(seed)
    if kind == "padding":
        valid = np.arange(kv_len)[None, :] < np.array([kv_len, kv_len // 2])[:, None]
        return np.broadcast_to(valid[:, None, None, :], (B, H, q_len, kv_len)).copy()
    if kind == "causal":  # top-left aligned, as every anchor here
        return np.broadcast_to(np.tri(q_len, kv_len, dtype=bool), (B, H, q_len, kv_len)).copy()
    allowed = rng.random((B, H, q_len, kv_len)) < 0.6
    allowed[np.arange(B)[:, None, None], np.arange(H)[None, :, None], np.arange(q_len),
            rng.integers(kv_len, size=q_len)] = True
    if kind == "fully-masked":
        allowed[:, :, 0, :] = False  # the first query of every head sees no key
        allowed[1] = False  # nor does any query of the second batch element
    return allowed


def dead_rows(allowed: np.ndarray) -> np.ndarray:
    """(B, H, Q) True where a query may attend to no key."""
    return ~allowed.any(axis=-1)


def assert_close(ours, theirs, dtype: str, what: str, tol: float | None = None) -> float:
    tol = TOL[dtype] if tol is None else tol
    rel, top = errors(np.asarray(ours), np.asarray(theirs))
    assert rel <= tol and top <= tol, f"{what} ({dtype}): relative {rel:.2e}, max {top:.2e} > {tol:.0e}"
    return rel


def assert_outputs(ours: dict, theirs, live_q, bias, dtype: str, tol: float | None = None) -> dict[str, float]:
    """Each of our outputs ``(B, Q, out)`` matches ``theirs`` on the rows where the query may
    attend to some key (``live_q``, ``(B, Q)``); on the others it is exactly the output bias
    (attention output 0). Returns each relative error by name."""
    errs = {}
    for name, o in ours.items():
        errs[name] = assert_close(o[live_q], theirs[live_q], dtype, name, tol)
        assert np.array_equal(o[~live_q], np.broadcast_to(bias, o[~live_q].shape)), f"{name}: a fully masked row"
    return errs


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (biases too: the built-in initialisers leave them zero)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.ndim == 2 else 10
            p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape)) / np.sqrt(fan_in)))


def np64(x) -> np.ndarray:
    return x.detach().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def jax_dtype(dtype: str):
    return jnp.float64 if dtype == "float64" else jnp.float32


# --- torch.nn.MultiheadAttention ---------------------------------------------------------------


def _run_torch_mha(dtype: str, kind: str, cross: bool):
    tdtype = getattr(torch, dtype)
    q_len, kv_len, kdim = (CQ, CK, KDIM) if cross else (Q, K, E)
    theirs = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, batch_first=True, dtype=tdtype)
    randomize_(theirs, seed=1)
    rng = np.random.default_rng(2)
    xq = torch.from_numpy(rng.normal(size=(B, q_len, E))).to(tdtype)
    xkv = xq if not cross else torch.from_numpy(rng.normal(size=(B, kv_len, kdim))).to(tdtype)
    allowed = allowed_mask(kind, q_len, kv_len)
    # its convention, True = ignore: padding as key_padding_mask, causal as a 2-d attn_mask
    attn_mask = key_padding_mask = None
    if kind == "padding":
        key_padding_mask = torch.from_numpy(~allowed[:, 0, 0, :])
    elif kind == "causal":
        attn_mask = torch.ones(q_len, kv_len, dtype=torch.bool).triu(1)
    else:
        attn_mask = torch.from_numpy(~allowed.reshape(B * H, q_len, kv_len))
    out, weights = theirs(
        xq, xkv, xkv, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
        need_weights=True, average_attn_weights=False,
    )

    ours_torch = mha_torch.from_torch_mha(theirs)
    mask_torch, bias_torch = mha_torch.mask_from_torch_mha(attn_mask, key_padding_mask, num_heads=H)
    args = (xq,) if not cross else (xq, xkv)
    out_t, weights_t = ours_torch(*args, mask=mask_torch, bias=bias_torch, need_weights=True)

    ours_jax = mha_jax.MultiHeadAttention(H, E, in_kv_features=kdim, param_dtype=jax_dtype(dtype), rngs=nnx.Rngs(0))
    mha_jax.load_weights(ours_jax, theirs.state_dict(), layout="torch_mha")
    as_jax = lambda t: None if t is None else jnp.asarray(t.numpy())  # noqa: E731
    mask_jax, bias_jax = mha_jax.mask_from_torch_mha(as_jax(attn_mask), as_jax(key_padding_mask), num_heads=H)
    out_j, weights_j = ours_jax(*map(as_jax, args), mask=mask_jax, bias=bias_jax, return_weights=True)
    return allowed, theirs, (np64(out), np64(weights)), {"torch": (np64(out_t), np64(weights_t)),
                                                         "jax": (np64(out_j), np64(weights_j))}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
def test_torch_multihead_attention(dtype, kind):
    allowed, theirs, (out, weights), ours = _run_torch_mha(dtype, kind, cross=False)
    dead = dead_rows(allowed)  # (B, H, Q); here a row is dead in every head or none
    live_q = ~dead.any(axis=1)  # (B, Q)
    # torch.nn.MultiheadAttention gives NaN where a query may attend to no key
    assert np.isnan(out[~live_q]).all() and np.isnan(weights[dead]).all()
    assert np.isfinite(out[live_q]).all()
    assert_outputs({name: o for name, (o, _) in ours.items()}, out, live_q, np64(theirs.out_proj.bias), dtype)
    for name, (_, w) in ours.items():
        assert_close(w[~dead], weights[~dead], dtype, f"{name} weights")
        assert np.all(w[dead] == 0), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_multihead_attention_cross_with_kdim(dtype):
    """kdim != embed_dim: separate q/k/v_proj_weight and a fused in_proj_bias."""
    allowed, theirs, (out, weights), ours = _run_torch_mha(dtype, "bool", cross=True)
    assert "q_proj_weight" in theirs.state_dict() and "in_proj_weight" not in theirs.state_dict()
    for name, (o, w) in ours.items():
        assert_close(o, out, dtype, f"{name} output")
        assert_close(w, weights, dtype, f"{name} weights")


# --- the functional cores: F.scaled_dot_product_attention and jax.nn.dot_product_attention ----


def _core_inputs(dtype: str, seed: int = 3):
    """q (B, H, CQ, D), k/v (B, KV_HEADS, CK, D) as float64 NumPy rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    shapes = [(B, H, CQ, D), (B, KV_HEADS, CK, D), (B, KV_HEADS, CK, D)]
    return [rng.normal(size=s).astype(dtype).astype(np.float64) for s in shapes]


def _ours_cores(q, k, v, dtype: str, allowed, is_causal: bool) -> dict[str, np.ndarray]:
    """Both our cores in torch layout (B, H, Q, D); ``allowed`` None or bool in our convention."""
    t = lambda x: torch.from_numpy(x).to(getattr(torch, dtype))  # noqa: E731
    j = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3), dtype=jax_dtype(dtype))  # noqa: E731
    mask_t = None if allowed is None else torch.from_numpy(allowed)
    mask_j = None if allowed is None else jnp.asarray(allowed)
    out_t = mha_torch.dot_product_attention(t(q), t(k), t(v), mask=mask_t, is_causal=is_causal)
    out_j = mha_jax.dot_product_attention(j(q), j(k), j(v), mask=mask_j, is_causal=is_causal)
    return {"torch": np64(out_t), "jax": np64(out_j).transpose(0, 2, 1, 3)}


def _mean_of_v(v: np.ndarray) -> np.ndarray:
    """(B, H, D): each query head's mean over all keys of its key/value head."""
    return np.repeat(v.mean(axis=2), H // KV_HEADS, axis=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
def test_scaled_dot_product_attention(dtype, kind):
    """SDPA, grouped-query via enable_gqa; its bool masks mean True = attend, as ours."""
    q, k, v = _core_inputs(dtype)
    allowed = allowed_mask(kind, CQ, CK)
    t = lambda x: torch.from_numpy(x).to(getattr(torch, dtype))  # noqa: E731
    if kind == "causal":
        theirs = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True)
    else:
        theirs = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=torch.from_numpy(allowed), enable_gqa=True)
    theirs = np64(theirs)
    causal = kind == "causal"
    ours = _ours_cores(q, k, v, dtype, None if causal else allowed, causal)
    dead = dead_rows(allowed)
    assert np.all(theirs[dead] == 0)  # SDPA gives 0 where a query may attend to no key
    for name, out in ours.items():
        assert_close(out, theirs, dtype, name)
        assert np.all(out[dead] == 0), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", MASKS)
def test_jax_nn_dot_product_attention(dtype, kind):
    """jax.nn.dot_product_attention, grouped-query; True = attend. Its softmax is always float32."""
    q, k, v = _core_inputs(dtype)
    allowed = allowed_mask(kind, CQ, CK)
    j = lambda x: jnp.asarray(x.transpose(0, 2, 1, 3), dtype=jax_dtype(dtype))  # noqa: E731
    causal = kind == "causal"
    theirs = jax.nn.dot_product_attention(j(q), j(k), j(v), mask=None if causal else jnp.asarray(allowed),
                                          is_causal=causal)
    assert theirs.dtype == jax_dtype(dtype)
    theirs = np64(theirs).transpose(0, 2, 1, 3)
    ours = _ours_cores(q, k, v, dtype, None if causal else allowed, causal)
    dead = dead_rows(allowed)
    live = ~dead
    # where a query may attend to no key, it gives the mean of V (a uniform softmax)
    assert_close(theirs[dead], np.broadcast_to(_mean_of_v(v)[:, :, None], theirs.shape)[dead], "float32", "mean of V")
    for name, out in ours.items():
        err = assert_close(out[live], theirs[live], "float32", name)  # at the precision it delivers
        if dtype == "float64":
            assert err > 1e-10, f"jax.nn.dot_product_attention is now float64-exact ({err:.1e}): tighten this test"
        assert np.all(out[dead] == 0), name


# --- flax.nnx.MultiHeadAttention and flax.linen.MultiHeadDotProductAttention -------------------


def _flax_inputs(dtype: str):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(B, Q, E)).astype(dtype)
    return x, jnp.asarray(x)


@pytest.mark.parametrize("sow_weights", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["padding", "bool", "fully-masked"])
def test_flax_nnx_multihead_attention(dtype, kind, sow_weights):
    """Its parameters go into ours unchanged (the same tree); grouped-query, 24 qkv, 12 out features.

    Without ``sow_weights`` it calls ``jax.nn.dot_product_attention`` (float32 softmax); with it,
    its own float64-exact path.
    """
    pdtype = jax_dtype(dtype)
    kw = dict(qkv_features=24, out_features=12, num_kv_heads=KV_HEADS, param_dtype=pdtype)
    theirs = nnx.MultiHeadAttention(
        H, E, dtype=pdtype, decode=False, bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(5), **kw
    )
    ours = mha_jax.MultiHeadAttention(H, E, rngs=nnx.Rngs(6), **kw)
    nnx.update(ours, nnx.state(theirs, nnx.Param))  # as they are
    ours_torch = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV_HEADS, qkv_dim=24, out_dim=12,
                                              dtype=getattr(torch, dtype))
    mha_torch.load_weights(ours_torch, mha_jax.to_torch(theirs))

    x, xj = _flax_inputs(dtype)
    allowed = allowed_mask(kind, Q, Q)
    out, sown = nnx.capture(theirs, nnx.Intermediate)(xj, mask=jnp.asarray(allowed), sow_weights=sow_weights)
    out = np64(out)
    out_j, weights_j = map(np64, ours(xj, mask=jnp.asarray(allowed), return_weights=True))
    out_t, weights_t = map(np64, ours_torch(torch.from_numpy(x), mask=torch.from_numpy(allowed), need_weights=True))
    dead = dead_rows(allowed)
    live_q = ~dead.any(axis=1)
    if sow_weights:  # its weights: uniform where a query may attend to no key
        (weights,) = nnx.to_pure_dict(sown)["attention_weights"]
        weights = np64(weights)
        assert np.allclose(weights[dead], 1 / Q, rtol=TOL[dtype], atol=0)
        for name, w in (("jax", weights_j), ("torch", weights_t)):
            assert_close(w[~dead], weights[~dead], dtype, f"{name} weights")
            assert np.all(w[dead] == 0)
    # where a query may attend to no key it gives the mean of V; ours gives 0, so the output bias
    value = np64(theirs.value(xj)).reshape(B, Q, KV_HEADS, 6).mean(axis=1)  # (B, kv_heads, head_dim)
    mean_v = np.repeat(value, H // KV_HEADS, axis=1).reshape(B, -1)
    out_kernel = np64(theirs.out.kernel.get_value()).reshape(-1, 12)
    expected_dead = mean_v @ out_kernel + np64(theirs.out.bias.get_value())
    assert_close(out[~live_q], np.broadcast_to(expected_dead[:, None], out.shape)[~live_q], "float32", "mean of V")
    tol = TOL[dtype] if sow_weights else TOL["float32"]
    errs = assert_outputs({"jax": out_j, "torch": out_t}, out, live_q, np64(theirs.out.bias.get_value()), dtype, tol)
    if dtype == "float64" and not sow_weights:
        assert min(errs.values()) > 1e-10, (f"flax.nnx.MultiHeadAttention is now float64-exact ({errs}): "
                                            "tighten this test")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "fully-masked"])
def test_flax_linen_multihead_dot_product_attention(dtype, kind):
    """Its variables go into our linen module unchanged, and through ``to_torch`` into mha_torch."""
    pdtype = jax_dtype(dtype)
    theirs = linen.MultiHeadDotProductAttention(
        H, dtype=pdtype, param_dtype=pdtype, out_features=12, bias_init=linen.initializers.normal(0.5)
    )
    ours = mha_jax.linen.MultiHeadDotProductAttention(H, out_features=12, param_dtype=pdtype)
    x, xj = _flax_inputs(dtype)
    variables = theirs.init(jax.random.key(7), xj)
    allowed = allowed_mask(kind, Q, Q)
    out = np64(theirs.apply(variables, xj, mask=jnp.asarray(allowed)))
    out_j = np64(ours.apply(variables, xj, mask=jnp.asarray(allowed)))
    ours_torch = mha_torch.MultiHeadAttention(E, H, out_dim=12, dtype=getattr(torch, dtype))
    mha_torch.load_weights(ours_torch, mha_jax.to_torch(variables))
    out_t = np64(ours_torch(torch.from_numpy(x), mask=torch.from_numpy(allowed)))
    live_q = ~dead_rows(allowed).any(axis=1)
    params = variables["params"]
    # where a query may attend to no key it gives the mean of V (the same as nnx)
    value = np64(xj @ params["value"]["kernel"].reshape(E, -1) + params["value"]["bias"].reshape(-1)).mean(axis=1)
    expected_dead = value @ np64(params["out"]["kernel"]).reshape(-1, 12) + np64(params["out"]["bias"])
    assert_close(out[~live_q], np.broadcast_to(expected_dead[:, None], out.shape)[~live_q], dtype, "mean of V")
    assert_outputs({"jax": out_j, "torch": out_t}, out, live_q, np64(params["out"]["bias"]), dtype)


# --- a fused qkv_proj, as in the tutorials, grouped as Phi-3 ----------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_tutorial_layer(dtype):
    tdtype = getattr(torch, dtype)
    theirs = fused_qkv_attention(E, H, KV_HEADS, dtype=tdtype)  # the source ``verify --weights`` builds
    randomize_(theirs, seed=8)
    allowed = allowed_mask("fully-masked", Q, Q)
    att_mask = torch.from_numpy(allowed.astype(np.int64))  # the tutorials' 0/1 masks
    x = torch.from_numpy(np.random.default_rng(9).normal(size=(B, Q, E))).to(tdtype)
    out = np64(theirs(x, att_mask))
    ours_t = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV_HEADS, dtype=tdtype)
    mha_torch.load_weights(ours_t, theirs.state_dict(), layout="fused_qkv")
    ours_j = mha_jax.MultiHeadAttention(H, E, num_kv_heads=KV_HEADS, param_dtype=jax_dtype(dtype), rngs=nnx.Rngs(0))
    mha_jax.load_weights(ours_j, theirs.state_dict(), layout="fused_qkv")
    out_t = np64(ours_t(x, mask=att_mask))
    out_j = np64(ours_j(jnp.asarray(x.numpy()), mask=jnp.asarray(att_mask.numpy())))
    live_q = ~dead_rows(allowed).any(axis=1)
    assert np.isnan(out[~live_q]).all()  # -inf filling: NaN where a query may attend to no key
    bias = np64(theirs.o_proj.bias)
    assert_outputs({"torch": out_t, "jax": out_j}, out, live_q, bias, dtype)


# --- Hugging Face transformers: BERT's attention ("bert") and Llama's ("hf") -----------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["padding", "bool", "fully-masked"])
def test_hf_bert_attention(dtype, kind):
    """A whole (tiny) BertModel's state dict; the layer's attention read with a prefix, its
    LayerNorm knowingly left out. Its masks are additive: the dtype's minimum ignores a key."""
    from transformers import BertConfig, BertModel

    tdtype = getattr(torch, dtype)
    config = BertConfig(
        vocab_size=8, hidden_size=E, num_attention_heads=H, intermediate_size=8, num_hidden_layers=1,
        max_position_embeddings=8, attn_implementation="eager",
    )
    model = BertModel(config).to(tdtype).eval()
    randomize_(model, seed=10)
    attention = model.encoder.layer[0].attention
    allowed = allowed_mask(kind, Q, Q)
    extended = allowed[:, :1, :1, :] if kind == "padding" else allowed  # HF's (batch, 1, 1, kv_len)
    additive = torch.from_numpy(~extended).to(tdtype) * torch.finfo(tdtype).min
    x = torch.from_numpy(np.random.default_rng(11).normal(size=(B, Q, E))).to(tdtype)
    with torch.no_grad():
        context = attention.self(x, attention_mask=additive)[0]  # (B, Q, E), before output.dense
        out = np64(attention.output.dense(context))
        value = np64(attention.self.value(x)).reshape(B, Q, H, D)

    load = dict(layout="bert", prefix="encoder.layer.0.attention.", ignore=("output.LayerNorm",))
    ours_t = mha_torch.MultiHeadAttention(E, H, dtype=tdtype)
    mha_torch.load_weights(ours_t, model.state_dict(), **load)
    ours_j = mha_jax.MultiHeadAttention(H, E, param_dtype=jax_dtype(dtype), rngs=nnx.Rngs(0))
    mha_jax.load_weights(ours_j, model.state_dict(), **load)
    out_t = np64(ours_t(x, mask=torch.from_numpy(allowed)))
    out_j = np64(ours_j(jnp.asarray(x.numpy()), mask=jnp.asarray(allowed)))

    dead = dead_rows(allowed)
    live_q = ~dead.any(axis=1)
    # a finite fill value: where a query may attend to no key, the softmax is uniform (mean of V)
    mean_v = np.broadcast_to(value.mean(axis=1)[:, None], (B, Q, H, D))
    assert_close(np64(context).reshape(B, Q, H, D)[~live_q], mean_v[~live_q], dtype, "mean of V")
    bias = np64(attention.output.dense.bias)
    assert_outputs({"torch": out_t, "jax": out_j}, out, live_q, bias, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "fully-masked"])
def test_hf_llama_attention(dtype, kind):
    """LlamaAttention (grouped-query, biases on), its rotary embedding set to the identity
    (cos 1, sin 0) since ours has none; its "sdpa" path takes bool masks, True = attend."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    tdtype = getattr(torch, dtype)
    config = LlamaConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=KV_HEADS, attention_bias=True,
        vocab_size=8, intermediate_size=8, num_hidden_layers=1, attn_implementation="sdpa",
    )
    theirs = LlamaAttention(config, layer_idx=0).to(tdtype).eval()
    randomize_(theirs, seed=12)
    allowed = allowed_mask(kind, Q, Q)
    x = torch.from_numpy(np.random.default_rng(13).normal(size=(B, Q, E))).to(tdtype)
    identity_rotation = (torch.ones(B, Q, D, dtype=tdtype), torch.zeros(B, Q, D, dtype=tdtype))
    with torch.no_grad():
        out = np64(theirs(x, position_embeddings=identity_rotation, attention_mask=torch.from_numpy(allowed))[0])

    ours_t = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV_HEADS, dtype=tdtype)
    mha_torch.load_weights(ours_t, theirs.state_dict(), layout="hf")
    ours_j = mha_jax.MultiHeadAttention(H, E, num_kv_heads=KV_HEADS, param_dtype=jax_dtype(dtype), rngs=nnx.Rngs(0))
    mha_jax.load_weights(ours_j, theirs.state_dict(), layout="hf")
    out_t = np64(ours_t(x, mask=torch.from_numpy(allowed)))
    out_j = np64(ours_j(jnp.asarray(x.numpy()), mask=jnp.asarray(allowed)))
    live_q = ~dead_rows(allowed).any(axis=1)
    bias = np64(theirs.o_proj.bias)
    # through SDPA, 0 where a query may attend to no key: its output row is the output bias too
    assert np.allclose(out[~live_q], np.broadcast_to(bias, out[~live_q].shape), rtol=0, atol=TOL[dtype])
    assert_outputs({"torch": out_t, "jax": out_j}, out, live_q, bias, dtype)
