"""Decoding with a key/value cache, in both frameworks: token by token, in chunks of varied sizes
and all at once, the outputs are those of the full causal forward pass; ragged batches (left- and
right-padded prompts), sliding windows over a rolling buffer, grouped and multi-query heads; JAX
and PyTorch decode alike, a cache continues across frameworks, flax's own decode loop gives our
outputs, one compiled step serves every position, and bad caches fail by name.
"""

import pathlib
import re
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx

import mha_jax
import mha_torch
from mha_torch import testing as torch_testing
from parity_tests.conftest import X64

pytestmark = pytest.mark.skipif(not X64, reason="float64 decoding needs jax_enable_x64")

B, T, E, H = 2, 10, 16, 4
TOL = {"float64": 1e-12, "float32": 1e-6, "bfloat16": 2e-2}
KV_HEADS = {"mha": 4, "gqa": 2, "mqa": 1}
CHUNKINGS = {"tokens": [1] * T, "chunks": [3, 1, 4, 2], "all": [T]}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _pair(kv_heads: int, dtype: str):
    """Our nnx module and its PyTorch twin with the same weights, and the inputs."""
    jdt = jnp.dtype(dtype)
    layer = mha_jax.MultiHeadAttention(H, E, num_kv_heads=kv_heads, param_dtype=jdt, rngs=nnx.Rngs(0))
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=kv_heads, dtype=getattr(torch, dtype)).eval()
    mha_torch.load_weights(twin, mha_jax.to_torch(layer))
    x = np.random.default_rng(0).normal(size=(B, T, E))
    return layer, twin, jnp.asarray(x, jdt), torch.from_numpy(x).to(getattr(torch, dtype))


def _decode_jax(layer, x, chunks, max_length=T, **kw):
    layer.init_cache((B, max_length, E), x.dtype)
    outs, t = [], 0
    for n in chunks:
        outs.append(layer(x[:, t:t + n], decode=True, is_causal=True, **kw))
        t += n
    return jnp.concatenate(outs, axis=1)


