"""Multi-head latent attention (``mha_spec.latent``) in both twins: the latent decoding cache, whose
absorbed steps give the full computation, against a float64 NumPy oracle and transformers'
``DeepseekV3Attention`` with its own cache; its conversion and its errors.

One tiny shape throughout: 4 heads of 6 no-rope and 4 rope features, values of 12 (apart from
the query/key head dim of 10), a latent of 8, a query rank of 16, hidden 32. The comparison with
transformers without a cache (outputs and gradients, float64 and float32, both twins) is the
census's, ``test_hf_families.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import mha_jax
import mha_torch
from mha_spec import families
from mha_spec.latent import Latent
from mha_torch.latent import LatentCache
from parity_tests.conftest import X64
from parity_tests.test_decode import padded_prompts
from parity_tests.test_hf_models import _keep_float64, _tables64

pytestmark = pytest.mark.skipif(not X64, reason="float64 decoding needs jax_enable_x64")

B, T, HIDDEN, HEADS = 2, 7, 32, 4
LATENT = Latent(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=12, q_lora_rank=16)
CONFIG = dict(  # transformers' DeepseekV3Config keywords of the same shape
    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=8,
    qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=12, num_hidden_layers=1, max_position_embeddings=16,
    intermediate_size=8, moe_intermediate_size=8, vocab_size=11, attention_bias=True,
)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _pair():
    """A float64 torch module with random weights (biases, interleaved rotary), the JAX twin loaded from it."""
    rotary = dict(head_dim=LATENT.qk_rope_head_dim, theta=100.0, interleaved=True)
    twin = mha_torch.MultiHeadAttention(HIDDEN, HEADS, latent=LATENT, rotary=mha_torch.RotaryEmbedding(**rotary),
                                        dtype=torch.float64).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "layernorm" in name else 0.0))
    layer = mha_jax.MultiHeadAttention(HEADS, HIDDEN, latent=LATENT, rotary=mha_jax.RotaryEmbedding(**rotary),
                                       param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    mha_jax.load_weights(layer, twin.state_dict())
    x = np.random.default_rng(0).normal(size=(B, T, HIDDEN))
    return layer, twin, x


def _oracle(twin, x, positions):
    """The full computation in float64 NumPy from the torch module's weights: causal by position."""
    w = {k: v.numpy() for k, v in twin.state_dict().items()}
    lat = LATENT

    def rms(y, weight):
        return y / np.sqrt((y * y).mean(-1, keepdims=True) + lat.eps) * weight

    inv = np.float64(twin.rotary.inv_freq.numpy())  # transformers' frequencies, float32 values

    def rotate(y):  # interleaved pairs (2i, 2i + 1) at ``positions`` (batch, len)
        ang = positions[:, :, None, None] * inv
        y1, y2 = y[..., 0::2], y[..., 1::2]
        return np.stack([y1 * np.cos(ang) - y2 * np.sin(ang), y2 * np.cos(ang) + y1 * np.sin(ang)], -1).reshape(y.shape)

    def linear(y, name):
        return y @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0.0)

    q = linear(rms(linear(x, "q_a_proj"), w["q_a_layernorm.weight"]), "q_b_proj").reshape(B, -1, HEADS, lat.qk_head_dim)
    kv = linear(x, "kv_a_proj_with_mqa")
    c, k_rope = rms(kv[..., :lat.kv_lora_rank], w["kv_a_layernorm.weight"]), rotate(kv[..., None, lat.kv_lora_rank:])
    lifted = linear(c, "kv_b_proj").reshape(B, -1, HEADS, lat.kv_b_features)
    q = np.concatenate([q[..., :lat.qk_nope_head_dim], rotate(q[..., lat.qk_nope_head_dim:])], -1)
    k = np.concatenate([lifted[..., :lat.qk_nope_head_dim], np.broadcast_to(k_rope, lifted.shape[:3] + (4,))], -1)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(lat.qk_head_dim)
    logits = np.where(positions[:, None, None, :] <= positions[:, None, :, None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    out = np.einsum("bhqk,bkhv->bqhv", weights / weights.sum(-1, keepdims=True), lifted[..., lat.qk_nope_head_dim:])
    return linear(out.reshape(B, -1, HEADS * lat.v_head_dim), "out_proj")


def _decode(layer, twin, x, chunks, positions=None, dtype="float64"):
    """Both twins decoding ``x`` in ``chunks`` from a fresh cache (one chunk: at ``positions``, if given):
    (JAX outputs, torch outputs, torch cache)."""
    layer.init_cache((B, T, HIDDEN), jnp.dtype(dtype))
    cache = LatentCache(B, T, LATENT, dtype=getattr(torch, dtype))
    at_j, at_t = ({}, {}) if positions is None else ({"query_positions": jnp.asarray(positions)},
                                                     {"query_positions": torch.from_numpy(positions)})
    out_j, out_t, t = [], [], 0
    with torch.no_grad():
        for n in chunks:
            out_j.append(layer(jnp.asarray(x[:, t:t + n]), decode=True, is_causal=True, **at_j))
            out_t.append(twin(torch.from_numpy(x[:, t:t + n]), cache=cache, is_causal=True, **at_t))
            t += n
    return np.concatenate(out_j, axis=1), torch.cat(out_t, dim=1).numpy(), cache


def test_the_latent_cache_holds_rank_plus_rope_numbers_and_its_steps_give_the_full_pass():
    """Decoded token by token and in chunks, both twins give the full causal pass and the float64
    oracle; each cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers per token, nothing else."""
    layer, twin, x = _pair()
    want = _oracle(twin, x, np.broadcast_to(np.arange(T), (B, T)))
    full_j = layer(jnp.asarray(x), is_causal=True)
    with torch.no_grad():
        full_t = twin(torch.from_numpy(x), is_causal=True).numpy()
    assert _rel(full_j, want) <= 1e-12 and _rel(full_t, want) <= 1e-12
    for chunks in ([1] * T, [3, 1, 3]):
        got_j, got_t, cache = _decode(layer, twin, x, chunks)
        assert _rel(got_j, want) <= 1e-12 and _rel(got_t, want) <= 1e-12, chunks
    assert nnx.state(layer, nnx.Cache)["cached_key"].shape == (B, T, 1, LATENT.cache_dim)
    assert sorted(nnx.to_pure_dict(nnx.state(layer, nnx.Cache))) == ["cache_index", "cache_overflow", "cached_key"]
    assert cache.key.shape == (B, T, 1, LATENT.cache_dim) and cache.value is None and cache.value_storage is None
    assert LATENT.cache_dim == 12


def test_a_ragged_batch_decodes_each_row_at_its_own_position():
    """Left-padded prompts of 4 and 2 tokens prefilled at once (padding at position -1, not cached),
    then 3 tokens each: every row's outputs are those of the row alone."""
    layer, twin, x = _pair()
    lengths = np.array([4, 2])
    prompts, real, pos = padded_prompts(x, lengths, 4)
    steps = np.concatenate([prompts, x[:, 4:7]], axis=1)
    got_j, got_t, cache = _decode(layer, twin, steps[:, :4], [4], pos)
    more_j, more_t, _ = _decode_more(layer, twin, cache, x[:, 4:7])
    assert np.array_equal(cache.index.numpy(), lengths + 3)
    for b, n in enumerate(lengths):
        alone = np.concatenate([x[b:b + 1, :n], x[b:b + 1, 4:7]], axis=1)
        want = _oracle_row(twin, alone)
        for got, more in ((got_j, more_j), (got_t, more_t)):
            assert _rel(np.concatenate([got[b, real[b]], more[b]]), want) <= 1e-12, b


def _decode_more(layer, twin, cache, x):
    """One token at a time after a prefill (``_decode``'s caches)."""
    out_j, out_t = [], []
    with torch.no_grad():
        for i in range(x.shape[1]):
            out_j.append(layer(jnp.asarray(x[:, i:i + 1]), decode=True, is_causal=True))
            out_t.append(twin(torch.from_numpy(x[:, i:i + 1]), cache=cache, is_causal=True))
    return np.concatenate(out_j, axis=1), torch.cat(out_t, dim=1).numpy(), cache


def _oracle_row(twin, x_row):
    """The oracle of one row (run as a batch of two equal rows)."""
    x = np.concatenate([x_row, x_row])
    return _oracle(twin, x, np.broadcast_to(np.arange(x.shape[1]), x.shape[:2]))[0]


def _deepseek(dtype=torch.float64):
    """transformers' DeepseekV3Attention (eager, random weights), its config and rotary module."""
    config = transformers.DeepseekV3Config(**CONFIG)
    config._attn_implementation = "eager"
    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3
    torch.manual_seed(0)
    attention = modeling.DeepseekV3Attention(config, layer_idx=0).to(dtype).eval()
    with torch.no_grad():
        for name, p in attention.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (0.5 if "norm" in name else 0.0))
    return config, attention, modeling.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("float32", 1e-6)])
