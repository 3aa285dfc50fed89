"""The core on 8 devices: data parallel, head parallel and both, on Auto and Explicit meshes and
inside ``jax.shard_map`` (``check_vma=True``), forward and gradients against the same function on
one device; and what the compiled programs communicate.

Needs 8 devices, so it runs in a process of its own (``.ci/run``):
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q parity_tests/test_mesh.py``.
In the main run (1 device) only the check that CI runs it that way is not skipped.

Shapes are shared by every test (each new one compiles anew), and small: the blockwise kernel
runs on blocks of 16 and 32 (as ``test_blockwise`` does; at its own sizes, 256 x 256 for batch x
heads = 64, the same coverage would take lengths over 512, many times slower here), so that a
length of 72 gives 3 to 5 blocks, the last padded: causality, windows and segments leave whole,
partial and empty blocks.
"""

import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mha_jax import testing
from mha_jax.attention import dot_product_attention
from parity_tests.eight_devices import COLLECTIVES, ci_runs_on_8_devices, needs_8

B, L, H, D = 8, 72, 8, 8
TOLERANCE = {"float32": 1e-6, "float64": 1e-12}  # max |sharded - one device| / max |one device|


def test_ci_runs_this_file_on_8_devices():
    assert ci_runs_on_8_devices()


@pytest.fixture(autouse=True, scope="module")
def small_blocks():
    """Forward blocks of 32 queries x 16 keys (3 x 5), backward blocks of 16 x 32 (5 x 3), bands
    of 16 queries (5)."""
    with testing.tuned(blocks=(32, 16), backward_blocks=(16, 32), band_block=16):  # bands: windows at default positions
        yield


