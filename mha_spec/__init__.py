"""The specification both twins import (pure Python and NumPy): what must be the same in ``mha_jax`` and
``mha_torch`` lives here once, so that a bad argument fails alike and a checkpoint reads alike. Each module's
docstring says what it holds. Not a public API of its own: use it through ``mha_jax`` and ``mha_torch``.
"""
