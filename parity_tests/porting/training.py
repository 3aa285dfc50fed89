"""Training runs compared step by step: ``compare_training``.

A copy of the PyTorch model and a copy of the port's parameters start from the same weights and
are trained on the same batches (cycled), each side with its own set-up: a ``torch.optim``
optimizer (and scheduler, and ``clip_grad_norm_``) on one side, an ``optax`` transformation on the
other. After every step each paired parameter's drift (the relative error of the port's
parameter against PyTorch's, paired as in ``compare_gradients``) is judged against an allowance,
and so is the loss of the step.

The allowance is what rounding does to a correct port. In float64 it is ``1e-8`` (a correct port
with equal set-ups stays far below over hundreds of steps). In lower precisions rounding grows
with the steps (Adam moves an entry whose gradient is rounding-sized by the full learning rate, in
either direction), so a third run measures it: a float64 copy of the PyTorch model trained with the
same set-up. The PyTorch run's own distance from it, per parameter and step (its running maximum
over the steps so far) gives the allowance by ``verdict.bound``, never less than ``FLOORS[dtype]``:
a port may make as much rounding error as the reference makes, several times over, but a set-up
difference moves a parameter by a share of the learning rate at once.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from parity_tests.porting import jax_side, parameter_pairs, settings, torch_side
from parity_tests.tool import arrays, verdict

FLOAT64_TOLERANCE = 1e-8
# the least allowance by dtype: a few roundings of a parameter of that precision
FLOORS = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}


@dataclass
class Divergence:
    """The first ``step`` (1: after the first update) where ``name`` (a PyTorch parameter, or
    ``loss``: the loss of that step) left its ``allowance`` with a relative ``error``."""

    step: int
    name: str
    error: float
    allowance: float

    def __str__(self) -> str:
        return f"step {self.step}, {self.name} ({self.error:.2e} > {self.allowance:.2e})"


@dataclass
class TrainingReport:
    """``names``: the paired PyTorch parameters in PyTorch's order (``jax_names`` their pairs);
    per step: ``torch_loss``, ``jax_loss``, ``reference_loss`` (the float64 run, or None) and
    ``drift``/``allowance`` ``[step][parameter]``; ``loss_allowance`` per step. ``unpaired_torch``:
    PyTorch parameters without a JAX pair that took part (a failure); ``unused_torch``: those without
    a pair that no step gave a gradient (transformers keeps some its forward never uses)."""

    names: list[str]
    jax_names: list[str]
    torch_loss: list[float]
    jax_loss: list[float]
    drift: list[list[float]]
    allowance: list[list[float]]
    loss_allowance: list[float]
    settings: dict
    reference_loss: list[float] | None = None
    unpaired_torch: list[str] = field(default_factory=list)
    unpaired_jax: list[str] = field(default_factory=list)
    unused_torch: list[str] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.torch_loss)

    def loss_error(self, step: int) -> float:
        t, j = self.torch_loss[step - 1], self.jax_loss[step - 1]
        return abs(j - t) / max(abs(t), np.finfo(np.float64).tiny) if np.isfinite(j) else float("inf")

    @property
    def first_divergence(self) -> Divergence | None:
        """The first step, and in it the loss (computed before the update) or else the first
        parameter in PyTorch's order, that left its allowance; None when none did."""
        for step in range(1, self.steps + 1):
            if not verdict.within(self.loss_error(step), self.loss_allowance[step - 1]):
                return Divergence(step, "loss", self.loss_error(step), self.loss_allowance[step - 1])
            for name, error, allowed in zip(self.names, self.drift[step - 1], self.allowance[step - 1]):
                if not verdict.within(error, allowed):
                    return Divergence(step, name, error, allowed)
        return None

    @property
    def passed(self) -> bool:
        return bool(self.names) and not self.unpaired_torch and self.first_divergence is None

    def worst(self) -> tuple[int, str, float]:
        """The step and parameter of the largest drift relative to its allowance, and that drift."""
        ratios = np.asarray(self.drift) / np.asarray(self.allowance)
        step, p = np.unravel_index(int(np.argmax(ratios)), ratios.shape)
        return int(step) + 1, self.names[p], float(self.drift[step][p])

    def failures(self) -> list[str]:
        """What failed, in words: no parameter paired, those without a pair, the first divergence
        (its step and parameter)."""
        reasons = []
        if not self.names:
            reasons.append("no parameter paired")
        if self.unpaired_torch:
            reasons.append(f"{len(self.unpaired_torch)} PyTorch parameters without a JAX pair "
                           f"({', '.join(self.unpaired_torch[:4])}{' ...' if len(self.unpaired_torch) > 4 else ''})")
        if self.first_divergence is not None:
            reasons.append(f"training: first divergence at {self.first_divergence}")
        return reasons

    def verdict(self) -> str:
        what = f"training, {self.steps} steps, {len(self.names)} parameters ({self.settings.get('dtype')})"
        if self.passed:
            step, name, drift = self.worst()
            return f"{what}: passed; largest drift {drift:.2e} ({name}, step {step}) within its allowance"
        return f"{what}: " + verdict.line(False, self.failures())

    def table(self, rows: int = 12) -> str:
        """The verdict, then about ``rows`` steps (the first three, the first divergence, the last):
        both losses, the largest drift against its allowance and its parameter."""
        lines = [self.verdict(), f"  {'step':>5}  {'PyTorch loss':>13}  {'JAX loss':>13}  {'drift':>9}  "
                                 f"{'allowed':>9}  worst parameter"]
        divergence = self.first_divergence
        shown = {1, 2, 3, self.steps, *np.linspace(1, self.steps, rows, dtype=int).tolist()}
        if divergence is not None:
            shown.add(divergence.step)
        for step in sorted(s for s in shown if 1 <= s <= self.steps):
            ratios = np.asarray(self.drift[step - 1]) / np.asarray(self.allowance[step - 1])
            p = int(np.argmax(ratios))
            ok = "ok" if verdict.within(self.drift[step - 1][p], self.allowance[step - 1][p]) and verdict.within(
                self.loss_error(step), self.loss_allowance[step - 1]) else "FAILED"
            lines.append(f"  {step:>5}  {self.torch_loss[step - 1]:>13.6g}  {self.jax_loss[step - 1]:>13.6g}  "
                         f"{self.drift[step - 1][p]:>9.2e}  {self.allowance[step - 1][p]:>9.2e}  {self.names[p]}  {ok}")
        if self.unpaired_torch:
            lines.append("  PyTorch parameters without a JAX pair: " + ", ".join(self.unpaired_torch))
        if self.unused_torch:
            lines.append("  PyTorch parameters without a pair or a gradient (not compared): "
                         + ", ".join(self.unused_torch))
        return "\n".join(lines)

    def as_json(self) -> dict:
        divergence = self.first_divergence
        out = asdict(self)
        out.update(passed=self.passed, verdict=self.verdict(), failures=self.failures(),
                   first_divergence=None if divergence is None else asdict(divergence))
        return json.loads(json.dumps(out, default=float))

    def plot(self, path: str | os.PathLike) -> str | None:
        """Both loss curves, and per step the drift of the parameter nearest its allowance, saved to ``path``
        (PNG, SVG... by its suffix); None, and nothing written, where matplotlib is not installed."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        steps = np.arange(1, self.steps + 1)
        figure, (losses, drifts) = plt.subplots(1, 2, figsize=(10, 3.6))
        losses.plot(steps, self.torch_loss, label="PyTorch", linewidth=2.5)
        losses.plot(steps, self.jax_loss, "--", label="JAX port")
        losses.set(xlabel="step", ylabel="loss", title="loss (before each step)")
        losses.legend()
        drift, allowance = np.asarray(self.drift), np.asarray(self.allowance)
        worst = np.argmax(drift / allowance, axis=1)  # per step, the parameter nearest its allowance
        drifts.semilogy(steps, drift[steps - 1, worst], label="drift (the parameter nearest its allowance)")
        drifts.semilogy(steps, allowance[steps - 1, worst], ":", label="its allowance")
        drifts.set(xlabel="step", ylabel="relative error", title="port against PyTorch")
        drifts.legend()
        figure.suptitle(self.verdict().split(":")[0] + (": passed" if self.passed else ": FAILED"), fontsize=10)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return str(path)


def _logits(outputs):
    """The ``logits`` field of a model's outputs, else its first array."""
    found = dict(arrays.fields(outputs))
    return found["logits"] if "logits" in found else arrays.primary(outputs)


