"""A pytest plugin that runs flax's own attention tests with our classes in place of flax's.

flax's ``tests/linen/linen_attention_test.py`` and ``tests/nnx/nn/attention_test.py`` (from the
flax source at the installed version; flax's wheel ships no tests) call
``nn.MultiHeadDotProductAttention``/``nn.MultiHeadAttention``/``nn.SelfAttention`` and
``nnx.MultiHeadAttention`` through flax's modules; this plugin puts ``mha_jax.linen``'s and
``mha_jax``'s classes there before they run, and at the end prints how many of the tests that
built one of our modules passed::

    PYTHONPATH=. python -m pytest -p parity_tests.flax_suites -s \\
        flax/tests/linen/linen_attention_test.py flax/tests/nnx/nn/attention_test.py
"""

from __future__ import annotations

import functools

import flax.nnx.nn.attention as nnx_attention
import pytest
from flax import linen, nnx

import mha_jax
import mha_jax.linen

_touched: set[str] = set()
_current: list[str | None] = [None]

for _name in ("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention"):
    setattr(linen, _name, getattr(mha_jax.linen, _name))
nnx.MultiHeadAttention = nnx_attention.MultiHeadAttention = mha_jax.MultiHeadAttention


def _noting(method):
    @functools.wraps(method)
    def noted(self, *args, **kwargs):
        _touched.add(_current[0])
        return method(self, *args, **kwargs)
    return noted


mha_jax.MultiHeadAttention.__init__ = _noting(mha_jax.MultiHeadAttention.__init__)
mha_jax.linen.MultiHeadDotProductAttention.__call__ = _noting(mha_jax.linen.MultiHeadDotProductAttention.__call__)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current[0] = item.nodeid


def pytest_terminal_summary(terminalreporter):
    passed = {r.nodeid for r in terminalreporter.stats.get("passed", [])}
    failed = {r.nodeid for r in terminalreporter.stats.get("failed", [])}
    terminalreporter.write_line(
        f"tests that built our modules: {len(_touched)}; passed {len(_touched & passed)}, "
        f"failed {len(_touched & failed)}"
    )
    for nodeid in sorted(_touched & failed):
        terminalreporter.write_line(f"  failed: {nodeid}")
