"""The PyTorch side: a model run with forward hooks on every submodule, recording what each
call was given (bound to its ``forward``'s parameter names), which call made each of those
tensors (the data flow, by tensor identity) and what it returned; and a float64 copy of the model,
run module by module on the same inputs and as a whole, to measure the rounding each module makes
and inherits."""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections import Counter

import numpy as np

from parity_tests.porting.recording import Call, Flow, Recording
from parity_tests.tool import arrays


def parameter_dtypes(model) -> set[str]:
    return {str(p.dtype).replace("torch.", "") for p in model.parameters()}


def to_torch(x, device):
    import torch

    x = np.asarray(x)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.array(x, copy=True)).to(device)


def device_of(model):
    import torch

    return next(model.parameters(), torch.empty(0)).device


def _bound(module, args, kwargs) -> list[tuple[str, object]]:
    """The call's arguments by parameter name (``args.N`` where the signature cannot bind them)."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        items = []
        for name, value in bound.arguments.items():
            kind = bound.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                items += [(f"{name}.{i}", v) for i, v in enumerate(value)]
            elif kind is inspect.Parameter.VAR_KEYWORD:
                items += list(value.items())
            else:
                items.append((name, value))
        return items
    except TypeError:
        return [(f"args.{i}", a) for i, a in enumerate(args)] + list(kwargs.items())


def _flat(items) -> list[tuple[str, object]]:
    """``(name, tensor)`` of every tensor of the call, a tuple argument's as ``name.0``, ``name.1``..."""
    import torch

    found = []
    for name, value in items:
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, (tuple, list)):
            found += [(f"{name}.{i}", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return found


def _as_float64(value):
    """A call's argument for the float64 copy: floating tensors in float64, containers rebuilt,
    other objects (a cache) deep-copied so that the copy's run leaves the model's own untouched."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().double() if value.is_floating_point() else value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_as_float64(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_float64(v) for k, v in value.items()}
    return copy.deepcopy(value)


def float64_copy(model):
    """A copy of ``model`` in float64 (None when it computes in float64 already: it is its own reference)."""
    import torch

    if all(p.dtype == torch.float64 for p in model.parameters() if p.is_floating_point()):
        return None
    return copy.deepcopy(model).double()


def _float_output(output) -> np.ndarray | None:
    out = arrays.primary(output)
    return None if out is None or not out.is_floating_point() else arrays.numpy(out)


@contextlib.contextmanager
def recording(model, calls: list[Call], flow: Flow | None = None, shadow=None):
    """Hooks on every submodule (not ``model`` itself) for the block, appending a ``Call`` to ``calls``
    as each call finishes, with the source of each input (``flow``) and, given ``shadow`` (a float64
    copy of ``model``), the output of its copy of the module on the same inputs."""
    names = {id(m): n for n, m in model.named_modules() if n}
    copies = dict(shadow.named_modules()) if shadow is not None else {}
    flow = flow if flow is not None else Flow()
    counts: Counter = Counter()
    pending: dict[int, list] = {}

    def before(module, args, kwargs):
        tensors = _flat(_bound(module, args, kwargs))
        pending.setdefault(id(module), []).append(
            ([(n, arrays.numpy(t)) for n, t in tensors], [flow.source(t) for _, t in tensors],
             _own_float64(copies.get(names[id(module)]), args, kwargs)))

    def after(module, args, kwargs, output):
        name = names[id(module)]
        out = arrays.primary(output)
        inputs, sources, output64 = pending[id(module)].pop()
        calls.append(Call(name, counts[name], f"{type(module).__module__}.{type(module).__qualname__}",
                          inputs, None if out is None else arrays.numpy(out), sources, output64))
        flow.mark(out, f"{name}#{counts[name]}")
        counts[name] += 1

    handles = []
    for _, module in model.named_modules():
        if id(module) in names:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _own_float64(copy_of_module, args, kwargs) -> np.ndarray | None:
    """The float64 copy of a module run on its call's arguments (in float64), or None when it cannot be."""
    if copy_of_module is None:
        return None
    try:
        return _float_output(copy_of_module(*_as_float64(args), **_as_float64(kwargs)))
    except Exception:  # a module whose float64 run fails is judged by its fixed tolerance alone
        return None


def _whole_float64(shadow, inputs, device, keywords: dict | None = None) -> tuple[dict, list]:
    """Every submodule's output when the float64 copy runs the whole model (``(name, occurrence)`` ->
    array), and the model's output fields (``arrays.fields``)."""
    outputs: dict[tuple[str, int], np.ndarray] = {}
    counts: Counter = Counter()
    names = {id(m): n for n, m in shadow.named_modules() if n}

    def after(module, args, output):
        name = names[id(module)]
        found = _float_output(output)
        if found is not None:
            outputs[(name, counts[name])] = found
        counts[name] += 1

    handles = [m.register_forward_hook(after) for _, m in shadow.named_modules() if id(m) in names]
    try:
        result = shadow(*(_as_float64(to_torch(x, device)) for x in inputs),
                        **{k: _as_float64(to_torch(x, device)) for k, x in (keywords or {}).items()})
    except Exception:  # the model cannot run in float64: every module is judged by its fixed tolerance
        return {}, []
    finally:
        for handle in handles:
            handle.remove()
    return outputs, [(k, arrays.numpy(v)) for k, v in arrays.fields(result)]


def check_eval(model) -> None:
    training = [n or "the model" for n, m in model.named_modules() if m.training]
    if training:
        more = " and more" if len(training) > 1 else ""
        raise ValueError(f"the PyTorch model is in training mode ({training[0]}{more}: dropout would differ "
                         "between the sides); call model.eval() first")


def record(model, inputs, *, settings: dict, dtype: str, keywords: dict | None = None) -> Recording:
    """Run ``model(*inputs, **keywords)`` (NumPy arrays, each as a tensor of its own dtype) without gradients;
    unless it computes in float64, a float64 copy of it too: each module on its call's inputs
    (the module's own rounding) and the whole model (the rounding each module inherits)."""
    import torch

    check_eval(model)
    device = device_of(model)
    calls: list[Call] = []
    flow = Flow()
    given = [to_torch(x, device) for x in inputs]
    named = {k: to_torch(x, device) for k, x in (keywords or {}).items()}
    for i, x in enumerate([*given, *named.values()]):
        flow.mark(x, f"input.{i}")
    with torch.no_grad():
        shadow = float64_copy(model)
        whole, outputs64 = _whole_float64(shadow, inputs, device, keywords) if shadow is not None else ({}, [])
        with recording(model, calls, flow, shadow):
            output = model(*given, **named)
    for call in calls:
        call.inherited64 = whole.get(call.key)
    outputs = [(k, arrays.numpy(v)) for k, v in arrays.fields(output)]
    return Recording([np.asarray(x) for x in inputs], outputs, calls, dtype, settings, outputs64)