def test_decoding_equals_deepseek_v3_attention_with_its_cache(monkeypatch, dtype, tolerance):
    """transformers' attention with its DynamicCache (a prefill of 4 tokens, then 3 steps) and
    ``from_hf``'s layers with their latent caches give the same outputs, both twins; float64 with
    transformers' float32 steps kept in float64, float32 as transformers computes."""
    config, attention, rotary = _deepseek(getattr(torch, dtype))
    if dtype == "float64":
        _keep_float64(monkeypatch, attention)
    x = np.random.default_rng(0).normal(size=(B, T, HIDDEN)).astype(dtype)
    cache = transformers.DynamicCache(config=config)
    theirs = []
    for start, n in ((0, 4), (4, 1), (5, 1), (6, 1)):
        positions = torch.arange(start, start + n)[None].expand(B, n)
        step = torch.from_numpy(x[:, start:start + n])
        tables = _tables64(rotary, positions, LATENT.qk_rope_head_dim) if dtype == "float64" else \
            rotary(step, positions)
        mask = torch.where(torch.arange(start + n)[None] <= positions[0, :, None], 0.0, -torch.inf)
        with torch.no_grad():
            out, _ = attention(step, tables, mask[None, None].to(step.dtype), past_key_values=cache)
        theirs.append(out.numpy())
    theirs = np.concatenate(theirs, axis=1)
    state = {"model.layers.0.self_attn." + k: v for k, v in attention.state_dict().items()}
    layer = mha_jax.from_hf(config.to_dict(), state, param_dtype=jnp.dtype(dtype))
    twin = mha_torch.from_hf(config.to_dict(), state, dtype=getattr(torch, dtype)).eval()
    got_j, got_t, _ = _decode(layer, twin, x, [4, 1, 1, 1], dtype=dtype)
    assert _rel(got_j, theirs) <= tolerance and _rel(got_t, theirs) <= tolerance, (_rel(got_j, theirs),
                                                                                   _rel(got_t, theirs))


