"""The suite runs with float64 enabled in JAX: the float64 cases need it, and it leaves
explicitly float32/bfloat16 arrays as they are (Python scalars stay weakly typed)."""

import jax

jax.config.update("jax_enable_x64", True)
