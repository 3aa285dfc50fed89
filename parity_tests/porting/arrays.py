"""Outputs as named arrays, and the errors between two of them.

An output may be an array, a tuple or list, a dict, or a transformers ``ModelOutput``; it is read as
an ordered list of ``(field, array)`` (``None`` fields left out; tuple elements are ``0``, ``1``...,
a bare array is ``output``). Errors are relative: ``max(||a - b|| / ||b||, max|a - b| / max|b|)``,
``b`` the PyTorch side, in float64.
"""

from __future__ import annotations

import numpy as np

from parity_tests.tool.arrays import to_float64, to_numpy


def is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def fields(output, prefix: str = "") -> list[tuple[str, object]]:
    """``(name, array)`` of every array in ``output``, in order (nested names joined by ``.``)."""
    if output is None:
        return []
    if is_array(output):
        return [(prefix or "output", output)]
    if hasattr(output, "keys") and hasattr(output, "__getitem__"):  # dict, ModelOutput
        items = [(str(k), output[k]) for k in output.keys()]
    elif isinstance(output, (tuple, list)):
        items = [(str(i), v) for i, v in enumerate(output)]
    else:
        return []
    found = []
    for key, value in items:
        found += fields(value, f"{prefix}.{key}" if prefix else key)
    return found


def primary(output):
    """The first array of ``output`` (a module's result: its hidden states before anything
    else it returns), or None."""
    found = fields(output)
    return found[0][1] if found else None


def numpy(x) -> np.ndarray:
    """A copy as NumPy in its own dtype (torch bfloat16 as ml_dtypes' bfloat16)."""
    return np.array(to_numpy(x), copy=True)


def dtype_name(x) -> str:
    return str(to_numpy(x).dtype) if not hasattr(x, "detach") else str(x.dtype).replace("torch.", "")


def relative_error(a, b, valid: np.ndarray | None = None) -> float:
    """``max(||a - b|| / ||b||, max|a - b| / max|b|)`` in float64, ``a`` reshaped to ``b``'s shape
    (the same number of elements; else a ValueError naming both shapes). ``valid`` (bool
    ``(batch, length)``): only those positions of arrays whose shape starts with it."""
    a, b = to_float64(a), to_float64(b)
    if a.size != b.size:
        raise ValueError(f"shapes {a.shape} (JAX) and {b.shape} (PyTorch) hold different numbers of elements")
    a = a.reshape(b.shape)
    if valid is not None and b.shape[: valid.ndim] == valid.shape:
        a, b = a[valid], b[valid]
    if b.size == 0:
        return 0.0
    diff = np.abs(a - b)
    if not np.all(np.isfinite(diff)):
        return float("inf")
    norm, peak = np.linalg.norm(b), np.max(np.abs(b))
    rel = np.linalg.norm(diff) / norm if norm else (0.0 if not diff.any() else float("inf"))
    peak_rel = diff.max() / peak if peak else (0.0 if not diff.any() else float("inf"))
    return float(max(rel, peak_rel))


def max_abs_error(a, b, valid: np.ndarray | None = None) -> float:
    a, b = to_float64(a), to_float64(b)
    a = a.reshape(b.shape)
    if valid is not None and b.shape[: valid.ndim] == valid.shape:
        a, b = a[valid], b[valid]
    return float(np.max(np.abs(a - b))) if b.size else 0.0


def is_float(x) -> bool:
    x = to_numpy(x)
    return x.dtype.kind == "f" or x.dtype.name == "bfloat16"
