"""Our Flax modules are drop-ins for flax's: the same constructor and call, the same parameters
from the same ``Rngs``/key, and the same outputs and gradients as ``flax.nnx.MultiHeadAttention``
and ``flax.linen.MultiHeadDotProductAttention`` across their interface (options, batch axes,
flax's masks, dropout from a shared key, sown weights, views), under the transformations a
Flax model uses. The one deliberate difference, a query that may see no key, is shown too.

Flax's default attention (``jax.nn.dot_product_attention``'s XLA kernel) takes the softmax in
float32 even for float64 inputs; its explicit formula (taken with ``sow_weights=True``) is
exact. Float64 comparisons use that one (``_flax_exact``), float32 ones flax's default.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen, nnx
from jax import export

import mha_jax
import mha_torch
from parity_tests.conftest import X64

pytestmark = pytest.mark.skipif(not X64, reason="compares float64 with flax")

L, E = 5, 16
TOL = {"float64": 1e-12, "float32": 1e-6}
CONFIGS = {
    "self": dict(num_heads=4, in_features=E),
    "cross-gqa": dict(num_heads=4, in_features=E, qkv_features=24, out_features=8, num_kv_heads=2, in_kv_features=12),
    "mqa-nobias": dict(num_heads=4, in_features=E, num_kv_heads=1, use_bias=False),
    "normalize_qk": dict(num_heads=4, in_features=E, num_kv_heads=2, normalize_qk=True),
    "inits": dict(num_heads=2, in_features=E, bias_init=nnx.initializers.normal(0.5),
                  out_kernel_init=nnx.initializers.normal(0.3), out_bias_init=nnx.initializers.ones_init()),
}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _assert_trees_close(ours, theirs, tol):
    """Each leaf within ``tol`` of the whole tree's norm (a leaf whose exact value is 0, such as
    a key bias's gradient, holds only rounding noise)."""
    ours, theirs = (nnx.to_pure_dict(t) if isinstance(t, nnx.State) else t for t in (ours, theirs))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    total = np.sqrt(sum(np.sum(np.asarray(b, np.float64) ** 2) for b in jax.tree.leaves(theirs)))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)):
        error = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert error <= tol * total, (jax.tree_util.keystr(path), error / total)


class _Silent:
    """A module that keeps nothing sown: given one, flax's attention takes its explicit formula."""

    def sow(self, *args, **kwargs):
        pass


def _flax_exact(query, key, value, module=None, **kwargs):
    """``flax.nnx.dot_product_attention`` by its explicit formula, exact in float64."""
    return nnx.dot_product_attention(query, key, value, module=module or _Silent(), **kwargs)


def _pair(config: dict, dtype=jnp.float64, **extra):
    """Ours and flax's nnx module from the same arguments and the same Rngs."""
    kw = dict(CONFIGS[config], param_dtype=dtype, **extra)
    exact = {"attention_fn": _flax_exact} if jnp.dtype(dtype) == jnp.float64 and "attention_fn" not in kw else {}
    return (mha_jax.MultiHeadAttention(**kw, rngs=nnx.Rngs(0)),
            nnx.MultiHeadAttention(**kw, **exact, decode=False, rngs=nnx.Rngs(0)))


