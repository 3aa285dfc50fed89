"""The verification tool's public Python API, imported when first used (importing
``parity_tests`` imports neither framework):

- ``verify(torch_fn, jax_fn, inputs)`` and ``Inputs``: an attention on the grid of mask forms,
  dtypes and gradients (``parity_tests.tool.callables``);
- ``compare(torch_model, flax_model, *inputs)`` and ``compare_gradients``, ``compare_step``,
  ``compare_decoding``, ``save_reference``, ``load_reference``: a whole PyTorch model against its
  Flax port, module by module (``parity_tests.porting``).
"""

import importlib

_PUBLIC = {
    "verify": "parity_tests.tool.callables", "Inputs": "parity_tests.tool.callables",
    **{name: "parity_tests.porting" for name in (
        "compare", "compare_gradients", "compare_step", "compare_decoding", "save_reference", "load_reference")},
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'parity_tests' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
