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

from parity_tests.porting import jax_side, settings
from parity_tests.porting import logits as logit_metrics
from parity_tests.tool import arrays, verdict


@dataclass
class DecodeResult:
    """One row's tokens and logits from one way of decoding (``what``) against PyTorch's alone."""

    what: str
    row: int
    tokens: list[int]
    expected: list[int]
    logits_error: float
    tolerance: float
    step_errors: list[float] = field(default_factory=list)
    module: str | None = None  # the first module whose output differs in the first step that differs

    @property
    def passed(self) -> bool:
        return self.tokens == self.expected and verdict.within(self.logits_error, verdict.bound(self.tolerance))

    @property
    def first_step(self) -> int | None:
        """The first step whose token differs or whose logits are beyond the tolerance (None: none)."""
        for step, (mine, theirs) in enumerate(zip(self.tokens, self.expected)):
            error = self.step_errors[step] if step < len(self.step_errors) else 0.0
            if mine != theirs or not verdict.within(error, verdict.bound(self.tolerance)):
                return step
        return None if self.passed else len(self.expected)

    def failure(self) -> str:
        """The failure in words: the row, the way of decoding, the first step that differs and how."""
        step = self.first_step
        if step is None or step >= len(self.tokens):
            return f"{self.what} row {self.row}: logits {self.logits_error:.2e} > {self.tolerance:.0e}"
        how = (f"token {self.tokens[step]} for {self.expected[step]}" if self.tokens[step] != self.expected[step]
               else f"logits {self.step_errors[step]:.2e} > {self.tolerance:.0e}")
        where = f"; first module differing in that step: {self.module}" if self.module else ""
        return f"{self.what} row {self.row}: differs from step {step} ({how}){where}"

    def as_json(self) -> dict:
        return dict(asdict(self), passed=self.passed, first_step=self.first_step)


