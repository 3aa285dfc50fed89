"""The parity harness behind the pytest suite and ``mha-parity verify``.

A ``Case`` (``parity_tests.tool.cases``) is one module configuration, one mask form, one dtype
and the implementations that run it. ``run_case`` draws random weights and inputs (float64,
rounded to the dtype, so every side sees the same numbers), runs the JAX module, the PyTorch
module and the float64 oracle, forward and backward, and compares each framework with the
oracle and the two frameworks with each other. The same ``run_case`` runs a checkpoint's
weights (``weights=``); ``workers.run_cases`` runs many, in worker processes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parity_tests.tool import oracle, verdict
from parity_tests.tool.arrays import cast, numpy_dtype, rounded, to_float64
from parity_tests.tool.cases import (  # noqa: F401  (the grid's names, read from here by the suite and the CLI)
    CAUSAL,
    CONFIGS,
    DROPOUT_RATE,
    DTYPES,
    IMPLEMENTATIONS,
    MASKS,
    SIDES,
    STRUCTURED,
    TOLERANCES,
    WINDOWED,
    Case,
    Config,
    grid_masks,
)


@dataclass
class Data:
    """One case's numbers, as float64 NumPy arrays already rounded to the case's dtype."""

    params: dict[str, np.ndarray]  # mha_torch state-dict names
    xq: np.ndarray
    xk: np.ndarray
    xv: np.ndarray
    d_out: np.ndarray
    attention: oracle.Attention
    padding_valid: np.ndarray | None = None  # built with each package's padding_mask helper


def make_data(case: Case, seed: int = 0) -> Data:
    """The case's weights (``mha_torch`` state-dict names), inputs, output cotangent and
    masking terms, drawn from ``seed`` and rounded to the case's dtype."""
    c = case.config
    rng = np.random.default_rng(seed)
    params = _draw_params(case, rng)
    in_kv = c.in_features if c.self_attention else c.in_kv_features
    out = c.in_features if c.out_features is None else c.out_features
    xq = rounded(rng.normal(size=(c.batch, c.q_len, c.in_features)), case.dtype)
    if c.self_attention:
        xk = xv = xq
    else:
        xk = rounded(rng.normal(size=(c.batch, c.kv_len, in_kv)), case.dtype)
        xv = rounded(rng.normal(size=(c.batch, c.kv_len, in_kv)), case.dtype)
    d_out = rounded(rng.normal(size=(c.batch, c.q_len, out)), case.dtype)
    if case.mask not in MASK_FORMS:
        raise ValueError(f"unknown mask kind {case.mask!r}")
    att = oracle.Attention(soft_cap=c.soft_cap, scale=c.scale)
    valid = MASK_FORMS[case.mask](att, rng, case)
    att.is_causal = case.mask in CAUSAL
    return Data(params, xq, xk, xv, d_out, att, valid)


