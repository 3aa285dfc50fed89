"""JAX's persistent compilation cache for ``mha-parity verify``.

Nearly all of a run's time is XLA compiling small programs; with the cache, a second run of the
same grid reads them back from disk instead. The cache is a directory of compiled programs keyed
by the program, the compile options, and the JAX, jaxlib and XLA versions (a new JAX compiles
afresh); deleting the directory is always safe. Every program is kept, however quick to compile
or small: the grid's are both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENVIRONMENT = "MHA_PARITY_COMPILE_CACHE"  # a directory that overrides the default one

# The settings ``use`` makes: the cache on, in the directory given (None here), keeping every
# program; or off.
SETTINGS = {
    "jax_enable_compilation_cache": True,
    "jax_compilation_cache_dir": None,
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,  # no minimum size, and none chosen for the filesystem
}


def default_directory() -> str:
    """``$MHA_PARITY_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/mha-parity/jax``, else
    ``~/.cache/mha-parity/jax``."""
    if os.environ.get(ENVIRONMENT):
        return os.environ[ENVIRONMENT]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mha-parity", "jax")


def use(directory: str | None) -> None:
    """Every JAX program this process compiles from now on is looked up in ``directory``
    first and written there after compiling (the directory is made when first needed); None:
    no persistent cache at all, not even one that JAX's own settings ask for."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        for name, value in SETTINGS.items():
            jax.config.update(name, directory if value is None else value)
    compilation_cache.reset_cache()  # a cache this process opened before gives way


@contextlib.contextmanager
def using(directory: str | None) -> Iterator[None]:
    """``use(directory)`` within the block, then the settings as they were before."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = {name: getattr(jax.config, name) for name in SETTINGS}
    use(directory)
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
