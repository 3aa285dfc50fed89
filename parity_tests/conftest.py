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


# The files that take longest, longest first (TPU compiles, drawn cases, whole models, processes of
# their own); then the others, most tests first. Under ``-n auto --dist loadfile`` a file runs on one
# worker, so the longest start first and the last minutes are not one worker alone on one of them.
_LONGEST_FIRST = ("test_tpu_compile.py", "test_hf_families.py", "test_differential.py", "test_properties.py",
                  "test_verify_sources.py", "test_ports.py", "test_decode.py", "test_llama_checkpoints.py",
                  "test_default_float32.py", "test_verify_models.py", "test_packaging.py", "test_determinism.py",
                  "test_compare_llama.py", "test_robustness.py", "test_multiprocess.py")


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", False):  # pytest-xdist's order by test count: the one below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name]))
