"""One of the two JAX processes that ``test_multiprocess.py`` starts: JAX's multi-controller runtime on one
machine, as on a TPU pod slice or a GPU cluster, where each process drives its own devices only.

``python -m parity_tests.multiprocess_worker PROCESS_ID PORT OUT_DIR PAGE``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``: the process joins the coordinator on
``localhost:PORT`` (2 processes, CPU collectives over gloo), so that ``jax.devices()`` lists the 8 devices of
both processes and ``jax.local_devices()`` its own 4. Every check builds a global mesh, gives each process
only the block of each input that its own devices hold (``jax.make_array_from_process_local_data``), runs
the attention and gathers the results with ``multihost_utils.process_allgather``; each process writes what
it gathered to ``OUT_DIR/results_PROCESS_ID.npz`` (and a check's error to ``errors_PROCESS_ID.json``) for
the test to compare with the same functions run in one process (``reference``). Last, it runs the
per-host program of the docs' ``PAGE`` (``page_example``) and the same step on one of its devices.

The data and the functions are shared with the test: ``data()`` (NumPy, float32), ``ring``,
``flash`` and ``train_step`` run the same code with a mesh or without one.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys
import traceback

import numpy as np

B, L, H, KVH, D, FEATURES = 2, 32, 4, 2, 8, 16  # test_ring's shapes: L = 32 splits into 16 chunks over 8 devices
PROMPT, STEPS = 8, 4  # decoding: a prompt of 8 tokens, then 4 one-token steps, over a cache of 12 slots
RING_CASES = ("causal", "segments+causal")
PROCESSES, LOCAL_DEVICES = 2, 4


def data() -> dict[str, np.ndarray]:
    """The inputs of every check, the same in every process: q ``(B, L, H, D)``, k and v ``(B, L, KVH, D)``,
    the cotangent ``cot`` of the outputs, packed ``segments`` and key ``lengths`` ``(B,)``, the module's
    inputs ``x`` ``(B, L, FEATURES)``, keys and values of ``H`` heads ``kh``, ``vh`` ``(B, L, H, D)`` (heads
    sharded with the query's), all float32 but the integer terms."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, L, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, L, KVH, D)).astype(np.float32) for _ in range(2))
    return dict(
        q=q, k=k, v=v, cot=rng.standard_normal((B, L, H, D)).astype(np.float32),
        segments=np.stack([np.cumsum(rng.random(L) < 0.15) for _ in range(B)]).astype(np.int32),
        lengths=np.array([L, 13], np.int32), x=rng.standard_normal((B, L, FEATURES)).astype(np.float32),
        kh=rng.standard_normal((B, L, H, D)).astype(np.float32),
        vh=rng.standard_normal((B, L, H, D)).astype(np.float32),
    )


def module_parameters(model) -> dict:
    """The parameters of the nnx module ``model`` (its state of ``nnx.Param``) replaced by NumPy draws of a
    fixed seed, so that every process and the one-process reference hold the same ones, whatever JAX's
    configuration (float64 on or off) does to its initialisers."""
    import jax
    from flax import nnx

    rng = np.random.default_rng(1)
    return jax.tree.map(lambda p: (0.3 * rng.standard_normal(p.shape)).astype(np.float32), nnx.state(model, nnx.Param))


def new_module():
    """Our nnx module, ``H`` heads over ``FEATURES``, with ``module_parameters``."""
    from flax import nnx

    from mha_jax import MultiHeadAttention

    model = MultiHeadAttention(H, FEATURES, rngs=nnx.Rngs(0))
    nnx.update(model, module_parameters(model))
    return model


def train_step(graphdef, state, x, lengths, out_sharding=None):
    """A training step of the module: the loss (causal, padded keys) and its gradients by the parameters.
    ``out_sharding``: of the output, where the output projection contracts heads sharded over an Explicit
    mesh axis (JAX asks for it)."""
    import jax.numpy as jnp
    from flax import nnx

    def loss(model):
        return jnp.mean(model(x, is_causal=True, key_value_seq_lengths=lengths, out_sharding=out_sharding) ** 2)

    return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))


def ring(case: str, axis: str | None, q, k, v, segments, cot):
    """The core's output for ``case`` (``RING_CASES``) and its gradients by q, k, v under ``cot``; ``axis``
    the ring's mesh axis, or None on one device."""
    import jax

    from mha_jax import dot_product_attention

    extra = dict(query_segment_ids=segments, key_segment_ids=segments) if case == "segments+causal" else {}
    out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True, sequence_axis=axis, **extra),
                       q, k, v)
    return (out, *vjp(cot))


