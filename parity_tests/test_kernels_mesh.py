"""The chips' kernels on a mesh with Explicit axes: a Pallas kernel is not partitioned by the
compiler, so ``"splash"`` (and ``"flash"`` where it is a chip's kernel) runs once per device on
its own examples and heads (``jax.shard_map``). On 4 simulated CPU devices (a process of its own:
the device count is fixed before JAX starts), batch over one axis and heads over the other, the
output and gradients are those of the unsharded call, with the masking terms of each device's
examples; a sharded length is refused by name.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PROGRAM = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np, pytest
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import mha_jax

    mesh = jax.make_mesh((2, 2), ("data", "heads"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(0)
    B, T, H, KV, D = 4, 40, 4, 2, 16
    q, d_out = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(B, T, KV, D)), jnp.float32) for _ in range(2))
    ids = jnp.asarray(np.arange(T)[None] // 15)
    terms = dict(is_causal=True, key_value_seq_lengths=jnp.array([T, 30, 0, 11]), query_segment_ids=ids,
                 key_segment_ids=ids, sinks=jnp.asarray(rng.normal(size=H), jnp.float32), logit_soft_cap=4.0)

    def loss(q, k, v, sinks):
        out = mha_jax.dot_product_attention(q, k, v, implementation="splash", **dict(terms, sinks=sinks))
        return jnp.sum(out * d_out), out

    want, want_grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, terms["sinks"])
    layout = P("data", None, "heads")
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, layout)) for x in (q, k, v)]
        got, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*placed, terms["sinks"])
        assert jax.typeof(got[1]).sharding.spec == P("data", None, "heads", None), jax.typeof(got[1]).sharding
        with pytest.raises(ValueError, match="shard the batch and heads only"):
            by_length = jax.device_put(q, NamedSharding(mesh, P(None, "data", "heads")))
            mha_jax.dot_product_attention(by_length, placed[1], placed[2], implementation="splash")
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=2e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)
    print("ok")
''')


def run_on_4_devices(program: str) -> None:
    """``program`` in a Python process of its own on 4 simulated CPU devices; it must print ``ok`` last."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=root, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]


def test_splash_runs_per_device_on_an_explicit_mesh():
    run_on_4_devices(PROGRAM)
