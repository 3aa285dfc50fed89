"""The numerics that change results, said and set: JAX's default matmul precision, PyTorch's TF32
switches (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``), each
side's dtypes. A comparison runs inside ``numerics()``, which sets full precision on both sides
(``"highest"``, TF32 off) and puts back what was there."""

from __future__ import annotations

import contextlib
import sys

from parity_tests.tool import harness

# relative error a module may add, by dtype; ours (mha_jax / mha_torch attention) by the
# parity suite's forward tolerances
MODULE_TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2, "float16": 5e-3}
OUTPUT_TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 1e-1, "float16": 2e-2}
GRADIENT_TOLERANCES = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 1e-1, "float16": 2e-2}


def attention_tolerance(dtype: str) -> float:
    return harness.TOLERANCES.get(dtype, (MODULE_TOLERANCES.get(dtype, 1e-5),))[0]


def module_tolerance(dtype: str) -> float:
    return MODULE_TOLERANCES.get(dtype, MODULE_TOLERANCES["float32"])


@contextlib.contextmanager
def numerics(matmul_precision: str = "highest", *, torch_needed: bool = True):
    """Set ``jax_default_matmul_precision`` and PyTorch's TF32 switches (off) for the block;
    yields the settings as recorded in a report."""
    import jax

    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", matmul_precision)
    torch = sys.modules.get("torch") if not torch_needed else _torch()
    saved = None
    if torch is not None:  # one API only: PyTorch refuses to read a precision set through both of its APIs
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        yield recorded(torch)
    finally:
        jax.config.update("jax_default_matmul_precision", before)
        if saved is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _torch():
    import torch

    return torch


def recorded(torch=None) -> dict:
    """The settings in force now (``torch`` None: PyTorch's left out)."""
    import jax

    out = {"jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
           "jax_enable_x64": bool(jax.config.jax_enable_x64), "jax": jax.__version__,
           "jax_backend": jax.default_backend()}
    if torch is not None:
        out.update({"torch_allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                    "torch_allow_tf32_cudnn": torch.backends.cudnn.allow_tf32, "torch": torch.__version__})
    return out


def check_dtype(side: str, found: set[str], asked: str | None) -> str:
    """The one floating dtype of ``side``'s parameters, which must be ``asked`` when given."""
    floating = sorted(d for d in found if d in MODULE_TOLERANCES)
    if asked is not None and floating and floating != [asked]:
        raise ValueError(f"the {side} side holds {' and '.join(floating)} parameters, not the {asked} asked for "
                         f"(dtype={asked!r}): convert it, or ask for its dtype")
    if len(floating) > 1:
        raise ValueError(f"the {side} side holds parameters in several dtypes ({', '.join(floating)}): "
                         "convert them to one, or pass dtype=")
    return floating[0] if floating else (asked or "float32")