@functools.cache
def _data(dtype, kv_heads=H):
    """Inputs of every case, as NumPy arrays: q, k, v, bias, cotangent, and the masking terms."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, L, H, D)).astype(dtype)
    k, v = (rng.standard_normal((B, L, kv_heads, D)).astype(dtype) for _ in range(2))
    bias = (0.5 * rng.standard_normal((1, H, L, L))).astype(dtype)
    cot = rng.standard_normal((B, L, H, D)).astype(dtype)
    lengths = np.array([L, 40, 33, 17, 64, 1, 50, 32], np.int32)
    valid = np.arange(L)[None] < lengths[:, None]
    # packed rows: segments of random lengths, a different packing per batch element
    segments = np.stack([np.cumsum(rng.random(L) < 0.08) for _ in range(B)]).astype(np.int32)
    positions = (np.arange(L)[None] + rng.integers(0, 20, (B, 1))).astype(np.int32)
    keep = rng.random((B, H, L, L)) > 0.1
    terms = dict(lengths=lengths, valid=valid, segments=segments, positions=positions, keep=keep)
    return (q, k, v, bias, cot), terms


# What each piece is sharded along: batch on "data", heads on "model" (P for the global arrays).
SPECS = dict(q=P("data", None, "model"), k=P("data", None, "model"), v=P("data", None, "model"),
             bias=P(None, "model"), cot=P("data", None, "model"), lengths=P("data"), valid=P("data"),
             segments=P("data"), positions=P("data"), keep=P("data", "model"))
CASES = ("padding+bias", "causal+dropout", "window+positions+lengths", "segments+causal", "window+segments+lengths")
GRADS = ("output", "dq", "dk", "dv", "dbias")


def _case(case, implementation, q, k, v, bias, t, rng):
    """One attention call of a named case; ``rng`` draws dropout where given, else ``t["keep"]``."""
    common = dict(implementation=implementation)
    drop = dict(dropout_rate=0.1, **(dict(dropout_rng=rng) if rng is not None else dict(dropout_mask=t["keep"])))
    if case == "padding+bias":
        return dot_product_attention(q, k, v, mask=t["valid"][:, None, None, :], bias=bias, **common)
    if case == "causal+dropout":
        return dot_product_attention(q, k, v, is_causal=True, **drop, **common)
    if case == "causal+window+dropout":  # every term shared by the batch
        return dot_product_attention(q, k, v, is_causal=True, local_window_size=(24, 0), **drop, **common)
    if case == "window+positions+lengths":
        return dot_product_attention(q, k, v, local_window_size=(20, 5), query_positions=t["positions"],
                                     key_positions=t["positions"], key_value_seq_lengths=t["lengths"], **common)
    if case == "window+segments+lengths":  # over default positions: the bands of ``_band``
        return dot_product_attention(q, k, v, is_causal=True, local_window_size=(20, 0),
                                     query_segment_ids=t["segments"], key_segment_ids=t["segments"],
                                     key_value_seq_lengths=t["lengths"], **common)
    assert case == "segments+causal"
    return dot_product_attention(q, k, v, is_causal=True, query_segment_ids=t["segments"],
                                 key_segment_ids=t["segments"], **common)


def _grads(implementation, cases, use_rng, q, k, v, bias, cot, t):
    """Per case: the output and the gradients of <output, cot> by q, k, v and the bias."""
    rng = jax.random.key(7) if use_rng else None
    results = {}
    for case in cases:
        f = functools.partial(lambda c, q, k, v, bias: _case(c, implementation, q, k, v, bias, t, rng), case)
        out, vjp = jax.vjp(f, q, k, v, bias)
        results[case] = (out, *vjp(cot.astype(out.dtype)))
    return results


@functools.cache
def _one_device(implementation, dtype, cases, use_rng=False, kv_heads=H):
    (q, k, v, bias, cot), t = _data(dtype, kv_heads)
    f = jax.jit(functools.partial(_grads, implementation, cases, use_rng))
    return jax.tree.map(np.asarray, f(q, k, v, bias, cot, t))


def _assert_close(got, want, dtype):
    for case in want:
        for name, a, b in zip(GRADS, got[case], want[case]):
            a, b = np.asarray(a), np.asarray(b)
            err = np.abs(a - b).max() / max(np.abs(b).max(), np.finfo(b.dtype).tiny)
            assert err <= TOLERANCE[dtype], f"{case}: {name} relative error {err:.2e}"


def _mesh(shape, axis_type):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type,) * 2)


def _placed(mesh, dtype, kv_heads=H, specs=SPECS):
    (q, k, v, bias, cot), t = _data(dtype, kv_heads)
    put = lambda x, name: jax.device_put(x, NamedSharding(mesh, specs[name]))  # noqa: E731
    arrays = [put(x, n) for x, n in zip((q, k, v, bias, cot), ("q", "k", "v", "bias", "cot"))]
    return arrays, {n: put(x, n) for n, x in t.items()}


def _compiled(f, *args):
    """(results, {collective: count}, all-reduce operand types) of ``jax.jit(f)`` on ``args``."""
    compiled = jax.jit(f).lower(*args).compile()
    text = compiled.as_text()
    counts = {op: len(re.findall(rf"[ )]{op}(-start)?\(", text)) for op in COLLECTIVES}
    reduced = [line.split(" = ")[1].split(" all-reduce")[0] for line in text.splitlines()
               if re.search(r"[ )]all-reduce(-start)?\(", line)]
    return compiled(*args), counts, reduced


def _ids(x):
    return "x".join(map(str, x)) if isinstance(x, tuple) else getattr(x, "name", x)


# Each mesh shape on both axis types, each dtype on each shape (a compilation per line).
LAYOUTS = [
    ("blockwise", (8, 1), AxisType.Explicit, "float64"), ("blockwise", (8, 1), AxisType.Auto, "float32"),
    ("blockwise", (2, 4), AxisType.Explicit, "float32"), ("blockwise", (2, 4), AxisType.Auto, "float64"),
    ("blockwise", (1, 8), AxisType.Explicit, "float64"), ("blockwise", (1, 8), AxisType.Auto, "float32"),
    ("xla", (2, 4), AxisType.Explicit, "float64"), ("xla", (8, 1), AxisType.Auto, "float32"),
]


@needs_8
@pytest.mark.parametrize("implementation, shape, axis_type, dtype", LAYOUTS, ids=_ids)
def test_layout_matches_one_device(implementation, shape, axis_type, dtype):
    """Every case, forward and gradients, against one device; nothing gathered or permuted.
    Over "data", the batch-shared bias's gradient is reduced: once (blockwise on an Auto mesh:
    in the backward's loops, block by block). Blockwise on an Auto mesh also reduces the block
    tables of the per-example terms (which blocks to visit, shared by the batch): bool arrays of
    at most ``kv_len`` entries. On an Explicit mesh each device decides for its own examples."""
    mesh = _mesh(shape, axis_type)
    with jax.set_mesh(mesh):
        (q, k, v, bias, cot), t = _placed(mesh, dtype)
        got, counts, reduced = _compiled(functools.partial(_grads, implementation, CASES, False), q, k, v, bias, cot, t)
    _assert_close(got, _one_device(implementation, dtype, CASES), dtype)
    if axis_type == AxisType.Explicit:
        assert got["padding+bias"][0].sharding.spec == P("data", None, "model", None)
        assert got["padding+bias"][4].sharding.spec == P(None, "model", None, None)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, counts
    floats, tables = [r for r in reduced if "pred[" not in r], [r for r in reduced if "pred[" in r]
    if shape[0] == 1:
        assert not reduced
    elif implementation == "blockwise" and axis_type == AxisType.Auto:
        assert len(floats) == 2 and tables, reduced
        assert all(max(map(int, re.findall(r"\d+", r.split("{")[0]))) <= L for r in tables), reduced
    else:
        assert len(floats) == 1 and not tables, reduced


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=_ids)
def test_data_parallel_communicates_nothing(axis_type):
    """Batch over 8 devices, terms shared by the batch, dropout drawn from a key (the same bits
    as on one device): forward and backward with no collective at all."""
    mesh = _mesh((8, 1), axis_type)
    cases = ("causal+window+dropout",)
    with jax.set_mesh(mesh):
        (q, k, v, bias, cot), t = _placed(mesh, "float32")
        got, counts, reduced = _compiled(functools.partial(_grads, "blockwise", cases, True), q, k, v, bias, cot, t)
    assert sum(counts.values()) == 0, (counts, reduced)
    _assert_close(got, _one_device("blockwise", "float32", cases, True), "float32")


@needs_8
def test_grouped_heads_shard_with_their_group():
    """8 query heads over 2 key/value heads, heads over model=2 (Explicit): each device holds one
    key/value head and its 4 query heads; nothing gathered, only the bias's gradient reduced."""
    mesh = _mesh((4, 2), AxisType.Explicit)
    cases = ("padding+bias", "segments+causal")
    with jax.set_mesh(mesh):
        (q, k, v, bias, cot), t = _placed(mesh, "float64", kv_heads=2)
        got, counts, reduced = _compiled(functools.partial(_grads, "blockwise", cases, False), q, k, v, bias, cot, t)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, counts
    assert len(reduced) == 1 and "pred[" not in reduced[0], reduced  # the bias's gradient, over "data"
    assert got["padding+bias"][2].sharding.spec == P("data", None, "model", None)
    _assert_close(got, _one_device("blockwise", "float64", cases, kv_heads=2), "float64")


