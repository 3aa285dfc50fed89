"""Ring attention (``sequence_axis``) on 8 devices: the length sharded over a mesh axis of 8, of
4 beside a batch axis of 2, and of 4 beside a heads axis of 2, on Auto and Explicit meshes;
forward and gradients against the same function on one device, with the structured masking
terms and with dense masks, biases (and their gradient) and dropout (a keep-mask, and bits drawn
from a key: one device's bits); what the compiled program communicates (inside the ring's
loops: collective-permutes of one key/value block, nothing else; a mask's or bias's rows
reordered once, outside them); the modules; and the refusals.

Needs 8 devices, so it runs in a process of its own, with ``test_mesh.py`` (``.ci/run``):
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q parity_tests/test_mesh.py
parity_tests/test_ring.py``. In the main run (1 device) only the checks that need no mesh of 8
run. Shapes are small and shared (each new one compiles anew): a length of 32 is 16 chunks of 2
over 8 devices, 8 chunks of 4 over 4.
"""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from mha_jax import testing
from mha_jax.attention import dot_product_attention
from parity_tests.eight_devices import COLLECTIVES, ci_runs_on_8_devices, needs_8

B, L, H, KVH, D = 2, 32, 4, 2, 8
TOLERANCE = {"float32": 1e-6, "float64": 1e-12}  # max |ring - one device| / max |one device|


def test_ci_runs_this_file_on_8_devices():
    assert ci_runs_on_8_devices()


@pytest.fixture(autouse=True, scope="module")
def small_tiles():
    """Tiles of 2 queries x 2 keys: over 8 devices one per chunk, over 4 two, so that causality
    and windows leave whole, partial and empty tiles (skipped)."""
    with testing.tuned(ring_tile=2):
        yield


@functools.cache
def _data(dtype):
    """q, k, v, sinks, cotangent, and the masking terms, as NumPy arrays."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, L, H, D)).astype(dtype)
    k, v = (rng.standard_normal((B, L, KVH, D)).astype(dtype) for _ in range(2))
    sinks = rng.standard_normal(H).astype(dtype)
    cot = rng.standard_normal((B, L, H, D)).astype(dtype)
    terms = dict(
        lengths=np.array([L, 13], np.int32),  # 13: inside a chunk, on any of the layouts
        segments=np.stack([np.cumsum(rng.random(L) < 0.15) for _ in range(B)]).astype(np.int32),
        positions=(np.arange(L)[None] + rng.integers(0, 9, (B, 1))).astype(np.int32),
    )
    return (q, k, v, sinks, cot), terms


CASES = ("padding", "causal", "window+positions+lengths", "segments+causal", "sinks+soft_cap+causal+lengths")
GRADS = ("output", "dq", "dk", "dv", "dsinks")


def _case(case, axis, q, k, v, sinks, t):
    common = dict(sequence_axis=axis)
    if case == "padding":
        return dot_product_attention(q, k, v, key_value_seq_lengths=t["lengths"], **common)
    if case == "causal":
        return dot_product_attention(q, k, v, is_causal=True, **common)
    if case == "window+positions+lengths":
        return dot_product_attention(q, k, v, local_window_size=(7, 2), query_positions=t["positions"],
                                     key_positions=t["positions"], key_value_seq_lengths=t["lengths"], **common)
    if case == "segments+causal":
        return dot_product_attention(q, k, v, is_causal=True, query_segment_ids=t["segments"],
                                     key_segment_ids=t["segments"], **common)
    assert case == "sinks+soft_cap+causal+lengths"
    return dot_product_attention(q, k, v, sinks=sinks, logit_soft_cap=2.0, is_causal=True,
                                 key_value_seq_lengths=t["lengths"], **common)


def _grads(axis, cases, q, k, v, sinks, cot, t):
    """Per case: the output and the gradients of <output, cot> by q, k, v and the sinks."""
    results = {}
    for case in cases:
        out, vjp = jax.vjp(functools.partial(lambda c, *args: _case(c, axis, *args, t), case), q, k, v, sinks)
        results[case] = (out, *vjp(cot.astype(out.dtype)))
    return results


@functools.cache
def _one_device(dtype, cases=CASES):
    (q, k, v, sinks, cot), t = _data(dtype)
    return jax.tree.map(np.asarray, jax.jit(functools.partial(_grads, None, cases))(q, k, v, sinks, cot, t))


def _errors(got, want):
    """{(case, name): max |got - want| / max |want|}."""
    errors = {}
    for case in want:
        for name, a, b in zip(GRADS, got[case], want[case]):
            a, b = np.asarray(a), np.asarray(b)
            errors[case, name] = np.abs(a - b).max() / max(np.abs(b).max(), np.finfo(b.dtype).tiny)
    return errors


def _assert_close(got, want, dtype):
    worst = max(_errors(got, want).items(), key=lambda item: item[1])
    assert worst[1] <= TOLERANCE[dtype], f"{worst[0]} relative error {worst[1]:.2e}"


def _placed(dtype, batch, heads):
    """The inputs placed with the length over "seq" and the batch and heads over the named axes."""
    (q, k, v, sinks, cot), t = _data(dtype)
    seq = P(batch, "seq", heads)
    arrays = [jax.device_put(x, seq) for x in (q, k, v)] + [sinks, jax.device_put(cot, seq)]
    terms = dict(lengths=jax.device_put(t["lengths"], P(batch)),
                 **{n: jax.device_put(t[n], P(batch, "seq")) for n in ("segments", "positions")})
    return arrays, terms


def _computations(text):
    """{name: lines} of an HLO module's computations."""
    computations, name = {}, None
    for line in text.splitlines():
        found = re.match(r"^(?:ENTRY )?%(\S+) ", line)
        if found and line.rstrip().endswith("{"):
            name = found.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    return computations


