"""The suite runs with float64 enabled in JAX: the float64 cases need it, and it leaves
explicitly float32/bfloat16 arrays as they are (Python scalars stay weakly typed).
``MHA_JAX_X64=0`` leaves JAX's default (float32) instead, as users run it; ``test_default_float32``
runs a part of the suite that way, in a process of its own.

The tolerances are those of full-precision products: on a GPU JAX's default float32 product
is TF32 (a relative error near 1e-3) and PyTorch's cuDNN convolutions may use TF32 too, so the
suite asks both for full float32 products there (a CPU computes them in full already, and its
programs are left as users run them).

Hypothesis runs under the profile named by ``MHA_HYPOTHESIS_PROFILE`` (``ci`` by default,
``long`` for a longer search); see ``parity_tests/strategies.py``.

``mha-parity verify``'s JAX compilation cache goes to a directory of the test run, never the
user's cache (the variable reaches the processes the tests start as well).
"""

import os

import jax
import pytest

from parity_tests import strategies
from parity_tests.tool import compile_cache

X64 = os.environ.get("MHA_JAX_X64", "1") != "0"
jax.config.update("jax_enable_x64", X64)
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
try:
    import torch
except ImportError:  # a JAX-only install runs the JAX tests
    pass
else:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
strategies.load_profile()


@pytest.fixture(autouse=True, scope="session")
def _compile_cache_of_the_run(tmp_path_factory):
    os.environ[compile_cache.ENVIRONMENT] = str(tmp_path_factory.mktemp("compile-cache"))