def torch_lm_loss(outputs, input_ids, *rest):
    """Next-token cross-entropy: the ``logits`` ``(batch, length, vocab)`` at each position
    against the next of ``input_ids`` ``(batch, length)``, averaged."""
    import torch

    logits = _logits(outputs)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def jax_lm_loss(outputs, input_ids, *rest):
    """``torch_lm_loss`` in JAX."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(_logits(outputs)[:, :-1], input_ids[:, 1:]).mean()


class _TorchRun:
    """A copy of a PyTorch model (in ``dtype`` when given) trained with its own optimizer,
    scheduler (stepped after each step) and ``clip_grad_norm_``."""

    def __init__(self, model, make_optimizer, make_scheduler, clip: float | None, loss, dtype=None):
        self.model = copy.deepcopy(model) if dtype is None else copy.deepcopy(model).to(dtype)
        torch_side.check_eval(self.model)  # dropout's random masks cannot be the same on both sides
        self.params = dict(self.model.named_parameters())
        for p in self.params.values():
            p.grad = None
        self.optimizer = make_optimizer(list(self.params.values()))
        self.scheduler = None if make_scheduler is None else make_scheduler(self.optimizer)
        self.clip, self.loss, self.dtype = clip, loss, dtype
        self.device = torch_side.device_of(self.model)
        self.used: set[str] = set()  # the parameters some step gave a gradient

    def step(self, batch: tuple) -> float:
        """One update on ``batch`` (NumPy; floating inputs in ``dtype`` when given); the loss before it."""
        import torch

        xs = [torch_side.to_torch(x, self.device) for x in batch]
        if self.dtype is not None:
            xs = [x.to(self.dtype) if x.is_floating_point() else x for x in xs]
        self.optimizer.zero_grad(set_to_none=True)
        value = self.loss(self.model(*xs), *xs)
        value.backward()
        self.used.update(n for n, p in self.params.items() if p.grad is not None)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return float(value.detach())

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: arrays.numpy(p.detach()) for n, p in self.params.items()}


class _NnxCall:
    """An nnx model as a function of its parameters: equal (and so compiled once) for equal graphs."""

    def __init__(self, graphdef):
        self.graphdef = graphdef

    def __call__(self, params, rest, xs):
        from flax import nnx

        return nnx.merge(self.graphdef, params, rest, copy=True)(*xs)  # fresh Variables: a port may write its state

    def __eq__(self, other):
        return isinstance(other, _NnxCall) and self.graphdef == other.graphdef

    def __hash__(self):
        return hash(self.graphdef)


class _LinenCall:
    """A linen module as a function of its parameters (``rest``: its other collections)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, params, rest, xs):
        return self.module.apply({**rest, "params": params}, *xs)


