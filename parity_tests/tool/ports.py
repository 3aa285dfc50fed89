"""A user's checkpoint in both frameworks, behind ``mha-parity verify --weights`` and ``convert``.

A checkpoint file is ``.safetensors`` in PyTorch names (any layout the loaders read), or Flax
parameters (layout ``"flax"``): a flax msgpack file or ``.safetensors`` with dot-joined names
(``query.kernel``). The parity cases reuse the harness: its random inputs and masks, our
modules in both frameworks and the float64 oracle, with the checkpoint's weights in place of
random ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from parity_tests.tool import files, harness
from parity_tests.tool.arrays import numpy_dtype, same_bits

FLAX = "flax"
MAPPED = "mapped"  # a file read by --mapping whose keys show no layout of ours


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read from ``path``: ``state`` in ``mha_torch`` names, in the file's dtype."""

    path: str
    layout: str
    state: dict[str, np.ndarray]
    num_heads: int
    num_kv_heads: int
    load: dict = field(default_factory=dict)  # the loaders' naming arguments (layout, prefix, ignore)
    detected: bool = False  # the layout was read from the keys, not given

    @property
    def dtype(self) -> str:
        return self.state["q_proj.weight"].dtype.name

    def config(self) -> harness.Config:
        """The module configuration the weights fit; self-attention when key features = query's."""
        s = self.state
        in_features, in_kv = s["q_proj.weight"].shape[1], s["k_proj.weight"].shape[1]
        cross = {} if in_kv == in_features else {"in_kv_features": in_kv, "q_len": 5, "kv_len": 7}
        return harness.Config(
            "weights", in_features=in_features, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, qkv_features=s["q_proj.weight"].shape[0],
            out_features=s["out_proj.weight"].shape[0], use_bias="q_proj.bias" in s,
            normalize_qk=self.normalize_qk, **cross,
        )

    @property
    def normalize_qk(self) -> bool:
        """True with QK-norm scales (flax's ``normalize_qk``: LayerNorm per head, eps 1e-6)."""
        return "q_norm.weight" in self.state

    def describe(self) -> str:
        c = self.config()
        return (
            f"{self.path} (layout {self.layout}{', detected from the keys' if self.detected else ''}"
            f"{', read by --mapping' if 'mapping' in self.load else ''}, {self.dtype}): "
            f"num_heads {c.num_heads}, num_kv_heads {c.kv_heads}, features in {c.in_features}, key/value "
            f"{c.in_kv_features or c.in_features}, qkv {c.qkv_features}, out {c.out_features}, "
            f"{'with' if c.use_bias else 'no'} biases" + (", normalize_qk" if c.normalize_qk else "")
        )


def read(
    path: str, *, layout: str | None = None, num_heads: int | None = None,
    num_kv_heads: int | None = None, prefix: str = "", ignore: tuple[str, ...] = (),
    mapping: dict[str, str] | None = None,
) -> Checkpoint:
    """Read a checkpoint file; ValueError/TypeError name what does not fit. Without ``layout``,
    a ``.msgpack`` file is Flax parameters and a ``.safetensors`` file is in the layout its keys
    (under ``prefix``) show. With ``mapping`` (``from_torch``'s), the weights are read by its names and
    ``layout``, the source's, is still the one the keys show."""
    import mha_jax
    from mha_spec import layouts

    path = os.fspath(path)
    if mapping is not None and layout is not None:
        raise ValueError(f"give --layout or --mapping, not both: got --layout {layout} and a mapping")
    detected = layout is None and not path.endswith(".msgpack")
    if detected:
        keys = under_prefix(file_keys(path), prefix)
        where = f"the keys of {path}" + (f" under --prefix {prefix}" if prefix else "")
        try:
            layout = layouts.detect_layout(keys, where=where)
        except ValueError:
            if mapping is None:
                raise
            layout, detected = MAPPED, False  # names of the mapping's own: no source implementation known
    if mapping is not None and not path.endswith(".safetensors"):
        raise ValueError(f"--mapping names PyTorch keys of a .safetensors file, not {path}")
    layout = layout or FLAX
    if layout == FLAX:
        if prefix or ignore:
            raise ValueError("--prefix and --ignore apply to PyTorch-named weights, not to Flax parameters")
        if path.endswith(".safetensors"):
            _check_flax_names(path)
        tree = read_flax_tree(path)
        state = mha_jax.to_torch(tree)  # checks the tree: four projections, rank-3 kernels
        found = {"num_heads": tree["query"]["kernel"].shape[1], "num_kv_heads": tree["key"]["kernel"].shape[1]}
        for name, given in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if given is not None and given != found[name]:
                raise ValueError(f"{name}={given}, but the Flax kernels in {path} have {found[name]}")
        return Checkpoint(path, layout, state, int(found["num_heads"]), int(found["num_kv_heads"]), detected=detected)
    if num_heads is None:
        raise ValueError(f"--num-heads is needed to read {path} (layout {layout}): "
                         "PyTorch names do not say how rows split into heads")
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    load = {"prefix": prefix, "ignore": tuple(ignore)}
    load.update({"layout": layout} if mapping is None else {"mapping": mapping})
    params = mha_jax.from_torch(path, num_heads=num_heads, num_kv_heads=num_kv_heads, **load)
    state = mha_jax.to_torch(params)
    checkpoint = Checkpoint(path, layout, state, num_heads, num_kv_heads, load, detected)
    _check_norms(checkpoint)
    return checkpoint