def _inputs(config: str, batch: tuple, dtype=jnp.float64):
    """Queries, keys (None in self-attention) and flax's key-padding + causal mask for ``batch``
    axes; every query sees a key (where flax and we differ by design, see the last nnx test)."""
    c = CONFIGS[config]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=batch + (L, E)), dtype)
    y = None if "in_kv_features" not in c else jnp.asarray(rng.normal(size=batch + (L, c["in_kv_features"])), dtype)
    lengths = rng.integers(2, L + 1, size=batch)
    tokens = jnp.asarray((np.arange(L) < lengths[..., None]).astype(np.int32))
    mask = nnx.combine_masks(nnx.make_attention_mask(jnp.ones_like(tokens), tokens > 0), nnx.make_causal_mask(tokens))
    return x, y, mask


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_same_rngs_same_parameters(config):
    ours, theirs = _pair(config)
    a, b = nnx.to_pure_dict(nnx.state(ours, nnx.Param)), nnx.to_pure_dict(nnx.state(theirs, nnx.Param))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_nnx_outputs_and_gradients_equal_flax(config, dtype):
    """Two batch axes and flax's padding+causal mask: outputs, parameter and input gradients."""
    dt = jnp.dtype(dtype)
    ours, theirs = _pair(config, dt)
    x, y, mask = _inputs(config, (2, 3), dt)

    def loss(model, x, y):
        out = model(x, y, mask=mask)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1, 2) if y is not None else (0, 1)))
    args = (x, y)
    assert _rel(ours(*args, mask=mask), theirs(*args, mask=mask)) <= TOL[dtype]
    for a, b in zip(grad(ours, *args), grad(theirs, *args)):
        if isinstance(a, nnx.State):
            _assert_trees_close(a, b, 10 * TOL[dtype])
        else:
            assert _rel(a, b) <= 10 * TOL[dtype]


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)], ids=["unbatched", "one axis", "two axes"])
def test_any_batch_axes(batch):
    ours, theirs = _pair("self")
    x, _, mask = _inputs("self", batch)
    out = ours(x, mask=mask, is_causal=True)
    assert out.shape == batch + (L, E)
    assert _rel(out, theirs(x, mask=mask, is_causal=True)) <= TOL["float64"]


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_dropout_from_a_shared_key_is_flax_dropout(broadcast_dropout):
    """The same dropout stream (kept at construction, or passed to the call) drops the same weights."""
    kw = dict(dropout_rate=0.3, broadcast_dropout=broadcast_dropout, deterministic=False)
    ours, theirs = _pair("cross-gqa", **kw)
    x, y, mask = _inputs("cross-gqa", (2,))
    assert _rel(ours(x, y, mask=mask), theirs(x, y, mask=mask)) <= TOL["float64"]
    ours, theirs = _pair("cross-gqa", keep_rngs=False, **kw)
    a = ours(x, y, mask=mask, rngs=nnx.Rngs(dropout=7))
    assert _rel(a, theirs(x, y, mask=mask, rngs=nnx.Rngs(dropout=7))) <= TOL["float64"]
    assert _rel(a, ours(x, y, mask=mask, deterministic=True)) > 1e-3  # dropout acted
    with pytest.raises(ValueError, match="no rngs were given"):
        ours(x, y)


@pytest.mark.parametrize("implementation", [None, "blockwise"])
def test_sow_weights_where_flax_sows_them(implementation):
    """Weights before dropout, as ``nnx.Intermediate`` ``attention_weights``, with any implementation."""
    ours, theirs = _pair("cross-gqa", dropout_rate=0.3, deterministic=False)
    ours.implementation = implementation
    x, y, mask = _inputs("cross-gqa", (2, 3))
    ours(x, y, mask=mask, sow_weights=True)
    theirs(x, y, mask=mask, sow_weights=True)
    ours(x, y, mask=mask, sow_weights=True, deterministic=True)  # no dropout: the weights applied
    theirs(x, y, mask=mask, sow_weights=True, deterministic=True)
    a, b = nnx.state(ours, nnx.Intermediate), nnx.state(theirs, nnx.Intermediate)
    assert len(a["attention_weights"]) == 2 and a["attention_weights"][0].shape == (2, 3, 4, L, L)
    _assert_trees_close(a, b, TOL["float64"])
    fresh, _ = _pair("cross-gqa")
    fresh(x, y, mask=mask)
    assert not nnx.to_pure_dict(nnx.state(fresh, nnx.Intermediate))  # nothing sown unless asked


