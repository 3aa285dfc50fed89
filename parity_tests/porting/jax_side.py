"""The JAX side: an nnx module (its submodules' calls intercepted by wrapping their classes'
``__call__`` for the run) or a linen ``(module, variables)`` pair (``nn.intercept_methods``).
Each call of a submodule paired with a recorded PyTorch call is run a second time on the
PyTorch call's inputs, with its own keyword arguments, the module's state and its stateful
arguments as they were when the call began: the error that module adds."""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parity_tests.porting import names
from parity_tests.porting.recording import Call, Flow
from parity_tests.tool import arrays, axis_layouts

# an input adapter: PyTorch's recorded call (argument name -> NumPy array) -> the JAX call's (args, kwargs)
Adapter = Callable[[dict], tuple]


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
    """One JAX module call and, when paired, its errors against the PyTorch call; ``note`` says
    why an error could not be computed; ``sources``: for each array argument, the JAX call whose
    output it is (``name#occurrence``, ``input.N``, None: made by code between modules)."""

    name: str
    occurrence: int
    cls: str
    dtype: str | None
    inherited: float | None = None
    added: float | None = None
    note: str = ""
    sources: list[str | None] = field(default_factory=list)
    layout: str = "as is"  # how its output was read in PyTorch's layout (``axis_layouts``)


def _kind(dtype) -> str:
    return "float" if np.dtype(dtype).kind == "f" or np.dtype(dtype).name == "bfloat16" else "integer"


def _fit(i: int, value, name: str | None, recorded: list[tuple[str, np.ndarray]], used: set[int], only: bool) -> int:
    """The index of the PyTorch input that fills JAX argument ``i`` (``value``, parameter ``name``):
    one of as many elements and the same kind, of the same name first. A float argument may take
    the next unused one of another name (``x`` for ``hidden_states``); an integer argument (ids,
    positions, segments: arrays of one size often mean different things) only one of its own name,
    or the one input when it is the only array on both sides (``tokens`` for ``input_ids``).
    A ValueError says why none fits."""
    size, kind = int(np.prod(value.shape)), _kind(value.dtype)
    fits = [j for j, (_, x) in enumerate(recorded) if j not in used and x.size == size and _kind(x.dtype) == kind]
    named = [j for j in fits if recorded[j][0] == name]
    if named or (fits and (kind == "float" or only)):
        return (named or fits)[0]
    have = ", ".join(f"{n} {x.shape} {x.dtype}" for n, x in recorded) or "none"
    why = "" if kind == "float" else f"; an integer argument is filled only from the input of its name ({name})"
    raise ValueError(f"no PyTorch input fits argument {i} {tuple(value.shape)} (PyTorch's inputs: {have}){why}")


