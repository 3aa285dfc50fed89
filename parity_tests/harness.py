"""The parity harness behind the pytest suite and ``mha-parity verify``.

A ``Case`` is one module configuration, one mask form and one dtype. ``run_case`` draws random
weights and inputs (float64, rounded to the dtype, so every side sees the same numbers), runs
the JAX module, the PyTorch module and the float64 oracle, forward and backward, and compares
each framework with the oracle and the two frameworks with each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from parity_tests import oracle

# Tolerances from the design: (forward, gradients), relative error ||a - b|| / ||b||, also
# applied to the largest elementwise error scaled by max |b|.
TOLERANCES = {"float64": (1e-13, 1e-12), "float32": (1e-6, 1e-5), "bfloat16": (2e-2, 5e-2)}
DTYPES = tuple(TOLERANCES)
DROPOUT_RATE = 0.25


@dataclass(frozen=True)
class Config:
    """A module configuration. ``in_kv_features=None`` means self-attention (one input)."""

    name: str
    batch: int = 2
    q_len: int = 6
    kv_len: int = 6
    in_features: int = 16
    in_kv_features: int | None = None
    num_heads: int = 4
    num_kv_heads: int | None = None
    qkv_features: int | None = None
    out_features: int | None = None
    use_bias: bool = True

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def self_attention(self) -> bool:
        return self.in_kv_features is None

    @property
    def mask_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.num_heads, self.q_len, self.kv_len)


CONFIGS = {
    c.name: c
    for c in (
        Config("self"),
        Config(
            "cross-gqa", q_len=5, kv_len=7, in_kv_features=10, num_kv_heads=2,
            qkv_features=24, out_features=12,
        ),
        Config(
            "cross-mqa-nobias", q_len=5, kv_len=7, in_kv_features=10, num_kv_heads=1,
            use_bias=False,
        ),
    )
}

# Every mask form; see ``make_data`` for what each one draws.
MASKS = (
    "none", "bool", "int", "float", "padding", "causal", "padding+causal", "per-head",
    "bcast-qk", "bcast-k", "bcast-b11k-float", "fully-masked", "dropout",
    "flax-float", "bias", "positions+causal", "window", "segments", "lengths", "everything",
)
# The masks that the positions-first terms add; the grid runs them on the first two configs.
STRUCTURED = ("flax-float", "bias", "positions+causal", "window", "segments", "lengths", "everything")


@dataclass(frozen=True)
class Case:
    config: Config
    mask: str
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.config.name}/{self.mask}/{self.dtype}"


def default_grid() -> list[Case]:
    """Every mask form on self- and grouped cross-attention, a few on multi-query; all dtypes."""
    few = ("none", "padding+causal", "fully-masked", "dropout", "everything")
    return [
        Case(config, mask, dtype)
        for config in CONFIGS.values()
        for mask in (few if config.name == "cross-mqa-nobias" else MASKS)
        for dtype in DTYPES
    ]


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


def numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(numpy_dtype(dtype)).astype(np.float64)


def make_data(case: Case, seed: int = 0) -> Data:
    c = case.config
    rng = np.random.default_rng(seed)
    in_kv = c.in_features if c.self_attention else c.in_kv_features
    qkv = c.in_features if c.qkv_features is None else c.qkv_features
    out = c.in_features if c.out_features is None else c.out_features
    kv = c.kv_heads * qkv // c.num_heads
    shapes = {"q_proj": (qkv, c.in_features), "k_proj": (kv, in_kv), "v_proj": (kv, in_kv), "out_proj": (out, qkv)}
    params = {}
    for name, (rows, cols) in shapes.items():
        params[f"{name}.weight"] = _rounded(rng.normal(size=(rows, cols)) / np.sqrt(cols), case.dtype)
        if c.use_bias:
            params[f"{name}.bias"] = _rounded(0.1 * rng.normal(size=rows), case.dtype)
    xq = _rounded(rng.normal(size=(c.batch, c.q_len, c.in_features)), case.dtype)
    if c.self_attention:
        xk = xv = xq
    else:
        xk = _rounded(rng.normal(size=(c.batch, c.kv_len, in_kv)), case.dtype)
        xv = _rounded(rng.normal(size=(c.batch, c.kv_len, in_kv)), case.dtype)
    d_out = _rounded(rng.normal(size=(c.batch, c.q_len, out)), case.dtype)

    att = oracle.Attention()
    valid = None
    b, h, q, k = c.mask_shape
    kind = case.mask
    if kind == "bool":
        att.mask = rng.random((b, h, q, k)) < 0.7
    elif kind == "int":  # the seeds' 0/1 masks
        att.mask = (rng.random((b, 1, q, k)) < 0.7).astype(np.int32)
    elif kind == "float":
        bias = rng.normal(size=(b, h, q, k))
        att.mask = _rounded(np.where(rng.random((b, h, q, k)) < 0.2, -np.inf, bias), case.dtype)
    elif kind in ("padding", "padding+causal"):
        valid = np.arange(k)[None, :] < np.array([k, k // 2])[:, None]
        att.mask = valid[:, None, None, :]
    elif kind == "per-head":
        att.mask = rng.random((1, h, q, k)) < 0.6
    elif kind == "bcast-qk":
        att.mask = rng.random((q, k)) < 0.6
    elif kind == "bcast-k":
        att.mask = (rng.random(k) < 0.6).astype(np.int64)
    elif kind == "bcast-b11k-float":  # additive padding, as the seeds' -1e9 filling
        att.mask = np.where(np.arange(k)[None, None, None, :] < np.array([k, 3])[:, None, None, None], 0.0, -1e9)
    elif kind == "fully-masked":
        mask = rng.random((b, h, q, k)) < 0.7
        mask[:, :, 0, :] = False  # the first query of every head sees no key
        mask[1] = False  # nor does any query of the second batch element
        att.mask = mask
    elif kind == "dropout":
        att.keep = rng.random((b, h, q, k)) >= DROPOUT_RATE
        att.dropout_rate = DROPOUT_RATE
    elif kind == "flax-float":  # flax's helpers' float32 0/1 (JAX: nonzero = attend; torch: as bool)
        att.mask = np.tril(np.ones((q, k), bool), k - q)[None, None] & (rng.random((b, 1, 1, k)) < 0.8)
    elif kind == "bias":
        att.bias = _rounded(rng.normal(size=(b, 1, q, k)), case.dtype)
    elif kind in ("positions+causal", "window", "everything"):
        # each batch element's queries at its own positions, keys at theirs (self-attention: the same)
        att.query_positions = np.stack([rng.permutation(q) + 3, np.arange(q) + k - q])
        att.key_positions = att.query_positions if c.self_attention else np.stack([np.arange(k), rng.permutation(k)])
        if kind != "positions+causal":
            att.window = (2, 1)
    if kind in ("segments", "everything"):
        att.query_segment_ids = np.stack([np.arange(q) * 3 // q, np.zeros(q, int)])
        att.key_segment_ids = att.query_segment_ids if c.self_attention else np.stack([np.arange(k) * 3 // k, np.arange(k) % 2])
    if kind in ("lengths", "everything"):
        att.lengths = np.array([k, k // 2 + 1])
    if kind == "everything":
        att.mask = rng.random((b, h, q, k)) < 0.8
        att.bias = _rounded(rng.normal(size=(h, q, k)), case.dtype)
    elif kind not in ("none", "causal", *MASKS[:13], *STRUCTURED):
        raise ValueError(f"unknown mask kind {kind!r}")
    att.is_causal = kind in ("causal", "padding+causal", "positions+causal", "everything")
    return Data(params, xq, xk, xv, d_out, att, valid)


# --- running each side -------------------------------------------------------------------


def run_oracle(case: Case, data: Data) -> dict:
    c = case.config
    result = oracle.mha(
        data.params, data.xq, data.xk, data.xv, data.attention,
        num_heads=c.num_heads, num_kv_heads=c.kv_heads, d_out=data.d_out,
    )
    grads = result["grads"]
    if c.self_attention:  # one input feeds query, key and value
        grads["inputs_q"] = grads.pop("inputs_q") + grads.pop("inputs_k") + grads.pop("inputs_v")
    return result


def run_jax(case: Case, data: Data, *, jit: bool = False, module: str = "nnx", implementation: str = "xla") -> dict:
    """Forward and VJP of ``mha_jax``'s nnx (or linen) module; arrays back as float64 NumPy.

    Attention weights come back only from ``implementation="xla"``, the one that forms them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import mha_jax

    c, att = case.config, data.attention
    dtype = jnp.dtype(numpy_dtype(case.dtype))
    as_jax = lambda x: None if x is None else jnp.asarray(_cast(x, case.dtype))  # noqa: E731
    keep = None if att.keep is None else jnp.asarray(att.keep)
    with_weights = implementation == "xla"
    kwargs = dict(**_terms(att, as_jax), dropout_mask=keep, return_weights=with_weights)
    if data.padding_valid is not None:
        kwargs["mask"] = mha_jax.padding_mask(jnp.asarray(data.padding_valid))
    elif case.mask == "flax-float":
        kwargs["mask"] = as_jax(att.mask.astype(np.float32))
    elif att.mask is not None and att.mask.dtype.kind == "f":  # additive: JAX's masks are nonzero = attend
        kwargs["mask"], kwargs["bias"] = None, as_jax(att.mask) if att.bias is None else as_jax(att.mask + att.bias)
    inputs = [as_jax(data.xq)] if c.self_attention else [as_jax(data.xq), as_jax(data.xk), as_jax(data.xv)]
    torch_params = {k: _cast(v, case.dtype) for k, v in data.params.items()}

    if module == "nnx":
        model = mha_jax.MultiHeadAttention(
            c.num_heads, c.in_features, c.qkv_features, c.out_features,
            num_kv_heads=c.num_kv_heads, in_kv_features=c.in_kv_features, use_bias=c.use_bias,
            dropout_rate=att.dropout_rate, deterministic=True, param_dtype=dtype,
            implementation=implementation, rngs=nnx.Rngs(0),
        )
        mha_jax.load_weights(model, torch_params)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def apply(params, *xs):
            return nnx.merge(graphdef, params, rest)(*xs, **kwargs)
    else:
        model = mha_jax.linen.MultiHeadDotProductAttention(
            c.num_heads, qkv_features=c.qkv_features, out_features=c.out_features, num_kv_heads=c.num_kv_heads,
            use_bias=c.use_bias, dropout_rate=att.dropout_rate, deterministic=True, param_dtype=dtype,
            implementation=implementation,
        )
        params = jax.tree.map(jnp.asarray, mha_jax.from_torch(torch_params, num_heads=c.num_heads, num_kv_heads=c.kv_heads))

        def apply(params, *xs):
            return model.apply({"params": params}, *xs, **kwargs)

    def forward_and_vjp(params, xs, d_out):
        result, vjp = jax.vjp(lambda p, *x: apply(p, *x), params, *xs)
        if with_weights:
            (out, weights), grads = result, vjp((d_out, jnp.zeros_like(result[1])))
        else:
            out, weights, grads = result, None, vjp(d_out)
        return out, weights, grads

    if jit:
        forward_and_vjp = jax.jit(forward_and_vjp)
    out, weights, grads = forward_and_vjp(params, inputs, as_jax(data.d_out))
    param_grads = mha_jax.to_torch(nnx.to_pure_dict(grads[0]) if isinstance(grads[0], nnx.State) else grads[0])
    named = {k: _f64(v) for k, v in param_grads.items()}
    for name, g in zip(("inputs_q", "inputs_k", "inputs_v"), grads[1:]):
        named[name] = _f64(g)
    return {"out": _f64(out), "weights": None if weights is None else _f64(weights), "grads": named}


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
    ).eval()
    mha_torch.load_weights(model, {k: _cast(v, case.dtype) for k, v in data.params.items()})
    def as_torch(x):  # float64 -> dtype is exact here; integer and bool arrays as they are
        x = torch.from_numpy(np.array(x))
        return x.to(dtype) if x.is_floating_point() else x

    kwargs = _terms(data.attention, lambda x: None if x is None else as_torch(x))
    if data.padding_valid is not None:
        kwargs["mask"] = mha_torch.padding_mask(torch.from_numpy(data.padding_valid))
    keep = None if att.keep is None else torch.from_numpy(np.array(att.keep))
    xs = [data.xq] if c.self_attention else [data.xq, data.xk, data.xv]
    inputs = [as_torch(x).requires_grad_(True) for x in xs]
    with_weights = implementation == "math"
    result = model(*inputs, **kwargs, need_weights=with_weights, dropout_mask=keep)
    out, weights = result if with_weights else (result, None)
    out.backward(as_torch(data.d_out))
    named = {name: _f64(p.grad) for name, p in model.named_parameters()}
    for name, x in zip(("inputs_q", "inputs_k", "inputs_v"), inputs):
        named[name] = _f64(x.grad)
    return {"out": _f64(out), "weights": None if weights is None else _f64(weights), "grads": named}