def test_attention_fn_is_called_as_flax_calls_it():
    calls = []

    def attention_fn(query, key, value, **kwargs):
        calls.append(sorted(kwargs))
        return nnx.dot_product_attention(query, key, value, **kwargs)

    ours, theirs = _pair("cross-gqa", attention_fn=attention_fn)
    flax_default = nnx.MultiHeadAttention(**CONFIGS["cross-gqa"], param_dtype=jnp.float64, decode=False,
                                          rngs=nnx.Rngs(0))
    x, y, mask = _inputs("cross-gqa", (2, 3))
    assert np.array_equal(ours(x, y, mask=mask, is_causal=True), flax_default(x, y, mask=mask, is_causal=True))
    flax_arguments = {"mask", "dropout_rng", "dropout_rate", "broadcast_dropout", "deterministic", "dtype", "precision",
                      "module", "is_causal"}
    assert flax_arguments <= set(calls[0])
    # what flax's attention_fn has no argument for reaches it as a mask: a window here
    ours = mha_jax.MultiHeadAttention(**CONFIGS["cross-gqa"], param_dtype=jnp.float64, attention_fn=_flax_exact,
                                      rngs=nnx.Rngs(0))
    windowed = ours(x, y, local_window_size=(1, 0))
    reference = mha_jax.MultiHeadAttention(**CONFIGS["cross-gqa"], param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    assert _rel(windowed, reference(x, y, local_window_size=(1, 0))) <= TOL["float64"]


def test_views_and_modes_reach_the_attention():
    """``nnx.view``, ``.eval()``/``.train()`` set our layer's mode as they set ``nnx.Dropout``'s."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention = mha_jax.MultiHeadAttention(4, E, dropout_rate=0.5, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.attention(x))

    block = Block(nnx.Rngs(0))
    x = jnp.ones((2, L, E))
    viewed = nnx.view(block, deterministic=True)
    assert viewed.attention.deterministic and viewed.dropout.deterministic
    assert np.array_equal(viewed(x), viewed(x))
    block.train()
    assert not np.array_equal(block(x), block(x))
    block.eval()
    assert block.attention.deterministic is True


def test_a_query_that_sees_no_key():
    """Deliberate difference: ours gives such a query 0 before the output projection (so the
    output bias), flax the mean of the values (every logit equally masked)."""
    ours, theirs = _pair("self", bias_init=nnx.initializers.normal(0.5))
    x, _, _ = _inputs("self", (2,))
    mask = jnp.ones((2, 1, L, L), bool).at[:, :, 0].set(False)  # query 0 sees nothing
    a, b = ours(x, mask=mask), theirs(x, mask=mask)
    assert _rel(a[:, 0], jnp.broadcast_to(ours.out.bias[...], (2, E))) == 0.0
    values = theirs.value(x).mean(axis=1)  # (batch, heads, head_dim)
    assert _rel(b[:, 0], theirs.out(values)) <= TOL["float64"]
    assert _rel(a[:, 1:], b[:, 1:]) <= TOL["float64"]


def test_decode_not_given_is_false_where_flax_raises():
    """Deliberate difference: with ``decode`` given neither to the constructor nor the call,
    flax raises and ours attends without a cache, as flax does with ``decode=False``."""
    x, _, mask = _inputs("self", (2,))
    ours = mha_jax.MultiHeadAttention(**CONFIGS["self"], param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(**CONFIGS["self"], param_dtype=jnp.float64, attention_fn=_flax_exact,
                                    rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="No `decode` argument was provided"):
        theirs(x, mask=mask)
    assert ours.decode is None and ours.cached_key is None
    assert _rel(ours(x, mask=mask), theirs(x, mask=mask, decode=False)) <= TOL["float64"]
    assert ours.cached_key is None  # no cache was made or needed


@pytest.mark.parametrize("config", ["self", "normalize_qk"])
def test_computation_dtype_bfloat16_with_float32_parameters(config):
    """``dtype=bfloat16``, ``param_dtype=float32``: float32 parameters, bfloat16 projections and
    output, as flax's, within bfloat16's tolerance of flax's and of the float32 module."""
    kw = dict(CONFIGS[config], param_dtype=jnp.float32, dtype=jnp.bfloat16)
    ours = mha_jax.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(**kw, decode=False, rngs=nnx.Rngs(0))
    reference, _ = _pair(config, jnp.float32)
    x, _, mask = _inputs(config, (2, 3), jnp.float32)
    a, b = ours(x, mask=mask), theirs(x, mask=mask)
    assert a.dtype == b.dtype == jnp.bfloat16
    assert ours.query(x).dtype == theirs.query(x).dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(ours, nnx.Param)))
    assert _rel(a, b) <= 2e-2 and _rel(a, reference(x, mask=mask)) <= 2e-2
    assert _rel(a, reference(x, mask=mask)) > 1e-6  # computed in bfloat16 indeed


def _dot_precisions(f, *args) -> list[str]:
    """The ``precision`` of each ``dot_general`` in ``f``'s jaxpr ('' where none is set)."""
    text = str(jax.make_jaxpr(f)(*args))
    blocks = re.findall(r"dot_general\[(.*?)\n\s*\]", text, flags=re.DOTALL)
    return [m.group(1) if (m := re.search(r"precision=(.*)", block)) else "" for block in blocks]


def test_precision_reaches_every_matrix_product():
    """``precision=HIGHEST`` is set on the four projections and both attention products, as in
    flax's module with its explicit attention; without it none is set."""
    x, _, mask = _inputs("self", (2, 3), jnp.float32)
    highest = "(Precision.HIGHEST, Precision.HIGHEST)"
    ours, _ = _pair("self", jnp.float32, precision=jax.lax.Precision.HIGHEST)
    theirs = nnx.MultiHeadAttention(**CONFIGS["self"], precision=jax.lax.Precision.HIGHEST, attention_fn=_flax_exact,
                                    decode=False, rngs=nnx.Rngs(0))
    got = _dot_precisions(lambda x: ours(x, mask=mask), x)
    assert got == [highest] * 6 and got == _dot_precisions(lambda x: theirs(x, mask=mask), x)
    assert _rel(ours(x, mask=mask), theirs(x, mask=mask)) <= TOL["float32"]
    plain, _ = _pair("self", jnp.float32)
    with jax.default_matmul_precision(None):  # the suite's own default on a GPU is HIGHEST
        assert _dot_precisions(lambda x: plain(x, mask=mask), x) == [""] * 6


