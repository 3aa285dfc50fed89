"""A saved reference: the PyTorch side of ``compare`` (its inputs, outputs and every module call's
inputs and output, the outputs of its float64 copy, the data flow) in a folder,
``arrays.safetensors`` and ``reference.json`` (names, order, dtypes and the settings it ran
under), read back where PyTorch is not installed. Reading imports neither PyTorch nor transformers."""

from __future__ import annotations

import json
import os

import numpy as np

from parity_tests.porting import settings, torch_side
from parity_tests.porting.recording import Call, Recording
from parity_tests.tool.arrays import numpy_dtype

FORMAT = 1
ARRAYS, INDEX = "arrays.safetensors", "reference.json"


def _put(store: dict, key: str, x: np.ndarray) -> dict:
    """Store ``x`` under ``key``; bfloat16 as its bits (uint16), which safetensors' NumPy side lacks."""
    x = np.ascontiguousarray(x)
    dtype = x.dtype.name
    store[key] = x.view(np.uint16) if dtype == "bfloat16" else x
    return {"key": key, "dtype": dtype}


def _get(store: dict, entry: dict) -> np.ndarray:
    x = store[entry["key"]]
    if entry["dtype"] == "bfloat16":
        return x.view(numpy_dtype("bfloat16"))
    return x


def reference(torch_model, inputs, dtype: str | None) -> Recording:
    """The PyTorch side's recording (``torch_model`` a saved ``Recording``: itself, its dtype checked)."""
    if isinstance(torch_model, Recording):
        if dtype is not None and torch_model.dtype != dtype:
            raise ValueError(f"the saved reference is {torch_model.dtype}, not the {dtype} asked for (dtype={dtype!r})")
        if inputs and (len(inputs) != len(torch_model.inputs)
                       or not all(np.array_equal(np.asarray(a), b) for a, b in zip(inputs, torch_model.inputs))):
            raise ValueError("the inputs given are not the saved reference's: leave them out to use its own")
        return torch_model
    if not inputs:
        raise ValueError("compare needs the inputs (NumPy arrays) to give both models; a saved reference has its own")
    found = settings.check_dtype("PyTorch", torch_side.parameter_dtypes(torch_model), dtype)
    return torch_side.record(torch_model, inputs, settings=settings.recorded(_torch()), dtype=found)


def record(torch_model, *inputs, dtype: str | None = None, matmul_precision: str = "highest") -> Recording:
    """The PyTorch side of ``compare`` alone: its inputs, outputs and every module call, as NumPy
    (give it to ``compare`` in place of the model, or keep it with ``save_reference``)."""
    with settings.numerics(matmul_precision):
        return reference(torch_model, inputs, dtype)


def _torch():
    import sys

    return sys.modules.get("torch")


def save_reference(path: str | os.PathLike, torch_model, *inputs, dtype: str | None = None,
                   matmul_precision: str = "highest") -> Recording:
    """Run ``torch_model`` on ``inputs`` as ``compare`` does and save what it recorded in folder
    ``path`` (made if missing; its two files overwritten). Returns the recording."""
    recording = torch_model if isinstance(torch_model, Recording) else record(
        torch_model, *inputs, dtype=dtype, matmul_precision=matmul_precision)
    write(path, recording)
    return recording


def write(path: str | os.PathLike, recording: Recording) -> None:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    store: dict[str, np.ndarray] = {}

    def named(key: str, name: str, x: np.ndarray) -> dict:
        return dict(_put(store, key, x), name=name)

    index = {
        "format": FORMAT, "dtype": recording.dtype, "settings": recording.settings,
        "inputs": [_put(store, f"input.{i}", x) for i, x in enumerate(recording.inputs)],
        "outputs": [named(f"output.{i}", name, x) for i, (name, x) in enumerate(recording.outputs)],
        "outputs64": [named(f"output64.{i}", name, x) for i, (name, x) in enumerate(recording.outputs64)],
        "calls": [{"name": c.name, "occurrence": c.occurrence, "class": c.cls,
                   "inputs": [named(f"call.{j}.input.{k}", name, x) for k, (name, x) in enumerate(c.inputs)],
                   "sources": c.sources,
                   **{what: None if getattr(c, attr) is None else _put(store, f"call.{j}.{what}", getattr(c, attr))
                      for what, attr in (("output", "output"), ("output64", "output64"),
                                         ("inherited64", "inherited64"))}}
                  for j, c in enumerate(recording.calls)],
    }
    save_file(store, os.path.join(path, ARRAYS))
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump(index, f, indent=1)


def load_reference(path: str | os.PathLike) -> Recording:
    """The recording saved in folder ``path``; give it to ``compare`` in place of the PyTorch model."""
    from safetensors.numpy import load_file

    index_path = os.path.join(path, INDEX)
    if not os.path.exists(index_path):
        raise FileNotFoundError(f"{path} holds no saved reference ({INDEX} is missing): save one with save_reference")
    with open(index_path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{index_path}: format {index.get('format')!r}, this version reads format {FORMAT}")
    store = load_file(os.path.join(path, ARRAYS))
    read = lambda entry: None if entry is None else _get(store, entry)  # noqa: E731
    calls = [Call(c["name"], c["occurrence"], c["class"], [(e["name"], _get(store, e)) for e in c["inputs"]],
                  read(c["output"]), c.get("sources", []), read(c.get("output64")), read(c.get("inherited64")))
             for c in index["calls"]]
    return Recording([_get(store, e) for e in index["inputs"]], [(e["name"], _get(store, e)) for e in index["outputs"]],
                     calls, index["dtype"], index["settings"],
                     [(e["name"], _get(store, e)) for e in index.get("outputs64", [])])
