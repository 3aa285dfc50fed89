"""``compare``: a PyTorch model (or a saved reference) and its Flax port on the same inputs,
module by module."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from parity_tests.porting import jax_side, logits, names, settings
from parity_tests.porting.recording import Recording
from parity_tests.porting.reference import reference
from parity_tests.porting.report import ModuleResult, OutputResult, Report
from parity_tests.porting.suggest import suggest_mapping
from parity_tests.tool import arrays, axis_layouts, verdict


def _is_ours(cls: str) -> bool:
    return cls.split(".", 1)[0] in ("mha_jax", "mha_torch") and "Attention" in cls.rsplit(".", 1)[-1]


def _pair_outputs(jax_output, torch_fields: list[tuple[str, np.ndarray]]) -> list[tuple[str, object, np.ndarray]]:
    """``(name, jax array, torch array)`` per field: by name when the JAX side names its fields
    as PyTorch's, else in order (a bare array pairs with the first field, e.g. ``logits``)."""
    jax_fields = arrays.fields(jax_output)
    torch_map = dict(torch_fields)
    if jax_fields and all(k in torch_map for k, _ in jax_fields):
        return [(k, v, torch_map[k]) for k, v in jax_fields]
    return [(name, v, t) for (name, t), (_, v) in zip(torch_fields, jax_fields)]


def compare(
    torch_model,
    flax_model,
    *inputs,
    mapping: Mapping[str, str | None] | None = None,
    dtype: str | None = None,
    valid: np.ndarray | None = None,
    top_k: int = 5,
    matmul_precision: str = "highest",
    output_tolerance: float | None = None,
) -> Report:
    """Run both models on ``inputs`` and compare them module by module.

    Args:
      torch_model: a ``torch.nn.Module`` (in eval mode), or a reference saved by ``save_reference``
        and read by ``load_reference`` (then ``inputs`` may be left out).
      flax_model: an ``nnx.Module``, or a linen ``(module, variables)`` pair.
      inputs: NumPy arrays, each given to both models as its framework's array (integers stay integers).
      mapping: regular expressions on PyTorch module names -> the JAX module's name (``\\1``
        references allowed; None leaves a module out), for modules whose names differ; a value
        ``(name, adapter)`` also maps PyTorch's recorded call to the JAX module's (``adapter(args:
        dict[str, np.ndarray]) -> (args, kwargs)``, ``...`` or an argument left out keeping the JAX
        call's own);
        ``"auto"``: the mapping ``suggest_mapping`` proposes from this run's recording (or the
        saved reference) and the port.
      dtype: the dtype both sides' parameters must hold (default: PyTorch's; JAX must hold the same).
      valid: bool ``(batch, length)``: compare only these positions (padding left out) of every
        array whose shape starts with ``(batch, length)``.
      top_k: ``k`` of the logits' top-k agreement.
      matmul_precision: ``jax_default_matmul_precision`` for the run (PyTorch's TF32 is off).
      output_tolerance: relative error the outputs may have (default: by dtype, ``settings.OUTPUT_TOLERANCES``).

    Returns:
      A ``Report``: ``modules`` (each with ``name``, ``added``, ``reference``, ``bound``,
      ``inherited``, ``outcome``: passed, failed or not compared) in execution order,
      ``first_divergence``, ``outputs``, ``logits``, ``settings``.
    """
    flax = jax_side.as_flax(flax_model)
    auto = isinstance(mapping, str) and mapping == "auto"
    compiled = None if auto else names.check_mapping(mapping)
    valid = None if valid is None else np.asarray(valid, bool)
    saved = isinstance(torch_model, Recording)
    with settings.numerics(matmul_precision, torch_needed=not saved) as numerics:
        ref = reference(torch_model, inputs, dtype)
        inputs = ref.inputs
        if auto:  # suggested from the recording just made: PyTorch runs once
            compiled = names.check_mapping(suggest_mapping(ref, flax))
        _check_valid(valid, ref)
        jax_dtype = settings.check_dtype("JAX", flax.dtypes(), ref.dtype)
        if jax_dtype != ref.dtype:
            raise ValueError(f"the JAX side holds {jax_dtype} parameters and the PyTorch side {ref.dtype}: "
                             "compare them in one dtype")
        pairs, adapters, layouts = pairs_of(ref, compiled)
        output, jax_calls = jax_side.run(flax, inputs, pairs, valid, adapters, layouts)
    torch_settings = {k: v for k, v in ref.settings.items() if k.startswith("torch")}
    recorded = {**numerics, **torch_settings, "dtype": ref.dtype, "torch_dtype": ref.dtype, "jax_dtype": jax_dtype,
                "saved_reference": saved}
    return report(ref, output, jax_calls, pairs, valid, top_k, recorded, output_tolerance)