def _collectives(lines):
    return {op: [x for x in lines if re.search(rf"[ )]{op}(-start)?\(", x)] for op in COLLECTIVES}


def _loop_bodies(text):
    """[lines of each while loop's body, with what it calls (the loops over tiles inside the
    ring's loops too)], in the order of the loops."""
    computations = _computations(text)

    def closure(name, seen):
        if name in seen or name not in computations:
            return []
        seen.add(name)
        lines = list(computations[name])
        for line in computations[name]:
            called = re.findall(r"(?:calls|body|condition|to_apply|true_computation|false_computation)"
                                r"=%([\w.\-]+)", line)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):  # every branch of a cond
                called += re.findall(r"%([\w.\-]+)", branches)
            for name_called in called:
                lines += closure(name_called, seen)
        return lines

    return [closure(body, set()) for body in re.findall(r" while\(.*body=%([\w.\-]+)", text)]


def _compiled(f, *args):
    compiled = jax.jit(f).lower(*args).compile()
    return compiled(*args), compiled.as_text()


def _ids(x):
    return "x".join(map(str, x)) if isinstance(x, tuple) else getattr(x, "name", x)


# (mesh shape, axis names, the axes of the batch and the heads, axis type, dtype): each a compilation.
LAYOUTS = [
    ((8,), ("seq",), None, None, AxisType.Explicit, "float64"),
    ((8,), ("seq",), None, None, AxisType.Auto, "float32"),
    ((2, 4), ("data", "seq"), "data", None, AxisType.Explicit, "float32"),
    ((2, 4), ("data", "seq"), "data", None, AxisType.Auto, "float64"),
    ((4, 2), ("seq", "model"), None, "model", AxisType.Explicit, "float64"),
]