def test_conversion_between_the_twins_and_from_transformers_names():
    """``to_torch`` of the JAX tree is the torch state dict; ``load_weights`` reads transformers'
    names (``o_proj``) under a prefix and names a missing or mis-shaped key."""
    layer, twin, _ = _pair()
    ours = {k: v.numpy() for k, v in twin.state_dict().items()}
    theirs = mha_jax.to_torch(layer)
    assert sorted(theirs) == sorted(ours) and all(np.array_equal(theirs[k], ours[k]) for k in ours)
    hf = {("model.x." + k.replace("out_proj", "o_proj")): v for k, v in ours.items()}
    fresh = mha_torch.MultiHeadAttention(HIDDEN, HEADS, latent=LATENT, dtype=torch.float64)
    mha_torch.load_weights(fresh, hf, layout="mla", prefix="model.x.")
    assert all(torch.equal(fresh.state_dict()[k], twin.state_dict()[k]) for k in ours)
    bad = dict(hf)
    del bad["model.x.kv_b_proj.weight"]
    bad["model.x.q_b_proj.weight"] = np.zeros((3, 16))
    for load, module in ((mha_torch.load_weights, fresh), (mha_jax.load_weights, layer)):
        with pytest.raises(ValueError, match=r"missing key 'model.x.kv_b_proj.weight'.*'model.x.q_b_proj.weight' "
                                             r"has shape \(3, 16\), the module's is \(40, 16\)"):
            load(module, bad, prefix="model.x.")