def _shard_mapped(mesh, specs, implementation, cases, kv_heads=H, use_rng=False):
    (q, k, v, bias, cot), t = _placed(mesh, "float64", kv_heads, specs)
    grads = (specs["q"], specs["q"], specs["k"], specs["v"], specs["bias"])
    f = jax.shard_map(
        functools.partial(_grads, implementation, cases, use_rng), mesh=mesh,
        in_specs=(specs["q"], specs["k"], specs["v"], specs["bias"], specs["cot"], {n: specs[n] for n in t}),
        out_specs={c: grads for c in cases}, check_vma=True,
    )
    return jax.jit(f)(q, k, v, bias, cot, t)


@needs_8
@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
def test_inside_shard_map(implementation):
    """Each device runs the core on its own batch and heads (blockwise: blocks from the local
    sizes); the bias, replicated over "data", gets its gradient summed over it."""
    mesh = _mesh((2, 4), AxisType.Explicit)
    with jax.set_mesh(mesh):
        got = _shard_mapped(mesh, SPECS, implementation, CASES)
    _assert_close(got, _one_device(implementation, "float64", CASES), "float64")


@needs_8
def test_inside_shard_map_with_replicated_keys():
    """One key/value head for 8 query heads, the query heads over 8 devices and keys and values
    on every device: their gradients are summed over the devices."""
    mesh = _mesh((1, 8), AxisType.Auto)
    specs = dict(SPECS, k=P("data"), v=P("data"))
    cases = ("causal+dropout",)
    with jax.set_mesh(mesh):
        got = _shard_mapped(mesh, specs, "blockwise", cases, kv_heads=1)
    _assert_close(got, _one_device("blockwise", "float64", cases, kv_heads=1), "float64")


