"""Greedy decoding on both sides, each with its own cache: the prompt in one call (prefill), then
one token a step; the same tokens, the logits of every step within tolerance, and each row's
tokens the same alone as in a left- or right-padded batch. Beside it, teacher-forced decoding:
both sides fed PyTorch's tokens (the port's cache prefilled with the prompt, then given PyTorch's
token of each step, whatever it would have chosen), per step the KL divergence, top-1 and top-k
agreement and the logits' error; the first step out of bounds is located at its module, so that
a port that diverges late is found at its step even after its own tokens went another way.

The PyTorch side is a transformers causal language model, decoding with ``generate`` (greedy, its
own cache). The JAX side keeps its cache in the model: ``init_cache(batch, max_length)`` makes an
empty one and ``model(tokens, position_ids=positions, decode=True)`` appends ``tokens`` ``(batch,
n)`` at ``positions`` (``-1``: padding, not cached) and returns logits ``(batch, n, vocab)``, as
``examples/llama.py`` does on ``mha_jax``'s cache; decoding runs on a copy of the model.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

import numpy as np

from parity_tests.porting import core, jax_side, names, settings, torch_side
from parity_tests.porting import logits as logit_metrics
from parity_tests.tool import arrays, verdict


@dataclass
class Steps:
    """The bound of each step's logits (``verdict.bound``): ``tolerance`` alone where ``references``
    is empty (a tolerance given, or a float64 model); else ``references[step]`` (PyTorch's own logits
    against its float64 copy fed the same tokens) times the verdict's factor, at least ``floor``."""

    tolerance: float
    references: list[float | None] = field(default_factory=list)
    floor: float | None = None

    def bound(self, step: int) -> float:
        reference = self.references[step] if step < len(self.references) else None
        return verdict.bound(self.tolerance, reference, self.floor)

    def within(self, error: float, step: int) -> bool:
        return verdict.within(error, self.bound(step))

    def worst(self, errors: list[float]) -> str:
        """The step nearest its bound: ``"3.5e-07 (allowed 2.4e-06)"``."""
        if not errors:
            return "-"
        step = max(range(len(errors)), key=lambda s: errors[s] / self.bound(s) if errors[s] == errors[s] else np.inf)
        return f"{errors[step]:.2e} (allowed {self.bound(step):.1e})"


@dataclass
class DecodeResult:
    """One row's tokens and logits from one way of decoding (``what``) against PyTorch's alone;
    ``step_errors`` per step, each judged by ``limits`` (``Steps``)."""

    what: str
    row: int
    tokens: list[int]
    expected: list[int]
    logits_error: float
    tolerance: float
    step_errors: list[float] = field(default_factory=list)
    module: str | None = None  # the first module whose output differs in the first step that differs
    limits: Steps | None = None

    def __post_init__(self):
        self.limits = self.limits or Steps(self.tolerance)

    @property
    def passed(self) -> bool:
        return self.first_step is None

    @property
    def first_step(self) -> int | None:
        """The first step whose token differs or whose logits are beyond their bound (None: none)."""
        for step, (mine, theirs) in enumerate(zip(self.tokens, self.expected)):
            error = self.step_errors[step] if step < len(self.step_errors) else self.logits_error
            if mine != theirs or not self.limits.within(error, step):
                return step
        return None if len(self.tokens) == len(self.expected) else min(len(self.tokens), len(self.expected))

    def failure(self) -> str:
        """The failure in words: the row, the way of decoding, the first step that differs and how."""
        step = self.first_step
        if step is None or step >= len(self.tokens):
            return f"{self.what} row {self.row}: {len(self.tokens)} tokens for {len(self.expected)}"
        how = (f"token {self.tokens[step]} for {self.expected[step]}" if self.tokens[step] != self.expected[step]
               else f"logits {self.step_errors[step]:.2e} > {self.limits.bound(step):.2e}")
        where = f"; first module differing in that step: {self.module}" if self.module else ""
        return f"{self.what} row {self.row}: differs from step {step} ({how}){where}"

    def as_json(self) -> dict:
        return dict(asdict(self), passed=self.passed, first_step=self.first_step)


