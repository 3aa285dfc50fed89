"""The suite runs with float64 enabled in JAX: the float64 cases need it, and it leaves
explicitly float32/bfloat16 arrays as they are (Python scalars stay weakly typed).

Hypothesis runs under the profile named by ``MHA_HYPOTHESIS_PROFILE`` (``ci`` by default,
``long`` for a longer search); see ``parity_tests/strategies.py``.
"""

import jax

from parity_tests import strategies

jax.config.update("jax_enable_x64", True)
strategies.load_profile()