@needs_8
@pytest.mark.parametrize("shape, names, batch, heads, axis_type, dtype", LAYOUTS, ids=_ids)
def test_ring_matches_one_device(shape, names, batch, heads, axis_type, dtype):
    """Every case, the output and the gradients of q, k, v and the sinks, against one device;
    nothing gathered. The output and the gradients come back as the inputs were placed."""
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    with jax.set_mesh(mesh):
        (q, k, v, sinks, cot), t = _placed(dtype, batch, heads)
        got, text = _compiled(functools.partial(_grads, "seq", CASES), q, k, v, sinks, cot, t)
    _assert_close(got, _one_device(dtype), dtype)
    found = _collectives(text.splitlines())
    assert not found["all-gather"] and not found["all-to-all"], found
    # the sinks' gradient, summed over the devices of the length (and the batch): one all-reduce
    # (Auto meshes: one more, of the batch's share)
    assert 1 <= len(found["all-reduce"]) <= 2, found["all-reduce"]
    if axis_type == AxisType.Explicit:
        for name in GRADS[:4]:
            assert tuple(got["causal"][GRADS.index(name)].sharding.spec)[:3] == (batch, "seq", heads), name


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=_ids)
def test_ring_communicates_key_value_blocks_only(axis_type):
    """Causal with padding, length over 8 devices. In the forward loop, 2 collective-permutes (the
    key and value blocks) per step; in the backward loop 4 (with them, their gradients); in
    neither anything else. Outside the loops: the zig-zag reordering, two half blocks per array
    (q, k, v and the output; the output's cotangent and the three gradients), and the last step
    taking the key/value gradients home: 24 collective-permutes in all, no gather, no reduction."""
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(axis_type,))
    cases = ("causal+lengths",)
    def grads(q, k, v, cot, lengths, axis="seq"):
        out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=lengths, sequence_axis=axis), q, k, v)
        return {cases[0]: (out, *vjp(cot), jnp.zeros(1))}

    (q, k, v, _, cot), t = _data("float32")
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, P(None, "seq")) for x in (q, k, v, cot)]
        got, text = _compiled(grads, *placed, t["lengths"])
    want = jax.tree.map(np.asarray, jax.jit(functools.partial(grads, axis=None))(q, k, v, cot, t["lengths"]))
    _assert_close(got, want, "float32")

    loops = [lines for lines in _loop_bodies(text) if any(_collectives(lines).values())]
    per_loop = sorted(len(_collectives(lines)["collective-permute"]) for lines in loops)
    assert per_loop == [2, 4], per_loop  # the ring's loops; those over tiles communicate nothing
    block = f"f32[{B},{L // 8},{KVH},{D}]"  # one device's key (or value) block, and nothing bigger
    ring = "source_target_pairs={" + ",".join(f"{{{i},{(i + 1) % 8}}}" for i in range(8)) + "}"
    for lines in loops:
        found = _collectives(lines)
        assert not found["all-gather"] and not found["all-reduce"] and not found["all-to-all"], found
        for line in found["collective-permute"]:
            assert block in line and ring in line, line
    found = _collectives(text.splitlines())
    assert not found["all-gather"] and not found["all-to-all"] and not found["all-reduce"], found
    assert len(found["collective-permute"]) == 24, len(found["collective-permute"])