@needs_8
@pytest.mark.parametrize("implementation", ["blockwise", "xla"])
def test_inside_shard_map_dropout_from_a_key(implementation):
    """Dropout drawn inside shard_map: each device draws from the key it is given (here the same
    one, so the same bits for its own batch elements; fold in ``jax.lax.axis_index`` for others)."""
    mesh = _mesh((8, 1), AxisType.Auto)
    cases = ("causal+dropout",)
    with jax.set_mesh(mesh):
        out, *grads = _shard_mapped(mesh, SPECS, implementation, cases, use_rng=True)["causal+dropout"]
    out = np.asarray(out)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    without = dot_product_attention(*_data("float64")[0][:3], is_causal=True, implementation=implementation)
    assert np.abs(out - np.asarray(without)).max() > 0.1


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=_ids)
def test_module_training_step_reduces_only_gradients(axis_type):
    """flax.nnx module, batch over 8 devices, causal blockwise attention: the step's only
    collective is the reduction of the parameters' gradients."""
    from flax import nnx

    from mha_jax.module import MultiHeadAttention

    x = np.random.default_rng(1).standard_normal((B, L, 16)).astype(np.float32)
    model = MultiHeadAttention(num_heads=H, in_features=16, implementation="blockwise", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def step(state, x):
        loss = lambda model: jnp.mean(model(x, is_causal=True) ** 2)  # noqa: E731
        return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))

    want = jax.tree.map(np.asarray, jax.jit(step)(state, x))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        got, counts, reduced = _compiled(step, state, jax.device_put(x, P("data")))
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0, counts
    assert counts["all-reduce"] >= 1 and all("pred[" not in r for r in reduced), reduced
    # against the largest gradient: the key projection's bias has a gradient of 0 in exact
    # arithmetic (softmax ignores a shift common to a row's scores), here rounding noise only
    scale = max(np.abs(b).max() for b in jax.tree.leaves(want[1]))
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0])
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert np.abs(np.asarray(a) - b).max() <= 1e-6 * scale


@needs_8
def test_grouped_heads_split_from_their_group_is_refused():
    """8 query heads over 4 devices, but 2 key/value heads: a group would be split; on an
    Explicit mesh the core says which argument and which sizes."""
    mesh = _mesh((2, 4), AxisType.Explicit)
    with jax.set_mesh(mesh):
        (q, k, v, *_), _ = _placed(mesh, "float32", 2, dict(SPECS, k=P("data"), v=P("data")))
        for implementation in ("blockwise", "xla"):
            message = (r"query's 8 heads are sharded over mesh axes \('model',\) \(4 shards\), "
                       r"which does not divide its 2 key/value")
            with pytest.raises(ValueError, match=message):
                jax.jit(functools.partial(dot_product_attention, implementation=implementation)).trace(q, k, v)