def test_yarn_scale_and_rope_settings_read_as_transformers_builds_them():
    """yarn's ``mscale_all_dim`` folds into the softmax scale, as the attention's ``scaling``; the rope
    part's pairs interleave as ``rope_interleave`` says; ``v_head_dim`` falls back as MiniCPM3's config."""
    rope = dict(rope_type="yarn", rope_theta=100.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0)
    config = transformers.DeepseekV3Config(**dict(CONFIG, rope_parameters=rope, rope_interleave=False))
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, layer_idx=0)
    options = families.layer_options(config.to_dict(), 0)
    assert options.scale == pytest.approx(attention.scaling, rel=1e-15) and options.scale != 10 ** -0.5
    assert not options.rope_interleaved and mha_torch.from_hf(config.to_dict()).rotary.head_dim == 4
    minicpm = transformers.MiniCPM3Config(**dict(CONFIG, v_head_dim=None))
    assert families.layer_options(minicpm.to_dict(), 0).latent.v_head_dim == HIDDEN // HEADS


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_bad_latent_options_fail_by_name(framework):
    """Every option a latent module cannot take is named."""
    if framework == "jax":
        def make(**kw):
            return mha_jax.MultiHeadAttention(HEADS, HIDDEN, rngs=nnx.Rngs(0), **kw)
    else:
        def make(**kw):
            return mha_torch.MultiHeadAttention(HIDDEN, HEADS, **kw)
    with pytest.raises(TypeError, match="latent must be an mha_spec Latent"):
        make(latent=(8, 4, 6, 12))
    with pytest.raises(ValueError, match="num_kv_heads must be None or num_heads = 4, got 2"):
        make(latent=LATENT, num_kv_heads=2)
    with pytest.raises(ValueError, match="normalize_qk does not apply with latent"):
        make(latent=LATENT, normalize_qk=True)
    rotary = (mha_jax if framework == "jax" else mha_torch).RotaryEmbedding(head_dim=10)
    with pytest.raises(ValueError, match="head_dim must be qk_rope_head_dim = 4, got 10"):
        make(latent=LATENT, rotary=rotary)
    with pytest.raises(ValueError, match="Latent kv_lora_rank must be a positive integer, got 0"):
        Latent(0, 4, 6, 12)
    module = make(latent=LATENT)
    x = np.zeros((B, T, HIDDEN), np.float32)
    x, y = (jnp.asarray(x), jnp.asarray(x + 1)) if framework == "jax" else (torch.from_numpy(x),
                                                                            torch.from_numpy(x + 1))
    with pytest.raises(ValueError, match="keys and values both come from the key input's latent"):
        module(x, x, y)