def file_keys(path: str) -> list[str]:
    """The tensor names of a ``.safetensors`` file, read from its header."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    if not path.endswith(".safetensors"):
        raise ValueError(f"{path}: a checkpoint is a .safetensors or flax .msgpack file")
    try:
        from safetensors import safe_open

        with safe_open(path, "numpy") as f:
            return list(f.keys())
    except Exception as error:  # safetensors raises its own types for bad headers
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error


def under_prefix(keys: list[str], prefix: str) -> list[str]:
    """The keys starting with ``prefix``, the prefix taken off (all keys if none does)."""
    return [k[len(prefix):] for k in keys if k.startswith(prefix)] or keys


def _check_flax_names(path: str) -> None:
    """``--layout flax`` on a file of PyTorch names: say what it holds and which layout it looks like."""
    from mha_spec import layouts

    keys = file_keys(path)
    try:
        shown = layouts.detect_layout(keys)
    except ValueError:
        shown = None
    if shown != FLAX:
        looks = f"; it looks like --layout {shown}" if shown else ""
        raise ValueError(f"--layout flax: {path} holds no Flax parameter names (query.kernel, ...) "
                         f"but {layouts.some(keys)}{looks}")


def _check_norms(checkpoint: Checkpoint) -> None:
    """QK-norm scales: flax's per-head ones, ``(head_dim,)``, are what both modules and the oracle run."""
    head_dim = checkpoint.config().qkv_features // checkpoint.num_heads
    for name in ("q_norm.weight", "k_norm.weight"):
        if name in checkpoint.state and checkpoint.state[name].shape != (head_dim,):
            raise ValueError(
                f"{name} has shape {checkpoint.state[name].shape}: a norm over the whole projection, which "
                f"mha-parity runs only per head, (head_dim,) = ({head_dim},)"
            )