@needs_8
def test_batch_not_divisible_by_its_axis_is_refused_by_jax():
    """An axis that does not divide the batch cannot shard it: JAX refuses, naming the sizes."""
    mesh = _mesh((4, 2), AxisType.Explicit)
    q = np.zeros((6, L, H, D), np.float32)
    with pytest.raises(ValueError, match="does not evenly divide the dimension size 6"):
        jax.device_put(q, NamedSharding(mesh, SPECS["q"]))


@needs_8
def test_docs_scaling_out_examples_run():
    """At the kernel's own block sizes; the page's figures are the same layouts' counts."""
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
    blocks = page.read_text().split("```py\n")[1:]
    assert len(blocks) == 2  # the second, ring attention's, runs in test_ring
    names = {}
    with testing.tuned(**dataclasses.asdict(testing.Tuning())):
        exec(compile(blocks[0].split("```")[0], "docs/scaling.md", "exec"), names)
    assert names["out"].sharding.spec == P("data", None, "model", None)


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=_ids)
def test_decoding_with_the_cache_sharded_over_the_batch(axis_type):
    """Our nnx module decodes on ``jax.make_mesh``'s mesh with its cache and inputs sharded over
    the batch (a prompt, then one-token steps over 136 slots, which take the product over all
    heads where the mesh is Auto): the outputs of the full causal pass on one device, and the
    cache stays sharded."""
    from flax import nnx

    from mha_jax import MultiHeadAttention

    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    slots, features = 136, 32
    layer = MultiHeadAttention(4, features, num_kv_heads=2, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(B, slots, features)))
    full = layer(x, is_causal=True)
    layer.init_cache((B, slots, features), jnp.float64)
    sharded = NamedSharding(mesh, P("data"))
    nnx.update(layer, jax.tree.map(lambda a: jax.device_put(a, sharded), nnx.state(layer, nnx.Cache)))
    step = nnx.jit(lambda m, x: m(x, decode=True, is_causal=True))
    xs = jax.device_put(x, sharded)
    with jax.set_mesh(mesh):
        out = jnp.concatenate([step(layer, xs[:, :128])] + [step(layer, xs[:, t:t + 1]) for t in range(128, slots)],
                              axis=1)
    assert layer.cached_key[...].sharding.spec[0] == "data"
    err = np.abs(np.asarray(out) - np.asarray(full)).max() / np.abs(np.asarray(full)).max()
    assert err <= TOLERANCE["float64"], err


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=_ids)
def test_paged_steps_with_the_pool_sharded_over_its_heads(axis_type):
    """Our nnx module serves a sequence from pages (a prefill of 4, then 1 and 2 tokens, rotary, a window) on
    ``jax.make_mesh``'s mesh with the pool's 4 key/value heads sharded over 4 devices (each holds whole heads: an
    axis of 8 would part a head's key from its value, which explicit sharding refuses to slice): the outputs of the
    full causal pass on one device, and the pool stays sharded."""
    from flax import nnx

    from mha_jax import MultiHeadAttention, RotaryEmbedding
    from mha_jax import paged as pj
    from mha_spec.paged import PageTable

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    layer = MultiHeadAttention(8, 32, num_kv_heads=4, rotary=RotaryEmbedding(4), local_window_size=(3, 0),
                               param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(7, 32)))
    full = np.asarray(layer(x[None], is_causal=True)[0])
    table, heads = PageTable(16, 2, 2, 8), NamedSharding(mesh, P(None, None, "model"))
    cache = pj.init_cache(table, 4, 4, jnp.float64)
    step = nnx.jit(lambda m, x, c: m.paged_step(x, c, max_q_len=4))
    outs = []
    with jax.set_mesh(mesh):
        for a, b in ((0, 4), (4, 5), (5, 7)):
            cache = pj.schedule(cache, table.append([b - a, 0]))
            out, cache = step(layer, x[a:b], cache._replace(kv_pages=jax.device_put(cache.kv_pages, heads)))
            outs.append(np.asarray(out))
    assert cache.kv_pages.sharding.spec[2] == "model"
    err = np.abs(np.concatenate(outs) - full).max() / np.abs(full).max()
    assert err <= TOLERANCE["float64"], err