@functools.cache
def _compiled():
    """The loss and its gradients, and the optimizer's update, each compiled once per model
    (per optimizer) and shapes: the model and the loss, the optimizer, are static arguments."""
    import jax
    import optax

    def gradients(call, loss, params, rest, *xs):
        return jax.value_and_grad(lambda p: loss(call(p, rest, xs), *xs))(params)

    def update(tx, grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(gradients, static_argnums=(0, 1)), jax.jit(update, static_argnums=0)


class _JaxRun:
    """The port's parameters, copied, trained by ``tx`` on ``loss``."""

    def __init__(self, flax: jax_side.Flax, tx, loss):
        import jax
        import jax.numpy as jnp

        if flax.kind == "nnx":
            from flax import nnx

            graphdef, params, self.rest = nnx.split(flax.module, nnx.Param, ...)
            self.call = _NnxCall(graphdef)
            self.model = lambda p: jax_side.Flax("nnx", nnx.merge(graphdef, p, self.rest))
        else:
            params = flax.variables["params"]
            self.rest = {k: v for k, v in flax.variables.items() if k != "params"}
            self.call = _LinenCall(flax.module)
            self.model = lambda p: jax_side.Flax("linen", flax.module, {**self.rest, "params": p})
        # fresh buffers: a port read from PyTorch's state_dict may share its memory
        self.params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        self.tx, self.loss, self.state = tx, loss, tx.init(self.params)

    def step(self, batch: tuple) -> float:
        gradients, update = _compiled()
        value, grads = gradients(self.call, self.loss, self.params, self.rest, *(jax_side.to_jax(x) for x in batch))
        self.params, self.state = update(self.tx, grads, self.state, self.params)
        return float(value)

    def parameters(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(v) for n, v in self.model(self.params).parameters().items()}


def _check(batches, steps, loss, torch_clip) -> list[tuple]:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if loss != "lm" and not (isinstance(loss, tuple) and len(loss) == 2 and all(map(callable, loss))):
        raise TypeError(f'loss must be "lm" or a pair (torch_loss, jax_loss) of callables, got {loss!r}')
    if torch_clip is not None and not torch_clip > 0:
        raise ValueError(f"torch_clip must be a positive max norm or None, got {torch_clip!r}")
    batches = [b if isinstance(b, tuple) else (b,) for b in batches]
    if not batches:
        raise ValueError("batches is empty: give at least one tuple of inputs")
    return batches


def _drift(torch_params: dict, jax_params: dict, pairs: list[parameter_pairs.Pair]) -> list[float]:
    """Each pair's relative error, the JAX parameters in PyTorch's layout."""
    return [p.error(torch_params, jax_params) for p in pairs]


def _allowance(dtype: str, seen: np.ndarray | None, error) -> np.ndarray:
    """``FLOAT64_TOLERANCE`` in float64; else ``verdict.bound`` of the reference run's largest error
    so far (``seen``, updated with this step's ``error``), at least ``FLOORS[dtype]``."""
    error = np.asarray(error, np.float64)
    error = np.where(np.isfinite(error), error, 0.0)  # a reference run that overflowed measures nothing
    if dtype == "float64":
        return np.full(error.shape, verdict.bound(FLOAT64_TOLERANCE))
    seen[...] = np.maximum(seen, error)
    return np.array([verdict.bound(FLOORS.get(dtype, FLOORS["float32"]), float(e)) for e in seen])


def _setups(torch_optimizer, optax_optimizer, learning_rate: float = 1e-3, weight_decay: float = 1e-2):
    """The given set-ups, or the defaults: AdamW at ``learning_rate`` and ``weight_decay`` on both sides."""
    import torch

    make = torch_optimizer or (lambda params: torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay))
    return make, optax_optimizer or _default_optax(learning_rate, weight_decay)