@dataclass
class ForcedResult:
    """One row decoded teacher-forced: per step (0: the prompt's last token) the relative ``errors``
    of the port's logits against PyTorch's, ``kl`` (``KL(PyTorch || port)``), ``top1`` (the argmaxes
    agree) and ``topk`` (overlap of the ``k`` most likely), each step's logits judged by ``limits``;
    ``prompt_divergence``: the first module that fails when the prompt is compared module by module
    as ``compare`` compares it (step 0 then fails, whatever its logits); ``module``: the first module
    differing in the first step out of bounds."""

    row: int
    errors: list[float]
    kl: list[float]
    top1: list[bool]
    topk: list[float]
    tolerance: float
    k: int = 5
    module: str | None = None
    limits: Steps | None = None
    prompt_divergence: str | None = None

    def __post_init__(self):
        self.limits = self.limits or Steps(self.tolerance)

    @property
    def first_step(self) -> int | None:
        """The first step whose logits are beyond the bound or whose argmax differs (None: none)."""
        if self.prompt_divergence is not None:
            return 0
        return next((s for s, (e, agree) in enumerate(zip(self.errors, self.top1))
                     if not agree or not self.limits.within(e, s)), None)

    @property
    def passed(self) -> bool:
        return self.first_step is None

    def failure(self) -> str:
        step = self.first_step
        where = f"; first module differing in that step: {self.module}" if self.module else ""
        return (f"teacher-forced row {self.row}: out of bounds from step {step} (logits {self.errors[step]:.2e}, "
                f"bound {self.limits.bound(step):.2e}, KL {self.kl[step]:.2e}, "
                f"top-1 {'agrees' if self.top1[step] else 'differs'})" + where)

    def as_json(self) -> dict:
        return dict(asdict(self), passed=self.passed, first_step=self.first_step)


@dataclass
class DecodeReport:
    results: list[DecodeResult]
    steps: int
    settings: dict = field(default_factory=dict)
    forced: list[ForcedResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results) and all(f.passed for f in self.forced)

    def failures(self) -> list[str]:
        return [r.failure() for r in self.results if not r.passed] + [f.failure() for f in self.forced if not f.passed]

    def table(self) -> str:
        lines = [f"greedy decoding, {self.steps} tokens a row, against transformers' generate for the row alone:"]
        for r in self.results:
            step = "" if r.passed else f", first differs at step {r.first_step}" + (
                f" (first module differing: {r.module})" if r.module else "")
            lines.append(f"  {r.what:<28} row {r.row}: tokens {'equal' if r.tokens == r.expected else 'DIFFER'}, "
                         f"logits {r.limits.worst(r.step_errors)} {'ok' if r.passed else 'FAILED'}"
                         + step)
        for f in self.forced:
            step = "" if f.passed else f", first out of bounds at step {f.first_step}" + (
                f" (first module differing: {f.module})" if f.module else "")
            lines.append(f"  {'teacher-forced':<28} row {f.row}: KL max {max(f.kl):.2e}, top-1 {np.mean(f.top1):.3f}, "
                         f"top-{f.k} {np.mean(f.topk):.3f}, logits {f.limits.worst(f.errors)} "
                         f"{'ok' if f.passed else 'FAILED'}" + step)
        lines.append(verdict.line(self.passed, self.failures(), "decoding: verdict"))
        return "\n".join(lines)

    def as_json(self) -> dict:
        return {"passed": self.passed, "failures": self.failures(), "steps": self.steps, "settings": self.settings,
                "results": [r.as_json() for r in self.results], "teacher_forced": [f.as_json() for f in self.forced]}