def flash(q, k, v, lengths, cot):
    """``implementation="flash"`` (on a CPU, the blockwise kernel): causal, padded keys; output and
    gradients by q, k, v."""
    import jax

    from mha_jax import dot_product_attention

    out, vjp = jax.vjp(lambda q, k, v: dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths, implementation="flash"), q, k, v)
    return (out, *vjp(cot))


def reference() -> dict[str, np.ndarray]:
    """The results of the ``CHECKS``, computed here on one device (no mesh), under the same names."""
    import jax
    from flax import nnx

    d = data()
    results = {}
    for case in RING_CASES:
        results |= _named(f"ring[{case}]", jax.jit(functools.partial(ring, case, None))(
            d["q"], d["k"], d["v"], d["segments"], d["cot"]))
    results |= _named("flash", jax.jit(flash)(d["q"], d["kh"], d["vh"], d["lengths"], d["cot"]))
    graphdef, state = nnx.split(new_module())
    results |= _named("train_step", jax.jit(functools.partial(train_step, graphdef))(state, d["x"], d["lengths"]))
    model = new_module()
    results["decode"] = np.asarray(model(d["x"][:, :PROMPT + STEPS], is_causal=True))
    return results


def _named(name: str, tree) -> dict[str, np.ndarray]:
    """The leaves of ``tree`` as NumPy arrays under ``name/i``, in ``jax.tree.leaves``'s order."""
    import jax

    return {f"{name}/{i}": np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(tree))}


# ---- in a process of the two ----

def local_block(x: np.ndarray, sharding) -> np.ndarray:
    """The block of the global ``x`` that this process's devices hold under ``sharding``: what a process
    of a real job loads (its own examples, its own part of the length), the rest never read."""
    indices = sharding.addressable_devices_indices_map(x.shape).values()
    box = []
    for dim, size in enumerate(x.shape):
        ranges = [index[dim].indices(size)[:2] for index in indices]
        box.append(slice(min(r[0] for r in ranges), max(r[1] for r in ranges)))
    return x[tuple(box)]


def feed(x: np.ndarray, sharding):
    """The global array of ``x`` under ``sharding``, each process giving only its own block."""
    import jax

    return jax.make_array_from_process_local_data(sharding, local_block(x, sharding), x.shape)


def gathered(name: str, tree) -> dict[str, np.ndarray]:
    """The leaves of the global arrays in ``tree``, each gathered whole into this process."""
    from jax.experimental import multihost_utils

    return _named(name, multihost_utils.process_allgather(tree, tiled=True))


def _check_ring(d: dict) -> dict:
    """Ring attention over 8 devices, the length split across the two processes (4 devices each)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((PROCESSES * LOCAL_DEVICES,), ("seq",))
    length = NamedSharding(mesh, P(None, "seq"))
    results = {}
    with jax.set_mesh(mesh):
        args = [feed(d[n], length) for n in ("q", "k", "v", "segments", "cot")]
        for case in RING_CASES:
            results |= gathered(f"ring[{case}]", jax.jit(functools.partial(ring, case, "seq"))(*args))
    return results


def _batch_heads_mesh():
    """Batch over ``data`` (one row of the mesh per process), heads over ``model`` (each process's 4 devices)."""
    import jax

    return jax.make_mesh((PROCESSES, LOCAL_DEVICES), ("data", "model"))


def _check_flash(d: dict) -> dict:
    """``"flash"`` with the batch over the processes and the heads over each one's devices: output and
    gradients, and the output outside ``jit`` (``flash-eager``)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mha_jax import dot_product_attention

    mesh = _batch_heads_mesh()
    with jax.set_mesh(mesh):
        heads = NamedSharding(mesh, P("data", None, "model"))
        args = (feed(d["q"], heads), feed(d["kh"], heads), feed(d["vh"], heads),
                feed(d["lengths"], NamedSharding(mesh, P("data"))), feed(d["cot"], heads))
        # outside jit too: the key lengths' values, held by both processes, are not read
        eager = dot_product_attention(*args[:3], is_causal=True, key_value_seq_lengths=args[3], implementation="flash")
        return gathered("flash", jax.jit(flash)(*args)) | gathered("flash-eager", eager)


def _parameter_spec(path, leaf):
    """Heads over ``model``: the projections' kernels ``(in, heads, head_dim)`` and biases ``(heads,
    head_dim)``, the output kernel ``(heads, head_dim, out)``; the output bias replicated."""
    from jax.sharding import PartitionSpec as P

    layer, name = path[0].key, path[1].key
    if layer == "out":
        return P("model", None, None) if name == "kernel" else P()
    return P(None, "model", None) if name == "kernel" else P("model", None)


def _check_train_step(d: dict) -> dict:
    """The nnx module's training step, the batch over the processes, the heads over each one's devices."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _batch_heads_mesh()
    graphdef, state = nnx.split(new_module())
    with jax.set_mesh(mesh):
        state = jax.tree_util.tree_map_with_path(
            lambda path, p: feed(np.asarray(p), NamedSharding(mesh, _parameter_spec(path, p))), state)
        batch = NamedSharding(mesh, P("data"))
        step = jax.jit(functools.partial(train_step, graphdef, out_sharding=P("data")))
        return gathered("train_step", step(state, feed(d["x"], batch), feed(d["lengths"], batch)))


