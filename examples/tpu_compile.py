"""Compile a sharded attention training step for a TPU v5e 2x2 slice, on a CPU host.

No TPU is needed: with ``libtpu`` installed (``pip install "mha-parity[test]"`` pins it), JAX
compiles for a described topology, and the compiled program says how much memory it needs on
each chip. Batch is sharded over the mesh's ``data`` axis and heads over ``heads``
(Explicit axes: the shardings are part of the arrays' types). ``implementation="flash"`` is the
Pallas TPU kernel on a TPU (cuDNN's on an NVIDIA GPU, ``"blockwise"`` on a CPU), chosen where
the program is compiled.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=. python examples/tpu_compile.py [--length 8192]

(``ALLOW_MULTIPLE_LIBTPU_LOAD``: another JAX process on the host may hold libtpu's lock.)
"""

import argparse
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import mha_jax  # noqa: E402

FEATURES, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128  # Llama 3 8B's attention


def train_step(params, x, learning_rate=1e-3):
    """One SGD step of a causal self-attention layer; x ``(batch, length, features)``."""

    def loss(params):
        q = jnp.einsum("ble,ehd->blhd", x, params["q"])
        k = jnp.einsum("ble,ehd->blhd", x, params["k"])
        v = jnp.einsum("ble,ehd->blhd", x, params["v"])
        out = mha_jax.dot_product_attention(q, k, v, is_causal=True, implementation="flash")
        # the heads are summed over: say how the result is laid out (an all-reduce over "heads")
        y = jnp.einsum("blhd,hde->ble", out, params["o"], out_sharding=P("data", None, None))
        return jnp.mean(y.astype(jnp.float32) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - learning_rate * g.astype(p.dtype), params, grads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args(argv)

    devices = topologies.get_topology_desc(args.topology, "tpu").devices
    mesh = Mesh(np.array(devices).reshape(2, -1), ("data", "heads"), axis_types=(AxisType.Explicit,) * 2)

    def array(shape, *entries):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(*entries)))

    params = {
        "q": array((FEATURES, HEADS, HEAD_DIM), None, "heads", None),
        "k": array((FEATURES, KV_HEADS, HEAD_DIM), None, "heads", None),
        "v": array((FEATURES, KV_HEADS, HEAD_DIM), None, "heads", None),
        "o": array((HEADS, HEAD_DIM, FEATURES), "heads", None, None),
    }
    x = array((args.batch, args.length, FEATURES), "data", None, None)
    with jax.set_mesh(mesh):
        compiled = jax.jit(train_step).lower(params, x).compile()
    memory = compiled.memory_analysis()
    print(f"compiled for {devices[0].device_kind} x{len(devices)}: length {args.length}, batch {args.batch}; per chip "
          f"{memory.temp_size_in_bytes / 2**20:.0f} MiB temporaries, {memory.argument_size_in_bytes / 2**20:.0f} MiB "
          f"arguments; TPU kernel: {'tpu_custom_call' in compiled.as_text()}")
    return compiled


if __name__ == "__main__":
    main()