def test_promote_dtype_keywords_are_called_as_flax_calls_them():
    """``qkv_promote_dtype``, ``out_promote_dtype`` and ``ln_promote_dtype`` reach the projections
    and the LayerNorms: the same calls as flax's, with the same effect (here, rounding to
    bfloat16)."""

    def rounding(name, calls):
        def promote(args, /, *, dtype=None, inexact=True):
            calls.append((name, tuple(None if a is None else a.shape for a in args), dtype))
            return tuple(None if a is None else a.astype(jnp.bfloat16).astype(a.dtype) for a in args)
        return promote

    logs = []
    for make in (mha_jax.MultiHeadAttention, nnx.MultiHeadAttention):
        calls = []
        kw = {f"{name}_promote_dtype": rounding(name, calls) for name in ("qkv", "out", "ln")}
        exact = {} if make is mha_jax.MultiHeadAttention else dict(attention_fn=_flax_exact, decode=False)
        logs.append((make(**CONFIGS["normalize_qk"], param_dtype=jnp.float64, **kw, **exact, rngs=nnx.Rngs(0)), calls))
    (ours, ours_calls), (theirs, theirs_calls) = logs
    x, _, mask = _inputs("normalize_qk", (2,))
    a, b = ours(x, mask=mask), theirs(x, mask=mask)
    assert ours_calls == theirs_calls and [c[0] for c in ours_calls] == ["qkv"] * 3 + ["ln"] * 2 + ["out"]
    assert _rel(a, b) <= TOL["float64"]
    plain, _ = _pair("normalize_qk")
    assert _rel(a, plain(x, mask=mask)) > 1e-4  # the promotion acted


# --- linen ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, dict(normalize_qk=True, qkv_features=24, out_features=8)],
                         ids=["plain", "normalize_qk"])
def test_linen_equals_flax_linen(options):
    x, _, mask = _inputs("self", (2, 3))
    ours = mha_jax.linen.MultiHeadDotProductAttention(4, param_dtype=jnp.float64, **options)
    theirs = linen.MultiHeadDotProductAttention(4, param_dtype=jnp.float64, **options)
    variables = ours.init(jax.random.key(0), x)
    assert jax.tree.all(jax.tree.map(np.array_equal, variables, theirs.init(jax.random.key(0), x)))

    def loss(module, params, x):
        out, state = module.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])
        return jnp.sum(out * jnp.sin(jnp.arange(out.size).reshape(out.shape))), state

    (a, sown_a), grads_a = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(ours, variables, x)
    (b, sown_b), grads_b = jax.value_and_grad(loss, argnums=(1, 2), has_aux=True)(theirs, variables, x)
    assert _rel(a, b) <= TOL["float64"]
    _assert_trees_close(sown_a, sown_b, TOL["float64"])
    _assert_trees_close(grads_a, grads_b, 10 * TOL["float64"])


FLAX_INPUTS_KV_WARNING = "The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v instead."
FLAX_INPUTS_KV_ERROR = "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None."
FLAX_INPUTS_K_ERROR = "`inputs_k` cannot be None if `inputs_v` is not None."