def pairs_of(ref: Recording, compiled: list[tuple], adapters: bool = True) -> tuple[dict, dict, dict]:
    """The recorded calls by the JAX call each pairs with (``(JAX name, occurrence)``), and the input
    adapters (unless ``adapters`` is False) and declared output layouts of their mapping entries, by
    the PyTorch call's key."""
    pairs, adapter_of, layouts = {}, {}, {}
    for call in ref.calls:
        target = names.jax_name(call.name, compiled)
        if target is None:
            continue
        pairs[(target, call.occurrence)] = call
        if adapters and names.adapter(call.name, compiled) is not None:
            adapter_of[call.key] = names.adapter(call.name, compiled)
        if names.layout(call.name, compiled) is not None:
            layouts[call.key] = names.layout(call.name, compiled)
    return pairs, adapter_of, layouts


def _check_valid(valid: np.ndarray | None, ref: Recording) -> None:
    """``valid`` must be ``(batch, length)`` of the first output: a mask that selects nothing is an error."""
    if valid is None:
        return
    first = ref.outputs[0][1].shape if ref.outputs else ()
    if valid.ndim != 2 or tuple(first[:2]) != valid.shape:
        raise ValueError(f"valid must be bool (batch, length) of the outputs, whose first is {tuple(first)}; "
                         f"got {valid.shape}")


def _optional_error(a, b, valid) -> float | None:
    """``a`` against ``b`` where ``b`` is finite (transformers' float64 masks make a left-padded row
    NaN); None without ``b`` or without a finite entry, so that the fixed tolerance alone judges."""
    if a is None or b is None or a.shape != b.shape:
        return None
    a, b = arrays.to_float64(a), arrays.to_float64(b)
    finite = np.isfinite(b)
    if not finite.any():
        return None
    try:
        error = arrays.relative_error(np.where(finite, a, 0.0), np.where(finite, b, 0.0), valid)
    except axis_layouts.LayoutError:  # padding that cannot be placed (heads == length): the row is not compared
        return None
    return error if np.isfinite(error) else None


def _row(call, mine, ref: Recording, valid) -> ModuleResult:
    attention = _is_ours(call.cls) or _is_ours(mine.cls)
    dtype = str(call.output.dtype) if call.output is not None and arrays.is_float(call.output) else ref.dtype
    tolerance = settings.attention_tolerance(dtype) if attention else settings.module_tolerance(dtype)
    sources = [s for s in call.sources if s is not None]
    return ModuleResult(call.name, mine.name, call.occurrence, call.cls, attention, dtype, tolerance, mine.added,
                        mine.inherited, mine.note, _optional_error(call.output, call.output64, valid),
                        _optional_error(call.output, call.inherited64, valid), sources,
                        jax_sources=[s for s in mine.sources if s is not None], layout=mine.layout)


def judge_by_flow(modules: list[ModuleResult]) -> None:
    """A row without an added error fails, ``by_flow``, when its inherited error is beyond what it
    may inherit while every input whose error is known (the output of a paired module, or the
    model's input) was within what it may: the error arose inside it. Inputs made by code between
    modules, or by unpaired modules, are not known; a row with no known input stays not compared."""
    by_key = {m.key: m for m in modules}
    for m in modules:
        if m.added is not None or m.inherited is None:
            continue
        known = [(0.0, 0.0) if s.startswith("input.") else (by_key[s].inherited, by_key[s].inherited_bound)
                 for s in m.sources if s.startswith("input.") or (s in by_key and by_key[s].inherited is not None)]
        if not known:
            m.note = m.note or "the errors of its inputs are not known"
            continue
        m.by_flow = all(verdict.within(e, limit) for e, limit in known) and not verdict.within(m.inherited,
                                                                                               m.inherited_bound)


def report(ref: Recording, output, jax_calls, pairs, valid, top_k, recorded, output_tolerance) -> Report:
    """The ``Report`` of a run: a row per paired call, judged; the outputs; the unpaired modules."""
    by_torch = {(pairs[(c.name, c.occurrence)].key): c for c in jax_calls if (c.name, c.occurrence) in pairs}
    modules, unpaired = [], []
    for call in ref.calls:
        mine = by_torch.get(call.key)
        if mine is None:
            unpaired.append(call.name)
        else:
            modules.append(_row(call, mine, ref, valid))
    judge_by_flow(modules)
    paired = set(pairs)
    unpaired_jax = [c.name for c in jax_calls if (c.name, c.occurrence) not in paired]
    tolerance = output_tolerance if output_tolerance is not None else settings.OUTPUT_TOLERANCES.get(ref.dtype, 1e-4)
    floor, exact = verdict.module_floor(tolerance, ref.dtype), dict(ref.outputs64 if output_tolerance is None else [])
    outputs, metrics = [], None
    for name, mine, theirs in _pair_outputs(output, ref.outputs):
        if not arrays.is_float(theirs):
            continue
        try:
            errors = arrays.relative_error(mine, theirs, valid), arrays.max_abs_error(mine, theirs, valid)
        except ValueError:  # an output of no (or no one) layout of PyTorch's cannot hold: it fails, its error infinite
            errors = float("inf"), float("inf")
        outputs.append(OutputResult(name, *errors, tolerance, reference=_optional_error(theirs, exact.get(name), valid),
                                    floor=floor))
        if name == "logits" and np.isfinite(errors[0]):
            metrics = logits.metrics(mine, theirs, k=top_k, valid=valid)
    return Report(modules, outputs, metrics, recorded, unpaired, unpaired_jax)