def _terms(att: oracle.Attention, convert) -> dict:
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


def is_floating(x: np.ndarray) -> bool:
    """Whether a NumPy array holds floats (bfloat16, whose dtype kind is 'V', included)."""
    return np.asarray(x).dtype.kind == "f" or np.asarray(x).dtype.name == "bfloat16"


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x).astype(numpy_dtype(dtype)) if np.asarray(x).dtype.kind == "f" else np.asarray(x)


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float() if str(x.dtype) == "torch.bfloat16" else x.detach()
        return x.double().numpy()
    return np.asarray(x).astype(np.float64)


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
    case: Case
    max_abs: float  # worst max |a - b| / max |b| of outputs and weights, over the three pairs
    rel: float  # worst relative error of outputs and weights
    grad: float  # worst relative (and scaled max) error of any gradient
    passed: bool
    details: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {
            "case": self.case.id, "config": dataclasses.asdict(self.case.config),
            "mask": self.case.mask, "dtype": self.case.dtype, "max_abs_error": self.max_abs,
            "relative_error": self.rel, "gradient_error": self.grad, "passed": self.passed,
            "details": self.details,
        }


def compare(case: Case, results: dict[str, dict]) -> Result:
    """Every framework against the oracle, and the frameworks against each other."""
    tol, grad_tol = TOLERANCES[case.dtype]
    pairs = [(n, "oracle") for n in results if n != "oracle"]
    others = [n for n in results if n != "oracle"]
    pairs += [(a, b) for i, a in enumerate(others) for b in others[i + 1:]]
    details: dict[str, dict] = {}
    worst_rel = worst_abs = worst_grad = 0.0
    for a, b in pairs:
        entry = {}
        for key in ("out", "weights"):
            if results[a][key] is None or results[b][key] is None:
                continue  # an implementation that never forms the weights
            rel, top = errors(results[a][key], results[b][key])
            entry[key] = {"rel": rel, "max_abs": top}
            worst_rel, worst_abs = max(worst_rel, rel), max(worst_abs, top)
        grads_b = results[b]["grads"]
        for name, g in results[a]["grads"].items():
            if name not in grads_b:
                raise AssertionError(f"{a} has gradient {name!r} that {b} lacks")
            rel, top = grad_errors(name, g, grads_b)
            entry[f"grad:{name}"] = {"rel": rel, "max_abs": top}
            worst_grad = max(worst_grad, rel, top)
        if set(grads_b) != set(results[a]["grads"]):
            raise AssertionError(f"gradient names differ: {sorted(results[a]['grads'])} vs {sorted(grads_b)}")
        details[f"{a} vs {b}"] = entry
    passed = worst_rel <= tol and worst_abs <= tol and worst_grad <= grad_tol
    return Result(case, worst_abs, worst_rel, worst_grad, passed, details)


def run_case(case: Case, *, jit: bool = False, seed: int = 0) -> Result:
    """Every implementation of both frameworks against the oracle and each other.

    ``F.scaled_dot_product_attention`` takes no dropout mask, so the ``dropout`` case (a
    mask shared across frameworks) runs PyTorch's explicit path only.
    """
    data = make_data(case, seed)
    results = {
        "oracle": run_oracle(case, data),
        "jax": run_jax(case, data, jit=jit),
        "jax-blockwise": run_jax(case, data, jit=jit, implementation="blockwise"),
        "torch": run_torch(case, data),
    }
    if data.attention.keep is None:
        results["torch-sdpa"] = run_torch(case, data, implementation="sdpa")
    return compare(case, results)
