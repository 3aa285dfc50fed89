"""Moving numbers between NumPy, JAX and PyTorch without changing them, comparing bits, and the
errors between two arrays, for ``mha-parity verify`` and ``mha-parity compare`` alike.

Every side of a comparison starts from the same float64 NumPy arrays, rounded once to the
case's dtype (``rounded``), handed to a framework in that dtype (``cast``), and read back as
float64 (``to_float64``). ``same_bits`` is the one bitwise equality of the package: shapes,
dtypes and every bit (``-0.0``, NaN payloads and bfloat16 included).

A model's output may be an array, a tuple or list, a dict, or a transformers ``ModelOutput``;
``fields`` reads it as an ordered list of ``(field, array)`` (``None`` fields left out; tuple
elements are ``0``, ``1``..., a bare array is ``output``). Errors are relative:
``max(||a - b|| / ||b||, max|a - b| / max|b|)``, ``b`` the reference (PyTorch) side, in float64,
``a`` brought to ``b``'s layout by ``axis_layouts.fit`` (never reshaped across shapes).
"""

from __future__ import annotations

import numpy as np

from parity_tests.tool import axis_layouts


def numpy_dtype(dtype: str):
    """The NumPy dtype of a dtype name; ``"bfloat16"`` is ml_dtypes' (as JAX's)."""
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def is_floating(x) -> bool:
    """Whether a NumPy array holds floats (bfloat16, whose dtype kind is 'V', included)."""
    return np.asarray(x).dtype.kind == "f" or np.asarray(x).dtype.name == "bfloat16"


def rounded(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and widened back to float64 (exact)."""
    return np.asarray(x).astype(numpy_dtype(dtype)).astype(np.float64)


def cast(x, dtype: str) -> np.ndarray:
    """Floating arrays in ``dtype``; integer and bool arrays as they are."""
    x = np.asarray(x)
    return x.astype(numpy_dtype(dtype)) if x.dtype.kind == "f" else x


def to_numpy(x) -> np.ndarray:
    """A NumPy array of the same values and dtype: a torch tensor (bfloat16 as ml_dtypes'
    bfloat16, bit for bit), a JAX array, or anything ``np.asarray`` reads."""
    if hasattr(x, "detach"):
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return x.numpy()
    return np.asarray(x)


def to_float64(x) -> np.ndarray:
    """Any array (torch, JAX, NumPy; bfloat16 included) as float64 NumPy; widening is exact."""
    return to_numpy(x).astype(np.float64)


def same_bits(a, b) -> bool:
    """Bitwise equality of two array-likes (torch tensors, JAX or NumPy arrays): the same shape,
    the same dtype and the same bits, so that ``-0.0 != 0.0`` and NaN equals the same NaN."""
    a, b = to_numpy(a), to_numpy(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.tobytes() == b.tobytes()


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


def is_float(x) -> bool:
    return is_floating(to_numpy(x))


def _pair(a, b, valid, layout) -> tuple[np.ndarray, np.ndarray]:
    """``a`` in ``b``'s layout (``axis_layouts.fit``; a ``LayoutError`` when it has none, or several),
    both float64, at the ``valid`` positions (``_keep``)."""
    a, b = to_numpy(a), to_float64(b)
    aligned = to_float64(axis_layouts.fit(a, b.shape, layout))
    keep = None if valid is None or valid.all() else _keep(a.shape, b.shape, valid, layout)
    return (aligned, b) if keep is None else (aligned[keep], b[keep])


def _holds_positions(shape: tuple[int, ...], valid: np.ndarray) -> bool | None:
    """Whether ``shape`` starts with ``valid``'s ``(batch, length)`` and no later axis has the length
    (True), starts with it but another axis has the length too (None: heads == length), or not (False)."""
    if shape[: valid.ndim] != valid.shape:
        return False
    return None if valid.shape[-1] in shape[valid.ndim:] else True


def _keep(a_shape, b_shape, valid: np.ndarray, layout) -> np.ndarray | None:
    """The mask of ``b``'s elements at ``valid`` positions: placed on ``b`` where its shape holds
    ``(batch, length)`` alone, else on ``a`` where its shape does and carried to ``b``'s layout by the
    layout ``a`` is read in (``(batch, length, heads, ...)`` against ``(batch, heads, length, ...)``);
    None where neither starts with it. Where a side starts with it but its length axis is not the
    only one of that size on either side, a ``LayoutError``: the positions are not placed by guess."""
    def spread(shape):
        return np.broadcast_to(valid.reshape(valid.shape + (1,) * (len(shape) - valid.ndim)), shape)

    on_b, on_a = _holds_positions(tuple(b_shape), valid), _holds_positions(tuple(a_shape), valid)
    if on_b:
        return spread(b_shape)
    if on_a:
        return axis_layouts.fit(spread(a_shape), b_shape, layout)
    if on_a is None or on_b is None:
        raise axis_layouts.LayoutError(
            f"valid {valid.shape} (batch, length) reads more than one axis of the JAX array {tuple(a_shape)} and "
            f"of PyTorch's {tuple(b_shape)} as the length: padding is not left out by guess, nothing is compared")
    return None


def relative_error(a, b, valid: np.ndarray | None = None, layout=None) -> float:
    """``max(||a - b|| / ||b||, max|a - b| / max|b|)`` in float64, ``a`` in ``b``'s layout (see
    ``axis_layouts.fit``: ``layout`` a declared one; a ``LayoutError`` naming both shapes when none
    fits, or several do). Equal shapes are compared as they are, unless another layout of that shape
    (axes of one size exchanged: heads == length) reads ``a`` nearer ``b``: then nothing is
    (a ``LayoutError`` naming both errors), for the port may keep either. ``valid`` (bool
    ``(batch, length)``): only those positions, placed on the side whose shape holds them alone and
    carried by that layout (``_keep``; a ``LayoutError`` where neither side tells its length axis)."""
    error = _relative(*_pair(a, b, valid, layout))
    if layout is None and tuple(np.shape(a)) == tuple(np.shape(b)) and error > 0:
        for other in axis_layouts.alternatives(np.shape(b)):
            nearer = _relative(*_pair(other.apply(to_numpy(a)), b, valid, None))
            if nearer < error:
                raise axis_layouts.LayoutError(
                    f"the JAX array {tuple(np.shape(a))} reads as PyTorch's in more than one layout, and {other} "
                    f"({nearer:.2e}) nearer than as is ({error:.2e}): declare one in the mapping")
    return error


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    if b.size == 0:
        return 0.0
    diff = np.abs(a - b)
    if not np.all(np.isfinite(diff)):
        return float("inf")
    norm, peak = np.linalg.norm(b), np.max(np.abs(b))
    rel = np.linalg.norm(diff) / norm if norm else (0.0 if not diff.any() else float("inf"))
    peak_rel = diff.max() / peak if peak else (0.0 if not diff.any() else float("inf"))
    return float(max(rel, peak_rel))


def max_abs_error(a, b, valid: np.ndarray | None = None, layout=None) -> float:
    """``max|a - b|``, ``a`` in ``b``'s layout as ``relative_error`` brings it."""
    a, b = _pair(a, b, valid, layout)
    return float(np.max(np.abs(a - b))) if b.size else 0.0
