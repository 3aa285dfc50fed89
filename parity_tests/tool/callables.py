"""Any attention written in PyTorch or JAX, compared on one grid of masks, dtypes and gradients.

An implementation is a callable ``fn(inputs_q, inputs_kv, mask) -> output`` in its framework's
arrays: ``inputs_q`` ``(batch, q_len, in_features)``, ``inputs_kv`` ``(batch, kv_len,
in_kv_features)`` (the query input itself in self-attention), ``mask`` None or bool ``(batch,
1, q_len, kv_len)`` (the same for every head, so that implementations with other head counts
take it), True = attend, every query attending to at least one key; it returns ``(batch,
q_len, out_features)``. ``compare`` runs every implementation on the same
inputs, rounded once to each dtype, forward and backward (the gradients of the inputs), and
compares each pair; given the weights (``mha_torch`` state-dict names) the float64 oracle joins
as the reference. ``verify`` (the Python API) wraps ``compare`` for one PyTorch and one JAX
callable and prints the report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from parity_tests.tool import harness, oracle
from parity_tests.tool import report as reporting
from parity_tests.tool.arrays import cast, rounded, to_float64

# Mask forms every attention can take as one boolean mask (no query left without a key: the
# implementations people port disagree there, with NaN, 0 or the mean of V).
MASKS = ("none", "padding", "causal", "padding+causal", "bool")


@dataclass(frozen=True)
class Inputs:
    """What the implementations are called with. ``kv_len``/``in_kv_features`` None: self-attention."""

    num_heads: int
    in_features: int
    batch: int = 2
    q_len: int = 6
    kv_len: int | None = None
    in_kv_features: int | None = None

    @property
    def self_attention(self) -> bool:
        return self.kv_len is None and self.in_kv_features is None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, 1, q_len, kv_len)`` of the mask."""
        return (self.batch, 1, self.q_len, self.q_len if self.kv_len is None else self.kv_len)

    def config(self, name: str, weights: dict | None = None) -> harness.Config:
        """The harness configuration of these inputs (sizes of the projections from ``weights``)."""
        w = weights or {}
        b, _, q, k = self.shape
        return harness.Config(
            name, batch=b, q_len=q, kv_len=k, in_features=self.in_features,
            in_kv_features=None if self.self_attention else (self.in_kv_features or self.in_features),
            num_heads=self.num_heads,
            num_kv_heads=w["k_proj.weight"].shape[0] * self.num_heads // w["q_proj.weight"].shape[0] if w else None,
            qkv_features=w["q_proj.weight"].shape[0] if w else None,
            out_features=w["out_proj.weight"].shape[0] if w else None, use_bias="q_proj.bias" in w,
        )


