"""The PyTorch side: a model run with forward hooks on every submodule, recording what each
call was given (bound to its ``forward``'s parameter names) and what it returned."""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter

import numpy as np

from parity_tests.porting import arrays
from parity_tests.porting.recording import Call, Recording


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


def _tensors(items) -> list[tuple[str, np.ndarray]]:
    import torch

    found = []
    for name, value in items:
        if isinstance(value, torch.Tensor):
            found.append((name, arrays.numpy(value)))
        elif isinstance(value, (tuple, list)):
            found += [(f"{name}.{i}", arrays.numpy(v)) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return found


@contextlib.contextmanager
def recording(model, calls: list[Call]):
    """Hooks on every submodule (not ``model`` itself) for the block, appending a ``Call`` to ``calls``
    as each call finishes."""
    names = {id(m): n for n, m in model.named_modules() if n}
    counts: Counter = Counter()
    pending: dict[int, list] = {}

    def before(module, args, kwargs):
        pending.setdefault(id(module), []).append(_tensors(_bound(module, args, kwargs)))

    def after(module, args, kwargs, output):
        name = names[id(module)]
        out = arrays.primary(output)
        calls.append(Call(name, counts[name], f"{type(module).__module__}.{type(module).__qualname__}",
                          pending[id(module)].pop(), None if out is None else arrays.numpy(out)))
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


def check_eval(model) -> None:
    training = [n or "the model" for n, m in model.named_modules() if m.training]
    if training:
        more = " and more" if len(training) > 1 else ""
        raise ValueError(f"the PyTorch model is in training mode ({training[0]}{more}: dropout would differ "
                         "between the sides); call model.eval() first")


def record(model, inputs, *, settings: dict, dtype: str) -> Recording:
    """Run ``model(*inputs)`` (NumPy arrays, each as a tensor of its own dtype) without gradients."""
    import torch

    check_eval(model)
    device = device_of(model)
    calls: list[Call] = []
    with torch.no_grad(), recording(model, calls):
        output = model(*(to_torch(x, device) for x in inputs))
    outputs = [(k, arrays.numpy(v)) for k, v in arrays.fields(output)]
    return Recording([np.asarray(x) for x in inputs], outputs, calls, dtype, settings)
