"""Chunked attention (Llama 4's ``attention_chunk_size``): a query sees only the keys of its own
chunk of positions, with causality where the layer has it.

Every implementation against the float64 oracle, forward and gradients, in both frameworks (so
the frameworks against each other); the blocks ``blockwise`` skips for chunks, counted; the
modules (nnx, linen, PyTorch) against the same call with the chunks given as a dense mask, and
decoding with the cache (a cache of one chunk is a rolling buffer) against the full pass;
``from_hf`` of a Llama 4 text config against transformers' own attention class.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers import masking_utils
from transformers.models.llama4 import modeling_llama4

import mha_jax
import mha_torch
from mha_jax import testing
from mha_jax.testing import blockwise as _blockwise
from parity_tests.conftest import X64
from parity_tests.tool import harness, oracle

pytestmark = pytest.mark.skipif(not X64, reason="float64 comparisons need jax_enable_x64")

B, T, H, KV, D, E = 2, 12, 4, 2, 8, 16
# (is_causal, chunk size, query positions, key positions): default positions; a chunk of queries
# at later positions (one row shifted) over keys from 0, chunks not aligned with the blocks
CASES = {
    "causal": (True, 5, None, None),
    "positions": (False, 4, np.stack([np.arange(T) + 3, np.arange(T)]), np.arange(T)[None]),
    "causal+positions": (True, 3, np.stack([np.arange(T) + 2, np.arange(T) * 2]), np.stack([np.arange(T)] * 2) * 2),
}


@pytest.fixture
def tiny_blocks():
    """Forward blocks of 4 queries x 3 keys, backward blocks of 2 x 4: chunks of 3 to 5 make
    empty, whole and partial blocks."""
    with testing.tuned(blocks=(4, 3), backward_blocks=(2, 4)):
        yield


def _data():
    rng = np.random.default_rng(0)
    return [rng.normal(size=s) for s in ((B, H, T, D), (B, KV, T, D), (B, KV, T, D), (B, H, T, D))]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_implementation_matches_the_oracle(case, tiny_blocks):
    causal, size, qp, kp = CASES[case]
    q, k, v, d_out = _data()
    want, _, cache = oracle.attention(q, k, v, oracle.Attention(is_causal=causal, chunk_size=size, query_positions=qp,
                                                                key_positions=kp))
    want_grads = oracle.attention_grad(cache, d_out)
    for impl in ("xla", "blockwise", "math", "sdpa"):
        if impl in ("xla", "blockwise"):
            kw = dict(is_causal=causal, attention_chunk_size=size, implementation=impl)
            kw.update(query_positions=None if qp is None else jnp.asarray(qp),
                      key_positions=None if kp is None else jnp.asarray(kp))
            f = functools.partial(mha_jax.dot_product_attention, **kw)
            out, vjp = jax.vjp(f, *(jnp.asarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)))
            got = [np.asarray(x).transpose(0, 2, 1, 3) for x in (out, *vjp(jnp.asarray(d_out.transpose(0, 2, 1, 3))))]
        else:
            qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
            kw = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in
                  dict(is_causal=causal, attention_chunk_size=size, query_positions=qp, key_positions=kp).items()}
            out = mha_torch.dot_product_attention(qt, kt, vt, implementation=impl, **kw)
            out.backward(torch.from_numpy(d_out))
            got = [x.detach().numpy() for x in (out, qt.grad, kt.grad, vt.grad)]
        assert max(harness.errors(got[0], want)) <= 1e-13, impl
        for name, g, w in zip("qkv", got[1:], want_grads):
            assert max(harness.errors(g, w)) <= 1e-12, (impl, name)


def _visits(q_len, kv_len, block_q, block_k, *, causal, chunk):
    """Per query block: (whole key blocks, partial key blocks), as the forward visits them."""
    cfg = _blockwise.Config(block_q, block_k, q_len, kv_len, causal, None, 1.0, 1.0, 0.0, None, chunk_size=chunk)
    tokens = testing.Tokens(jnp.arange(q_len)[None], jnp.arange(kv_len)[None])
    order, whole, live = _blockwise.schedule(*_blockwise.classes(cfg, None, tokens, padding=True))
    return [(int(w), int(n) - int(w)) for w, n in zip(whole, live)]


def test_blocks_visited_follow_the_chunks():
    """16 x 16 in 4 x 4 blocks, counted by hand: blocks of other chunks are skipped, blocks
    inside one chunk (and below the diagonal) go unmasked."""
    # chunks of 8, causal: the diagonal blocks partial, the one below it in the chunk whole
    assert _visits(16, 16, 4, 4, causal=True, chunk=8) == [(0, 1), (1, 1), (0, 1), (1, 1)]
    # chunks of 8 both ways: two whole blocks per query block, the other chunk's two skipped
    assert _visits(16, 16, 4, 4, causal=False, chunk=8) == [(2, 0), (2, 0), (2, 0), (2, 0)]
    # chunks of 6 straddle blocks: block 1 (positions 4..7) spans chunks 0 and 1, so every key
    # block it meets is partial; blocks 2 (8..11) and 3 (12..15) lie in chunks 1 and 2: whole
    # with keys 8..11 and 12..15
    assert _visits(16, 16, 4, 4, causal=False, chunk=6) == [(1, 1), (0, 3), (1, 1), (1, 0)]
    # without chunks all 4 x 4 blocks are visited
    assert _visits(16, 16, 4, 4, causal=False, chunk=None) == [(4, 0)] * 4


def _mask(causal: bool, size: int, q_len: int = T):
    """The chunks (and causality) as a dense boolean mask (q_len, q_len), computed here."""
    i, j = np.arange(q_len)[:, None], np.arange(q_len)[None]
    return (i // size == j // size) & ((j <= i) | (not causal))


def test_modules_match_the_dense_mask_and_each_other():
    """nnx, linen and PyTorch with ``attention_chunk_size`` against the same module given the
    chunks as a mask; the nnx module and its PyTorch twin (same weights) agree."""
    x = np.random.default_rng(1).normal(size=(B, T, E))
    layer = mha_jax.MultiHeadAttention(H, E, num_kv_heads=KV, param_dtype=jnp.float64, rngs=nnx.Rngs(0),
                                       attention_chunk_size=5)
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV, dtype=torch.float64, attention_chunk_size=5).eval()
    mha_torch.load_weights(twin, mha_jax.to_torch(layer))
    plain = mha_jax.MultiHeadAttention(H, E, num_kv_heads=KV, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    mask = jnp.asarray(_mask(True, 5))
    ours = layer(jnp.asarray(x), is_causal=True)
    assert float(jnp.abs(ours - plain(jnp.asarray(x), mask=mask)).max()) <= 1e-13
    with torch.no_grad():
        theirs = twin(torch.from_numpy(x), is_causal=True).numpy()
    assert np.abs(theirs - np.asarray(ours)).max() <= 1e-12
    chunked = mha_jax.linen.MultiHeadDotProductAttention(H, attention_chunk_size=5, param_dtype=jnp.float64)
    params = chunked.init(jax.random.key(0), jnp.asarray(x))
    masked = mha_jax.linen.MultiHeadDotProductAttention(H, param_dtype=jnp.float64)
    got = chunked.apply(params, jnp.asarray(x), is_causal=True)
    assert float(jnp.abs(got - masked.apply(params, jnp.asarray(x), mask=mask)).max()) <= 1e-13
    assert float(jnp.abs(got - masked.apply(params, jnp.asarray(x), is_causal=True)).max()) > 1e-3  # chunks matter


@pytest.mark.parametrize("chunks, room", [([1] * T, 4), ([3, 2, 3, 4], 6), ([T], T)])
def test_decoding_equals_the_full_chunked_pass(chunks, room):
    """Token by token over a cache of one chunk (4 slots: a rolling buffer), in steps of up to 3
    over 6 slots (chunk + step - 1), and all at once; one step too many for the room raises."""
    x = np.random.default_rng(2).normal(size=(B, T, E))
    layer = mha_jax.MultiHeadAttention(H, E, num_kv_heads=KV, param_dtype=jnp.float64, rngs=nnx.Rngs(0),
                                       attention_chunk_size=4)
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV, dtype=torch.float64, attention_chunk_size=4).eval()
    mha_torch.load_weights(twin, mha_jax.to_torch(layer))
    full = np.asarray(layer(jnp.asarray(x), is_causal=True))
    layer.init_cache((B, room, E), jnp.float64)
    cache = mha_torch.KVCache(B, room, KV, E // H, dtype=torch.float64)
    outs_j, outs_t, t = [], [], 0
    with torch.no_grad():
        for n in chunks:
            outs_j.append(np.asarray(layer(jnp.asarray(x[:, t:t + n]), decode=True, is_causal=True)))
            outs_t.append(twin(torch.from_numpy(x[:, t:t + n]), cache=cache, is_causal=True).numpy())
            t += n
    assert np.abs(np.concatenate(outs_j, axis=1) - full).max() <= 1e-12
    assert np.abs(np.concatenate(outs_t, axis=1) - full).max() <= 1e-12
    if room < T:
        layer.init_cache((B, room, E), jnp.float64)
        layer(jnp.asarray(x[:, :3]), decode=True, is_causal=True)
        with pytest.raises(ValueError, match=f"the cache overflows: row 0 would hold positions up to {room + 1} "):
            layer(jnp.asarray(x[:, 3:3 + room - 1]), decode=True, is_causal=True)


def test_linen_decodes_chunks():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, E)))
    module = mha_jax.linen.MultiHeadDotProductAttention(H, attention_chunk_size=4, param_dtype=jnp.float64, decode=True)
    variables = module.init(jax.random.key(0), x)  # flax: the first call makes the cache, shaped as x
    params, cache = variables["params"], variables["cache"]
    full = mha_jax.linen.MultiHeadDotProductAttention(H, attention_chunk_size=4, param_dtype=jnp.float64).apply(
        {"params": params}, x, is_causal=True)
    outs = []
    for t in range(T):
        out, state = module.apply({"params": params, "cache": cache}, x[:, t:t + 1], is_causal=True, mutable=["cache"])
        cache = state["cache"]
        outs.append(out)
    assert float(jnp.abs(jnp.concatenate(outs, axis=1) - full).max()) <= 1e-12


def test_a_bad_chunk_size_fails_by_name():
    q = jnp.zeros((1, 4, 2, 8))
    for bad, error in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="attention_chunk_size must be a positive integer"):
            mha_jax.dot_product_attention(q, q, q, attention_chunk_size=bad)
        with pytest.raises(error, match="attention_chunk_size must be a positive integer"):
            mha_torch.dot_product_attention(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8),
                                            attention_chunk_size=bad)
        with pytest.raises(error, match="attention_chunk_size must be a positive integer"):
            mha_torch.MultiHeadAttention(E, H, attention_chunk_size=bad)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: XLA_FLAGS=...device_count=8, as test_ring")
def test_ring_matches_the_oracle():
    """The length over 4 devices, tiles of 2 x 2: tiles of other chunks are skipped."""
    q, k, v, d_out = (np.concatenate([x, x[:, :, ::-1]], axis=2) for x in _data())  # length 24: 2 x 4 chunks of 3
    positions = np.arange(2 * T)[None]
    want, _, cache = oracle.attention(q, k, v, oracle.Attention(is_causal=True, chunk_size=5))
    want_grads = oracle.attention_grad(cache, d_out)
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh), testing.tuned(ring_tile=2):
        def f(q, k, v):
            return mha_jax.dot_product_attention(q, k, v, is_causal=True, attention_chunk_size=5, sequence_axis="seq",
                                                 query_positions=jnp.asarray(positions))
        def place(x):  # (B, H, L, D) -> (B, L, H, D), the length over "seq"
            return jax.device_put(jnp.asarray(x.transpose(0, 2, 1, 3)), jax.sharding.PartitionSpec(None, "seq"))

        out, vjp = jax.vjp(jax.jit(f), *map(place, (q, k, v)))
        grads = vjp(place(d_out))
    assert max(harness.errors(np.asarray(out).transpose(0, 2, 1, 3), want)) <= 1e-13
    for g, w in zip(grads, want_grads):
        assert max(harness.errors(np.asarray(g).transpose(0, 2, 1, 3), w)) <= 1e-12


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs an NVIDIA GPU")
def test_cudnn_takes_the_chunks_as_a_mask():
    q, k, v, _ = _data()
    want, _, _ = oracle.attention(q, k, v, oracle.Attention(is_causal=True, chunk_size=5))
    got = mha_jax.dot_product_attention(*(jnp.asarray(x.transpose(0, 2, 1, 3), jnp.bfloat16) for x in (q, k, v)),
                                        is_causal=True, attention_chunk_size=5, implementation="cudnn")
    assert max(harness.errors(np.asarray(got, np.float64).transpose(0, 2, 1, 3), want)) <= 2e-2


def _llama4(layer: int, **overrides):
    """transformers' Llama 4 text attention (float64, random weights) of a two-layer config:
    layer 0 chunked (chunks of 3) with its rotary embedding, layer 1 a NoPE layer of full
    attention; and the config."""
    config = transformers.Llama4TextConfig(**{**dict(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=KV, head_dim=E // H, num_hidden_layers=2,
        intermediate_size=8, intermediate_size_mlp=8, vocab_size=11, max_position_embeddings=32,
        use_qk_norm=False, no_rope_layers=[1, 0], attn_temperature_tuning=False, attention_chunk_size=3,
        rope_parameters=dict(rope_type="default", rope_theta=500.0)), **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = modeling_llama4.Llama4TextAttention(config, layer_idx=layer).double().eval()
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return config, attention


def _rotated64(xq, xk, freqs_cis):
    """``modeling_llama4.apply_rotary_emb`` (pairs as complex numbers) kept in float64."""
    def rotate(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis[:, :, None]).flatten(3)

    return rotate(xq), rotate(xk)


@pytest.mark.parametrize("layer", [0, 1])
def test_from_hf_equals_transformers_llama4_attention(layer, monkeypatch):
    """``from_hf`` of a chunked layer (its interleaved rotary embedding at each position) and of
    a NoPE layer (full attention, no rotary embedding) against ``Llama4TextAttention`` under
    transformers' own chunked causal mask function (``masking_utils``), on a batch with a padded
    row: outputs and input gradients to 1e-12 in float64 (transformers' rotary step, in float32
    whatever the input, kept in float64)."""
    config, attention = _llama4(layer)
    lengths, s = torch.tensor([7, 5]), 7
    x = torch.tensor(np.random.default_rng(4).normal(size=(B, s, E)), requires_grad=True)
    idx = torch.arange(s)
    if layer == 0:
        seen = masking_utils.chunked_causal_mask_function(3, torch.zeros(B, dtype=torch.long))(
            torch.arange(B)[:, None, None, None], 0, idx[None, None, :, None], idx[None, None, None, :])
        assert torch.equal(seen[0, 0], torch.from_numpy(_mask(True, 3, s)))  # our chunks, as transformers'
    else:
        seen = idx[None, None, None, :] <= idx[None, None, :, None]
    seen = seen & (idx < lengths[:, None])[:, None, None, :]
    rotary = modeling_llama4.Llama4TextRotaryEmbedding(config)
    freqs = idx[None].double()[..., None] * rotary.inv_freq.double()
    monkeypatch.setattr(modeling_llama4, "apply_rotary_emb", _rotated64)
    out, _ = attention(x, position_embeddings=torch.polar(torch.ones_like(freqs), freqs).expand(B, -1, -1),
                       attention_mask=torch.where(seen, torch.tensor(0.0).double(), torch.finfo(torch.float64).min))
    # a padded query that sees no key (row 1's query 6, alone in its chunk): ours 0, transformers' the
    # mean of the values; compared, and differentiated, where a query sees some key
    sees = seen.any(dim=-1)[:, 0, :, None]  # (B, s, 1)
    out = torch.where(sees, out, 0.0)
    d_out = torch.tensor(np.random.default_rng(5).normal(size=out.shape)) * sees
    (want_dx,) = torch.autograd.grad(out, x, d_out)
    state = {f"model.layers.{layer}.self_attn.{k}": v.detach() for k, v in attention.state_dict().items()}
    options = mha_torch.from_hf(config.to_dict(), state, layer=layer, dtype=torch.float64)
    assert options.attention_chunk_size == (3 if layer == 0 else None) and (options.rotary is None) == (layer == 1)
    got = options(x, is_causal=True, key_value_seq_lengths=lengths)
    (dx,) = torch.autograd.grad(got, x, d_out)
    ours = mha_jax.from_hf(config.to_dict(), {k: v.numpy() for k, v in state.items()}, layer=layer,
                           param_dtype=jnp.float64)
    out_j, vjp = jax.vjp(lambda h: ours(h, is_causal=True, key_value_seq_lengths=jnp.asarray(lengths)),
                         jnp.asarray(x.detach()))
    for a, b in ((got, out), (dx, want_dx), (out_j, out), (vjp(jnp.asarray(d_out))[0], want_dx)):
        a, b = np.asarray(a.detach() if isinstance(a, torch.Tensor) else a), b.detach().numpy()
        assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max()


def test_from_hf_builds_llama4_qk_norm_and_temperature_tuning_on_their_layers():
    """Llama 4's ``use_qk_norm`` (a weightless RMS norm of q and k) on its rotating layers and its
    ``attn_temperature_tuning`` (queries scaled by position) on its NoPE layers: built, in both twins, where
    transformers applies them and nowhere else (their values: ``test_hf_config_variants.py``)."""
    config, _ = _llama4(0)
    base = config.to_dict()
    for from_hf in (mha_jax.from_hf, mha_torch.from_hf):
        normed = from_hf(dict(base, use_qk_norm=True), layer=0)
        assert normed.query_scale is None and not normed.normalize_qk.weight  # weightless RMS norm
        tuned = from_hf(dict(base, attn_temperature_tuning=True), layer=1)  # a NoPE layer
        assert tuned.query_scale is not None
        assert from_hf(dict(base, attn_temperature_tuning=True), layer=0).query_scale is None  # it rotates
        assert not from_hf(dict(base, use_qk_norm=True), layer=1).normalize_qk  # NoPE: no QK-norm
    defaults = {k: v for k, v in base.items() if k not in ("no_rope_layers", "layer_types", "attention_chunk_size")}
    assert mha_torch.from_hf(dict(defaults, num_hidden_layers=4), layer=2).attention_chunk_size == 8192  # the default