def read_flax_tree(path: str) -> dict:
    """The nested parameter dict of a flax ``.msgpack`` file or of a ``.safetensors`` file with
    dot-joined names (``query.kernel``); a ``{"params": ...}`` wrapper is taken off."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    try:
        if path.endswith(".msgpack"):
            from flax.serialization import msgpack_restore

            with open(path, "rb") as f:
                tree = msgpack_restore(f.read())
        else:
            from safetensors.numpy import load_file

            tree = {}
            for name, array in load_file(path).items():
                *parents, leaf = name.split(".")
                node = tree
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = array
    except OSError:
        raise
    except Exception as error:  # msgpack and safetensors raise their own types for bad bytes
        raise ValueError(f"{path} is not a readable parameter file: {error}") from error
    return tree.get("params", tree)


def build_ours(checkpoint: Checkpoint, dtype: str | None = None):
    """Our module in each framework, in ``dtype`` (default: the file's), each loaded from the
    file with its own loader (a Flax tree by ``nnx.update``): ``(nnx module, torch module)``."""
    import jax.numpy as jnp
    import torch
    from flax import nnx

    import mha_jax
    import mha_torch

    c = checkpoint.config()
    dtype = dtype or checkpoint.dtype
    model = mha_jax.MultiHeadAttention(
        c.num_heads, c.in_features, c.qkv_features, c.out_features, num_kv_heads=c.num_kv_heads,
        in_kv_features=c.in_kv_features, use_bias=c.use_bias, normalize_qk=c.normalize_qk,
        param_dtype=jnp.dtype(numpy_dtype(dtype)), rngs=nnx.Rngs(0),
    )
    module = mha_torch.MultiHeadAttention(
        c.in_features, c.num_heads, num_kv_heads=c.num_kv_heads, kdim=c.in_kv_features,
        vdim=c.in_kv_features, qkv_dim=c.qkv_features, out_dim=c.out_features, bias=c.use_bias,
        normalize_qk=c.normalize_qk, dtype=getattr(torch, dtype),
    )
    if checkpoint.layout == FLAX:
        tree = read_flax_tree(checkpoint.path)
        nnx.update(model, {m: {k: jnp.asarray(v, model.query.kernel.get_value().dtype) for k, v in leaves.items()}
                           for m, leaves in tree.items()})  # a Flax tree loads as it is
        mha_torch.load_weights(module, mha_jax.to_torch(checkpoint.path))
    else:
        mha_jax.load_weights(model, checkpoint.path, **checkpoint.load)
        mha_torch.load_weights(module, checkpoint.path, **checkpoint.load)
    return model, module.eval()


def check_loads(checkpoint: Checkpoint) -> None:
    """Load the file into our module in each framework, each with its own loader, and require
    both to hold exactly the checkpoint's bits (AssertionError naming the tensor otherwise)."""
    import mha_jax

    model, module = build_ours(checkpoint)
    check_held(checkpoint, {"jax": mha_jax.to_torch(model), "torch": dict(module.state_dict())})


def check_held(checkpoint: Checkpoint, held: dict) -> None:
    """Each framework's loaded state (framework -> name -> tensor) against the checkpoint's bits (AssertionError
    naming the framework and the tensor otherwise)."""
    for framework, state in held.items():
        for name, expected in checkpoint.state.items():
            if not same_bits(state[name], expected):
                raise AssertionError(f"{framework} holds different values for {name} after loading {checkpoint.path}")


def cases(checkpoint: Checkpoint, dtypes=None, masks=None) -> list[harness.Case]:
    """Every mask form and dtype of the default run (or those asked for), on the checkpoint's shape."""
    config = checkpoint.config()
    return [
        harness.Case(config, mask, dtype)
        for mask in harness.MASKS if not masks or mask in masks
        for dtype in harness.DTYPES if not dtypes or dtype in dtypes
    ]


def write(checkpoint: Checkpoint, out: str, to: str) -> None:
    """Write ``checkpoint`` for ``to`` = "torch" (``.safetensors``, mha_torch names) or "flax"
    (``.msgpack`` or dot-named ``.safetensors`` of the parameter tree), read back bit for bit
    (``check_written``) before it replaces ``out``: on any failure ``out`` is as it was."""
    import mha_jax

    if to == "torch":
        if not out.endswith(".safetensors"):
            raise ValueError(f"--to torch writes a .safetensors file, got {out!r}")
        from safetensors.numpy import save_file

        def save(path):
            save_file(checkpoint.state, path)
    elif not out.endswith((".msgpack", ".safetensors")):
        raise ValueError(f"--to flax writes a .msgpack or .safetensors file, got {out!r}")
    else:
        params = mha_jax.from_torch(checkpoint.state, num_heads=checkpoint.num_heads,
                                    num_kv_heads=checkpoint.num_kv_heads)

        def save(path):
            if out.endswith(".msgpack"):
                from flax.serialization import msgpack_serialize

                with open(path, "wb") as f:
                    f.write(msgpack_serialize(params))
            else:
                from safetensors.numpy import save_file

                save_file({f"{module}.{name}": array
                           for module, leaves in params.items() for name, array in leaves.items()}, path)

    files.write_atomically(out, save, lambda path: check_written(checkpoint, path, to))


def check_written(checkpoint: Checkpoint, out: str, to: str) -> None:
    """Read ``out`` back as the other side would and require the checkpoint's exact bits."""
    again = read(out, layout=FLAX if to == "flax" else "mha_torch", num_heads=checkpoint.num_heads,
                 num_kv_heads=checkpoint.num_kv_heads)
    check_loads(again)
    for name, expected in checkpoint.state.items():
        if not same_bits(again.state[name], expected):
            raise AssertionError(f"{out} holds different values for {name} than {checkpoint.path}")