def _check_decode(d: dict) -> dict:
    """Decoding with the batch (inputs and cache) over the processes: a prompt outside ``jit``, then one-token
    steps inside; ``decode-overflow`` ``(B, 2)``: each row's ``cache_overflow`` with the cache full, and after
    one more step outside ``jit`` (which one process cannot check alone, so it sets the flag, as in ``jit``)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _batch_heads_mesh()
    model = new_module()
    model.init_cache((B, PROMPT + STEPS, FEATURES), jnp.float32)
    with jax.set_mesh(mesh):
        batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
        nnx.update(model, jax.tree.map(lambda a: feed(np.asarray(a), batch), nnx.state(model, nnx.Cache)))
        nnx.update(model, jax.tree.map(lambda a: feed(np.asarray(a), replicated), nnx.state(model, nnx.Param)))
        x = feed(d["x"][:, :PROMPT + STEPS], batch)
        outs = [model(x[:, :PROMPT], decode=True, is_causal=True)]  # op by op: the checks read no global values
        step = nnx.jit(lambda m, x: m(x, decode=True, is_causal=True))
        outs += [step(model, x[:, t:t + 1]) for t in range(PROMPT, PROMPT + STEPS)]
        full = model.cache_overflow[...]
        model(x[:, :1], decode=True, is_causal=True)  # past the last slot, outside jit: flagged, as inside
        overflow = jnp.stack([full, model.cache_overflow[...]], axis=1)
        return {"decode": gathered("decode", jnp.concatenate(outs, axis=1))["decode/0"],
                "decode-overflow": gathered("overflow", overflow)["overflow/0"]}


def page_example(page: pathlib.Path) -> str:
    """The code of the block of ``page`` that ``test_multiprocess.py`` runs: the first after its marker."""
    marker = "<!-- run by: parity_tests/test_multiprocess.py::test_docs_launching_example_runs_on_two_processes -->"
    return page.read_text().split(marker + "\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def _check_page(page: pathlib.Path, d: dict) -> dict:
    """The docs' per-host program (a training step, the batch across the processes, ring attention within
    each), and the same step on one device of this process, over the gathered inputs and parameters."""
    from flax import nnx
    from jax.experimental import multihost_utils

    names = {}
    exec(compile(page_example(page), str(page), "exec"), names)
    layer, loss_fn = names["layer"], names["loss_fn"]
    x, (graphdef, state) = multihost_utils.process_allgather((names["x"], nnx.split(layer)), tiled=True)
    alone = nnx.merge(graphdef, state)
    alone.sequence_axis = None  # the same layer without the ring
    return gathered("page", (names["loss"], names["grads"])) | _named("page-alone", nnx.value_and_grad(loss_fn)(
        alone, x)) | {"page-x": x}


CHECKS = {"ring": _check_ring, "flash": _check_flash, "train_step": _check_train_step, "decode": _check_decode}


def run_checks(process_id: int, port: int, out: pathlib.Path, page: pathlib.Path) -> None:
    """Join the 2-process job and run every check, each one's error recorded rather than raised; ``page``:
    the docs' page whose per-host program runs as the last check."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=PROCESSES,
                               process_id=process_id)
    layout = np.array([jax.process_count(), jax.device_count(), jax.local_device_count()])
    d, results, errors = data(), {"layout": layout}, {}
    for name, check in (CHECKS | {"page": functools.partial(_check_page, page)}).items():
        try:
            results |= check(d)
        except Exception:  # recorded for the test of this check; the other checks still run
            errors[name] = traceback.format_exc()
    np.savez(out / f"results_{process_id}.npz", **results)
    (out / f"errors_{process_id}.json").write_text(json.dumps(errors))
    jax.distributed.shutdown()


if __name__ == "__main__":
    run_checks(int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]), pathlib.Path(sys.argv[4]))
