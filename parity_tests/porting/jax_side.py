"""The JAX side: an nnx module (its submodules' calls intercepted by wrapping their classes'
``__call__`` for the run) or a linen ``(module, variables)`` pair (``nn.intercept_methods``).
Each call of a submodule paired with a recorded PyTorch call is run a second time on the
PyTorch call's inputs, with its own keyword arguments: the error that module adds."""

from __future__ import annotations

import contextlib
import inspect
import types
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from parity_tests.porting import arrays, names
from parity_tests.porting.recording import Call


@dataclass
class Flax:
    """The model: ``kind`` ``"nnx"`` (``module`` an ``nnx.Module``) or ``"linen"`` (``module``
    bound by ``variables``)."""

    kind: str
    module: object
    variables: object = None

    def parameters(self) -> dict[str, object]:
        """Parameter path (dotted, as PyTorch names them) -> array."""
        import jax

        if self.kind == "nnx":
            from flax import nnx

            state = nnx.state(self.module, nnx.Param)
            return {names.normalize(path): value[...] for path, value in nnx.to_flat_state(state)}
        flat = jax.tree_util.tree_flatten_with_path(self.variables.get("params", {}))[0]
        return {names.linen([getattr(k, "key", str(k)) for k in path]): leaf for path, leaf in flat}

    def dtypes(self) -> set[str]:
        return {str(np.dtype(v.dtype)) for v in self.parameters().values()}

    def __call__(self, *args, **kwargs):
        if self.kind == "nnx":
            return self.module(*args, **kwargs)
        return self.module.apply(self.variables, *args, **kwargs)


def as_flax(model) -> Flax:
    """An nnx module, or a linen ``(module, variables)`` pair; anything else is a TypeError."""
    from flax import linen, nnx

    if isinstance(model, Flax):
        return model
    if isinstance(model, nnx.Module):
        return Flax("nnx", model)
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], linen.Module):
        return Flax("linen", model[0], model[1])
    raise TypeError(f"flax_model must be an nnx.Module or a linen (module, variables) pair, got {type(model).__name__}")


@dataclass
class JaxCall:
    """One JAX module call and, when paired, its errors against the PyTorch call."""

    name: str
    occurrence: int
    cls: str
    dtype: str | None
    inherited: float | None = None
    added: float | None = None
    note: str = ""


def _kind(dtype) -> str:
    return "float" if np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16" else "integer"


def substitute(signature: inspect.Signature, args: tuple, recorded: list[tuple[str, np.ndarray]]) -> tuple:
    """The call's positional arrays replaced by the PyTorch call's: the input of the same parameter
    name when it holds as many elements of the same kind, else the next unused one that does
    (reshaped to the JAX argument's shape, in its dtype). A ValueError when one has no match."""
    import jax.numpy as jnp

    params = [p for p in signature.parameters.values()
              if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    used: set[int] = set()
    out = list(args)
    for i, value in enumerate(args):
        if not arrays.is_array(value):
            continue
        size, kind = int(np.prod(value.shape)), _kind(value.dtype)
        fits = [j for j, (_, x) in enumerate(recorded) if j not in used and x.size == size and _kind(x.dtype) == kind]
        named = [j for j in fits if i < len(params) and recorded[j][0] == params[i].name]
        if not fits:
            have = ", ".join(f"{n} {x.shape}" for n, x in recorded) or "none"
            raise ValueError(f"no PyTorch input fits argument {i} {tuple(value.shape)} (PyTorch's inputs: {have})")
        j = (named or fits)[0]
        used.add(j)
        out[i] = jnp.asarray(recorded[j][1].reshape(value.shape)).astype(value.dtype)
    return tuple(out)


@dataclass
class Interceptor:
    """Called for every submodule call: runs it, and again on the paired PyTorch call's inputs."""

    pairs: dict[tuple[str, int], Call]
    valid: np.ndarray | None = None
    calls: list[JaxCall] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    replaying: bool = False

    def __call__(self, name: str, cls: str, fn, signature: inspect.Signature, args: tuple, kwargs: dict, again=None):
        """``fn(*args, **kwargs)``, recorded; ``again`` (default ``fn``) runs it on PyTorch's inputs."""
        if self.replaying:
            return fn(*args, **kwargs)
        occurrence = self.counts[name]
        self.counts[name] += 1
        output = fn(*args, **kwargs)
        out = arrays.primary(output)
        call = JaxCall(name, occurrence, cls, None if out is None else arrays.dtype_name(out))
        reference = self.pairs.get((name, occurrence))
        if reference is not None and out is not None and reference.output is not None:
            try:
                call.inherited = arrays.relative_error(out, reference.output, self.valid)
                replaced = substitute(signature, args, reference.inputs)
                self.replaying = True
                try:
                    added = arrays.primary((again or fn)(*replaced, **kwargs))
                finally:
                    self.replaying = False
                call.added = arrays.relative_error(added, reference.output, self.valid)
            except ValueError as error:
                call.note = str(error)
        self.calls.append(call)
        return output


def _class_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@contextlib.contextmanager
def _nnx_intercepted(model, interceptor: Interceptor):
    from flax import nnx

    paths = {}
    for path, module in nnx.iter_modules(model):
        if path:
            paths.setdefault(id(module), names.normalize(path))
    classes = {type(m) for _, m in nnx.iter_modules(model) if id(m) in paths}
    originals = {cls: (cls.__call__, cls.__dict__.get("__call__")) for cls in classes}
    active: set[int] = set()

    def wrap(original):
        def __call__(self, *args, **kwargs):
            name = paths.get(id(self))
            if name is None or id(self) in active:
                return original(self, *args, **kwargs)
            active.add(id(self))
            try:
                bound = types.MethodType(original, self)
                return interceptor(name, _class_name(self), bound, inspect.signature(bound), args, kwargs)
            finally:
                active.discard(id(self))
        return __call__

    try:
        for cls, (resolved, _) in originals.items():
            cls.__call__ = wrap(resolved)
        yield
    finally:
        for cls, (_, own) in originals.items():
            if own is None:
                del cls.__call__
            else:
                cls.__call__ = own


@contextlib.contextmanager
def _linen_intercepted(interceptor: Interceptor):
    from flax import linen

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not module.path:
            return next_fun(*args, **kwargs)
        signature = inspect.signature(types.MethodType(context.orig_method, module))

        def again(*args, **kwargs):  # a second call inside one linen call would declare its parameters twice
            unbound, variables = module.unbind()
            return unbound.apply(variables, *args, **kwargs)

        return interceptor(names.linen(module.path), _class_name(module), next_fun, signature, args, kwargs, again)

    with linen.intercept_methods(intercept):
        yield


def to_jax(x):
    import jax.numpy as jnp

    return jnp.asarray(np.asarray(x))


def run(model: Flax, inputs, pairs: dict[tuple[str, int], Call], valid=None) -> tuple[object, list[JaxCall]]:
    """``model(*inputs)`` with every submodule call intercepted; returns its output and the calls."""
    interceptor = Interceptor(pairs, valid)
    context = _nnx_intercepted(model.module, interceptor) if model.kind == "nnx" else _linen_intercepted(interceptor)
    with context:
        output = model(*(to_jax(x) for x in inputs))
    return output, interceptor.calls