@functools.cache
def _default_optax(learning_rate: float, weight_decay: float):
    """``optax.adamw``, one object per hyper-parameters: its update compiles once."""
    import optax

    return optax.adamw(learning_rate, weight_decay=weight_decay)


def compare_training(torch_model, flax_model, batches, *, steps: int = 200, torch_optimizer=None,
                     torch_scheduler=None, optax_optimizer=None, torch_clip: float | None = None, loss="lm",
                     mapping=None) -> TrainingReport:
    """Train a copy of each model from the same weights for ``steps`` steps on ``batches`` (a list
    of tuples of NumPy inputs, cycled) and compare them after every step.

    ``torch_optimizer``: ``params -> torch.optim.Optimizer`` (default ``AdamW``, lr 1e-3, weight
    decay 1e-2); ``torch_scheduler``: ``optimizer -> LRScheduler``, stepped after each step;
    ``torch_clip``: the max norm of ``clip_grad_norm_`` before each PyTorch step;
    ``optax_optimizer``: an ``optax.GradientTransformation`` (default ``optax.adamw`` with the same
    hyper-parameters); ``loss``: ``"lm"`` (next-token cross-entropy of the ``logits`` on the first
    input's ids) or a pair ``(torch_loss(outputs, *batch), jax_loss(outputs, *batch))`` of scalar
    losses, each given its framework's arrays. Parameters pair through ``mapping`` as in
    ``compare_gradients`` (``parameter_pairs``). Neither model changes; the PyTorch model must be in eval mode."""
    batches = _check(batches, steps, loss, torch_clip)
    torch_loss, jax_loss = (torch_lm_loss, jax_lm_loss) if loss == "lm" else loss
    make_optimizer, tx = _setups(torch_optimizer, optax_optimizer)
    flax = jax_side.as_flax(flax_model)
    with settings.numerics() as numerics:
        dtype = settings.check_dtype("PyTorch", torch_side.parameter_dtypes(torch_model), None)
        settings.check_dtype("JAX", flax.dtypes(), dtype)
        theirs = _TorchRun(torch_model, make_optimizer, torch_scheduler, torch_clip, torch_loss)
        reference = None
        if dtype != "float64":  # what rounding alone does to this run: the same set-up in float64
            import torch

            reference = _TorchRun(torch_model, make_optimizer, torch_scheduler, torch_clip, torch_loss, torch.float64)
        mine = _JaxRun(flax, tx, jax_loss)
        pairs, unpaired = parameter_pairs.pair(theirs.model, list(theirs.params), list(mine.parameters()), mapping)
        report = TrainingReport([p.name for p in pairs], [p.jax_name for p in pairs], [], [], [], [], [],
                                {**numerics, "dtype": dtype, "steps": steps, "torch_clip": torch_clip,
                                 "torch_optimizer": type(theirs.optimizer).__name__,
                                 "torch_scheduler": type(theirs.scheduler).__name__ if theirs.scheduler else None,
                                 "optax_optimizer": "given" if optax_optimizer else "optax.adamw(1e-3, 1e-2)"},
                                None if reference is None else [], unpaired,
                                sorted(set(mine.parameters()) - {part.jax_name for p in pairs for part in p.parts}))
        _run(report, theirs, mine, reference, batches, pairs)
    report.unused_torch = [n for n in unpaired if n not in theirs.used]
    report.unpaired_torch = [n for n in unpaired if n in theirs.used]
    return report