def _decode_torch(twin, x, chunks, kv_heads, max_length=T, grad=False, **kw):
    cache = mha_torch.KVCache(B, max_length, kv_heads, E // H, dtype=x.dtype)
    outs, t = [], 0
    with torch.set_grad_enabled(grad):
        for n in chunks:
            outs.append(twin(x[:, t:t + n], cache=cache, is_causal=True, **kw))
            t += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("heads", sorted(KV_HEADS))
def test_decoding_equals_the_full_causal_pass(heads, dtype):
    layer, twin, xj, xt = _pair(KV_HEADS[heads], dtype)
    full_j = layer(xj, is_causal=True)
    with torch.no_grad():
        full_t = twin(xt, is_causal=True)
    for name, chunks in CHUNKINGS.items():
        dj = _decode_jax(layer, xj, chunks)
        dt = _decode_torch(twin, xt, chunks, KV_HEADS[heads])
        assert _rel(dj, full_j) <= TOL[dtype], name
        assert _rel(dt.float(), full_t.float()) <= TOL[dtype], name
        assert _rel(dt.float(), np.asarray(dj, np.float32)) <= TOL[dtype], name


def _torch_of(x, dtype: str) -> torch.Tensor:
    """A NumPy or JAX array as a PyTorch tensor of ``dtype`` (bfloat16 through float32, exactly)."""
    return torch.from_numpy(np.array(x, np.float64 if dtype == "float64" else np.float32)).to(getattr(torch, dtype))


def padded_prompts(x, lengths, width: int, padding: str = "left"):
    """Row ``b``'s first ``lengths[b]`` tokens of ``x`` ``(batch, len, features)`` padded to ``width`` on the
    ``padding`` side: float64 prompts ``(batch, width, features)``, which are real ``(batch, width)``,
    and their positions (from 0 in each row; -1 on padding)."""
    lengths = np.asarray(lengths)
    slots = np.arange(width)[None]
    real = slots < lengths[:, None] if padding == "right" else slots >= width - lengths[:, None]
    prompts = np.zeros((len(lengths), width, x.shape[-1]))
    for b, n in enumerate(lengths):
        prompts[b, real[b]] = np.asarray(x[b, :n], np.float64)
    return prompts, real, np.where(real, np.cumsum(real, axis=1) - 1, -1)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("padding", ["left", "right"])
def test_ragged_batch_decodes_each_row_at_its_own_position(padding, dtype):
    """Prompts of 6 and 3 tokens padded to 6, prefilled at once, then 3 tokens each, decode as
    each row alone does, in each dtype to its tolerance."""
    layer, twin, xj, xt = _pair(2, dtype)
    jdt = jnp.dtype(dtype)
    lengths = np.array([6, 3])
    prompts, real, pos = padded_prompts(xj, lengths, 6, padding)
    steps = [np.asarray(xj[:, 6 + i:7 + i], np.float64) for i in range(3)]
    layer.init_cache((B, T, E), jdt)
    cache = mha_torch.KVCache(B, T, 2, E // H, dtype=getattr(torch, dtype))
    out_j = [layer(jnp.asarray(prompts, jdt), decode=True, is_causal=True, query_positions=jnp.asarray(pos))]
    with torch.no_grad():
        out_t = [twin(_torch_of(prompts, dtype), cache=cache, is_causal=True, query_positions=torch.from_numpy(pos))]
        for s in steps:
            out_j.append(layer(jnp.asarray(s, jdt), decode=True, is_causal=True))
            out_t.append(twin(_torch_of(s, dtype), cache=cache, is_causal=True))
    assert np.array_equal(np.asarray(layer.cache_index[...]), lengths + 3)
    assert np.array_equal(cache.index.numpy(), lengths + 3)
    for b, n in enumerate(lengths):
        alone = layer(jnp.concatenate([xj[b:b + 1, :n], xj[b:b + 1, 6:9]], axis=1), is_causal=True)[0]
        got_j = jnp.concatenate([out_j[0][b, real[b]]] + [o[b] for o in out_j[1:]])
        got_t = torch.cat([out_t[0][b, torch.from_numpy(real[b])]] + [o[b] for o in out_t[1:]]).double()
        assert _rel(got_j, alone) <= TOL[dtype] and _rel(got_t, alone) <= TOL[dtype], b


def test_sliding_window_keeps_a_rolling_buffer_of_the_window():
    """A window of 3 keys behind over a cache of 4 slots decodes 10 tokens (and chunks of 1 and 2
    over 5 slots) as the full windowed pass; one more than the room raises."""
    layer, twin, xj, xt = _pair(2, "float64")
    window = dict(local_window_size=(3, 0))
    full = layer(xj, is_causal=True, **window)
    for chunks, room in (([1] * T, 4), ([2, 1, 2, 2, 1, 2], 5)):
        assert _rel(_decode_jax(layer, xj, chunks, max_length=room, **window), full) <= TOL["float64"]
        assert _rel(_decode_torch(twin, xt, chunks, 2, max_length=room, **window), full) <= TOL["float64"]
    assert not np.asarray(layer.cache_overflow[...]).any()
    with pytest.raises(ValueError, match="the cache overflows: row 0 would hold positions up to 5 in max_length 5"):
        _decode_jax(layer, xj, [3, 3], max_length=5, **window)


def test_overflow_inside_jit_is_flagged_not_silent():
    layer, _, xj, _ = _pair(4, "float64")
    layer.init_cache((B, 4, E), jnp.float64)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    for t in range(4):
        step(layer, xj[:, t:t + 1])
    assert not np.asarray(layer.cache_overflow[...]).any()
    step(layer, xj[:, 4:5])
    assert np.asarray(layer.cache_overflow[...]).all()


def test_one_compiled_step_serves_every_position():
    """One trace (JAX) and one compilation (PyTorch) for every position; the donated JAX cache is
    aliased; past the cache the compiled PyTorch step flags the row's ``overflow``."""
    layer, twin, xj, xt = _pair(2, "float32")
    traces = []

    @nnx.jit(donate_argnums=0)
    def step(model, token):
        traces.append(token.shape)
        return model(token, decode=True)

    layer.init_cache((B, T, E), jnp.float32)
    out = jnp.concatenate([step(layer, xj[:, t:t + 1]) for t in range(T)], axis=1)
    assert len(traces) == 1
    assert _rel(out, layer(xj, is_causal=True)) <= TOL["float32"]
    graphdef, state = nnx.split(layer)

    def pure_step(state, token):  # the functional form: the new cache is an output
        model = nnx.merge(graphdef, state)
        return model(token, decode=True), nnx.state(model)

    compiled = jax.jit(pure_step, donate_argnums=0).lower(state, xj[:, :1]).compile().as_text()
    assert "input_output_alias" in compiled  # the donated cache buffers are updated in place

    compiles = []

    def backend(graph, example_inputs):
        compiles.append(1)
        return graph.forward

    torch._dynamo.reset()
    cache = mha_torch.KVCache(B, T, 2, E // H)
    compiled = torch.compile(lambda token: twin(token, cache=cache), backend=backend)
    with torch.no_grad():
        first = compiled(xt[:, :1])
        after_first = len(compiles)
        rest = [compiled(xt[:, t:t + 1]) for t in range(1, T)]
        full = twin(xt, is_causal=True)
    assert after_first >= 1 and len(compiles) == after_first
    assert _rel(torch.cat([first] + rest, dim=1), full) <= TOL["float32"]
    # past the cache the compiled step cannot raise: it sets the overflowing row's flag, which stays
    assert not cache.overflow.any()
    cache.index.copy_(torch.tensor([T, T - 1], dtype=torch.int32))
    flags = []
    with torch.no_grad():
        for t in range(2):
            compiled(xt[:, t:t + 1])
            flags.append(cache.overflow.tolist())
    assert flags == [[True, False], [True, True]] and cache.index.tolist() == [T + 2, T + 1]


@pytest.mark.parametrize("batch, kv_heads", [(1, 2), (1, 1), (2, 2), (2, 4)])
def test_the_compiled_step_reads_and_writes_the_cache_in_place(batch, kv_heads):
    """No instruction of the compiled one-token step (cache donated) makes an array the size of
    the cache but the two writes into it: the attention reads the cache where it lies (no
    head-major copy), and the write is not split into copies per reader (batch 1 included)."""
    heads, features, max_length = 4, 64, 160
    layer = mha_jax.MultiHeadAttention(heads, features, num_kv_heads=kv_heads, rngs=nnx.Rngs(0))
    layer.init_cache((batch, max_length, features), jnp.float32)
    graphdef, state = nnx.split(layer)

    def pure_step(state, token):
        model = nnx.merge(graphdef, state)
        return model(token, decode=True), nnx.state(model)

    token = jnp.ones((batch, 1, features), jnp.float32)
    text = jax.jit(pure_step, donate_argnums=0).lower(state, token).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    size = batch * max_length * kv_heads * (features // heads)
    cache_sized = []
    for line in entry.splitlines():
        shape = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\{[^}]*\} (\w+)", line)
        if shape and shape.group(2) not in ("parameter", "bitcast", "get-tuple-element"):
            dims = [int(d) for d in shape.group(1).split(",") if d]
            if int(np.prod(dims)) == size:
                cache_sized.append(line.strip()[:120])
    assert len(cache_sized) == 2, cache_sized


def test_a_cache_continues_in_the_other_framework():
    """Filled by JAX for 6 tokens, exported as arrays, continued by PyTorch (and back)."""
    layer, twin, xj, xt = _pair(2, "float64")
    full = layer(xj, is_causal=True)
    _decode_jax(layer, xj, [6])
    cache = mha_torch.KVCache(B, T, 2, E // H, dtype=torch.float64)
    for name, variable in (("key", layer.cached_key), ("value", layer.cached_value), ("index", layer.cache_index)):
        getattr(cache, name).copy_(torch.from_numpy(np.asarray(variable[...])))
    with torch.no_grad():
        rest = twin(xt[:, 6:8], cache=cache, is_causal=True)
    assert _rel(rest, full[:, 6:8]) <= TOL["float64"]
    layer.cached_key[...], layer.cached_value[...] = jnp.asarray(cache.key.numpy()), jnp.asarray(cache.value.numpy())
    layer.cache_index[...] = jnp.asarray(cache.index.numpy())
    assert _rel(layer(xj[:, 8:], decode=True, is_causal=True), full[:, 8:]) <= TOL["float64"]


def test_masks_and_biases_span_the_cache():
    """A user ``mask`` ``(batch, heads, n, max_length)`` and ``bias`` ``(batch, 1, n, max_length)``,
    the rows of the full pass's ``(batch, heads, T, T)``/``(batch, 1, T, T)`` for the step's
    queries, give the full causal pass with that mask and bias, in both frameworks: a prompt of
    6 tokens, then one token a step."""
    layer, twin, xj, xt = _pair(2, "float64")
    rng = np.random.default_rng(3)
    allowed = rng.random((B, H, T, T)) < 0.6
    allowed[..., np.arange(T), np.arange(T)] = True  # every query sees itself
    bias = rng.normal(size=(B, 1, T, T))
    full_j = layer(xj, is_causal=True, mask=jnp.asarray(allowed), bias=jnp.asarray(bias))
    with torch.no_grad():
        full_t = twin(xt, is_causal=True, mask=torch.from_numpy(allowed), bias=torch.from_numpy(bias))
    assert _rel(full_j, layer(xj, is_causal=True)) > 1e-2  # the mask and bias act
    layer.init_cache((B, T, E), jnp.float64)
    cache = mha_torch.KVCache(B, T, 2, E // H, dtype=torch.float64)
    out_j, out_t, t = [], [], 0
    with torch.no_grad():
        for n in [6, 1, 1, 1, 1]:
            rows = slice(t, t + n)
            out_j.append(layer(xj[:, rows], decode=True, is_causal=True, mask=jnp.asarray(allowed[:, :, rows]),
                               bias=jnp.asarray(bias[:, :, rows])))
            out_t.append(twin(xt[:, rows], cache=cache, is_causal=True, mask=torch.from_numpy(allowed[:, :, rows]),
                              bias=torch.from_numpy(bias[:, :, rows])))
            t += n
    dj, dt = jnp.concatenate(out_j, axis=1), torch.cat(out_t, dim=1)
    assert _rel(dj, full_j) <= TOL["float64"]
    assert _rel(dt, full_t) <= TOL["float64"]
    assert _rel(dt, full_j) <= TOL["float64"]


def test_torch_chunk_longer_than_the_room_left_raises_and_leaves_the_cache():
    """Four tokens cached in six slots, a chunk of three: the error names the row and the
    sizes, and the cache is as it was (as the JAX module, same message)."""
    layer, twin, xj, xt = _pair(2, "float64")
    cache = mha_torch.KVCache(B, 6, 2, E // H, dtype=torch.float64)
    layer.init_cache((B, 6, E), jnp.float64)
    message = r"the cache overflows: row 0 would hold positions up to 6 in max_length 6 slots"
    with torch.no_grad():
        twin(xt[:, :4], cache=cache, is_causal=True)
        layer(xj[:, :4], decode=True, is_causal=True)
        key, value = cache.key.clone(), cache.value.clone()
        with pytest.raises(ValueError, match=message):
            twin(xt[:, 4:7], cache=cache, is_causal=True)
        with pytest.raises(ValueError, match=message):
            layer(xj[:, 4:7], decode=True, is_causal=True)
        assert cache.index.tolist() == [4, 4] and not cache.overflow.any()
        assert torch.equal(cache.key, key) and torch.equal(cache.value, value)
        rest = twin(xt[:, 4:6], cache=cache, is_causal=True)  # what fits still decodes
        full = twin(xt[:, :6], is_causal=True)
    assert _rel(rest, full[:, 4:6]) <= TOL["float64"]


def test_decoding_gradients_equal_the_full_causal_pass():
    """Differentiated through a decode loop (a prompt of 4, tokens, chunks), the gradients of the
    input and of the key projection are those of the full causal pass, in both frameworks: the
    PyTorch cache is written out of place under autograd, so that gradients flow from step to
    step as through JAX's functional cache; the input is left as it was."""
    layer, twin, xj, xt = _pair(2, "float64")
    chunks = [4, 1, 1, 2, 2]
    cotangent = np.random.default_rng(1).normal(size=(B, T, E))
    ct_j, ct_t = jnp.asarray(cotangent), torch.from_numpy(cotangent)

    def decoded(layer, x):
        return (_decode_jax(layer, x, chunks) * ct_j).sum()

    def full(layer, x):
        return (layer(x, is_causal=True) * ct_j).sum()

    (dlayer, dx), (flayer, fx) = (nnx.grad(f, argnums=(0, 1))(layer, xj) for f in (decoded, full))
    x = xt.clone().requires_grad_(True)
    (_decode_torch(twin, x, chunks, 2, grad=True) * ct_t).sum().backward()
    grads = (x.grad.clone(), twin.k_proj.weight.grad.clone())
    twin.zero_grad()
    y = xt.clone().requires_grad_(True)
    (twin(y, is_causal=True) * ct_t).sum().backward()
    assert torch.equal(x.detach(), xt)
    assert _rel(grads[0], y.grad) <= TOL["float64"] and _rel(grads[1], twin.k_proj.weight.grad) <= TOL["float64"]
    assert _rel(dx, fx) <= TOL["float64"]
    assert _rel(dlayer["key"]["kernel"][...], flayer["key"]["kernel"][...]) <= TOL["float64"]
    assert _rel(grads[0], dx) <= TOL["float64"]
    with torch.no_grad():  # and the cache decodes on, in place
        twin(xt[:, :1], cache=mha_torch.KVCache(B, T, 2, E // H, dtype=torch.float64))


def test_torch_overflow_raises_outside_torch_compile():
    """Rows at positions 0 and 2 of a 4-slot cache, one token a step: the step that would
    overwrite row 1's first position raises naming the row and the sizes, and leaves the cache
    as it was (under ``torch.compile`` it sets ``overflow`` instead, see the compiled-step test)."""
    _, twin, _, xt = _pair(2, "float32")
    cache = mha_torch.KVCache(B, 4, 2, E // H)
    cache.index.copy_(torch.tensor([0, 2], dtype=torch.int32))
    with torch.no_grad():
        twin(xt[:, :1], cache=cache)
        twin(xt[:, 1:2], cache=cache)
        key = cache.key.clone()
        overflow = "the cache overflows: row 1 would hold positions up to 4 in max_length 4 slots"
        with pytest.raises(ValueError, match=overflow):
            twin(xt[:, 2:3], cache=cache)
    assert cache.index.tolist() == [2, 4] and not cache.overflow.any() and torch.equal(cache.key, key)


def test_linen_cache_overflow_is_flagged_under_jit():
    """linen's ``'cache'`` collection: a jitted step that overflows a row sets that row's
    ``cache_overflow``, which stays set; outside ``jit`` the same step raises."""
    ours = mha_jax.linen.MultiHeadDotProductAttention(H, num_kv_heads=2, param_dtype=jnp.float64, decode=True)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(B, 4, E)))
    variables = ours.init(jax.random.key(0), x)  # a cache of 4 slots
    params, cache = {"params": variables["params"]}, variables["cache"]
    assert set(cache) == {"cached_key", "cached_value", "cache_index", "cache_overflow"}
    cache = dict(cache, cache_index=jnp.array([0, 2], jnp.int32))

    @jax.jit
    def step(cache, token):
        out, state = ours.apply({**params, "cache": cache}, token, mutable=["cache"])
        return out, state["cache"]

    flags = []
    for t in range(4):
        _, cache = step(cache, x[:, t % 4:t % 4 + 1])
        flags.append(np.asarray(cache["cache_overflow"]).tolist())
    assert flags == [[False, False], [False, False], [False, True], [False, True]]
    assert np.asarray(cache["cache_index"]).tolist() == [4, 6]
    eager = dict(variables["cache"], cache_index=jnp.array([0, 4], jnp.int32))
    with pytest.raises(ValueError, match="the cache overflows: row 1 would hold positions up to 4 in max_length 4"):
        ours.apply({**params, "cache": eager}, x[:, :1], mutable=["cache"])


def _flax_exact(query, key, value, module=None, **kwargs):
    """flax's attention by its explicit formula (its default takes the softmax in float32)."""
    class Silent:
        def sow(self, *args, **kwargs):
            pass

    return nnx.dot_product_attention(query, key, value, module=module or Silent(), **kwargs)


def test_flax_decode_loops_give_our_outputs():
    """flax's own ``decode=True`` loops (nnx and linen), the same weights, one token a call."""
    layer, _, xj, _ = _pair(2, "float64")
    theirs = nnx.MultiHeadAttention(H, E, num_kv_heads=2, param_dtype=jnp.float64, decode=True,
                                    attention_fn=_flax_exact, rngs=nnx.Rngs(0))
    theirs.init_cache((B, T, E), jnp.float64)
    flax_out = jnp.concatenate([theirs(xj[:, t:t + 1]) for t in range(T)], axis=1)
    assert _rel(_decode_jax(layer, xj, [1] * T), flax_out) <= TOL["float64"]
    viewed = nnx.view(mha_jax.MultiHeadAttention(H, E, num_kv_heads=2, param_dtype=jnp.float64, rngs=nnx.Rngs(0)),
                      decode=True, batch_size=B, max_length=T)
    assert _rel(jnp.concatenate([viewed(xj[:, t:t + 1]) for t in range(T)], axis=1), flax_out) <= TOL["float64"]

    ours = mha_jax.linen.MultiHeadDotProductAttention(H, param_dtype=jnp.float64, decode=True)
    flax_linen = linen.MultiHeadDotProductAttention(H, param_dtype=jnp.float64, decode=True)  # linen's formula is exact
    variables = ours.init(jax.random.key(0), xj)
    params, ours_cache = {"params": variables["params"]}, variables["cache"]
    flax_cache = flax_linen.init(jax.random.key(0), xj)["cache"]
    a, b = [], []
    for t in range(T):
        out, ours_cache = ours.apply({**params, "cache": ours_cache}, xj[:, t:t + 1], mutable=["cache"])
        a.append(out)
        out, flax_cache = flax_linen.apply({**params, "cache": flax_cache}, xj[:, t:t + 1], mutable=["cache"])
        b.append(out)
        ours_cache, flax_cache = ours_cache["cache"], flax_cache["cache"]
    assert _rel(jnp.concatenate(a, axis=1), jnp.concatenate(b, axis=1)) <= TOL["float64"]


def _greedy(step, embed, first, n):
    """``n`` greedy steps of a one-layer toy decoder from tokens ``first`` ``(batch,)``: ``step``
    maps an embedded token ``(batch, 1, E)`` to ``(batch, 1, E)``, scored against ``embed``
    ``(vocab, E)``; the tokens ``(batch, n + 1)`` and outputs ``(batch, n, E)``."""
    tokens, outs = [first], []
    for _ in range(n):
        out = step(embed[tokens[-1]][:, None])
        outs.append(out)
        tokens.append(jnp.argmax(out[:, 0] @ embed.T, axis=-1))
    return jnp.stack(tokens, axis=1), jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_a_cache_made_by_flax_decodes_in_ours(framework):
    """A cache flax's class made (a scalar ``cache_index``, no ``cache_overflow``), fresh or after
    3 of flax's steps, taken by ours (linen: as the ``'cache'`` collection; nnx: ``nnx.update``
    of its state): the same greedy tokens and outputs as flax's own loop, and ours' per-row
    index and flag after."""
    embed = jnp.asarray(np.random.default_rng(8).normal(size=(11, E)))
    first = jnp.array([3, 7])
    if framework == "nnx":
        def flax_module():
            module = nnx.MultiHeadAttention(H, E, num_kv_heads=2, param_dtype=jnp.float64, decode=True,
                                            attention_fn=_flax_exact, rngs=nnx.Rngs(0))
            module.init_cache((B, T, E), jnp.float64)
            return module

        def continue_in_ours(theirs, n, tokens):
            ours = mha_jax.MultiHeadAttention(H, E, num_kv_heads=2, param_dtype=jnp.float64, decode=True,
                                              rngs=nnx.Rngs(0))
            nnx.update(ours, nnx.state(theirs, nnx.Cache))
            assert ours.cache_overflow is None  # flax's cache: the step makes the flag
            out = _greedy(ours, embed, tokens, n)
            return out, (ours.cache_index[...], ours.cache_overflow[...])
    else:
        ours_linen = mha_jax.linen.MultiHeadDotProductAttention(H, param_dtype=jnp.float64, decode=True)
        flax_linen = linen.MultiHeadDotProductAttention(H, param_dtype=jnp.float64, decode=True)
        variables = flax_linen.init(jax.random.key(0), jnp.zeros((B, T, E)))

        class Looped:  # a linen module with its variables, called as the nnx one
            def __init__(self, module, variables):
                self.module, self.variables = module, variables

            def __call__(self, x):
                out, cache = self.module.apply(self.variables, x, mutable=["cache"])
                self.variables = {**self.variables, **cache}
                return out

        def flax_module():
            return Looped(flax_linen, variables)

        def continue_in_ours(theirs, n, tokens):
            assert set(theirs.variables["cache"]) == {"cached_key", "cached_value", "cache_index"}
            assert theirs.variables["cache"]["cache_index"].shape == ()
            ours = Looped(ours_linen, theirs.variables)
            out = _greedy(ours, embed, tokens, n)
            return out, (ours.variables["cache"]["cache_index"], ours.variables["cache"]["cache_overflow"])

    tokens, outs = _greedy(flax_module(), embed, first, 8)  # flax's own loop
    assert len(np.unique(np.asarray(tokens))) > 3  # tokens that depend on what came before
    (fresh_tokens, fresh_outs), (index, overflow) = continue_in_ours(flax_module(), 8, first)
    assert np.array_equal(fresh_tokens, tokens) and _rel(fresh_outs, outs) <= TOL["float64"]
    assert index.tolist() == [8, 8] and overflow.tolist() == [False, False]
    theirs = flax_module()
    _greedy(theirs, embed, first, 3)
    (later_tokens, later_outs), _ = continue_in_ours(theirs, 5, tokens[:, 3])
    assert np.array_equal(later_tokens, tokens[:, 3:]) and _rel(later_outs, outs[:, 3:]) <= TOL["float64"]


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_flax_float_masks_while_decoding(framework):
    """flax's own float32 0/1 masks (``make_attention_mask`` of keys with holes combined by
    ``combine_masks`` with ``make_causal_mask``), their rows for each step spanning the cache,
    while decoding in chunks (nnx ``decode=True``, linen's ``'cache'``): the full pass with the
    whole mask, and the same decoding with the mask as bool (nonzero = attend, never additive)."""
    x = jnp.asarray(np.random.default_rng(9).normal(size=(B, T, E)))
    keys = np.ones((B, T), np.int32)
    keys[0, [1, 4, 7]] = keys[1, [2, 3]] = 0  # holes; every query still sees key 0
    make = nnx if framework == "nnx" else linen
    mask = make.combine_masks(make.make_attention_mask(jnp.ones((B, T)), jnp.asarray(keys)),
                              make.make_causal_mask(jnp.ones((B, T))))
    assert mask.dtype == jnp.float32 and mask.shape == (B, 1, T, T)
    if framework == "nnx":
        layer = mha_jax.MultiHeadAttention(H, E, num_kv_heads=2, param_dtype=jnp.float64, decode=True, rngs=nnx.Rngs(0))

        def full_pass(mask):
            return layer(x, mask=mask, decode=False)

        def decode(mask):
            layer.init_cache((B, T, E), jnp.float64)
            return [layer(x[:, t:t + n], mask=mask[:, :, t:t + n]) for t, n in ((0, 3), (3, 1), (4, 4), (8, 2))]
    else:
        module = mha_jax.linen.MultiHeadDotProductAttention(H, num_kv_heads=2, param_dtype=jnp.float64, decode=True)
        variables = module.init(jax.random.key(0), x)

        def full_pass(mask):
            plain = mha_jax.linen.MultiHeadDotProductAttention(H, num_kv_heads=2, param_dtype=jnp.float64)
            return plain.apply({"params": variables["params"]}, x, mask=mask)

        def decode(mask):
            outs, state = [], variables
            for t, n in ((0, 3), (3, 1), (4, 4), (8, 2)):
                out, cache = module.apply(state, x[:, t:t + n], mask=mask[:, :, t:t + n], mutable=["cache"])
                outs.append(out)
                state = {**state, **cache}
            return outs

    full = full_pass(mask)
    assert _rel(full, full_pass(make.make_causal_mask(jnp.ones((B, T))))) > 1e-2  # the holes act
    floats, bools = jnp.concatenate(decode(mask), axis=1), jnp.concatenate(decode(mask != 0), axis=1)
    assert _rel(floats, full) <= TOL["float64"]
    assert _rel(floats, bools) <= TOL["float64"]


def test_bad_caches_fail_by_name():
    layer, twin, xj, xt = _pair(2, "float32")
    with pytest.raises(ValueError, match="decode=True needs a cache: call init_cache"):
        layer(xj[:, :1], decode=True)
    layer.init_cache((B + 1, T, E), jnp.float32)
    with pytest.raises(ValueError, match=r"the cache holds cached_key \(3, 10, 2, 4\)"):
        layer(xj[:, :1], decode=True)
    layer.init_cache((B, T, E), jnp.float64)
    with pytest.raises(TypeError, match="cached_key has dtype float64 but the keys are float32"):
        layer(xj[:, :1], decode=True)
    layer.init_cache((B, 4, E), jnp.float32)
    with pytest.raises(ValueError, match="a chunk of 5 tokens does not fit a cache of max_length 4"):
        layer(xj[:, :5], decode=True)
    with pytest.raises(ValueError, match="key_value_seq_lengths cannot be given while decoding"):
        layer(xj[:, :1], decode=True, key_value_seq_lengths=jnp.array([1, 1]))
    with pytest.raises(TypeError, match="query_positions must be integer, got dtype float32"):
        layer(xj[:, :1], decode=True, query_positions=jnp.zeros((B, 1), jnp.float32))
    shape_message = re.escape("query_positions must have shape (batch, n) = (2, 1) or (n,) = (1,) while decoding, "
                              "got (2,)")
    with pytest.raises(ValueError, match=shape_message):
        layer(xj[:, :1], decode=True, query_positions=jnp.zeros((B,), jnp.int32))
    with torch.no_grad():
        with pytest.raises(TypeError, match="query_positions must be integer, got dtype float32"):
            twin(xt[:, :1], cache=mha_torch.KVCache(B, T, 2, E // H), query_positions=torch.zeros(B, 1))
        with pytest.raises(ValueError, match=shape_message):
            twin(xt[:, :1], cache=mha_torch.KVCache(B, T, 2, E // H), query_positions=torch.zeros(B, dtype=torch.int32))
        with pytest.raises(ValueError, match=r"the cache holds key \(3, 10, 2, 4\)"):
            twin(xt[:, :1], cache=mha_torch.KVCache(B + 1, T, 2, E // H))
        with pytest.raises(TypeError, match="the cache's key has dtype float64 but the keys are float32"):
            twin(xt[:, :1], cache=mha_torch.KVCache(B, T, 2, E // H, dtype=torch.float64))
        with pytest.raises(ValueError, match="a chunk of 5 tokens does not fit a cache of max_length 4"):
            twin(xt[:, :5], cache=mha_torch.KVCache(B, 4, 2, E // H))
        with pytest.raises(ValueError, match="key_value_seq_lengths cannot be given while decoding"):
            twin(xt[:, :1], cache=mha_torch.KVCache(B, T, 2, E // H), key_value_seq_lengths=torch.tensor([1, 1]))
        with pytest.raises(TypeError, match="cache must be an mha_torch.KVCache"):
            twin(xt[:, :1], cache={"key": None})


def test_greedy_generation_example_gives_the_same_tokens_in_both_frameworks():
    """``examples/generate.py``: a tiny decoder on our modules, converted, generates the same
    tokens in both frameworks; the left-padded row generates what its prompt alone does."""
    example = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "generate.py"))
    prompts = np.array([[5, 9, 13, 2, 7], [0, 0, 11, 3, 8]])
    positions = np.array([[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2]])
    flax_tokens, torch_tokens = example["generate"](prompts, positions, steps=8)
    assert np.array_equal(flax_tokens, torch_tokens)
    alone, _ = example["generate"](prompts[1:, 2:], positions[1:, 2:], steps=8)
    assert np.array_equal(flax_tokens[1], alone[0])


FAST_CASES = {  # what a layer adds to the attention the fast path gives
    "rotary, RMS QK-norm, scale": dict(rotary=mha_torch.RotaryEmbedding(E // H), normalize_qk=mha_torch.QKNorm("rms"),
                                       scale=0.3),
    "sinks": dict(use_sinks=True),
    "soft-cap, weights": dict(logit_soft_cap=2.0, implementation="math"),
}
FAST_STEPS = [(4, False), (1, True), (1, True), (2, False), (1, True)]  # (tokens, is_causal)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("batch_shape", [(B,), (2, 3), ()], ids=str)
@pytest.mark.parametrize("case", sorted(FAST_CASES))
def test_torch_fast_path_gives_the_general_paths_and_the_uncached_outputs(case, batch_shape, grad):
    """Every row at one position with nothing but the cache restricting the keys (chunks without causality, one
    token with it): the fast path takes each step, under autograd and with any batch axes too, and gives in float64
    the outputs (weights over the filled slots), cache and input gradients of the general path (forced here) and of
    the attention without a cache over the keys so far at their positions; rows at two positions take the general
    path."""
    twin = mha_torch.MultiHeadAttention(E, H, num_kv_heads=2, dtype=torch.float64, **FAST_CASES[case]).eval()
    if twin.sinks is not None:
        torch.nn.init.normal_(twin.sinks)
    need_weights = twin.logit_soft_cap is not None
    x = torch.from_numpy(np.random.default_rng(5).normal(size=(*batch_shape, T, E)))
    taken = []

    def decode(cached: bool, fast: bool = True):
        xs = x.clone().requires_grad_(grad)
        cache = mha_torch.KVCache(batch_shape, T, 2, E // H, dtype=torch.float64)
        outs, weights, t = [], [], 0
        with torch.set_grad_enabled(grad), torch_testing.tuned(fast_step=fast):
            for n, causal in FAST_STEPS:
                if cached:
                    with torch_testing.observed() as seen:
                        result = twin(xs[..., t:t + n, :], cache=cache, is_causal=causal, need_weights=need_weights)
                    taken.append(("fast_step", n) in seen)
                else:
                    result = twin(xs[..., t:t + n, :], xs[..., :t + n, :], is_causal=causal, need_weights=need_weights,
                                  query_positions=torch.arange(t, t + n), key_positions=torch.arange(t + n))
                out, w = result if need_weights else (result, None)
                outs.append(out)
                weights.append(None if w is None else w[..., :t + n].detach())
                t += n
        out = torch.cat(outs, dim=-2)
        if grad:
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum().backward()
        return out.detach(), weights, (cache.index, cache.key.detach(), cache.value.detach()), xs.grad

    fast = decode(cached=True)
    assert taken == [True] * len(FAST_STEPS)
    forced, reference = decode(cached=True, fast=False), decode(cached=False)
    assert taken[len(FAST_STEPS):] == [False] * len(FAST_STEPS)
    for other in (forced, reference):
        assert _rel(fast[0], other[0]) <= TOL["float64"]
        if need_weights:
            assert all(_rel(a, b) <= TOL["float64"] for a, b in zip(fast[1], other[1]))
        if grad:
            assert _rel(fast[3], other[3]) <= TOL["float64"]
    assert torch.equal(fast[2][0], forced[2][0])  # the index; the keys and values:
    assert all(_rel(a, b) <= TOL["float64"] for a, b in zip(fast[2][1:], forced[2][1:]))
    if batch_shape == (B,):
        cache = mha_torch.KVCache(B, T, 2, E // H, dtype=torch.float64)
        cache.index.copy_(torch.tensor([0, 1], dtype=torch.int32))
        with torch.no_grad(), torch_testing.observed() as seen:
            twin(x[:, :1], cache=cache)
        assert not any(event == "fast_step" for event, _ in seen) and cache.index.tolist() == [1, 2]