def test_a_qk_norm_with_each_head_s_own_scale_in_linen_nnx_and_torch():
    """``QKNorm(per_head_scale=True)`` (StableLM's and Cohere's LayerNorm per head): a scale
    ``(heads, head_dim)``, the same output from linen, nnx and the PyTorch twin given the same
    parameters, and a scale per head that acts; refused over the whole projection."""
    norm = mha_jax.QKNorm("layer", per_head_scale=True, eps=1e-5)
    ours, _ = _pair("normalize_qk", normalize_qk=norm)
    assert ours.query_ln.scale.shape == (4, E // 4) and ours.key_ln.scale.shape == (2, E // 4)
    for ln in (ours.query_ln, ours.key_ln):
        ln.scale.set_value(ln.scale[...] + jnp.linspace(-0.5, 0.5, ln.scale.size).reshape(ln.scale.shape))
    x, _, mask = _inputs("normalize_qk", (2,))
    out = ours(x, mask=mask)
    shared = jax.tree.map(lambda a: a, nnx.state(ours, nnx.Param))
    linen_module = mha_jax.linen.MultiHeadDotProductAttention(4, num_kv_heads=2, normalize_qk=norm,
                                                              param_dtype=jnp.float64)
    assert _rel(linen_module.apply({"params": nnx.to_pure_dict(shared)}, x, mask=mask), out) <= TOL["float64"]
    twin = mha_torch.MultiHeadAttention(E, 4, num_kv_heads=2, normalize_qk=norm, dtype=torch.float64)
    mha_torch.load_weights(twin, mha_jax.to_torch(ours))
    with torch.no_grad():
        out_t = twin(torch.from_numpy(np.array(x)), mask=torch.from_numpy(np.asarray(mask) != 0))
    assert _rel(out_t.numpy(), out) <= TOL["float64"]
    ours.query_ln.scale.set_value(ours.query_ln.scale[...].at[0].multiply(2.0))  # head 0's scale alone
    assert _rel(ours(x, mask=mask), out) > 1e-3
    with pytest.raises(ValueError, match="per_head_scale=True needs per_head=True"):
        mha_jax.QKNorm("rms", per_head=False, per_head_scale=True)


def test_linen_dropout_aliases_and_inputs_kv():
    x, _, mask = _inputs("self", (2,))
    kw = dict(num_heads=4, dropout_rate=0.3, deterministic=False, param_dtype=jnp.float64)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    pairs = [(mha_jax.linen.MultiHeadDotProductAttention(**kw), linen.MultiHeadDotProductAttention(**kw)),
             (mha_jax.linen.MultiHeadAttention(**kw), linen.MultiHeadAttention(**kw))]
    for ours, theirs in pairs:
        a, variables = ours.init_with_output(rngs, x, x, mask=mask)
        assert _rel(a, theirs.apply(variables, x, x, mask=mask, rngs={"dropout": jax.random.key(1)})) <= TOL["float64"]
        b = {}
        for name, module in (("ours", ours), ("flax", theirs)):  # flax's text, which code matches
            with pytest.warns(DeprecationWarning, match=re.escape(FLAX_INPUTS_KV_WARNING)):
                b[name] = module.apply(variables, x, inputs_kv=x, mask=mask, rngs={"dropout": jax.random.key(1)})
            for kwargs, message in ((dict(inputs_kv=x, inputs_v=x), FLAX_INPUTS_KV_ERROR),
                                    (dict(inputs_v=x), FLAX_INPUTS_K_ERROR)):
                with pytest.raises(ValueError, match=re.escape(message)):
                    module.apply(variables, x, **kwargs)
        assert np.array_equal(a, b["ours"]) and _rel(b["ours"], b["flax"]) <= TOL["float64"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ours, theirs = (mha_jax.linen.SelfAttention(4, param_dtype=jnp.float64),
                        linen.SelfAttention(4, param_dtype=jnp.float64))
        variables = ours.init(jax.random.key(0), x)
        assert _rel(ours.apply(variables, x, mask), theirs.apply(variables, x, mask)) <= TOL["float64"]


@pytest.mark.parametrize("force_fp32_for_softmax", [False, True])
def test_linen_attention_fn_and_force_fp32_for_softmax(force_fp32_for_softmax):
    """linen's ``attention_fn`` receives flax's arguments (those its signature names),
    ``force_fp32_for_softmax`` included, and gives flax's output; in bfloat16, as the option is
    meant for."""
    x, _, mask = _inputs("self", (2, 3), jnp.float32)
    seen = []

    @functools.wraps(linen.dot_product_attention)  # the signature both modules read
    def attention_fn(query, key, value, **kwargs):
        seen.append({k: v for k, v in kwargs.items() if k in ("force_fp32_for_softmax", "dtype", "precision")})
        return linen.dot_product_attention(query, key, value, **kwargs)

    kw = dict(num_heads=4, dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32_for_softmax, attention_fn=attention_fn)
    ours, theirs = mha_jax.linen.MultiHeadDotProductAttention(**kw), linen.MultiHeadDotProductAttention(**kw)
    variables = theirs.init(jax.random.key(0), x)
    seen.clear()
    a, b = ours.apply(variables, x, mask=mask), theirs.apply(variables, x, mask=mask)
    assert a.dtype == b.dtype == jnp.bfloat16
    assert seen == [dict(force_fp32_for_softmax=force_fp32_for_softmax, dtype=jnp.bfloat16, precision=None)] * 2
    assert _rel(a, b) <= TOL["float32"]
    # the default attentions: ours takes the softmax in float32 always, flax's when asked
    kw.pop("attention_fn")
    ours, theirs = mha_jax.linen.MultiHeadDotProductAttention(**kw), linen.MultiHeadDotProductAttention(**kw)
    a, b = ours.apply(variables, x, mask=mask), theirs.apply(variables, x, mask=mask)
    assert a.dtype == b.dtype == jnp.bfloat16 and _rel(a, b) <= 2e-2


@pytest.mark.parametrize("force_fp32_for_softmax", [False, True])
def test_linen_force_fp32_for_softmax_sows_float32_weights(force_fp32_for_softmax):
    """In bfloat16, flax sows the weights as its float32 softmax gave them when
    ``force_fp32_for_softmax`` is set (else in bfloat16); ours sow the same dtype, within
    bfloat16's tolerance of flax's (flax forms the logits in bfloat16, ours in float32)."""
    x, _, mask = _inputs("self", (2,), jnp.float32)
    kw = dict(num_heads=4, dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32_for_softmax)
    ours, theirs = mha_jax.linen.MultiHeadDotProductAttention(**kw), linen.MultiHeadDotProductAttention(**kw)
    variables = theirs.init(jax.random.key(0), x)
    sown = [m.apply(variables, x, mask=mask, sow_weights=True,
                    mutable=["intermediates"])[1]["intermediates"]["attention_weights"][0]
            for m in (ours, theirs)]
    assert sown[0].dtype == sown[1].dtype == (jnp.float32 if force_fp32_for_softmax else jnp.bfloat16)
    assert sown[0].shape == (2, 4, L, L) and _rel(sown[0], sown[1]) <= 2e-2
    # the returned weights keep the inputs' dtype
    returned = ours.apply(variables, x, mask=mask, return_weights=True)[1]
    assert returned.dtype == jnp.bfloat16 and _rel(returned, sown[0]) <= 1e-2


@pytest.mark.parametrize("framework", ["nnx", "linen"])
def test_complex_inputs_as_flax_takes_them(framework):
    """flax's classes take complex inputs (its dtype inferred from them): ours give flax's complex
    output, sown weights and gradients; what flax's attention has no argument for is refused."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, L, E)) + 1j * rng.normal(size=(2, L, E)), jnp.complex64)
    _, _, mask = _inputs("self", (2,))
    if framework == "nnx":
        ours, theirs = _pair("self", jnp.float32, bias_init=nnx.initializers.normal(0.5))

        def run(model, x, sow_weights=True, **kw):
            out = model(x, mask=mask, sow_weights=sow_weights, **kw)
            return out, nnx.pop(model, nnx.Intermediate)["attention_weights"][0] if sow_weights else None

        params = None
    else:
        ours, theirs = (cls(4, bias_init=nnx.initializers.normal(0.5)) for cls in
                        (mha_jax.linen.MultiHeadDotProductAttention, linen.MultiHeadDotProductAttention))
        params = theirs.init(jax.random.key(0), x)

        def run(model, x, sow_weights=True, **kw):
            out, state = model.apply(params, x, mask=mask, sow_weights=sow_weights, mutable=["intermediates"], **kw)
            return out, state["intermediates"]["attention_weights"][0] if sow_weights else None

    (a, weights_a), (b, weights_b) = run(ours, x), run(theirs, x)
    assert a.dtype == b.dtype == jnp.complex64 and a.shape == x.shape
    assert _rel(a, b) <= TOL["float32"] and _rel(weights_a, weights_b) <= TOL["float32"]
    grads = [jax.grad(lambda x, m=m: jnp.sum(jnp.abs(run(m, x, sow_weights=False)[0]) ** 2))(x) for m in (ours, theirs)]
    assert _rel(*grads) <= 10 * TOL["float32"]
    with pytest.raises(ValueError, match="complex inputs are attended by flax's dot_product_attention, "
                                         "which takes no return_weights"):
        run(ours, x, return_weights=True)
    with pytest.raises(TypeError, match="inputs_q must be a real floating-point array, got dtype int32"):
        run(ours, x.real.astype(jnp.int32))


def test_linen_attention_fn_taking_any_keywords():
    """A linen ``attention_fn`` that forwards ``**kwargs`` to ``linen.dot_product_attention``
    works as that function given directly."""
    x, _, mask = _inputs("self", (2,), jnp.float32)

    def forwarding(query, key, value, **kwargs):
        return linen.dot_product_attention(query, key, value, **kwargs)

    direct = mha_jax.linen.MultiHeadDotProductAttention(4, attention_fn=linen.dot_product_attention)
    variables = direct.init(jax.random.key(0), x)
    ours = mha_jax.linen.MultiHeadDotProductAttention(4, attention_fn=forwarding)
    assert _rel(ours.apply(variables, x, mask=mask), direct.apply(variables, x, mask=mask)) <= TOL["float32"]
    # causality at default positions reaches it folded into the mask, as to a linen function
    causal = linen.make_causal_mask(jnp.ones(x.shape[:-1]))
    assert _rel(ours.apply(variables, x, mask=mask, is_causal=True),
                direct.apply(variables, x, mask=linen.combine_masks(mask, causal))) <= TOL["float32"]


# --- transformations -----------------------------------------------------------------------


def _stack(cls, n, **kw):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return cls(4, E, param_dtype=jnp.float64, **kw, rngs=rngs)

    return create(nnx.Rngs(0))


def test_scan_over_layers_and_remat_with_a_policy():
    ours = _stack(mha_jax.MultiHeadAttention, 3)
    theirs = _stack(nnx.MultiHeadAttention, 3, decode=False, attention_fn=_flax_exact)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, L, E)))

    def run(layers, x, policy):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def step(layer, h):
            return h + nnx.remat(lambda m, h: m(h, is_causal=True), policy=policy)(layer, h)

        return step(layers, x)

    policy = jax.checkpoint_policies.nothing_saveable
    assert _rel(run(ours, x, policy), run(theirs, x, policy)) <= TOL["float64"]
    grads = [nnx.grad(lambda m, x: run(m, x, policy).sum())(m, x) for m in (ours, theirs)]
    _assert_trees_close(grads[0], grads[1], 10 * TOL["float64"])


def test_jit_vmap_eval_shape_and_export_with_symbolic_shapes():
    layer = mha_jax.MultiHeadAttention(4, E, num_kv_heads=2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x, is_causal=True)

    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 2, 40, E)), jnp.float32)
    direct = apply(state, x)
    assert _rel(jax.jit(apply)(state, x), direct) <= 1e-6
    assert _rel(jax.vmap(apply, in_axes=(None, 0))(state, x), direct) <= 1e-6
    assert jax.eval_shape(apply, state, jax.ShapeDtypeStruct((2, 5000, E), jnp.float32)).shape == (2, 5000, E)
    b, n = export.symbolic_shape("b, n")
    exported = export.export(jax.jit(apply))(state, jax.ShapeDtypeStruct((b, n, E), jnp.float32))
    for xs in (x[0], jnp.asarray(np.random.default_rng(5).normal(size=(1, 300, E)), jnp.float32)):
        assert _rel(exported.call(state, xs), apply(state, xs)) <= 1e-6


@pytest.mark.parametrize("length", [32, 300])
def test_forward_mode_and_second_order_at_every_length(length):
    """The default works under jvp and grad-of-grad at any length (flax's results); the
    blockwise kernel refuses both by name."""
    ours, theirs = _pair("self")
    x = jnp.asarray(np.random.default_rng(4).normal(size=(1, length, E)))
    t = jnp.ones_like(x)

    def f(model):
        return lambda x: model(x, is_causal=True)

    (a, da), (b, db) = (jax.jit(lambda x, t, m=m: jax.jvp(f(m), (x,), (t,)))(x, t) for m in (ours, theirs))
    assert _rel(a, b) <= TOL["float64"] and _rel(da, db) <= 10 * TOL["float64"]

    def second(model):
        return jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(f(model)(x))))(x) ** 2))(x)


    assert _rel(jax.jit(lambda: second(ours))(), jax.jit(lambda: second(theirs))()) <= 100 * TOL["float64"]
    blockwise = mha_jax.MultiHeadAttention(4, E, param_dtype=jnp.float64, implementation="blockwise", rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="need implementation='xla'"):
        jax.jvp(f(blockwise), (x,), (t,))
    with pytest.raises(NotImplementedError, match="need implementation='xla'"):
        second(blockwise)
    first = [jax.jit(jax.grad(lambda x, m=m: f(m)(x).sum()))(x) for m in (blockwise, ours)]
    assert _rel(*first) <= 1e-10


# --- the PyTorch twin: the same batch axes and normalize_qk ---------------------------------


@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["unbatched", "two axes"])
def test_torch_twin_batch_axes_and_normalize_qk(batch):
    ours, _ = _pair("normalize_qk")
    for name in ("query_ln", "key_ln"):  # scales away from their initial ones
        ln = getattr(ours, name)
        ln.scale.set_value(ln.scale[...] + jnp.linspace(-0.5, 0.5, ln.scale.shape[0]))
    twin = mha_torch.MultiHeadAttention(E, 4, num_kv_heads=2, normalize_qk=True, dtype=torch.float64)
    mha_torch.load_weights(twin, mha_jax.to_torch(ours))
    x, _, mask = _inputs("normalize_qk", batch)
    xt = torch.from_numpy(np.array(x)).requires_grad_()
    out_t = twin(xt, mask=torch.from_numpy(np.asarray(mask) != 0), is_causal=True)
    out_t.pow(2).sum().backward()

    def forward(model, x):  # the output and the gradient of sum(output ** 2)
        out, vjp = jax.vjp(lambda x: model(x, mask=mask, is_causal=True), x)
        return out, vjp(2 * out)[0]

    out_j, grad_j = nnx.jit(forward)(ours, x)
    assert out_t.shape == batch + (L, E)
    assert _rel(out_j, out_t.detach().numpy()) <= TOL["float64"]
    assert _rel(grad_j, xt.grad.numpy()) <= 10 * TOL["float64"]


def test_a_flax_normalize_qk_checkpoint_converts_to_the_torch_twin():
    """flax's own module with ``normalize_qk`` (its parameters, not ours) converts to PyTorch."""
    theirs = nnx.MultiHeadAttention(4, E, num_kv_heads=2, normalize_qk=True, param_dtype=jnp.float64, decode=False,
                                    attention_fn=_flax_exact, rngs=nnx.Rngs(3))
    for name in ("query_ln", "key_ln"):
        ln = getattr(theirs, name)
        ln.scale.set_value(ln.scale[...] * jnp.linspace(0.5, 1.5, ln.scale.shape[0]))
    twin = mha_torch.MultiHeadAttention(E, 4, num_kv_heads=2, normalize_qk=True, dtype=torch.float64)
    mha_torch.load_weights(twin, mha_jax.to_torch(theirs))
    x, _, mask = _inputs("normalize_qk", (2,))
    with torch.no_grad():
        out = twin(torch.from_numpy(np.array(x)), mask=torch.from_numpy(np.array(mask) != 0))
    assert _rel(out.numpy(), theirs(x, mask=mask)) <= TOL["float64"]


def test_flax_imports_change_by_one_word():
    """What flax exports beside its attention classes comes with ours: the mask helpers."""
    assert mha_jax.make_attention_mask is nnx.make_attention_mask and mha_jax.combine_masks is nnx.combine_masks
    assert mha_jax.make_causal_mask is nnx.make_causal_mask
    assert (mha_jax.linen.make_causal_mask is linen.make_causal_mask
            and mha_jax.linen.combine_masks is linen.combine_masks)


BAD_CONSTRUCTIONS = {  # flax's and ours both refuse with the same exception type; ours names the argument
    "heads do not divide qkv_features": (dict(num_heads=3, in_features=E), "qkv_features"),
    "kv heads do not divide heads": (dict(num_heads=4, in_features=E, num_kv_heads=3),
                                     "num_kv_heads (3) must divide num_heads (4)"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONSTRUCTIONS))
def test_bad_head_counts_fail_as_in_flax_with_a_clearer_message(name):
    kwargs, message = BAD_CONSTRUCTIONS[name]
    with pytest.raises(ValueError):
        nnx.MultiHeadAttention(**kwargs, decode=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape(message)):
        mha_jax.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))


def test_dot_general_and_metadata_reach_the_projections():
    """``qkv_dot_general``/``out_dot_general`` are used as flax uses them, and parameter metadata
    lands on the same parameters."""
    calls = []

    def counted(name):
        def dot_general(*args, **kwargs):
            calls.append(name)
            return jax.lax.dot_general(*args, **kwargs)
        return dot_general

    kw = dict(qkv_dot_general=counted("qkv"), out_dot_general=counted("out"),
              kernel_metadata={"tag": "in"}, out_kernel_metadata={"tag": "out"})
    ours, theirs = _pair("self", **kw)
    x, _, mask = _inputs("self", (2,))
    assert _rel(ours(x, mask=mask), theirs(x, mask=mask)) <= TOL["float64"]
    assert calls == ["qkv", "qkv", "qkv", "out"] * 2
    for name in ("query", "key", "value", "out"):
        assert getattr(ours, name).kernel.get_metadata() == getattr(theirs, name).kernel.get_metadata()
    assert ours.out.kernel.get_metadata()["tag"] == "out" and ours.query.kernel.get_metadata()["tag"] == "in"


def test_linen_scan_over_layers_and_remat_with_a_policy():
    """``nn.scan`` over stacked layers of ``nn.remat``-ed attention, ours and flax's with the same
    parameters: the same outputs and gradients."""

    def stack(cls):
        class Layer(linen.Module):
            @linen.compact
            def __call__(self, h, _):
                attend = linen.remat(cls, policy=jax.checkpoint_policies.nothing_saveable)
                causal = linen.make_causal_mask(jnp.ones(h.shape[:-1]))  # flax's linen call has no is_causal
                return h + attend(4, param_dtype=jnp.float64, name="attention")(h, mask=causal), None

        return linen.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()

    x = jnp.asarray(np.random.default_rng(6).normal(size=(2, L, E)))
    ours = stack(mha_jax.linen.MultiHeadDotProductAttention)
    theirs = stack(linen.MultiHeadDotProductAttention)
    variables = ours.init(jax.random.key(0), x, None)
    assert jax.tree.all(jax.tree.map(np.array_equal, variables, theirs.init(jax.random.key(0), x, None)))

    def loss(module, variables):
        return jnp.sum(jnp.sin(module.apply(variables, x, None)[0]))

    assert _rel(ours.apply(variables, x, None)[0], theirs.apply(variables, x, None)[0]) <= TOL["float64"]
    _assert_trees_close(jax.grad(lambda v: loss(ours, v))(variables), jax.grad(lambda v: loss(theirs, v))(variables),
                        10 * TOL["float64"])


def test_flax_function_is_not_our_core_and_says_so():
    """A documented difference: ``mha_jax.dot_product_attention`` is our core (``jax.nn``'s
    signature: ``bias, mask`` by position, the rest by keyword), not flax's function; flax's own
    arguments are refused by name, not taken with another meaning. Given to our class as
    ``attention_fn``, flax's function is called as flax calls it (above)."""
    q = jnp.ones((2, 3, 4, 8), jnp.float32)
    with pytest.raises(TypeError, match="positional"):
        mha_jax.dot_product_attention(q, q, q, None, None, True)
    with pytest.raises(TypeError, match="deterministic"):
        mha_jax.dot_product_attention(q, q, q, deterministic=True)