def allowed_mask(kind: str, shape: tuple[int, int, int, int], rng: np.random.Generator) -> np.ndarray | None:
    """The bool mask of ``shape`` ``(batch, 1, q_len, kv_len)`` of a mask form (True = attend), or None."""
    b, h, q, k = shape
    if kind == "none":
        return None
    allowed = np.ones(shape, bool)
    if kind in ("padding", "padding+causal"):  # every other batch element's last keys are padding
        lengths = np.where(np.arange(b) % 2 == 1, max(1, k - k // 3), k)
        allowed &= (np.arange(k)[None, :] < lengths[:, None])[:, None, None, :]
    if kind in ("causal", "padding+causal"):  # top-left aligned
        allowed &= np.tri(q, k, dtype=bool)
    if kind == "bool":  # per batch element, one key at least for every query
        allowed = rng.random(shape) < 0.6
        np.put_along_axis(allowed, rng.integers(k, size=(b, h, q, 1)), True, axis=-1)
    elif kind not in ("padding", "causal", "padding+causal"):
        raise ValueError(f"mask must be one of {', '.join(MASKS)}, got {kind!r}")
    return allowed


def run_torch(fn: Callable, xq, xkv, mask, d_out, dtype: str, self_attention: bool) -> dict:
    import torch

    def tensor(x):
        return torch.from_numpy(np.array(cast(x, "float32" if dtype == "bfloat16" else dtype))).to(
            getattr(torch, dtype))

    q = tensor(xq).requires_grad_(True)
    kv = q if self_attention else tensor(xkv).requires_grad_(True)
    out = fn(q, kv, None if mask is None else torch.from_numpy(mask))
    out.backward(tensor(d_out))
    grads = {"inputs_q": to_float64(q.grad)}
    if not self_attention:
        grads["inputs_kv"] = to_float64(kv.grad)
    return {"out": to_float64(out), "weights": None, "grads": grads}


def run_jax(fn: Callable, xq, xkv, mask, d_out, dtype: str, self_attention: bool) -> dict:
    import jax
    import jax.numpy as jnp

    as_jax = lambda x: jnp.asarray(cast(x, dtype))  # noqa: E731
    jmask = None if mask is None else jnp.asarray(mask)
    if self_attention:
        out, vjp = jax.vjp(lambda q: fn(q, q, jmask), as_jax(xq))
    else:
        out, vjp = jax.vjp(lambda q, kv: fn(q, kv, jmask), as_jax(xq), as_jax(xkv))
    grads = vjp(as_jax(d_out).astype(out.dtype))
    names = ("inputs_q",) if self_attention else ("inputs_q", "inputs_kv")
    return {"out": to_float64(out), "weights": None, "grads": {n: to_float64(g) for n, g in zip(names, grads)}}


def run_oracle(weights: dict, inputs: Inputs, xq, xkv, mask, d_out, dtype: str, num_kv_heads: int) -> dict:
    params = {k: rounded(v, dtype) for k, v in weights.items()}
    result = oracle.mha(params, xq, xkv, xkv, oracle.Attention(mask=mask), num_heads=inputs.num_heads,
                        num_kv_heads=num_kv_heads, d_out=d_out)
    g = result["grads"]
    if inputs.self_attention:
        grads = {"inputs_q": g["inputs_q"] + g["inputs_k"] + g["inputs_v"]}
    else:
        grads = {"inputs_q": g["inputs_q"], "inputs_kv": g["inputs_k"] + g["inputs_v"]}
    return {"out": result["out"], "weights": None, "grads": grads}


def compare(
    implementations: dict[str, tuple[str, Callable[[str], Callable]]],
    inputs: Inputs,
    *,
    out_features: int,
    dtypes=harness.DTYPES,
    masks=MASKS,
    seed: int = 0,
    weights: dict[str, np.ndarray] | None = None,
    num_kv_heads: int | None = None,
    name: str = "callables",
    done=None,
) -> list[harness.Result]:
    """Run each implementation on every mask form and dtype and compare every pair (and each
    with the float64 oracle when ``weights`` are given).

    ``implementations``: name -> (``"torch"`` or ``"jax"``, ``build(dtype)``), where
    ``build`` returns the callable for that dtype (a module holding its weights in it).
    ``done(result)`` is called as each case finishes.
    """
    results = []
    config = inputs.config(name, weights)
    in_kv = inputs.in_features if inputs.self_attention else (inputs.in_kv_features or inputs.in_features)
    for dtype in dtypes:
        built = {n: (framework, build(dtype)) for n, (framework, build) in implementations.items()}
        for kind in masks:
            rng = np.random.default_rng([seed, list(MASKS).index(kind)])
            b, _, q, k = inputs.shape
            xq = rounded(rng.normal(size=(b, q, inputs.in_features)), dtype)
            xkv = xq if inputs.self_attention else rounded(rng.normal(size=(b, k, in_kv)), dtype)
            d_out = rounded(rng.normal(size=(b, q, out_features)), dtype)
            mask = allowed_mask(kind, inputs.shape, rng)
            outputs = {}
            if weights is not None:
                outputs["oracle"] = run_oracle(weights, inputs, xq, xkv, mask, d_out, dtype,
                                               num_kv_heads or inputs.num_heads)
            for n, (framework, fn) in built.items():
                run = run_torch if framework == "torch" else run_jax
                outputs[n] = run(fn, xq, xkv, mask, d_out, dtype, inputs.self_attention)
            result = harness.compare(harness.Case(config, kind, dtype), outputs)
            results.append(result)
            if done:
                done(result)
    return results


def verify(
    torch_fn: Callable | Callable[[str], Callable],
    jax_fn: Callable | Callable[[str], Callable],
    inputs: Inputs,
    *,
    out_features: int | None = None,
    dtypes=("float32",),
    masks=MASKS,
    seed: int = 0,
    weights: dict[str, np.ndarray] | None = None,
    num_kv_heads: int | None = None,
    per_dtype: bool = False,
    report: str | None = None,
    echo: bool = True,
) -> list[harness.Result]:
    """Compare a PyTorch attention with a JAX one on the grid of mask forms and dtypes, forward
    and input gradients, and print the report (``report``: also write it as Markdown).

    ``torch_fn`` and ``jax_fn`` are called as ``fn(inputs_q, inputs_kv, mask)`` (see the module's
    docstring). With ``per_dtype=True`` each is instead ``build(dtype) -> fn``, for modules that
    hold their weights in one dtype. ``weights`` (``mha_torch`` names, e.g. ``mha_jax.to_torch``
    of the Flax side) adds the float64 oracle as the reference. Returns the results; each has
    ``passed``.
    """
    out_features = out_features or inputs.in_features
    if weights is not None:
        out_features = weights["out_proj.weight"].shape[0]
    implementations = {
        "torch": ("torch", torch_fn if per_dtype else (lambda dtype: torch_fn)),
        "jax": ("jax", jax_fn if per_dtype else (lambda dtype: jax_fn)),
    }
    def named(fn, framework):
        name = getattr(fn, "__qualname__", type(fn).__name__)
        return f"{framework}: " + ("a function" if "<lambda>" in name else name)

    header = reporting.Header(
        "your PyTorch attention against your JAX attention" + (" and the float64 oracle" if weights else ""),
        implementations=[named(torch_fn, "PyTorch"), named(jax_fn, "JAX")],
        shapes=f"batch {inputs.batch}, q_len {inputs.shape[2]}, kv_len {inputs.shape[3]}, "
               f"features {inputs.in_features}, {inputs.num_heads} heads",
        seed=seed,
    )
    with reporting.Printer(header, echo=echo, total=len(dtypes) * len(masks)) as printer:
        results = compare(implementations, inputs, out_features=out_features, dtypes=dtypes, masks=masks, seed=seed,
                          weights=weights, num_kv_heads=num_kv_heads, name="yours", done=printer.done)
    printer.table(results)
    if report:
        reporting.write_markdown(report, header, results)
    return results