def padded(prompts: list[np.ndarray], left: bool, pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The prompts in one ``(batch, longest)`` array, and each token's position (``-1``: padding)."""
    lengths = np.array([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = np.full((len(prompts), width), pad, np.asarray(prompts[0]).dtype)
    positions = np.full((len(prompts), width), -1)
    for i, p in enumerate(prompts):
        start = width - len(p) if left else 0
        tokens[i, start:start + len(p)] = p
        positions[i, start:start + len(p)] = np.arange(len(p))
    return tokens, positions


@functools.cache
def _decode_call():
    from flax import nnx

    # one compiled call per shape (eager execution compiles every operation of every shape)
    return nnx.jit(lambda model, tokens, positions: model(tokens, position_ids=positions, decode=True))


def greedy_jax(model, tokens: np.ndarray, positions: np.ndarray, steps: int,
               max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``(batch, steps)`` and the logits that chose them ``(batch, steps, vocab)``; the cache
    holds ``max_length`` tokens a row (default: the prompts' and the steps')."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.clone(model)
    batch, width = tokens.shape
    model.init_cache(batch, max_length or width + steps)
    call = _decode_call()
    logits = call(model, jnp.asarray(tokens), jnp.asarray(positions))
    lengths = positions.max(axis=1) + 1
    logits = logits[np.arange(batch), positions.argmax(axis=1)]  # each row's last token
    chosen, every = [], []
    for step in range(steps):
        token = jnp.argmax(logits, axis=-1)
        chosen.append(np.asarray(token))
        every.append(arrays.numpy(logits))
        if step + 1 < steps:
            logits = call(model, token[:, None], jnp.asarray(lengths[:, None] + step))[:, -1]
    return np.stack(chosen, axis=1), np.stack(every, axis=1)


def forced_jax(model, prompt: np.ndarray, tokens: np.ndarray, max_length: int) -> np.ndarray:
    """The port's logits ``(len(tokens), vocab)`` fed ``tokens`` whatever it would choose: the prompt
    (1-D) prefilled, then ``tokens[s]`` at step ``s + 1``; step 0's logits are the prompt's last token's."""
    import jax.numpy as jnp
    from flax import nnx

    model = nnx.clone(model)
    model.init_cache(1, max_length)
    call = _decode_call()
    length = len(prompt)
    logits = call(model, jnp.asarray(prompt[None]), jnp.asarray(np.arange(length)[None]))[:, -1]
    every = [arrays.numpy(logits)[0]]
    for step in range(len(tokens) - 1):
        logits = call(model, jnp.asarray(tokens[None, step:step + 1]), jnp.asarray([[length + step]]))[:, -1]
        every.append(arrays.numpy(logits)[0])
    return np.stack(every)


def teacher_forced(row: int, mine: np.ndarray, theirs: np.ndarray, limits: Steps, k: int = 5) -> ForcedResult:
    """Per step, the port's logits ``mine`` against PyTorch's ``theirs`` (each ``(steps, vocab)``)."""
    a, b = arrays.to_float64(mine), arrays.to_float64(theirs)
    kl, top1, topk = logit_metrics.per_token(a, b, k)
    return ForcedResult(row, [arrays.relative_error(a[s], b[s]) for s in range(len(b))], kl.tolist(),
                        top1.tolist(), topk.tolist(), limits.tolerance, min(k, b.shape[-1]), limits=limits)


def own_rounding(shadow, prompt: np.ndarray, tokens: np.ndarray, logits: np.ndarray) -> list[float | None]:
    """Per step, PyTorch's logits ``(steps, vocab)`` (``tokens`` chosen after ``prompt``) against its
    float64 copy ``shadow`` fed the same tokens at once; Nones where the copy cannot run."""
    import torch

    sequence = np.concatenate([prompt, tokens[:-1]]).astype(prompt.dtype)[None]
    try:
        with torch.no_grad():
            out = shadow(torch_side.to_torch(sequence, torch_side.device_of(shadow)))
        exact = arrays.numpy(arrays.fields(out)[0][1])[0, len(prompt) - 1:]
    except Exception:  # a model that cannot run in float64: its steps keep the fixed tolerance
        return [None] * len(logits)
    return [arrays.relative_error(logits[s], exact[s]) for s in range(len(logits))]


def step_limits(torch_model, prompts, alone, tolerance: float | None, dtype: str) -> list[Steps]:
    """Each row's ``Steps``: a ``tolerance`` given judges alone; else ``verdict.bound`` of PyTorch's own
    rounding per step, at least a module's floor (``OUTPUT_TOLERANCES`` where it cannot be measured)."""
    if tolerance is not None:
        return [Steps(tolerance) for _ in prompts]
    fixed = settings.OUTPUT_TOLERANCES.get(dtype, 1e-4)
    shadow = torch_side.float64_copy(torch_model)
    if shadow is None:  # a float64 model is its own reference
        return [Steps(fixed) for _ in prompts]
    floor = verdict.module_floor(fixed, dtype)
    return [Steps(fixed, own_rounding(shadow, p, alone[i][0][0], alone[i][1][0]), floor)
            for i, p in enumerate(prompts)]


def greedy_torch(model, tokens: np.ndarray, positions: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``generate``, greedy, its own cache, on left-padded ``tokens``: exactly ``steps`` tokens."""
    import torch
    import transformers

    device = torch_side.device_of(model)
    config = transformers.GenerationConfig(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
                                           output_logits=True, return_dict_in_generate=True)
    mask = torch_side.to_torch((positions >= 0).astype(np.int64), device)
    with torch.no_grad():
        out = model.generate(torch_side.to_torch(tokens, device), attention_mask=mask, generation_config=config)
    new = out.sequences[:, tokens.shape[1]:]
    if new.shape[1] != steps:
        raise ValueError(f"generate stopped after {new.shape[1]} of {steps} tokens")
    return arrays.numpy(new), np.stack([arrays.numpy(x) for x in out.logits], axis=1)


def compare_decoding(torch_model, flax_model, prompts, *, steps: int = 16, tolerance: float | None = None,
                     paddings: tuple[str, ...] = ("left", "right"), mapping=None) -> DecodeReport:
    """Each prompt (1-D integer arrays of different lengths) decoded greedily for ``steps`` tokens:
    transformers' ``generate`` on each row alone is the reference; the JAX model decodes each row
    alone and the rows in a batch padded on each side of ``paddings`` (``"left"``, ``"right"``:
    a port that pads on one side only is checked on that side), and PyTorch the left-padded batch.
    Each step's logits are judged by ``verdict.bound``: PyTorch's own rounding of that step (against
    its float64 copy fed the same tokens), or ``tolerance`` when given. A failing result names its
    first differing step and the first module whose output differs in that step, in the row decoded
    alone or, where only the padded batch fails, in that batch (``mapping`` pairs the modules, as
    ``compare``'s). Each prompt is also decoded teacher-forced (``ForcedResult``, in ``forced``): its
    prompt compared module by module as ``compare`` compares it, then the port fed PyTorch's tokens,
    per step KL, top-1 and top-k agreement against PyTorch's logits, the first step out of bounds
    located at its module."""
    flax, prompts, paddings = _checked(flax_model, prompts, paddings)
    dtype = settings.check_dtype("PyTorch", torch_side.parameter_dtypes(torch_model), None)
    settings.check_dtype("JAX", flax.dtypes(), dtype)
    with settings.numerics() as numerics:
        alone = [greedy_torch(torch_model, p[None], np.arange(len(p))[None], steps) for p in prompts]
        limits = step_limits(torch_model, prompts, alone, tolerance, dtype)
        longest = max(map(len, prompts)) + steps  # one cache shape for every run
        run = Run(torch_model, flax, prompts, alone, limits, longest, mapping)
        results = run.free_running(paddings)
        forced = run.teacher_forced()
    return DecodeReport(results, steps, {**numerics, "dtype": dtype}, forced)


def _checked(flax_model, prompts, paddings) -> tuple[jax_side.Flax, list[np.ndarray], tuple[str, ...]]:
    paddings = tuple(paddings)
    if not set(paddings) <= {"left", "right"}:
        raise ValueError(f"paddings must name 'left' and/or 'right', got {paddings!r}")
    flax = jax_side.as_flax(flax_model)
    if flax.kind != "nnx":
        raise TypeError("compare_decoding takes an nnx model (its cache is in the model)")
    prompts = [np.asarray(p) for p in prompts]
    if not prompts or any(p.ndim != 1 or not len(p) or p.dtype.kind not in "iu" for p in prompts):
        raise ValueError("prompts must be non-empty 1-D integer arrays, "
                         f"got {[(p.shape, str(p.dtype)) for p in prompts]}")
    return flax, prompts, paddings


@dataclass
class Run:
    """One ``compare_decoding``: both models, the prompts, PyTorch's greedy run of each row alone
    (``alone[row]``: tokens and logits), each row's ``Steps``, the cache length and the mapping."""

    torch_model: object
    flax: jax_side.Flax
    prompts: list[np.ndarray]
    alone: list[tuple[np.ndarray, np.ndarray]]
    limits: list[Steps]
    longest: int
    mapping: object

    @property
    def steps(self) -> int:
        return self.alone[0][0].shape[1]

    def results(self, what: str, tokens: np.ndarray, logits: np.ndarray, rows: list[int]) -> list[DecodeResult]:
        """Each row of a decoding (``tokens`` ``(rows, steps)``, ``logits``) against PyTorch's alone."""
        found = []
        for i, row in enumerate(rows):
            expected_tokens, expected_logits = self.alone[row]
            per_step = [arrays.relative_error(logits[i, k], expected_logits[0, k]) for k in range(self.steps)]
            found.append(DecodeResult(what, row, tokens[i].tolist(), expected_tokens[0].tolist(),
                                      arrays.relative_error(logits[i], expected_logits[0]), self.limits[row].tolerance,
                                      per_step, limits=self.limits[row]))
        return found

    def free_running(self, paddings: tuple[str, ...]) -> list[DecodeResult]:
        """Each row alone, the rows padded on each side of ``paddings``, PyTorch's left-padded batch;
        each failing JAX result located at its module."""
        results, module = [], self.flax.module
        for i, p in enumerate(self.prompts):
            decoded = greedy_jax(module, p[None], np.arange(len(p))[None], self.steps, self.longest)
            results += self.results("JAX, the row alone", *decoded, [i])
        rows = list(range(len(self.prompts)))
        for side in paddings:
            batch = padded(self.prompts, left=side == "left")
            results += self.results(f"JAX, {side}-padded batch",
                                    *greedy_jax(module, *batch, self.steps, self.longest), rows)
        results += self.results("PyTorch, left-padded batch",
                                *greedy_torch(self.torch_model, *padded(self.prompts, left=True), self.steps), rows)
        self.locate(results)
        return results

    def locate(self, results: list[DecodeResult]) -> None:
        """Each failing JAX result's ``module``: the first module that differs in its first differing
        step, in the row decoded alone, or in the padded batch where the row passes alone."""
        found: dict[tuple, str] = {}
        alone_failed = {r.row: r.first_step for r in results if r.what == "JAX, the row alone" and not r.passed}
        for r in results:
            if r.passed or not r.what.startswith("JAX") or r.first_step is None or r.first_step >= len(r.expected):
                continue
            side = None if r.row in alone_failed else r.what.split(", ")[1].split("-")[0]
            key = (r.row, alone_failed[r.row]) if side is None else (side, r.first_step)
            if key not in found:
                found[key] = self.locate_step(key[1], [r.row] if side is None else None, side)
            r.module = found[key]

    def locate_step(self, step: int, rows: list[int] | None = None, side: str | None = None) -> str:
        """``locate_step`` of ``rows`` (default: every row, padded on ``side``) fed PyTorch's tokens."""
        rows = list(range(len(self.prompts))) if rows is None else rows
        prompts = [self.prompts[r] for r in rows]
        tokens, positions = padded(prompts, left=side != "right")
        expected = np.stack([self.alone[r][0][0] for r in rows])
        return locate_step(self.torch_model, self.flax, tokens, expected, step, self.longest, self.mapping, positions)

    def teacher_forced(self) -> list[ForcedResult]:
        """Each row fed PyTorch's tokens; its prompt compared module by module first."""
        forced = []
        for i, p in enumerate(self.prompts):
            tokens, logits = self.alone[i][0][0], self.alone[i][1][0]
            result = teacher_forced(i, forced_jax(self.flax.module, p, tokens, self.longest), logits, self.limits[i])
            result.prompt_divergence = step_report(self.torch_model, self.flax, p[None], tokens[None], 0,
                                                   self.longest, self.mapping).first_divergence
            if not result.passed:
                result.module = result.prompt_divergence or self.locate_step(result.first_step, [i])
            forced.append(result)
        return forced


def _last_position(x: np.ndarray | None, length: int, batch: int) -> np.ndarray | None:
    """The last token's part of a whole-sequence run's array of ``batch`` rows: ``x[:, -1:]`` for
    ``(batch, length, ...)``, or along the one other axis of ``length`` (``(batch, heads, length, head_dim)``)."""
    if x is None or x.ndim < 2 or x.shape[0] != batch:
        return x
    axes = [1] if x.shape[1] == length else [a for a in range(2, x.ndim) if x.shape[a] == length]
    if len(axes) != 1:
        return x
    return np.ascontiguousarray(np.take(x, [length - 1], axis=axes[0]))


def _torch_step(torch_model, sequence: np.ndarray, positions: np.ndarray, step: int):
    """PyTorch run on the whole ``sequence`` (``positions``: -1 padding, given as its attention mask
    and position ids), each array cut to its last token's part when ``step`` is a cached one."""
    keywords = {"attention_mask": (positions >= 0).astype(np.int64), "position_ids": np.maximum(positions, 0)}
    ref = torch_side.record(torch_model, [sequence], settings={}, dtype=settings.check_dtype(
        "PyTorch", torch_side.parameter_dtypes(torch_model), None), keywords=keywords)
    if step:
        cut = functools.partial(_last_position, length=sequence.shape[1], batch=sequence.shape[0])
        for call in ref.calls:
            call.inputs = [(n, cut(x)) for n, x in call.inputs]
            call.output, call.output64, call.inherited64 = cut(call.output), cut(call.output64), cut(call.inherited64)
        ref.outputs, ref.outputs64 = [(n, cut(x)) for n, x in ref.outputs], [(n, cut(x)) for n, x in ref.outputs64]
    return ref


def step_report(torch_model, flax, tokens: np.ndarray, expected: np.ndarray, step: int, max_length: int,
                mapping=None, positions: np.ndarray | None = None):
    """``compare``'s report of the port decoding ``step`` with its cache (the prompts ``tokens``
    ``(batch, width)`` at ``positions``, -1 padding, and ``expected[:, :step - 1]`` cached,
    ``expected[:, step - 1]`` the step's tokens; step 0: the prompts themselves) against PyTorch run
    on the whole sequences (their last token's part), the padding left out."""
    from flax import nnx

    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape) if positions is None else positions
    lengths = positions.max(axis=1, keepdims=True) + 1
    sequence = np.concatenate([tokens, expected[:, :step]], axis=1).astype(tokens.dtype)
    where = np.concatenate([positions, lengths + np.arange(step)], axis=1)
    ref = _torch_step(torch_model, sequence, where, step)
    model = nnx.clone(flax.module)
    model.init_cache(sequence.shape[0], max_length)
    if step:
        _decode_call()(model, sequence[:, :-1], where[:, :-1])
    pairs, _, layouts = core.pairs_of(ref, names.check_mapping(mapping), adapters=False)
    given, at = (sequence[:, -1:], where[:, -1:]) if step else (sequence, where)
    valid = None if step or (where >= 0).all() else where >= 0
    output, calls = jax_side.run(jax_side.Flax("nnx", model), [given], pairs, valid, None, layouts,
                                 position_ids=jax_side.to_jax(at), decode=True)
    return core.report(ref, output, calls, pairs, valid, 5, {}, None)


def locate_step(torch_model, flax, tokens: np.ndarray, expected: np.ndarray, step: int, max_length: int,
                mapping=None, positions: np.ndarray | None = None) -> str:
    """The first module whose output differs in ``step_report``: ``compare``'s first divergence,
    else the first module whose inherited error is beyond what it may inherit."""
    report = step_report(torch_model, flax, tokens, expected, step, max_length, mapping, positions)
    if report.first_divergence:
        return report.first_divergence
    return next((m.label for m in report.modules if m.inherited is not None and m.inherited > m.inherited_bound),
                "none found (every module's output within what it may inherit)")