@needs_8
def test_cross_lengths_one_key_value_head_nan_in_padding():
    """32 queries at positions 16..47 over 48 keys, one key/value head for 4 query heads, causal
    with a window, the second example's keys padded from 13 on and holding NaN there: as on one
    device (float64), nothing NaN."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, L, H, D))
    k, v = (rng.standard_normal((B, 48, 1, D)) for _ in range(2))
    lengths = np.array([48, 13], np.int32)
    k[1, 13:], v[1, 13:] = np.nan, np.nan
    positions = np.arange(16, 16 + L)[None]

    def grads(axis, q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(20, 0), query_positions=positions,
            key_value_seq_lengths=lengths, sequence_axis=axis), q, k, v)
        return {"cross": (out, *vjp(jnp.cos(out)), jnp.zeros(1))}

    want = jax.tree.map(np.asarray, jax.jit(functools.partial(grads, None))(q, k, v))
    with jax.set_mesh(jax.make_mesh((8,), ("seq",))):
        got = jax.jit(functools.partial(grads, "seq"))(*(jax.device_put(x, P(None, "seq")) for x in (q, k, v)))
    assert all(np.isfinite(np.asarray(x)).all() for x in got["cross"])
    _assert_close(got, want, "float64")


@needs_8
def test_modules_take_sequence_axis():
    """The nnx and linen modules (and an nnx one with a ``latent``) with ``sequence_axis``, causal,
    padded and packed: the same output and parameter gradients as without it, inputs ``(batch,
    length, features)`` over data x seq = 2 x 4 (float64); the training step gathers nothing (the
    reductions are the parameters' gradients over "data")."""
    from flax import nnx

    from mha_jax import RotaryEmbedding, linen
    from mha_jax.module import MultiHeadAttention
    from mha_spec.latent import Latent

    x = np.random.default_rng(1).standard_normal((B, L, 16))
    (_, t) = _data("float64")
    terms = dict(key_value_seq_lengths=t["lengths"], query_segment_ids=t["segments"])
    mesh = jax.make_mesh((2, 4), ("data", "seq"))

    def nnx_step(axis):
        model = MultiHeadAttention(num_heads=H, num_kv_heads=KVH, in_features=16, param_dtype=jnp.float64,
                                   sequence_axis=axis, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state, x, terms):
            out = nnx.merge(graphdef, state)(x, is_causal=True, **terms)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.value_and_grad(loss, has_aux=True), state

    def linen_step(axis):
        layer = linen.MultiHeadDotProductAttention(num_heads=H, num_kv_heads=KVH, param_dtype=jnp.float64,
                                                  sequence_axis=axis)
        params = layer.init(jax.random.key(0), x)

        def loss(params, x, terms):
            out = layer.apply(params, x, is_causal=True, **terms)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.value_and_grad(loss, has_aux=True), params

    def latent_step(axis):  # multi-head latent attention: keys and values lifted from the latent on each device
        model = MultiHeadAttention(num_heads=H, in_features=16, param_dtype=jnp.float64, sequence_axis=axis,
                                   latent=Latent(8, 4, 4, 6), rotary=RotaryEmbedding(4), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state, x, terms):
            out = nnx.merge(graphdef, state)(x, is_causal=True, **terms)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.value_and_grad(loss, has_aux=True), state

    for make in (nnx_step, linen_step, latent_step):
        step, params = make(None)
        want = jax.tree.map(np.asarray, jax.jit(step)(params, x, terms))
        with jax.set_mesh(mesh):
            step, params = make("seq")
            placed = dict(key_value_seq_lengths=jax.device_put(t["lengths"], P("data")),
                          query_segment_ids=jax.device_put(t["segments"], P("data", "seq")))
            got, text = _compiled(step, params, jax.device_put(x, P("data", "seq")), placed)
        scale = max(np.abs(b).max() for b in jax.tree.leaves(want))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.abs(np.asarray(a) - b).max() <= 1e-12 * scale, make.__name__
        found = _collectives(text.splitlines())
        assert not found["all-gather"] and not found["all-to-all"], (make.__name__, found)


# --- dense terms: masks, biases, dropout -------------------------------------------------------

RATE = 0.3  # of drawn dropout
DENSE_CASES = (
    "mask(B,1,L,L)+bias(1,H,L,L)+keep(1,H,L,L)+causal",
    "mask(L,L)+bias(B,1,1,L)+window+positions+segments+lengths",
    "mask(B,1,1,L)+drawn+soft_cap+causal+NaN keys",
)
DENSE_GRADS = ("output", "dq", "dk", "dv", "dbias")


@functools.cache
def _dense_data(dtype):
    """Masks of three broadcast shapes, biases of two (with -inf), a keep-mask of a fourth, as
    NumPy. Rows that see no key: example 1's query 5 (``rows``), head 1's query 3 (a -inf
    ``bias``); example 1's keys from 19 on are masked by ``keys`` (and hold NaN)."""
    rng = np.random.default_rng(4)
    rows = rng.random((B, 1, L, L)) < 0.7
    rows[1, 0, 5] = False
    bias = rng.standard_normal((1, H, L, L)).astype(dtype)
    bias[0, 1, 3], bias[0, 2, 7, 4] = -np.inf, -np.inf
    return dict(
        rows=rows, square=rng.random((L, L)) < 0.8,
        keys=np.arange(L)[None, None, None] < np.array([L, 19])[:, None, None, None],
        bias=bias, key_bias=rng.standard_normal((B, 1, 1, L)).astype(dtype),
        keep=rng.random((1, H, L, L)) < 0.75,
    )


def _dense_case(case, axis, q, k, v, bias, t, d):
    """``bias`` is the case's differentiated bias (``d["bias"]`` or ``d["key_bias"]``), or unused."""
    common = dict(sequence_axis=axis)
    if case == DENSE_CASES[0]:
        return dot_product_attention(q, k, v, mask=d["rows"], bias=bias, dropout_mask=d["keep"], dropout_rate=0.25,
                                     is_causal=True, **common)
    if case == DENSE_CASES[1]:
        return dot_product_attention(q, k, v, mask=d["square"], bias=bias, local_window_size=(7, 2),
                                     query_positions=t["positions"], key_positions=t["positions"],
                                     query_segment_ids=t["segments"], key_segment_ids=t["segments"],
                                     key_value_seq_lengths=t["lengths"], **common)
    assert case == DENSE_CASES[2]
    nan = jnp.logical_not(d["keys"][:, 0, 0, :, None, None])  # (B, L, 1, 1): the masked keys
    k, v = jnp.where(nan, jnp.nan, k), jnp.where(nan, jnp.nan, v)
    return dot_product_attention(q, k, v, mask=d["keys"], dropout_rate=RATE, dropout_rng=jax.random.key(7),
                                 logit_soft_cap=2.0, is_causal=True, **common)


def _dense_grads(axis, q, k, v, cot, t, d):
    """Per case: the output and the gradients of <output, cot> by q, k, v and the bias (0 without)."""
    results = {}
    for i, case in enumerate(DENSE_CASES):
        bias = (d["bias"], d["key_bias"], jnp.zeros(1, q.dtype))[i]
        f = functools.partial(lambda c, q, k, v, b: _dense_case(c, axis, q, k, v, b, t, d), case)
        out, vjp = jax.vjp(f, q, k, v, bias)
        results[case] = (out, *vjp(cot.astype(out.dtype)))
    return results


@functools.cache
def _dense_one_device(dtype):
    (q, k, v, _, cot), t = _data(dtype)
    return jax.tree.map(np.asarray, jax.jit(functools.partial(_dense_grads, None))(q, k, v, cot, t, _dense_data(dtype)))


def _dense_errors(got, want):
    """{(case, name): max |got - want| / max |want|} (a gradient that is 0 everywhere: max |got|)."""
    errors = {}
    for case in want:
        for name, a, b in zip(DENSE_GRADS, got[case], want[case]):
            a, b = np.asarray(a), np.asarray(b)
            error = np.abs(a - b).max() / max(np.abs(b).max(), 1.0 if not b.any() else 0.0)
            errors[case, name] = np.inf if np.isnan(error) else error  # NaN where one device has none
    return errors


def _dense_placed(d, batch, heads):
    """Each term with its query axis over "seq", its examples and heads as the query's (an axis of
    1 left whole): device i holds its rows, every key column."""
    def place(x):
        x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
        entries = (batch if x4.shape[0] > 1 else None, heads if x4.shape[1] > 1 else None,
                   "seq" if x4.shape[2] > 1 else None, None)[4 - x.ndim:]
        return jax.device_put(x, P(*entries))

    return {name: place(x) for name, x in d.items()}


@needs_8
@pytest.mark.parametrize("shape, names, batch, heads, axis_type, dtype", LAYOUTS, ids=_ids)
def test_ring_takes_masks_bias_dropout(shape, names, batch, heads, axis_type, dtype):
    """Dense masks of three broadcast shapes, biases of two (with their gradient), an explicit
    keep-mask and dropout drawn from a key, with structured terms, against one device: the
    output and the gradients of q, k, v and the bias (drawn dropout: the bits one device draws,
    on a ring of 8 or 4). Rows that see no key give exactly 0 and gradients 0; NaN in keys
    the mask hides reaches nothing. Nothing gathered; in the ring's loops, collective-permutes of
    key/value blocks only (on an Auto mesh with the batch over "data", the gradient of a bias
    shared by the batch is all-reduced over it tile by tile, as the blockwise kernel does)."""
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
    with jax.set_mesh(mesh):
        (q, k, v, _, cot), t = _placed(dtype, batch, heads)
        d = _dense_placed(_dense_data(dtype), batch, heads)
        got, text = _compiled(functools.partial(_dense_grads, "seq"), q, k, v, cot, t, d)
    errors = _dense_errors(got, _dense_one_device(dtype))
    worst = max(errors.items(), key=lambda item: item[1])
    assert worst[1] <= TOLERANCE[dtype], f"{worst[0]} relative error {worst[1]:.2e}"
    out, dq, dk, dv, dbias = (np.asarray(x) for x in got[DENSE_CASES[0]])
    assert not out[1, 5].any() and not dq[1, 5].any()  # the mask's empty row
    assert not out[:, 3, 1].any() and not dq[:, 3, 1].any() and not dbias[0, 1, 3].any()  # the bias's
    assert all(np.isfinite(np.asarray(x)).all() for x in got[DENSE_CASES[2]])
    found = _collectives(text.splitlines())
    assert not found["all-gather"] and not found["all-to-all"], found
    b, length = B // (2 if batch else 1), L // mesh.shape["seq"]
    # a key/value block (or its gradient), or its per-key terms (key positions, segment ids)
    blocks = (f"[{b},{length},{KVH // (2 if heads else 1)},{D}]", f"s32[{b},{length}]", f"s32[1,{length}]")
    for lines in _loop_bodies(text):
        inside = _collectives(lines)
        assert all(any(x in line for x in blocks) for line in inside["collective-permute"]), (
            inside["collective-permute"])
        assert not inside["all-reduce"] or (axis_type == AxisType.Auto and batch), inside["all-reduce"]


@needs_8
def test_explicit_ring_takes_a_bias_not_split_over_it():
    """On an Explicit sequence axis, a bias replicated over the devices (made inside the function,
    say): the gradients of q, k, v and the bias, each with its input's sharding, equal one device's."""
    (q, k, v, _, cot), _ = _data("float64")
    bias = np.asarray(_dense_data("float64")["bias"])

    def loss(q, k, v, bias, axis):
        out = dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation="blockwise", sequence_axis=axis)
        return (out * cot).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))
    want = grads(q, k, v, bias, None)
    with jax.set_mesh(jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Explicit,))):
        got = jax.jit(grads, static_argnums=4)(q, k, v, bias, "seq")
    assert tuple(jax.typeof(got[3]).sharding.spec) == (None,) * 4
    for name, w, g in zip(("dq", "dk", "dv", "dbias"), want, got):
        error = np.abs(np.asarray(g) - np.asarray(w)).max() / np.abs(np.asarray(w)).max()
        assert error <= TOLERANCE["float64"], f"{name}: relative error {error:.2e}"


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=_ids)
def test_ring_with_mask_and_bias_communicates_their_rows_once(axis_type):
    """As ``test_ring_communicates_key_value_blocks_only``, with a mask ``(B, 1, L, L)`` and a bias
    ``(1, H, L, L)`` (and its gradient) placed by query rows: the loops are the same (2 and 4
    collective-permutes of a key/value block, nothing else: the terms' columns are sliced where
    they are, their rows never travel round the ring); outside them, 6 collective-permutes more,
    the mask's and the bias's rows reordered once each (two half blocks: ``B x L/16 x L``
    booleans, ``H x L/16 x L`` floats; the backward's reordering is the forward's, XLA computes it
    once) and the bias's gradient taken back to the user's order. No gather, no reduction."""
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(axis_type,))
    d = _dense_data("float32")

    def grads(q, k, v, cot, lengths, mask, bias, axis="seq"):
        out, vjp = jax.vjp(lambda q, k, v, bias: dot_product_attention(
            q, k, v, mask=mask, bias=bias, is_causal=True, key_value_seq_lengths=lengths, sequence_axis=axis),
            q, k, v, bias)
        return {"mask+bias": (out, *vjp(cot))}

    (q, k, v, _, cot), t = _data("float32")
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, P(None, "seq")) for x in (q, k, v, cot)]
        dense = [jax.device_put(d[name], P(None, None, "seq")) for name in ("rows", "bias")]
        got, text = _compiled(grads, *placed, t["lengths"], *dense)
    want = jax.jit(functools.partial(grads, axis=None))(q, k, v, cot, t["lengths"], d["rows"], d["bias"])
    errors = _dense_errors(got, jax.tree.map(np.asarray, want))
    assert max(errors.values()) <= TOLERANCE["float32"], errors

    loops = [lines for lines in _loop_bodies(text) if any(_collectives(lines).values())]
    per_loop = sorted(len(_collectives(lines)["collective-permute"]) for lines in loops)
    assert per_loop == [2, 4], per_loop
    block = f"f32[{B},{L // 8},{KVH},{D}]"
    for lines in loops:
        found = _collectives(lines)
        assert not found["all-gather"] and not found["all-reduce"] and not found["all-to-all"], found
        assert all(block in line for line in found["collective-permute"]), found["collective-permute"]
    found = _collectives(text.splitlines())
    assert not found["all-gather"] and not found["all-to-all"] and not found["all-reduce"], found
    permutes = found["collective-permute"]
    mask_rows = [line for line in permutes if re.search(r"= pred\[", line)]
    bias_rows = [line for line in permutes if f"f32[1,{KVH},{H // KVH},{L // 16},{L}]" in line]
    assert len(mask_rows) == 2 and all(f"pred[{B},1,1,{L // 16},{L}]" in line for line in mask_rows), mask_rows
    assert len(bias_rows) == 4, bias_rows  # the bias's rows in, its gradient's out
    assert len(permutes) == 30, len(permutes)


