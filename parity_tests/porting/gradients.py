"""Gradients and one optimizer step, compared parameter by parameter.

The loss is ``sum(output * cotangent)`` for a fixed random ``cotangent`` shaped as the model's
first output (zero at positions ``valid`` leaves out): its gradient with respect to a parameter
is that parameter's vector-Jacobian product, whatever the model computes. Parameters pair as
``parameter_pairs`` pairs them (through their modules, ``mapping`` as in ``compare``, and their
names; a kernel in its module's orientation, a fused projection split as ``from_hf`` splits it).
Neither model is changed: PyTorch's gradients go back as they were, the step runs on copies.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from parity_tests.porting import jax_side, names, parameter_pairs, settings, torch_side
from parity_tests.tool import arrays, table, verdict

COLUMNS = ("parameter", "error", "allowed", "outcome")


@dataclass
class ParameterResult(table.Measured):
    """One parameter, a row of the report core: ``name`` (PyTorch's), ``jax_name``, the relative
    ``error``, its ``tolerance`` and (``reference``, ``floor``) the bound made of PyTorch's own rounding."""

    name: str
    jax_name: str
    error: float
    tolerance: float

    def cells(self) -> list[str]:
        return [self.name, f"{self.error:.2e}", f"{self.bound:.1e}", "ok" if self.passed else "FAILED"]

    def failure(self) -> str:
        return f"{self.name} {self.error:.2e} > {self.bound:.1e}"


@dataclass
class ParameterReport:
    """``parameters`` in PyTorch's order; ``what``: gradients, or the parameters after a step."""

    what: str
    parameters: list[ParameterResult]
    settings: dict
    unpaired_torch: list[str] = field(default_factory=list)
    unpaired_jax: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.parameters) and all(p.passed for p in self.parameters) and not self.unpaired_torch

    @property
    def worst(self) -> ParameterResult | None:
        return max(self.parameters, key=lambda p: p.error / p.bound, default=None)

    def failures(self) -> list[str]:
        """What failed, in words: each parameter beyond its tolerance, those without a pair, or none paired."""
        found = table.Table(COLUMNS, self.parameters).failures()
        if self.unpaired_torch:
            found.append(f"{len(self.unpaired_torch)} PyTorch parameters without a JAX pair "
                         f"({', '.join(self.unpaired_torch[:4])}{' ...' if len(self.unpaired_torch) > 4 else ''})")
        if not self.parameters:
            found.append("no parameter paired")
        return found

    def table(self) -> str:
        worst = self.worst
        lines = [f"{self.what}: {len(self.parameters)} parameters"
                 + (f", worst {worst.name} {worst.error:.2e}" if worst is not None else "")]
        lines += ["  " + line for line in table.Table(COLUMNS, self.parameters).text().splitlines()[2:]]
        if self.unpaired_torch:
            lines.append("  PyTorch parameters without a JAX pair (not compared): " + ", ".join(self.unpaired_torch))
        lines.append(verdict.line(self.passed, self.failures(), f"{self.what}: verdict"))
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"what": self.what, "passed": self.passed, "failures": self.failures(), "settings": self.settings,
                "parameters": [p.as_json() for p in self.parameters],
                "unpaired_torch": self.unpaired_torch, "unpaired_jax": self.unpaired_jax}


def cotangent(shape: tuple[int, ...], dtype: str, valid: np.ndarray | None, seed: int) -> np.ndarray:
    g = arrays_rounded(np.random.default_rng(seed).normal(size=shape), dtype)
    if valid is not None and shape[: valid.ndim] == valid.shape:
        g = g * valid.reshape(valid.shape + (1,) * (len(shape) - valid.ndim))
    return g


def arrays_rounded(x, dtype):
    return arrays.rounded(x, dtype)


def _torch_run(model, inputs, valid, seed, step: Mapping | None, g: np.ndarray | None = None):
    """PyTorch's gradients (name -> NumPy), or its parameters after one AdamW ``step`` (on a copy);
    the cotangent ``g`` given, or drawn from ``seed``."""
    import torch

    dtype = settings.check_dtype("PyTorch", torch_side.parameter_dtypes(model), None)
    if step is not None:
        model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    saved = {n: p.grad for n, p in params.items()}
    device = torch_side.device_of(model)
    try:
        for p in params.values():
            p.grad = None
        torch_side.check_eval(model)
        out = arrays.primary(model(*(torch_side.to_torch(x, device) for x in inputs)))
        g = cotangent(tuple(out.shape), dtype, valid, seed) if g is None else g
        (out * torch_side.to_torch(g, device).to(out.dtype)).sum().backward()
        if step is None:
            return {n: arrays.numpy(p.grad) for n, p in params.items() if p.grad is not None}, g, dtype
        optimizer = torch.optim.AdamW(params.values(), lr=step["learning_rate"], betas=(step["b1"], step["b2"]),
                                      eps=step["eps"], weight_decay=step["weight_decay"])
        optimizer.step()
        return {n: arrays.numpy(p) for n, p in params.items()}, g, dtype
    finally:
        if step is None:
            for n, p in params.items():
                p.grad = saved[n]