@dataclass
class ForcedResult:
    """One row decoded teacher-forced: per step (0: the prompt's last token) the relative ``errors``
    of the port's logits against PyTorch's, ``kl`` (``KL(PyTorch || port)``), ``top1`` (the argmaxes
    agree) and ``topk`` (overlap of the ``k`` most likely); ``module``: the first module differing in
    the first step out of bounds."""

    row: int
    errors: list[float]
    kl: list[float]
    top1: list[bool]
    topk: list[float]
    tolerance: float
    k: int = 5
    module: str | None = None

    @property
    def first_step(self) -> int | None:
        """The first step whose logits are beyond the bound or whose argmax differs (None: none)."""
        return next((s for s, (e, agree) in enumerate(zip(self.errors, self.top1))
                     if not agree or not verdict.within(e, verdict.bound(self.tolerance))), None)

    @property
    def passed(self) -> bool:
        return self.first_step is None

    def failure(self) -> str:
        step = self.first_step
        where = f"; first module differing in that step: {self.module}" if self.module else ""
        return (f"teacher-forced row {self.row}: out of bounds from step {step} (logits {self.errors[step]:.2e} "
                f"> {self.tolerance:.0e}, KL {self.kl[step]:.2e}, top-1 {'agrees' if self.top1[step] else 'differs'})"
                + where)

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
                         f"logits {r.logits_error:.2e} (tolerance {r.tolerance:.0e}) {'ok' if r.passed else 'FAILED'}"
                         + step)
        for f in self.forced:
            step = "" if f.passed else f", first out of bounds at step {f.first_step}" + (
                f" (first module differing: {f.module})" if f.module else "")
            lines.append(f"  {'teacher-forced':<28} row {f.row}: KL max {max(f.kl):.2e}, top-1 {np.mean(f.top1):.3f}, "
                         f"top-{f.k} {np.mean(f.topk):.3f}, logits {max(f.errors):.2e} (tolerance {f.tolerance:.0e}) "
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


def teacher_forced(row: int, mine: np.ndarray, theirs: np.ndarray, tolerance: float, k: int = 5) -> ForcedResult:
    """Per step, the port's logits ``mine`` against PyTorch's ``theirs`` (each ``(steps, vocab)``)."""
    a, b = arrays.to_float64(mine), arrays.to_float64(theirs)
    kl, top1, topk = logit_metrics.per_token(a, b, k)
    return ForcedResult(row, [arrays.relative_error(a[s], b[s]) for s in range(len(b))], kl.tolist(),
                        top1.tolist(), topk.tolist(), tolerance, min(k, b.shape[-1]))


def greedy_torch(model, tokens: np.ndarray, positions: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' ``generate``, greedy, its own cache, on left-padded ``tokens``: exactly ``steps`` tokens."""
    import torch
    import transformers

    from parity_tests.porting import torch_side

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
    A failing result names its first differing step and, where the row fails decoded alone, the
    first module whose output differs in that step (``mapping`` pairs the modules, as ``compare``'s).
    Each prompt is also decoded teacher-forced (``ForcedResult``, in ``forced``): the port fed
    PyTorch's tokens, per step KL, top-1 and top-k agreement against PyTorch's logits, the first
    step out of bounds located at its module."""
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
    from parity_tests.porting import torch_side

    dtype = settings.check_dtype("PyTorch", torch_side.parameter_dtypes(torch_model), None)
    settings.check_dtype("JAX", flax.dtypes(), dtype)
    tolerance = tolerance if tolerance is not None else settings.OUTPUT_TOLERANCES.get(dtype, 1e-4)
    results = []
    with settings.numerics() as numerics:
        alone = [greedy_torch(torch_model, p[None], np.arange(len(p))[None], steps) for p in prompts]

        def check(what, tokens, logits, rows):
            for i, row in enumerate(rows):
                expected_tokens, expected_logits = alone[row]
                per_step = [arrays.relative_error(logits[i, k], expected_logits[0, k]) for k in range(steps)]
                results.append(DecodeResult(what, row, tokens[i].tolist(), expected_tokens[0].tolist(),
                                            arrays.relative_error(logits[i], expected_logits[0]), tolerance,
                                            per_step))

        longest = max(map(len, prompts)) + steps  # one cache shape for every run
        for i, p in enumerate(prompts):
            check("JAX, the row alone", *greedy_jax(flax.module, p[None], np.arange(len(p))[None], steps, longest), [i])
        rows = list(range(len(prompts)))
        for side in paddings:
            decoded = greedy_jax(flax.module, *padded(prompts, left=side == "left"), steps, longest)
            check(f"JAX, {side}-padded batch", *decoded, rows)
        check("PyTorch, left-padded batch", *greedy_torch(torch_model, *padded(prompts, left=True), steps), rows)
        _locate_failures(results, torch_model, flax, prompts, alone, longest, mapping)
        # teacher-forced: PyTorch's greedy logits are its logits fed its own tokens; the port is fed them too
        forced = [teacher_forced(i, forced_jax(flax.module, p, alone[i][0][0], longest), alone[i][1][0], tolerance)
                  for i, p in enumerate(prompts)]
        for f in forced:
            if not f.passed:
                f.module = locate_step(torch_model, flax, prompts[f.row], alone[f.row][0][0], f.first_step, longest,
                                       mapping)
    return DecodeReport(results, steps, {**numerics, "dtype": dtype}, forced)


def _locate_failures(results: list[DecodeResult], torch_model, flax, prompts, alone, longest: int, mapping) -> None:
    """Each failing JAX result's ``module``: the first module that differs in its first differing step,
    the row decoded alone (a row that passes alone and fails padded: said so)."""
    found: dict[tuple[int, int], str] = {}
    alone_failed = {r.row: r.first_step for r in results if r.what == "JAX, the row alone" and not r.passed}
    for r in results:
        if r.passed or not r.what.startswith("JAX") or r.first_step is None or r.first_step >= len(r.expected):
            continue
        if r.row not in alone_failed:
            r.module = "none alone (the row passes decoded alone: the padding is what differs)"
            continue
        key = (r.row, alone_failed[r.row])
        if key not in found:
            found[key] = locate_step(torch_model, flax, prompts[r.row], alone[r.row][0][0], key[1], longest, mapping)
        r.module = found[key]


def _last_position(x: np.ndarray | None, length: int) -> np.ndarray | None:
    """The last token's part of a whole-sequence run's array of one row: ``x[:, -1:]`` for
    ``(1, length, ...)``, or along the one other axis of ``length`` (``(1, heads, length, head_dim)``)."""
    if x is None or x.ndim < 2 or x.shape[0] != 1:
        return x
    axes = [1] if x.shape[1] == length else [a for a in range(2, x.ndim) if x.shape[a] == length]
    if len(axes) != 1:
        return x
    return np.ascontiguousarray(np.take(x, [length - 1], axis=axes[0]))


def locate_step(torch_model, flax, prompt: np.ndarray, expected: np.ndarray, step: int, max_length: int,
                mapping=None) -> str:
    """The first module whose output differs when the port decodes ``step`` with its cache (the
    prompt and ``expected[:step - 1]`` cached, ``expected[step - 1]`` the step's token) against
    PyTorch run on the whole sequence (its last token's part): ``compare``'s first divergence,
    else the first module whose inherited error is beyond what it may inherit."""
    from flax import nnx

    from parity_tests.porting import core, names, torch_side

    sequence = np.concatenate([prompt, expected[:step]]).astype(prompt.dtype)[None]
    length = sequence.shape[1]
    ref = torch_side.record(torch_model, [sequence], settings={}, dtype=settings.check_dtype(
        "PyTorch", torch_side.parameter_dtypes(torch_model), None))
    if step:
        cut = lambda x: _last_position(x, length)  # noqa: E731
        for call in ref.calls:
            call.inputs = [(n, cut(x)) for n, x in call.inputs]
            call.output, call.output64, call.inherited64 = cut(call.output), cut(call.output64), cut(call.inherited64)
        ref.outputs = [(n, cut(x)) for n, x in ref.outputs]
    model = nnx.clone(flax.module)
    model.init_cache(1, max_length)
    positions = np.arange(length)[None]
    if step:
        _decode_call()(model, sequence[:, :-1], positions[:, :-1])
    compiled = names.check_mapping(mapping)
    pairs = {(names.jax_name(c.name, compiled), c.occurrence): c for c in ref.calls
             if names.jax_name(c.name, compiled) is not None}
    tokens, where = (sequence[:, -1:], positions[:, -1:]) if step else (sequence, positions)
    output, calls = jax_side.run(jax_side.Flax("nnx", model), [tokens], pairs, None,
                                 position_ids=jax_side.to_jax(where), decode=True)
    report = core._report(ref, output, calls, pairs, None, 5, {}, None)
    if report.first_divergence:
        return report.first_divergence
    return next((m.label for m in report.modules if m.inherited is not None and m.inherited > m.inherited_bound),
                "none found (every module's output within what it may inherit)")