def substitute(signature: inspect.Signature, args: tuple, recorded: list[tuple[str, np.ndarray]],
               declared: axis_layouts.Declared = None) -> tuple:
    """The call's positional arrays (not nnx Variables: those are the port's state) replaced by the
    PyTorch call's (see ``_fit``), in the JAX argument's layout (``axis_layouts.fit``: never
    reshaped across shapes; an array of the declared output layout's rank taken back through it),
    in its dtype. A ValueError when one has no match, or its layout is not one: the row is then not
    compared, never filled by a guess."""
    import jax.numpy as jnp
    from flax import nnx

    params = [p for p in signature.parameters.values()
              if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    mine = [i for i, v in enumerate(args) if arrays.is_array(v) and not isinstance(v, nnx.Variable)]
    only = len(mine) == 1 and len(recorded) == 1
    used: set[int] = set()
    out = list(args)
    for i in mine:  # a Variable is state: the port's own
        value = args[i]
        j = _fit(i, value, params[i].name if i < len(params) else None, recorded, used, only)
        used.add(j)
        back = axis_layouts.inverse(declared, recorded[j][1].ndim)
        given = axis_layouts.fit(recorded[j][1], value.shape, back, sides=(f"PyTorch's input {recorded[j][0]}",
                                                                           f"the JAX argument {i}"))
        out[i] = jnp.asarray(given).astype(value.dtype)
    return tuple(out)


def adapted(adapter: Adapter, recorded: list[tuple[str, np.ndarray]], args: tuple, kwargs: dict) -> tuple:
    """The JAX call ``adapter`` makes of PyTorch's recorded call: ``adapter({name: array})``
    returns ``(args, kwargs)``; an argument given as ``...`` (Ellipsis), and one it leaves out
    (a keyword, or positions past its ``args``), is the JAX call's own (its cache, flags), as it
    was when the call began. NumPy arrays
    become JAX arrays of their own dtype. Anything the adapter raises is a ValueError naming it."""
    try:
        given = adapter(dict(recorded))
        new_args, new_kwargs = given
    except Exception as error:  # the adapter is the user's code: its failure is reported on the row
        raise ValueError(f"the input adapter {getattr(adapter, '__name__', adapter)!r} raised "
                         f"{type(error).__name__}: {error}") from None
    as_jax = lambda x: to_jax(x) if isinstance(x, np.ndarray) else x  # noqa: E731
    out = [args[i] if a is Ellipsis else as_jax(a) for i, a in enumerate(new_args)] + list(args[len(new_args):])
    return tuple(out), {**kwargs, **{k: as_jax(v) for k, v in dict(new_kwargs).items() if v is not Ellipsis}}


def _as_it_was(value):
    """``value`` as it is now, kept from later writes: arrays (immutable) as they are, containers
    rebuilt, anything else (an nnx Variable, a cache object) deep-copied when it can be."""
    from flax import nnx

    if isinstance(value, nnx.Variable):  # a Variable's deepcopy is its bare array: copy it as a Variable
        return value.copy()
    if arrays.is_array(value) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_as_it_was(v) for v in value) if not hasattr(value, "_fields") else value
    if isinstance(value, dict):
        return {k: _as_it_was(v) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied is given as it is
        return value


@dataclass
class ModuleState:
    """The state a module writes when called (every nnx Variable that is not a Param: a cache, a
    counter), taken and put back, so that a re-run sees the module as it was when its call began."""

    module: object

    def take(self):
        import jax
        from flax import nnx

        return jax.tree.map(lambda x: x, nnx.state(self.module, nnx.Not(nnx.Param)))

    def put(self, state) -> None:
        from flax import nnx

        if state is not None:
            nnx.update(self.module, state)


@dataclass
class Interceptor:
    """Called for every submodule call: runs it, and again on the paired PyTorch call's inputs
    (through its mapping entry's input adapter, when it has one), with the module and its
    stateful arguments as they were when the call began."""

    pairs: dict[tuple[str, int], Call]
    valid: np.ndarray | None = None
    adapters: dict[tuple[str, int], Adapter] = field(default_factory=dict)
    layouts: dict[tuple[str, int], axis_layouts.Declared] = field(default_factory=dict)
    calls: list[JaxCall] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    replaying: bool = False
    flow: Flow = field(default_factory=Flow)

    def __call__(self, name: str, cls: str, fn, signature: inspect.Signature, args: tuple, kwargs: dict, again=None,
                 state: ModuleState | None = None):
        """``fn(*args, **kwargs)``, recorded; ``again`` (default ``fn``) runs it on PyTorch's inputs."""
        if self.replaying:
            return fn(*args, **kwargs)
        occurrence = self.counts[name]
        self.counts[name] += 1
        reference = self.pairs.get((name, occurrence))
        began = None
        if reference is not None:
            began = (_as_it_was(args), _as_it_was(kwargs), state.take() if state is not None else None)
        output = fn(*args, **kwargs)
        out = arrays.primary(output)
        call = JaxCall(name, occurrence, cls, None if out is None else arrays.dtype_name(out),
                       sources=[self.flow.source(v) for v in [*args, *kwargs.values()] if arrays.is_array(v)])
        self.flow.mark(out, f"{name}#{occurrence}")
        if reference is not None and out is not None and reference.output is not None:
            notes = []
            declared = self.layouts.get(reference.key)
            try:
                call.layout = axis_layouts.describe(out.shape, reference.output.shape, declared)
                call.inherited = arrays.relative_error(out, reference.output, self.valid, declared)
            except ValueError as error:  # no layout, or several: its re-run reads no better
                notes.append(str(error))
            try:
                if not notes:
                    call.added = self.added(reference, signature, began, again or fn, state)
            except (ValueError, TypeError) as error:
                notes.append(str(error))
            call.note = "; ".join(dict.fromkeys(notes))
        self.calls.append(call)
        return output

    def added(self, reference: Call, signature, began, fn, state: ModuleState | None) -> float:
        """The error of ``fn`` on PyTorch's inputs, the module and its arguments as the call ``began``."""
        args, kwargs, before = began
        adapter = self.adapters.get(reference.key)
        if adapter is not None:
            args, kwargs = adapted(adapter, reference.inputs, args, kwargs)
        else:
            args = substitute(signature, args, reference.inputs, self.layouts.get(reference.key))
        after = state.take() if state is not None else None
        if state is not None:
            state.put(before)
        self.replaying = True
        try:
            output = arrays.primary(fn(*args, **kwargs))
        finally:
            self.replaying = False
            if state is not None:
                state.put(after)
        if output is None:
            raise ValueError("the re-run returned no array")
        return arrays.relative_error(output, reference.output, self.valid, self.layouts.get(reference.key))


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
                return interceptor(name, _class_name(self), bound, inspect.signature(bound), args, kwargs,
                                   state=ModuleState(self))
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


def run(model: Flax, inputs, pairs: dict[tuple[str, int], Call], valid=None,
        adapters: dict[tuple[str, int], Adapter] | None = None, layouts: dict | None = None,
        **kwargs) -> tuple[object, list[JaxCall]]:
    """``model(*inputs, **kwargs)`` with every submodule call intercepted; returns its output and the
    calls. ``adapters`` and ``layouts`` (declared output layouts) by the PyTorch call's key."""
    interceptor = Interceptor(pairs, valid, adapters or {}, layouts or {})
    context = _nnx_intercepted(model.module, interceptor) if model.kind == "nnx" else _linen_intercepted(interceptor)
    given = [to_jax(x) for x in inputs]
    for i, x in enumerate(given):
        interceptor.flow.mark(x, f"input.{i}")
    with context:
        output = model(*given, **kwargs)
    return output, interceptor.calls
