"""Moving numbers between NumPy, JAX and PyTorch without changing them, and comparing bits.

Every side of a comparison starts from the same float64 NumPy arrays, rounded once to the
case's dtype (``rounded``), handed to a framework in that dtype (``cast``), and read back as
float64 (``to_float64``). ``same_bits`` is the one bitwise equality of the package: shapes,
dtypes and every bit (``-0.0``, NaN payloads and bfloat16 included).
"""

from __future__ import annotations

import numpy as np


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