@needs_8
def test_drawn_dropout_is_one_devices_draw_on_rings_of_8_and_4():
    """Queries 0 (every weight 1/L) and values 1: each output is (kept keys of its row) x
    keep_scale / L, so the ring's output reads off how many keys each row keeps. On a ring of 8
    and one of 4 (beside a batch axis of 2) these counts are those of ``jax.random.bernoulli(key,
    1 - rate, (B, H, L, L))``, the draw of ``implementation="xla"`` on one device; the kept
    fraction is within 0.02 of ``1 - rate`` (8192 draws: 5 standard deviations); rate 0 with a
    key is no dropout."""
    key = jax.random.key(11)
    q = np.zeros((B, L, H, D), np.float32)
    k = np.random.default_rng(5).standard_normal((B, L, KVH, D)).astype(np.float32)
    v = np.ones((B, L, KVH, D), np.float32)

    def attend(q, k, v, axis="seq"):
        drawn = dot_product_attention(q, k, v, dropout_rate=RATE, dropout_rng=key, sequence_axis=axis)
        return drawn, dot_product_attention(q, k, v, dropout_rate=0.0, dropout_rng=key, sequence_axis=axis)

    want = np.asarray(jax.random.bernoulli(key, 1.0 - RATE, (B, H, L, L))).sum(axis=-1).transpose(0, 2, 1)  # (B, L, H)
    assert abs(want.mean() / L - (1.0 - RATE)) <= 0.02
    counts = {}
    for shape, names, batch in (((8,), ("seq",), None), ((2, 4), ("data", "seq"), "data")):
        with jax.set_mesh(jax.make_mesh(shape, names)):
            drawn, kept = jax.jit(attend)(*(jax.device_put(x, P(batch, "seq")) for x in (q, k, v)))
        counts[shape] = np.asarray(drawn)[..., 0] * L * (1.0 - RATE)
        np.testing.assert_array_equal(np.round(counts[shape]), want)
        np.testing.assert_allclose(counts[shape], want, atol=1e-4)
        np.testing.assert_allclose(np.asarray(kept), 1.0, atol=1e-6)
    np.testing.assert_allclose(counts[(8,)], counts[(2, 4)], atol=1e-4)