def _own_rounding(model, inputs, valid, step: Mapping | None, g: np.ndarray) -> dict[str, np.ndarray]:
    """``_torch_run`` of the float64 copy of ``model`` on the same inputs and cotangent, against which
    PyTorch's own rounding is measured; {} for a float64 model, or one that cannot run in float64."""
    shadow = torch_side.float64_copy(model)
    if shadow is None:
        return {}
    try:
        return _torch_run(shadow, [arrays.cast(x, "float64") for x in inputs], valid, 0, step, g)[0]
    except Exception:  # judged by the fixed tolerance alone
        return {}


def _jax_run(flax: jax_side.Flax, inputs, g: np.ndarray, step: Mapping | None) -> dict[str, np.ndarray]:
    """JAX's gradients (dotted name -> NumPy), or its parameters after one ``optax.adamw`` step."""
    import jax
    import jax.numpy as jnp

    xs = [jax_side.to_jax(x) for x in inputs]
    if flax.kind == "nnx":
        from flax import nnx

        graphdef, params, rest = nnx.split(flax.module, nnx.Param, ...)
        call = lambda p: nnx.merge(graphdef, p, rest)(*xs)  # noqa: E731
    else:
        params = flax.variables["params"]
        call = lambda p: flax.module.apply({**flax.variables, "params": p}, *xs)  # noqa: E731

    def loss(p):
        out = arrays.primary(call(p))
        return jnp.sum(out * jnp.asarray(g, out.dtype))

    grads = jax.jit(jax.grad(loss))(params)  # compiled once: faster than running it operation by operation
    if step is not None:
        import optax

        tx = optax.adamw(step["learning_rate"], b1=step["b1"], b2=step["b2"], eps=step["eps"],
                         weight_decay=step["weight_decay"])
        updates, _ = tx.update(grads, tx.init(params), params)
        grads = optax.apply_updates(params, updates)
    if flax.kind == "nnx":
        from flax import nnx

        return {names.normalize(path): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    return {names.linen([getattr(k, "key", str(k)) for k in path]): np.asarray(v) for path, v in flat}


def _compare(what, torch_model, flax_model, inputs, mapping, valid, seed, tolerance, step) -> ParameterReport:
    flax = jax_side.as_flax(flax_model)
    valid = None if valid is None else np.asarray(valid, bool)
    with settings.numerics() as numerics:
        theirs, g, dtype = _torch_run(torch_model, inputs, valid, seed, step)
        settings.check_dtype("JAX", flax.dtypes(), dtype)
        mine = _jax_run(flax, inputs, g, step)
        exact = _own_rounding(torch_model, inputs, valid, step, g) if tolerance is None else {}
    pairs, unpaired = parameter_pairs.pair(torch_model, list(theirs), list(mine), mapping)
    tolerance = tolerance if tolerance is not None else settings.GRADIENT_TOLERANCES.get(dtype, 1e-4)
    # a step's floor stays the tolerance: AdamW's first step moves each element by about the learning rate
    # whatever its gradient's size (gradients within 4.9e-7 gave steps 4.5e-5 apart: docs/tolerances.md)
    floor = tolerance if step else verdict.module_floor(tolerance, dtype)
    results = [ParameterResult(p.name, p.jax_name, p.error(theirs, mine), tolerance, floor=floor,
                               reference=arrays.relative_error(theirs[p.name], exact[p.name]) if p.name in exact
                               else None) for p in pairs]
    used = {part.jax_name for p in pairs for part in p.parts}
    recorded = {**numerics, "dtype": dtype, "seed": seed, **({"optimizer": dict(step)} if step else {})}
    return ParameterReport(what, results, recorded, unpaired, [j for j in mine if j not in used])


def compare_gradients(torch_model, flax_model, *inputs, mapping=None, valid=None, seed: int = 0,
                      tolerance: float | None = None) -> ParameterReport:
    """The gradient of ``sum(output * cotangent)`` with respect to every paired parameter, both sides."""
    return _compare("gradients", torch_model, flax_model, inputs, mapping, valid, seed, tolerance, None)


def compare_step(torch_model, flax_model, *inputs, mapping=None, valid=None, seed: int = 0, learning_rate: float = 1e-3,
                 b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                 tolerance: float | None = None) -> ParameterReport:
    """Every paired parameter after one AdamW step on the loss's gradients: ``torch.optim.AdamW``
    against ``optax.adamw`` with the same hyper-parameters (on copies of both models)."""
    step = dict(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    what = "parameters after one AdamW step"
    return _compare(what, torch_model, flax_model, inputs, mapping, valid, seed, tolerance, step)
