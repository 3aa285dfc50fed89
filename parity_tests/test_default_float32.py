"""A part of the suite under JAX's default float32 (no ``jax_enable_x64``), as users run it:
flax's masks through our Flax modules, and the float32 grid on self-attention, every mask form."""

import os
import subprocess
import sys

import pytest

from parity_tests import conftest

TESTS = ["parity_tests/test_flax_masks.py", "parity_tests/test_parity.py",
         "-k", "not float64 and (flax or self/ and float32)"]


@pytest.mark.skipif(not conftest.X64, reason="this is the run in default float32 itself")
def test_suite_part_in_default_float32():
    env = dict(os.environ, MHA_JAX_X64="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", *TESTS], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and "failed" not in run.stdout.splitlines()[-1]


def test_float64_is_off_here_when_asked():
    """The switch works: with MHA_JAX_X64=0, JAX's arrays default to float32."""
    import jax.numpy as jnp

    assert (jnp.zeros(1).dtype == jnp.float64) == conftest.X64
