"""The JAX internals ``mha_jax`` uses are where the JAX it was written for keeps them.

``mha_jax/_platform.py`` reaches them alone; when a JAX release moves one, these fail naming the
internal and the version it was written for.
"""

from __future__ import annotations

import pytest

from mha_jax.testing import platform as _platform


@pytest.mark.parametrize("module", sorted(_platform.INTERNALS))
def test_each_internal_is_where_it_was(module):
    _platform.jax_internal(module)  # raises naming the internal and the version when it moved


def test_a_moved_internal_is_named_with_the_version():
    moved = {"jax._src.interpreters.partial_eval": ("no_such_function",), "jax._src.no_such_module": ("x",)}
    with pytest.raises(ImportError, match=r"partial_eval: no_such_function, written for jax 0\.10\.2"):
        _platform.jax_internal("jax._src.interpreters.partial_eval", moved)
    with pytest.raises(ImportError, match="no_such_module: x"):
        _platform.jax_internal("jax._src.no_such_module", moved)


def test_the_cudnn_check_is_restored_after_tracing():
    fused = _platform.jax_internal("jax._src.cudnn.fused_attention_stablehlo")
    before = fused.check_cudnn_version
    with _platform.cudnn_traced_anywhere():
        if fused.cuda_versions is None:
            assert fused.check_cudnn_version() == 90000
    assert fused.check_cudnn_version is before
