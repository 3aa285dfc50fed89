"""The verification tool's public Python API, imported when first used (importing
``parity_tests`` imports neither framework):

- ``verify(torch_fn, jax_fn, inputs)`` and ``Inputs``: an attention on the grid of mask forms,
  dtypes and gradients (``parity_tests.tool.callables``);
- ``compare(torch_model, flax_model, *inputs)`` and ``compare_gradients``, ``compare_step``,
  ``compare_decoding``, ``save_reference``, ``load_reference``, ``record``: a whole PyTorch model
  against its Flax port, module by module (``parity_tests.porting``);
- ``suggest_mapping(torch_model, flax_model, *inputs)`` and ``print_suggestion`` (the same, printed
  as a dict to paste): a name mapping for ``compare`` where the port names its modules otherwise
  (``parity_tests.porting``);
- ``compare_training(torch_model, flax_model, batches)``: both models trained from the same
  weights, step by step (``parity_tests.porting.training``).

``dir(parity_tests)`` lists them; each is imported when first used.
"""

import importlib

_PUBLIC = {
    "verify": "parity_tests.tool.callables", "Inputs": "parity_tests.tool.callables",
    **{name: "parity_tests.porting" for name in (
        "compare", "compare_gradients", "compare_step", "compare_decoding", "save_reference", "load_reference",
        "record", "suggest_mapping", "print_suggestion", "compare_training")},
}
__all__ = sorted(_PUBLIC)


def __dir__() -> list[str]:
    return sorted({*__all__, *(k for k in globals() if k.startswith("__"))})


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'parity_tests' has no attribute {name!r}")
    try:
        module = importlib.import_module(_PUBLIC[name])
    except ModuleNotFoundError as error:
        if error.name != _PUBLIC[name]:
            raise
        raise AttributeError(f"parity_tests.{name}: its module {_PUBLIC[name]} is not installed here") from None
    return getattr(module, name)