def _refusal(mesh_shape, names, message, **kwargs):
    (q, k, v, *_), _ = _data("float32")
    length = kwargs.pop("length", L)
    q, k, v = (x[:, :length] for x in (q, k, v))
    with jax.set_mesh(jax.make_mesh(mesh_shape, names)):
        with pytest.raises(ValueError, match=message):
            jax.jit(functools.partial(dot_product_attention, **kwargs)).trace(q, k, v)


def test_no_mesh_is_refused():
    (q, k, v, *_), _ = _data("float32")
    with pytest.raises(ValueError, match=r"sequence_axis='seq' needs a mesh: call under jax.set_mesh"):
        dot_product_attention(q, k, v, sequence_axis="seq")


@needs_8
@pytest.mark.parametrize("case", ["not in mesh", "size 1", "length", "dropout_rng", "weights", "cudnn"])
def test_bad_input_is_refused_by_name(case):
    """Each refusal names the argument and the sizes."""
    refusals = {
        "not in mesh": ((8,), ("data",),
                        r"sequence_axis='seq' is not an axis of the mesh, whose axes are \{'data': 8\}",
                        dict(sequence_axis="seq")),
        "size 1": ((8, 1), ("data", "seq"), r"sequence_axis='seq' has size 1 in the mesh \{'data': 8, 'seq': 1\}: "
                   r"a ring needs 2 devices or more", dict(sequence_axis="seq")),
        "length": ((8,), ("seq",), r"sequence_axis='seq' of size 8 needs q_len to be a multiple of 2 x 8 = 16 \(each "
                   r"device holds a front and a back chunk\), got q_len=24", dict(sequence_axis="seq", length=24)),
        "dropout_rng": ((8,), ("seq",), r"sequence_axis='seq' with dropout_rate > 0 needs dropout_rng to be one PRNG "
                        r"key \(jax.random.key\(seed\)\), got \w+ with shape \(3,\) and dtype key<fry>",
                        dict(sequence_axis="seq", dropout_rate=0.1,
                             dropout_rng=jax.random.split(jax.random.key(0), 3))),
        "weights": ((8,), ("seq",), r"does not take return_weights=True",
                    dict(sequence_axis="seq", return_weights=True)),
        "cudnn": ((8,), ("seq",), r"does not take implementation='cudnn'",
                  dict(sequence_axis="seq", implementation="cudnn")),
    }
    shape, names, message, kwargs = refusals[case]
    _refusal(shape, names, message, **kwargs)


@needs_8
def test_inside_shard_map_over_the_axis_is_refused():
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
    (q, k, v, *_), _ = _data("float32")
    f = jax.shard_map(functools.partial(dot_product_attention, sequence_axis="seq"), mesh=mesh,
                      in_specs=P(None, "seq"), out_specs=P(None, "seq"))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"sequence_axis='seq' is already manual here "
                                                             r"\(inside jax.shard_map over it\)"):
        jax.jit(f).trace(q, k, v)


@needs_8
def test_docs_ring_example_runs():
    """At the ring's own tile size."""
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
    blocks = page.read_text().split("```py\n")[1:]
    assert len(blocks) == 2
    names = {}
    with testing.tuned(ring_tile=testing.Tuning.ring_tile):
        exec(compile(blocks[1].split("```")[0], "docs/scaling.md", "exec"), names)
    assert tuple(names["out"].sharding.spec)[:2] == ("data", "seq")