def test_linen_holds_the_nnx_tree_and_decodes_with_the_latent_cache():
    """The linen module's parameters are the nnx module's tree; with them it gives the nnx outputs,
    in one pass and decoding token by token over a ``'cache'`` of the latent entries alone."""
    import jax

    layer, _, x = _pair()
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    want = layer(jnp.asarray(x), is_causal=True)
    options = dict(latent=LATENT, rotary=layer.rotary, param_dtype=jnp.float64)
    full = mha_jax.linen.MultiHeadDotProductAttention(HEADS, **options)
    made = full.init(jax.random.key(0), jnp.asarray(x), is_causal=True)["params"]
    assert jax.tree.map(jnp.shape, made) == jax.tree.map(jnp.shape, params)
    assert _rel(full.apply({"params": params}, jnp.asarray(x), is_causal=True), want) <= 1e-12
    step = mha_jax.linen.MultiHeadDotProductAttention(HEADS, decode=True, **options)
    cache = step.init(jax.random.key(0), jnp.zeros((B, T, HIDDEN)), is_causal=True)["cache"]
    assert jax.tree.map(jnp.shape, cache) == dict(cache_index=(B,), cache_overflow=(B,),
                                                  cached_key=(B, T, 1, LATENT.cache_dim))
    outs = []
    for i in range(T):
        out, changed = step.apply({"params": params, "cache": cache}, jnp.asarray(x[:, i:i + 1]), is_causal=True,
                                  mutable=["cache"])
        cache = changed["cache"]
        outs.append(out)
    assert _rel(jnp.concatenate(outs, axis=1), want) <= 1e-12


def test_a_latent_layer_serves_from_pages_of_its_latent_entries():
    """``paged_step`` with a latent: pages of one key/value head of ``cache_dim`` (each token's latent entry as
    both), the absorbed step; every token's output over ``test_paged.SERVED`` (prefill chunks and single tokens
    mixed, a sequence joining late) equals the layer's own causal pass over its whole sequence, float64, in nnx,
    linen (its parameters also made by ``init`` through ``paged_step``) and PyTorch."""
    import jax

    from mha_jax import paged as pj
    from mha_spec.paged import PageTable
    from mha_torch import paged as pt
    from parity_tests.test_paged import MAX_SEQS, NUM_PAGES, PAGES_PER_SEQ, SERVED, _served

    layer, twin, _ = _pair()
    rng, dims = np.random.default_rng(2), (1, LATENT.cache_dim)
    x = [rng.normal(size=(n, HIDDEN)) for n in np.sum(SERVED, axis=0)]
    whole = np.concatenate([np.asarray(layer(jnp.asarray(xs)[None], is_causal=True)[0]) for xs in x])

    def serve(step, twin_paged, dtype):
        table = PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ)
        return np.concatenate(_served(step, x, table, twin_paged.init_cache(table, *dims, dtype), twin_paged.schedule))

    with torch.no_grad():
        served = {"torch": serve(lambda i, c, n: twin.paged_step(torch.tensor(i), c, max_q_len=n), pt, torch.float64)}
    nnx_step = nnx.jit(lambda module, i, c, n: module.paged_step(i, c, max_q_len=n), static_argnums=3)
    served["nnx"] = serve(lambda i, c, n: nnx_step(layer, jnp.asarray(i), c, n), pj, jnp.float64)
    linen = mha_jax.linen.MultiHeadDotProductAttention(HEADS, latent=LATENT, rotary=layer.rotary,
                                                       param_dtype=jnp.float64)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    table = PageTable(NUM_PAGES, 2, MAX_SEQS, PAGES_PER_SEQ)
    cache = pj.schedule(pj.init_cache(table, *dims, jnp.float64), table.append([3]))
    made = linen.init(jax.random.key(0), jnp.zeros((3, HIDDEN)), cache, method="paged_step")["params"]
    assert jax.tree.map(jnp.shape, made) == jax.tree.map(jnp.shape, params)
    linen_step = jax.jit(lambda i, c, n: linen.apply({"params": params}, i, c, max_q_len=n, method="paged_step"),
                         static_argnums=2)
    served["linen"] = serve(lambda i, c, n: linen_step(jnp.asarray(i), c, n), pj, jnp.float64)
    assert {name: _rel(out, whole) <= 1e-12 for name, out in served.items()} == dict.fromkeys(served, True), {
        name: _rel(out, whole) for name, out in served.items()}
