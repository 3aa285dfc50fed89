"""``parity_tests.compare`` on a tiny model written three ways (PyTorch, nnx, linen): names,
outputs, the logit metrics, bad input, and ``mha-parity compare``'s table, files and exit codes."""

import json
import sys

import jax
import numpy as np
import pytest
import torch
from flax import linen, nnx

from parity_tests import compare
from parity_tests.porting import names
from parity_tests.tool import cli

VOCAB, DIM = 11, 8
MAPPING = {r"blocks\.(\d+)\.proj": r"blocks.\1.dense", r"head\.act": None}


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(x + torch.nn.functional.gelu(self.proj(x)))


class TorchTiny(torch.nn.Module):
    """ids ``(batch, length)`` -> ``{"logits": (batch, length, VOCAB), "hidden": ...}``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([TorchBlock(), TorchBlock()])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return {"logits": self.head(h), "hidden": h}


def _weights(model: TorchTiny) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


class NnxBlock(nnx.Module):
    def __init__(self, w, prefix, eps=1e-5):
        self.dense = nnx.Linear(DIM, DIM, rngs=nnx.Rngs(0))
        self.norm = nnx.LayerNorm(DIM, epsilon=eps, rngs=nnx.Rngs(0))
        self.dense.kernel.set_value(w[f"{prefix}.proj.weight"].T)
        self.dense.bias.set_value(w[f"{prefix}.proj.bias"])
        self.norm.scale.set_value(w[f"{prefix}.norm.weight"])
        self.norm.bias.set_value(w[f"{prefix}.norm.bias"])

    def __call__(self, x):
        return self.norm(x + jax.nn.gelu(self.dense(x), approximate=False))


class NnxTiny(nnx.Module):
    def __init__(self, eps=(1e-5, 1e-5)):
        w = _weights(TorchTiny())
        self.embed = nnx.Embed(VOCAB, DIM, rngs=nnx.Rngs(0))
        self.embed.embedding.set_value(w["embed.weight"])
        self.blocks = nnx.List([NnxBlock(w, f"blocks.{i}", e) for i, e in enumerate(eps)])
        self.head = nnx.Linear(DIM, VOCAB, rngs=nnx.Rngs(0))
        self.head.kernel.set_value(w["head.weight"].T)
        self.head.bias.set_value(w["head.bias"])

    def __call__(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return {"logits": self.head(h), "hidden": h}


class LinenBlock(linen.Module):
    @linen.compact
    def __call__(self, x):
        h = jax.nn.gelu(linen.Dense(DIM, name="dense")(x), approximate=False)
        return linen.LayerNorm(epsilon=1e-5, name="norm")(x + h)


class LinenTiny(linen.Module):
    def setup(self):
        self.embed = linen.Embed(VOCAB, DIM)
        self.blocks = [LinenBlock(), LinenBlock()]  # blocks_0, blocks_1
        self.head = linen.Dense(VOCAB)

    def __call__(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h), h  # a tuple: its fields pair with PyTorch's in order


def linen_tiny():
    w = _weights(TorchTiny())
    block = lambda i: {"dense": {"kernel": w[f"blocks.{i}.proj.weight"].T, "bias": w[f"blocks.{i}.proj.bias"]},  # noqa: E731
                       "norm": {"scale": w[f"blocks.{i}.norm.weight"], "bias": w[f"blocks.{i}.norm.bias"]}}
    params = {"embed": {"embedding": w["embed.weight"]}, "blocks_0": block(0), "blocks_1": block(1),
              "head": {"kernel": w["head.weight"].T, "bias": w["head.bias"]}}
    return LinenTiny(), {"params": params}


def torch_tiny():
    return TorchTiny().eval()


def nnx_tiny():
    return NnxTiny()


def nnx_tiny_wrong_epsilon():
    return NnxTiny(eps=(1e-5, 1e-3))


def tiny_inputs():
    return (np.random.default_rng(0).integers(0, VOCAB, (2, 5)),)


def test_names_of_both_frameworks_are_one_spelling():
    assert names.normalize("layers[0].mlp") == names.normalize(("layers", 0, "mlp")) == "layers.0.mlp"
    assert names.linen(("layers_0", "mlp", "Dense_1")) == "layers.0.mlp.Dense.1"
    mapping = names.check_mapping({r"(.*)\.q_proj": r"\1.query", r"rotary": None})
    assert names.jax_name("layers.1.q_proj", mapping) == "layers.1.query"
    assert names.jax_name("rotary", mapping) is None and names.jax_name("norm", mapping) == "norm"
    with pytest.raises(ValueError, match=r"mapping: '\(' is not a regular expression"):
        names.check_mapping({"(": "x"})


@pytest.mark.parametrize("flax", ["nnx", "linen"])
def test_every_module_pairs_and_a_wrong_epsilon_is_found(flax):
    model = nnx_tiny() if flax == "nnx" else linen_tiny()
    report = compare(torch_tiny(), model, *tiny_inputs(), mapping=MAPPING)
    assert report.passed, report.table()
    assert [m.name for m in report.modules] == ["embed", "blocks.0.proj", "blocks.0.norm", "blocks.0", "blocks.1.proj",
                                                "blocks.1.norm", "blocks.1", "head"]
    assert [o.name for o in report.outputs] == ["logits", "hidden"] and report.logits.top1 == 1.0
    if flax == "nnx":
        wrong = compare(torch_tiny(), nnx_tiny_wrong_epsilon(), *tiny_inputs(), mapping=MAPPING)
        assert wrong.first_divergence == "blocks.1.norm" and wrong.module("blocks.0").passed, wrong.table()
        assert wrong.module("blocks.1.norm").added > 1e-4 and wrong.module("head").added < 1e-5


def test_the_logit_metrics_against_their_definition():
    from parity_tests.porting.logits import metrics

    rng = np.random.default_rng(0)
    theirs = rng.normal(size=(2, 3, 7))
    mine = theirs + 0.1 * rng.normal(size=theirs.shape)
    p = np.exp(theirs) / np.exp(theirs).sum(-1, keepdims=True)
    q = np.exp(mine) / np.exp(mine).sum(-1, keepdims=True)
    kl = (p * np.log(p / q)).sum(-1)
    m = metrics(mine, theirs, k=3)
    assert np.isclose(m.kl_mean, kl.mean(), rtol=1e-12) and np.isclose(m.kl_max, kl.max(), rtol=1e-12)
    assert m.kl_max_token == np.unravel_index(kl.argmax(), kl.shape)
    assert m.top1 == (mine.argmax(-1) == theirs.argmax(-1)).mean()
    swapped = theirs.copy()
    swapped[0, 0, [np.argsort(theirs[0, 0])[-1], np.argsort(theirs[0, 0])[0]]] = swapped[0, 0, [
        np.argsort(theirs[0, 0])[0], np.argsort(theirs[0, 0])[-1]]]  # the likeliest and the least likely swapped
    s = metrics(swapped, theirs, k=3)
    assert s.top1 == 5 / 6 and np.isclose(s.topk, (5 + 2 / 3) / 6) and s.kl_max_token == (0, 0)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="flax_model must be an nnx.Module or a linen"):
        compare(torch_tiny(), object(), *tiny_inputs())
    with pytest.raises(ValueError, match=r"training mode \(the model and more"):
        compare(TorchTiny(), nnx_tiny(), *tiny_inputs())
    with pytest.raises(ValueError, match="compare needs the inputs"):
        compare(torch_tiny(), nnx_tiny())
    with pytest.raises(ValueError, match=r"valid must be bool \(batch, length\) of the outputs, whose first is "
                                         r"\(2, 5, 11\); got \(5, 2\)"):
        compare(torch_tiny(), nnx_tiny(), *tiny_inputs(), valid=np.ones((5, 2), bool))


def _cli(capsys, *argv):
    code = cli.main(["compare", *argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_the_command_line(capsys, tmp_path, monkeypatch):
    here = "parity_tests.test_compare_api"
    common = ["--inputs", f"{here}:tiny_inputs", "--mapping", f"{here}:MAPPING"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the plot is optional: its absence is said
    code, out = _cli(capsys, "--torch", f"{here}:torch_tiny", "--flax", f"{here}:nnx_tiny", *common,
                     "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.md"), "--gradients",
                     "--save-reference", str(tmp_path / "ref"))
    assert code == 0 and "every comparison passed" in out and "gradients: 11 parameters" in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["gradients"]["passed"] and len(report["modules"]) == 8
    markdown = (tmp_path / "r.md").read_text()
    assert "| blocks.1.norm | blocks.1.norm |" in markdown and "(no plot: matplotlib cannot be imported" in markdown
    code, out = _cli(capsys, "--reference", str(tmp_path / "ref"), "--flax", f"{here}:nnx_tiny_wrong_epsilon",
                     "--mapping", f"{here}:MAPPING")
    assert code == 1 and "FAILED: first divergence at blocks.1.norm" in out, out
    row = next(line for line in out.splitlines() if line.startswith("blocks.1.norm "))
    assert row.endswith("FIRST DIVERGENCE"), row
    code, out = _cli(capsys, "--flax", f"{here}:nnx_tiny")
    assert code == 2 and "give one of --torch" in out
    code, out = _cli(capsys, "--torch", f"{here}:nothing", "--flax", f"{here}:nnx_tiny", *common)
    assert code == 2 and "--torch: parity_tests.test_compare_api has no 'nothing'" in out


def test_the_guide_example_runs(capsys):
    import pathlib

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "porting-models.md").read_text()
    (block,) = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    exec(compile(block, "docs/porting-models.md", "exec"), {})
    assert "first divergence: 1" in capsys.readouterr().out


def test_importing_the_package_imports_no_framework_until_compare_is_used():
    import subprocess

    code = ("import sys, parity_tests; "
            "assert 'torch' not in sys.modules and 'parity_tests.porting' not in sys.modules; "
            "from parity_tests import compare, verify; from parity_tests.tool.callables import verify as v; "
            "assert verify is v and compare.__module__ == 'parity_tests.porting.core' and 'torch' not in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
