"""What the mesh and ring tests share: the 8-device command CI runs them with, the mark that skips a test on
fewer devices, and the collectives a compiled program is searched for."""

from __future__ import annotations

import pathlib

import jax
import pytest

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute")
CI_COMMAND = ("XLA_FLAGS=--xla_force_host_platform_device_count=8 "
              "python -m pytest -q parity_tests/test_mesh.py parity_tests/test_ring.py")

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason=f"needs 8 devices; CI runs: {CI_COMMAND}")


def ci_runs_on_8_devices() -> bool:
    """Whether ``.ci/run`` runs ``CI_COMMAND`` as one of its lines."""
    ci = (pathlib.Path(__file__).resolve().parent.parent / ".ci" / "run").read_text().splitlines()
    return CI_COMMAND in ci