def _draw_params(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The projections' weights ``(out, in)`` (scaled by ``1 / sqrt(in)``) and biases, the
    QK-norm scales and the sinks the configuration has."""
    c = case.config
    in_kv = c.in_features if c.self_attention else c.in_kv_features
    qkv = c.in_features if c.qkv_features is None else c.qkv_features
    out = c.in_features if c.out_features is None else c.out_features
    kv = c.kv_heads * qkv // c.num_heads
    shapes = {"q_proj": (qkv, c.in_features), "k_proj": (kv, in_kv), "v_proj": (kv, in_kv), "out_proj": (out, qkv)}
    params = {}
    for name, (rows, cols) in shapes.items():
        params[f"{name}.weight"] = rounded(rng.normal(size=(rows, cols)) / np.sqrt(cols), case.dtype)
        if c.use_bias:
            params[f"{name}.bias"] = rounded(0.1 * rng.normal(size=rows), case.dtype)
    if c.normalize_qk or c.qk_norm:  # norm scales away from 1, so that a dropped scale shows
        for name in ("q_norm", "k_norm"):
            params[f"{name}.weight"] = rounded(1.0 + 0.3 * rng.normal(size=qkv // c.num_heads), case.dtype)
    if c.sinks:
        params["sinks"] = rounded(rng.normal(size=c.num_heads), case.dtype)
    return params


# --- the mask forms ----------------------------------------------------------------------
# Each sets the terms of its form on ``att`` from ``rng`` (``case.config.mask_shape`` is
# ``(b, h, q, k)``) and returns the padding validity ``(batch, kv_len)`` where the form is a
# padding mask built with each package's ``padding_mask`` helper, else None. Causality is set
# by ``make_data`` for the forms of ``CAUSAL``.


def _no_terms(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    return None


def _bool_mask(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    b, h, q, k = case.config.mask_shape
    att.mask = rng.random((b, h, q, k)) < 0.7


def _int_mask(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    """The tutorials' 0/1 masks."""
    b, _, q, k = case.config.mask_shape
    att.mask = (rng.random((b, 1, q, k)) < 0.7).astype(np.int32)


def _float_mask(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    shape = case.config.mask_shape
    bias = rng.normal(size=shape)
    att.mask = rounded(np.where(rng.random(shape) < 0.2, -np.inf, bias), case.dtype)


def _padding(att: oracle.Attention, rng: np.random.Generator, case: Case) -> np.ndarray:
    _, _, _, k = case.config.mask_shape
    valid = np.arange(k)[None, :] < np.array([k, k // 2])[:, None]
    att.mask = valid[:, None, None, :]
    return valid


def _per_head_mask(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    _, h, q, k = case.config.mask_shape
    att.mask = rng.random((1, h, q, k)) < 0.6


def _qk_mask(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    _, _, q, k = case.config.mask_shape
    att.mask = rng.random((q, k)) < 0.6


def _k_mask(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    att.mask = (rng.random(case.config.kv_len) < 0.6).astype(np.int64)


def _additive_padding(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    """Additive padding, as the tutorials' -1e9 filling."""
    k = case.config.kv_len
    att.mask = np.where(np.arange(k)[None, None, None, :] < np.array([k, 3])[:, None, None, None], 0.0, -1e9)


def _fully_masked(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    mask = rng.random(case.config.mask_shape) < 0.7
    mask[:, :, 0, :] = False  # the first query of every head sees no key
    mask[1] = False  # nor does any query of the second batch element
    att.mask = mask


def _dropout(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    att.keep = rng.random(case.config.mask_shape) >= DROPOUT_RATE
    att.dropout_rate = DROPOUT_RATE


def _flax_float(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    """flax's helpers' float32 0/1 (JAX: nonzero = attend; torch: as bool)."""
    b, _, q, k = case.config.mask_shape
    att.mask = np.tril(np.ones((q, k), bool), k - q)[None, None] & (rng.random((b, 1, 1, k)) < 0.8)


def _bias(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    b, _, q, k = case.config.mask_shape
    att.bias = rounded(rng.normal(size=(b, 1, q, k)), case.dtype)


def _positions(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    """Each batch element's queries at its own positions, keys at theirs (self-attention: the same)."""
    c = case.config
    q, k = c.q_len, c.kv_len
    att.query_positions = np.stack([rng.permutation(q) + 3, np.arange(q) + k - q])
    att.key_positions = att.query_positions if c.self_attention else np.stack([np.arange(k), rng.permutation(k)])


def _window(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    _positions(att, rng, case)
    att.window = (2, 1)


def _segments(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    c = case.config
    q, k = c.q_len, c.kv_len
    att.query_segment_ids = np.stack([np.arange(q) * 3 // q, np.zeros(q, int)])
    att.key_segment_ids = (att.query_segment_ids if c.self_attention
                           else np.stack([np.arange(k) * 3 // k, np.arange(k) % 2]))


def _lengths(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    k = case.config.kv_len
    att.lengths = np.array([k, k // 2 + 1])


def _everything(att: oracle.Attention, rng: np.random.Generator, case: Case) -> None:
    """The window's positions, the segments and lengths, a dense mask and a bias over heads."""
    _window(att, rng, case)
    _segments(att, rng, case)
    _lengths(att, rng, case)
    _, h, q, k = case.config.mask_shape
    att.mask = rng.random(case.config.mask_shape) < 0.8
    att.bias = rounded(rng.normal(size=(h, q, k)), case.dtype)


# Every mask form (``cases.MASKS``) and the function that draws its terms.
MASK_FORMS: dict[str, Callable[[oracle.Attention, np.random.Generator, Case], np.ndarray | None]] = {
    "none": _no_terms, "bool": _bool_mask, "int": _int_mask, "float": _float_mask, "padding": _padding,
    "causal": _no_terms, "padding+causal": _padding, "per-head": _per_head_mask, "bcast-qk": _qk_mask,
    "bcast-k": _k_mask, "bcast-b11k-float": _additive_padding, "fully-masked": _fully_masked, "dropout": _dropout,
    "flax-float": _flax_float, "bias": _bias, "positions+causal": _positions, "window": _window,
    "segments": _segments, "lengths": _lengths, "everything": _everything,
}


# --- running each side -------------------------------------------------------------------


def run_oracle(case: Case, data: Data) -> dict:
    c = case.config
    result = oracle.mha(
        data.params, data.xq, data.xk, data.xv, data.attention,
        num_heads=c.num_heads, num_kv_heads=c.kv_heads, d_out=data.d_out,
        qk_norm=c.qk_norm or "layer", inv_freq=_inv_freq(c),
    )
    grads = result["grads"]
    if c.self_attention:  # one input feeds query, key and value
        grads["inputs_q"] = grads.pop("inputs_q") + grads.pop("inputs_k") + grads.pop("inputs_v")
    return result


def _inv_freq(c: Config):
    """The rotary frequencies ``1 / theta ** (2i / head_dim)`` the oracle rotates by, or None:
    computed in float32, as transformers computes them (and both frameworks after it); head_dim
    4 gives 1 and float32's 0.01, the same bits wherever they are computed."""
    if not c.rotary:
        return None
    head_dim = (c.qkv_features or c.in_features) // c.num_heads
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.float32(10000.0) ** exponents).astype(np.float32)


def _today(c: Config, package) -> dict:
    """The module keywords of today's models' terms, for ``package`` (mha_jax or mha_torch)."""
    head_dim = (c.qkv_features or c.in_features) // c.num_heads
    kwargs = dict(scale=c.scale, logit_soft_cap=c.soft_cap, use_sinks=c.sinks,
                  rotary=package.RotaryEmbedding(head_dim) if c.rotary else None)
    if c.qk_norm:
        kwargs["normalize_qk"] = package.QKNorm(c.qk_norm)
    return kwargs


def run_jax(case: Case, data: Data, *, jit: bool = False, module: str = "nnx", implementation: str = "xla",
            canonical: bool = False) -> dict:
    """Forward and VJP of ``mha_jax``'s nnx (or linen) module; arrays back as float64 NumPy.

    Attention weights come back only from ``implementation="xla"``, the one that forms them.
    The module is built once per configuration and dtype and given each case's weights with
    the loaders; with ``jit`` one jitted program serves every case of the same shapes.

    ``canonical``: instead of the case's mask in its own form, its terms in one form whatever
    the case (``canonical_terms``), jitted: one program per configuration, dtype and static
    option (causality, window, dropout) serves every mask form. Of the terms, the program takes
    those that some mask form with the same static options sets (``program_terms``)."""
    import jax.numpy as jnp
    from flax import nnx

    import mha_jax

    c, att = case.config, data.attention
    as_jax = lambda x: None if x is None else jnp.asarray(cast(x, case.dtype))  # noqa: E731
    keep = None if att.keep is None else jnp.asarray(att.keep)
    with_weights = implementation == "xla"
    arrays = dict(**masking_terms(att, as_jax), dropout_mask=keep)
    static = (("is_causal", arrays.pop("is_causal")), ("local_window_size", arrays.pop("local_window_size")),
              ("return_weights", with_weights))
    if canonical:
        terms = canonical_terms(case, data)
        taken = program_terms(c, static_options(att)) | set_terms(terms, c)
        arrays, jit = {k: as_jax(v) if _TERM_OF[k] in taken else None for k, v in terms.items()}, True
        arrays["dropout_mask"] = keep
    elif data.padding_valid is not None:
        arrays["mask"] = mha_jax.padding_mask(jnp.asarray(data.padding_valid))
    elif case.mask == "flax-float":
        arrays["mask"] = as_jax(att.mask.astype(np.float32))
    elif att.mask is not None and att.mask.dtype.kind == "f":  # additive: JAX's masks are nonzero = attend
        arrays["mask"], arrays["bias"] = None, as_jax(att.mask) if att.bias is None else as_jax(att.mask + att.bias)
    inputs = [as_jax(data.xq)] if c.self_attention else [as_jax(data.xq), as_jax(data.xk), as_jax(data.xv)]
    torch_params = {k: cast(v, case.dtype) for k, v in data.params.items()}

    apply, model = _jax_module(c, case.dtype, module, implementation, att.dropout_rate)
    if module == "nnx":
        mha_jax.load_weights(model, torch_params)
        params = nnx.state(model, nnx.Param)
    else:
        params = mha_jax.from_torch(torch_params, num_heads=c.num_heads, num_kv_heads=c.kv_heads)
    run = _jax_programs()[1 if jit else 0]
    out, weights, grads = run(params, inputs, as_jax(data.d_out), arrays, apply=apply, static=static)
    param_grads = mha_jax.to_torch(nnx.to_pure_dict(grads[0]) if isinstance(grads[0], nnx.State) else grads[0])
    named = {k: to_float64(v) for k, v in param_grads.items()}
    for name, g in zip(("inputs_q", "inputs_k", "inputs_v"), grads[1:]):
        named[name] = to_float64(g)
    return {"out": to_float64(out), "weights": None if weights is None else to_float64(weights), "grads": named}


@functools.cache
def _jax_module(config: Config, dtype: str, module: str, implementation: str, dropout_rate: float):
    """``(apply(params, *inputs, **kwargs), model)`` for one configuration: ``model`` is the nnx
    module that each case loads its weights into (None for linen, whose parameters are a tree)."""
    import jax.numpy as jnp
    from flax import nnx

    import mha_jax

    c = config
    param_dtype = jnp.dtype(numpy_dtype(dtype))
    if module == "nnx":
        # Built abstractly: every parameter is replaced by each case's (load_weights checks that
        # it names them all), so drawing initial ones would only compile the initialisers. The
        # grid's dropout is always a drawn mask (dropout_mask), never a stream kept by the module.
        model = nnx.eval_shape(lambda: mha_jax.MultiHeadAttention(
            c.num_heads, c.in_features, c.qkv_features, c.out_features,
            num_kv_heads=c.num_kv_heads, in_kv_features=c.in_kv_features, use_bias=c.use_bias,
            dropout_rate=dropout_rate, deterministic=True, param_dtype=param_dtype, keep_rngs=False,
            implementation=implementation, rngs=nnx.Rngs(0), **{"normalize_qk": c.normalize_qk, **_today(c, mha_jax)},
        ))
        graphdef, _, rest = nnx.split(model, nnx.Param, ...)

        def apply(params, *xs, **kwargs):
            return nnx.merge(graphdef, params, rest)(*xs, **kwargs)

        return apply, model
    linen = mha_jax.linen.MultiHeadDotProductAttention(
        c.num_heads, qkv_features=c.qkv_features, out_features=c.out_features, num_kv_heads=c.num_kv_heads,
        use_bias=c.use_bias, dropout_rate=dropout_rate, deterministic=True, param_dtype=param_dtype,
        implementation=implementation, **{"normalize_qk": c.normalize_qk, **_today(c, mha_jax)},
    )

    def apply(params, *xs, **kwargs):
        return linen.apply({"params": params}, *xs, **kwargs)

    return apply, None


@functools.cache
def _jax_programs():
    """(eager, jitted) forward and VJP of a module's ``apply``; the jitted one compiles once per
    module, static options and argument shapes, and is shared by every case that has them."""
    import jax
    import jax.numpy as jnp

    def forward_and_vjp(params, xs, d_out, arrays, *, apply, static):
        kwargs = {**arrays, **dict(static)}
        result, vjp = jax.vjp(lambda p, *x: apply(p, *x, **kwargs), params, *xs)
        if kwargs["return_weights"]:
            (out, weights), grads = result, vjp((d_out, jnp.zeros_like(result[1])))
        else:
            out, weights, grads = result, None, vjp(d_out)
        return out, weights, grads

    return forward_and_vjp, jax.jit(forward_and_vjp, static_argnames=("apply", "static"))


def run_torch(case: Case, data: Data, *, implementation: str = "math") -> dict:
    """Forward and backward of ``mha_torch.MultiHeadAttention``; arrays back as float64 NumPy.

    Attention weights come back only from ``implementation="math"``."""
    import torch

    import mha_torch

    c, att = case.config, data.attention
    dtype = getattr(torch, case.dtype)
    in_kv = c.in_kv_features
    model = mha_torch.MultiHeadAttention(
        c.in_features, c.num_heads, num_kv_heads=c.num_kv_heads, kdim=in_kv, vdim=in_kv,
        qkv_dim=c.qkv_features, out_dim=c.out_features, bias=c.use_bias,
        dropout=att.dropout_rate, implementation=implementation, dtype=dtype,
        **{"normalize_qk": c.normalize_qk, **_today(c, mha_torch)},
    ).eval()
    mha_torch.load_weights(model, {k: cast(v, case.dtype) for k, v in data.params.items()})
    def as_torch(x):  # float64 -> dtype is exact here; integer and bool arrays as they are
        x = torch.from_numpy(np.array(x))
        return x.to(dtype) if x.is_floating_point() else x

    kwargs = masking_terms(data.attention, lambda x: None if x is None else as_torch(x))
    if data.padding_valid is not None:
        kwargs["mask"] = mha_torch.padding_mask(torch.from_numpy(data.padding_valid))
    keep = None if att.keep is None else torch.from_numpy(np.array(att.keep))
    xs = [data.xq] if c.self_attention else [data.xq, data.xk, data.xv]
    inputs = [as_torch(x).requires_grad_(True) for x in xs]
    with_weights = implementation == "math"
    result = model(*inputs, **kwargs, need_weights=with_weights, dropout_mask=keep)
    out, weights = result if with_weights else (result, None)
    out.backward(as_torch(data.d_out))
    named = {name: to_float64(p.grad) for name, p in model.named_parameters()}
    for name, x in zip(("inputs_q", "inputs_k", "inputs_v"), inputs):
        named[name] = to_float64(x.grad)
    return {"out": to_float64(out), "weights": None if weights is None else to_float64(weights), "grads": named}


def masking_terms(att: oracle.Attention, convert) -> dict:
    """The call's masking keywords, as ``convert`` makes arrays of them (in the case's dtype).
    In self-attention the key positions and segment ids are left to default to the query's."""
    same = att.key_positions is att.query_positions
    return dict(
        mask=convert(att.mask), bias=convert(att.bias),
        is_causal=att.is_causal, local_window_size=att.window,
        query_positions=convert(att.query_positions),
        key_positions=None if same else convert(att.key_positions),
        query_segment_ids=convert(att.query_segment_ids),
        key_segment_ids=None if att.key_segment_ids is att.query_segment_ids else convert(att.key_segment_ids),
        key_value_seq_lengths=convert(att.lengths),
    )


def canonical_terms(case: Case, data: Data) -> dict[str, np.ndarray]:
    """What a case's terms mean, in one form for every case: a bool mask and a float bias of
    ``(batch, heads, q_len, kv_len)`` (all True and all 0 where the case has none; a floating
    mask is additive, a flax-style float mask nonzero = attend), positions and segment ids of
    every query and key (``arange`` and 0 by default), and every row's key length."""
    c, att = case.config, data.attention
    shape = c.mask_shape
    b, _, q, k = shape
    mask, bias = np.ones(shape, bool), np.zeros(shape)
    if data.padding_valid is not None:
        mask &= data.padding_valid[:, None, None, :]
    elif att.mask is not None and (att.mask.dtype.kind != "f" or case.mask == "flax-float"):
        mask &= np.broadcast_to(att.mask != 0, shape)
    elif att.mask is not None:
        bias = bias + np.broadcast_to(att.mask, shape)
    if att.bias is not None:
        bias = bias + np.broadcast_to(att.bias, shape)

    def rows(x, length, default):
        return np.broadcast_to(default if x is None else x, (b, length)).copy()

    return dict(
        mask=mask, bias=bias,
        query_positions=rows(att.query_positions, q, np.arange(q)),
        key_positions=rows(att.key_positions, k, np.arange(k)),
        query_segment_ids=rows(att.query_segment_ids, q, 0), key_segment_ids=rows(att.key_segment_ids, k, 0),
        key_value_seq_lengths=np.full(b, k) if att.lengths is None else np.asarray(att.lengths),
    )


# ``canonical_terms``' keys by the term they belong to: a term's keys are given or left out together
_TERM_OF = {
    "mask": "mask", "bias": "bias", "query_positions": "positions", "key_positions": "positions",
    "query_segment_ids": "segments", "key_segment_ids": "segments", "key_value_seq_lengths": "lengths",
}


def static_options(att: oracle.Attention) -> tuple[bool, tuple[int, int] | None, bool]:
    """What a jitted program is specialised on besides shapes: causality, the window, and
    whether a dropout mask is drawn."""
    return att.is_causal, att.window, att.keep is not None


def set_terms(terms: dict[str, np.ndarray], config: Config) -> frozenset[str]:
    """The terms (``_TERM_OF``'s values) that ``terms`` (``canonical_terms``' output) sets to
    other than their defaults, which are the terms of the ``none`` case."""
    default = _default_terms(config)
    return frozenset(_TERM_OF[k] for k, v in terms.items() if not np.array_equal(v, default[k]))


@functools.cache
def _default_terms(config: Config) -> dict[str, np.ndarray]:
    case = Case(config, "none", "float64")
    return canonical_terms(case, make_data(case))


@functools.cache
def program_terms(config: Config, static: tuple) -> frozenset[str]:
    """The terms that some mask form of ``grid_masks(config)`` with static options ``static``
    sets. A jitted program for those options takes just these: a term that no such form sets is
    left to the module's default, which means what the canonical default does, and every term
    costs compilation (the blockwise path builds block summaries from each)."""
    taken: frozenset[str] = frozenset()
    for kind in grid_masks(config):
        case = Case(config, kind, "float64")
        data = make_data(case)
        if static_options(data.attention) == static:
            taken |= set_terms(canonical_terms(case, data), config)
    return taken


# --- comparing ---------------------------------------------------------------------------


def errors(a: np.ndarray, b: np.ndarray, scale: np.ndarray | None = None) -> tuple[float, float]:
    """(relative error ||a - b|| / ||b||, max |a - b| / max |b|); inf if ``a`` is not finite.

    ``scale``, when given, is a reference whose size is used where it exceeds ``b``'s (see
    ``compare``). Where both are all zero (weights of a fully masked row) the errors are absolute.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    if not np.all(np.isfinite(a)):
        return float("inf"), float("inf")
    diff = np.abs(a - b)
    ref = b if scale is None else np.asarray(scale, np.float64)
    norm = max(np.linalg.norm(b), np.linalg.norm(ref))
    peak = max(np.max(np.abs(b), initial=0.0), np.max(np.abs(ref), initial=0.0))
    rel = float(np.linalg.norm(diff) / norm) if norm > 0 else float(np.linalg.norm(diff))
    top = float(diff.max(initial=0.0) / peak) if peak > 0 else float(diff.max(initial=0.0))
    return rel, top


def grad_errors(name: str, grad: np.ndarray, reference: dict[str, np.ndarray]) -> tuple[float, float]:
    """``errors`` of gradient ``name`` against ``reference[name]``.

    A bias gradient is measured on the scale of its projection's weight gradient: the key
    bias's is zero in exact arithmetic (softmax ignores a shift common to a row), so relative
    to itself it would compare rounding noise with rounding noise.
    """
    scale = reference.get(name.replace(".bias", ".weight")) if name.endswith(".bias") else None
    return errors(grad, reference[name], scale)


@dataclass
class Result:
    """One case's comparisons: ``details[pair][quantity] = {"rel", "max_abs", "abs"}`` for every
    pair of implementations (``"jax vs oracle"``, ...) and quantity (``out``, ``weights``,
    ``grad:<name>``). Whether it passed is judged against ``TOLERANCES`` when asked."""

    case: Case
    details: dict = field(default_factory=dict)

    def _worst(self, quantities, pairs=None) -> tuple[float, str]:
        worst, where = 0.0, ""
        for pair, entries in self.details.items():
            if pairs is not None and not pairs(pair):
                continue
            for name, e in entries.items():
                if quantities(name) and max(e["rel"], e["max_abs"]) >= worst:
                    worst, where = max(e["rel"], e["max_abs"]), f"{pair}: {name}"
        return worst, where

    def _largest(self, error: str) -> float:
        """The largest ``error`` of outputs and weights (not gradients), any pair."""
        return max((e[error] for entries in self.details.values() for n, e in entries.items()
                    if not n.startswith("grad:")), default=0.0)

    @property
    def rel(self) -> float:
        """Worst relative error (``||a - b|| / ||b||``) of outputs and weights, any pair."""
        return self._largest("rel")

    @property
    def max_abs(self) -> float:
        """Worst ``max |a - b| / max |b|`` of outputs and weights, any pair."""
        return self._largest("max_abs")

    @property
    def abs(self) -> float:
        """Worst absolute error ``max |a - b|`` of outputs and weights, any pair."""
        return self._largest("abs")

    @property
    def grad(self) -> float:
        """Worst relative (and scaled max) error of any gradient, any pair."""
        return self._worst(lambda n: n.startswith("grad:"))[0]

    @property
    def worst_pair(self) -> str:
        """The pair and quantity furthest apart, relative to the quantity's tolerance."""
        tol, grad_tol = TOLERANCES[self.case.dtype]
        forward, f_where = self._worst(lambda n: not n.startswith("grad:"))
        backward, b_where = self._worst(lambda n: n.startswith("grad:"))
        return f_where if forward / tol >= backward / grad_tol else b_where

    @property
    def jax_vs_torch(self) -> float:
        """Worst error, outputs, weights and gradients, between a JAX and a PyTorch implementation."""
        return self._worst(lambda n: True, lambda pair: "jax" in pair and "torch" in pair)[0]

    @property
    def passed(self) -> bool:
        tol, grad_tol = TOLERANCES[self.case.dtype]
        forward = self._worst(lambda n: not n.startswith("grad:"))[0]
        return verdict.within(forward, verdict.bound(tol)) and verdict.within(self.grad, verdict.bound(grad_tol))

    def as_json(self) -> dict:
        return {
            "case": self.case.id, "config": dataclasses.asdict(self.case.config),
            "mask": self.case.mask, "dtype": self.case.dtype, "implementations": list(self.case.sides[1:]),
            "abs_error": self.abs,
            "max_abs_error": self.max_abs, "relative_error": self.rel, "gradient_error": self.grad,
            "jax_vs_torch": self.jax_vs_torch, "worst_pair": self.worst_pair, "passed": self.passed,
            "tolerances": TOLERANCES[self.case.dtype], "details": self.details,
        }


def compare(case: Case, results: dict[str, dict]) -> Result:
    """Every implementation against the oracle, and the implementations against each other."""
    pairs = [(n, "oracle") for n in results if n != "oracle" and "oracle" in results]
    others = [n for n in results if n != "oracle"]
    pairs += [(a, b) for i, a in enumerate(others) for b in others[i + 1:]]
    details: dict[str, dict] = {}
    for a, b in pairs:
        entry = {}
        for key in ("out", "weights"):
            if results[a][key] is None or results[b][key] is None:
                continue  # an implementation that never forms the weights
            rel, top = errors(results[a][key], results[b][key])
            entry[key] = {"rel": rel, "max_abs": top, "abs": absolute_error(results[a][key], results[b][key])}
        grads_b = results[b]["grads"]
        if set(grads_b) != set(results[a]["grads"]):
            raise AssertionError(f"gradient names differ: {sorted(results[a]['grads'])} vs {sorted(grads_b)}")
        for name, g in results[a]["grads"].items():
            rel, top = grad_errors(name, g, grads_b)
            entry[f"grad:{name}"] = {"rel": rel, "max_abs": top, "abs": absolute_error(g, grads_b[name])}
        details[f"{a} vs {b}"] = entry
    return Result(case, details)


def absolute_error(a, b) -> float:
    """``max |a - b|`` (inf where ``a`` is not finite)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0)) if np.all(np.isfinite(a)) else float("inf")


def run_case(case: Case, *, weights: dict[str, np.ndarray] | None = None, jit: bool = False, seed: int = 0) -> Result:
    """The case's implementations (``case.sides``: every one that runs it, by default) against
    the oracle and each other.

    ``weights`` (``mha_torch`` state-dict names, any float dtype) replaces the random weights,
    rounded to the case's dtype: the same run for the built-in grid and for a checkpoint.
    """
    return compare(case, run_sides(case, SIDES, weights=weights, jit=jit, seed=seed))


def run_sides(case: Case, names: tuple[str, ...], *, weights: dict[str, np.ndarray] | None = None, jit: bool = False,
              seed: int = 0) -> dict[str, dict]:
    """``run_case``'s runs of ``names`` (of ``SIDES``, in that order) on the case's data:
    ``{name: {"out", "weights", "grads"}}``, leaving out those not in ``case.sides``. Run
    apart, as the worker processes do, the parts merge into ``run_case``'s."""
    data = make_data(case, seed)
    if weights is not None:
        data = dataclasses.replace(data, params={k: rounded(v, case.dtype) for k, v in weights.items()})
    results = {}
    for name in (n for n in names if n in case.sides):
        if name == "oracle":
            results[name] = run_oracle(case, data)
            continue
        framework, implementation = IMPLEMENTATIONS[name]
        if framework == "jax":  # blockwise: one program per configuration (the xla run reads each form)
            results[name] = run_jax(case, data, jit=jit, implementation=implementation,
                                    canonical=implementation == "blockwise")
        else:
            results[name] = run_torch(case, data, implementation=implementation)
    return results