def _run(report: TrainingReport, theirs: _TorchRun, mine: _JaxRun, reference: _TorchRun | None, batches, pairs):
    """The steps, in lockstep, each one's losses, drifts and allowances appended to ``report``."""
    dtype = report.settings["dtype"]
    seen = np.zeros(len(pairs)) if reference is not None else None
    seen_loss = np.zeros(1)
    for step in range(report.settings["steps"]):
        batch = batches[step % len(batches)]
        report.torch_loss.append(theirs.step(batch))
        report.jax_loss.append(mine.step(batch))
        params = theirs.parameters()
        report.drift.append(_drift(params, mine.parameters(), pairs))
        if reference is None:
            report.allowance.append(_allowance(dtype, None, report.drift[-1]).tolist())
            report.loss_allowance.append(FLOAT64_TOLERANCE)
            continue
        loss64 = reference.step(batch)
        report.reference_loss.append(loss64)
        exact = reference.parameters()
        report.allowance.append(_allowance(dtype, seen, [arrays.relative_error(params[p.name], exact[p.name])
                                                         for p in pairs]).tolist())
        loss_error = abs(report.torch_loss[-1] - loss64) / max(abs(loss64), np.finfo(np.float64).tiny)
        report.loss_allowance.append(float(_allowance(dtype, seen_loss, [loss_error])[0]))
