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


class NnxTinyDetached(NnxTiny):
    """Equal outputs, but no gradient reaches below the head: only training tells it apart."""

    def __call__(self, ids):
        out = super().__call__(ids)
        h = jax.lax.stop_gradient(out["hidden"])
        return {"logits": self.head(h), "hidden": h}


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
    block = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]][0]
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


class TorchAttention(torch.nn.Module):
    """``forward(hidden_states, bias)``: a table of positions (``bias``, floats) given by the caller;
    each token sees the sum of every token's projection."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, hidden_states, bias):
        keys = self.proj(hidden_states)
        return self.out(keys + keys.sum(1, keepdim=True) + bias)


class TorchForeign(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.attn = TorchAttention()
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        positions = torch.arange(ids.shape[1], dtype=h.dtype)
        return self.head(self.attn(h, torch.sin(positions)[None, :, None].expand_as(h)))


class NnxAttention(nnx.Module):
    """``attn(x, positions)``: integer positions, the table made inside; a cache that every call
    appends to, the sum taken over all it holds (a re-run that sees the cache its first run left
    behind counts that run's tokens twice)."""

    def __init__(self, w, length: int, wave=jax.numpy.sin):
        self.wave = wave
        self.proj = nnx.Linear(DIM, DIM, rngs=nnx.Rngs(0))
        self.out = nnx.Linear(DIM, DIM, rngs=nnx.Rngs(0))
        for mine, theirs in ((self.proj, "attn.proj"), (self.out, "attn.out")):
            mine.kernel.set_value(w[f"{theirs}.weight"].T)
            mine.bias.set_value(w[f"{theirs}.bias"])
        self.cache = nnx.Cache(jax.numpy.zeros((2, 4 * length, DIM), np.float32))  # up to 2 rows
        self.index = nnx.Cache(jax.numpy.zeros((), int))

    def __call__(self, x, positions, cache=None):
        """``cache``: Variables ``(keys, index)`` the caller holds, written in place of the attention's own."""
        cache, index = (self.cache, self.index) if cache is None else cache
        keys = self.proj(x)
        start = index[...]
        cache[...] = jax.lax.dynamic_update_slice(cache[...], keys, (0, start, 0))
        index[...] = start + x.shape[1]
        bias = self.wave(positions.astype(x.dtype))[..., None]
        return self.out(keys + cache[...][: x.shape[0]].sum(1, keepdims=True) + bias)


class NnxForeign(nnx.Module):
    def __init__(self, length: int = 5, wave=jax.numpy.sin, cache_argument: bool = False):
        torch_model = TorchForeign()
        w = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
        self.embed = nnx.Embed(VOCAB, DIM, rngs=nnx.Rngs(0))
        self.embed.embedding.set_value(w["embed.weight"])
        self.attn = NnxAttention(w, length, wave)
        self.head = nnx.Linear(DIM, VOCAB, rngs=nnx.Rngs(0))
        self.head.kernel.set_value(w["head.weight"].T)
        self.head.bias.set_value(w["head.bias"])
        self.cache = nnx.data((nnx.Cache(jax.numpy.zeros((2, 4 * length, DIM), np.float32)),
                               nnx.Cache(jax.numpy.zeros((), int))) if cache_argument else None)

    def __call__(self, ids):
        positions = jax.numpy.broadcast_to(jax.numpy.arange(ids.shape[1]), ids.shape)
        return self.head(self.attn(self.embed(ids), positions, self.cache))


def keep_positions(args):
    """PyTorch's attention call -> the port's: its hidden states, the port's own positions (``...``)."""
    return (args["hidden_states"], ...), {}


@pytest.mark.parametrize("rows, cache_argument", [(1, False), (2, False), (2, True)])
def test_a_port_that_writes_its_cache_on_every_call_passes(rows, cache_argument):
    """The cache the attention's own, or Variables its caller passes: the re-run sees it as it was."""
    ids = tiny_inputs()[0][:rows]
    port = NnxForeign(cache_argument=cache_argument)
    report = compare(TorchForeign().eval(), port, ids, mapping={"attn": ("attn", keep_positions)})
    assert report.passed and all(m.passed for m in report.modules), report.table()
    attn = report.module("attn")
    assert attn.added < 1e-6 and attn.sources == ["embed#0"] and attn.jax_sources == ["embed#0"], attn


def test_a_row_that_cannot_be_compared_is_neither_passed_nor_failed():
    report = compare(TorchForeign().eval(), NnxForeign(), *tiny_inputs(), mapping={"head": "attn.out"})
    attn, head = report.module("attn"), report.module("head")
    assert attn.outcome == "not compared" and not attn.passed and not attn.failed, report.table()
    assert "no PyTorch input fits argument 1 (2, 5)" in attn.note
    assert head.outcome == "not compared" and "no layout of the JAX array" in head.note
    assert report.passed and "4 paired modules (2 passed, 0 failed, 2 not compared)" in report.table()
    assert "not compared (no PyTorch input fits argument 1" in report.table()


@pytest.mark.parametrize("adapter", [None, keep_positions])
def test_a_defect_between_the_projections_is_named_at_the_attention(adapter):
    """The port's table of positions made with a cosine: without an adapter the attention is not
    compared, and its inherited error, beyond what it may inherit while its input held, names it."""
    mapping = {"attn": "attn" if adapter is None else ("attn", adapter)}
    report = compare(TorchForeign().eval(), NnxForeign(wave=jax.numpy.cos), *tiny_inputs(), mapping=mapping)
    assert report.first_divergence == "attn" and not report.passed, report.table()
    assert report.module("attn.proj").passed and report.module("attn.out").passed, report.table()
    assert report.module("attn").by_flow == (adapter is None), report.table()
    mark = "FIRST DIVERGENCE (found by inherited error)" if adapter is None else "FIRST DIVERGENCE"
    assert next(r for r in report.rows() if r[0] == "attn")[-1] == mark
    assert "verdict: FAILED: first divergence at attn" in report.table()


def test_the_bound_follows_pytorchs_own_rounding():
    from parity_tests.tool import verdict

    report = compare(torch_tiny(), nnx_tiny(), *tiny_inputs(), mapping=MAPPING)
    dense = report.module("blocks.0.proj")
    assert dense.reference is not None and 0 < dense.reference < 1e-6, report.table()
    floor = min(dense.tolerance, 16 * 2.0**-23)
    assert dense.bound == max(floor, 16 * dense.reference)
    assert verdict.bound(1e-6, 4e-7) == 6.4e-6 and verdict.bound(1e-6, None) == 1e-6
    assert verdict.bound(1e-6, float("nan")) == 1e-6 and verdict.bound(1e-6, 1e-8) == 1e-6
    # a module that rounds well is held below the fixed tolerance, to a few units of float32's rounding
    assert verdict.bound(1e-5, 1e-9, verdict.module_floor(1e-5, "float32")) == 16 * 2.0**-23 < 1e-5
    assert verdict.outcome(None, 1.0) == "not compared" and verdict.outcome(float("nan"), 1.0) == "failed"


class NnxTinyLogitsOff(NnxTiny):
    """Every module as PyTorch's; its logits scaled by 1 + 1e-5 between the head and the output,
    and every gradient below the blocks by 1 + 1e-5 (the forward unchanged, bit for bit)."""

    def __call__(self, ids):
        out = super().__call__(ids)
        h = out["hidden"]
        h = h + (1e-5 * h - jax.lax.stop_gradient(1e-5 * h))
        return {"logits": self.head(h) * (1 + 1e-5), "hidden": h}


def _own_rounding(values32, values64) -> float:
    """PyTorch's float32 result against its float64 copy's, relative as the report defines it."""
    a, b = np.asarray(values32, np.float64), np.asarray(values64, np.float64)
    return max(np.linalg.norm(a - b) / np.linalg.norm(b), np.abs(a - b).max() / np.abs(b).max())


def test_logits_gradients_and_a_step_are_bounded_by_pytorchs_own_rounding():
    """The logits' and each parameter's bound is ``verdict.bound`` of PyTorch's float32 result against
    its float64 copy's (at least a module's floor; a step's at least its tolerance): an error of 1e-5,
    within the fixed 1e-4, fails; a tolerance given judges alone."""
    from parity_tests.porting import compare_gradients, compare_step
    from parity_tests.porting.gradients import cotangent
    from parity_tests.tool import verdict

    floor = verdict.module_floor(1e-4, "float32")
    model, ids = torch_tiny(), torch.as_tensor(tiny_inputs()[0])
    exact = model.double()(ids)["logits"].detach().numpy()
    report = compare(torch_tiny(), nnx_tiny(), *tiny_inputs(), mapping=MAPPING)
    logits = next(o for o in report.outputs if o.name == "logits")
    ours = torch_tiny()(ids)["logits"].detach().numpy()
    assert np.isclose(logits.reference, _own_rounding(ours, exact), rtol=1e-6) and 0 < logits.reference < 1e-6
    assert report.passed and logits.bound == max(floor, 16 * logits.reference) < 1e-5, report.table()
    off = compare(torch_tiny(), NnxTinyLogitsOff(), *tiny_inputs(), mapping=MAPPING)
    assert not off.passed and off.first_divergence is None and off.failures()[0].startswith("logits relative error")
    assert compare(torch_tiny(), NnxTinyLogitsOff(), *tiny_inputs(), mapping=MAPPING, output_tolerance=1e-4).passed

    g = cotangent((2, 5, VOCAB), "float32", None, 0)
    grads = {}
    for name, m in (("float32", torch_tiny()), ("float64", torch_tiny().double())):
        (m(ids)["logits"] * torch.as_tensor(g).to(m.head.weight.dtype)).sum().backward()
        grads[name] = m.head.weight.grad.numpy()
    report = compare_gradients(torch_tiny(), nnx_tiny(), *tiny_inputs(), mapping=MAPPING)
    head = next(p for p in report.parameters if p.name == "head.weight")
    assert np.isclose(head.reference, _own_rounding(grads["float32"], grads["float64"]), rtol=1e-6)
    assert report.passed and all(p.bound == max(floor, 16 * p.reference) for p in report.parameters)
    off = compare_gradients(torch_tiny(), NnxTinyLogitsOff(), *tiny_inputs(), mapping=MAPPING)
    assert not off.passed and {p.name for p in off.parameters if not p.passed} >= {"embed.weight"}, off.table()
    assert compare_gradients(torch_tiny(), NnxTinyLogitsOff(), *tiny_inputs(), mapping=MAPPING, tolerance=1e-4).passed
    step = compare_step(torch_tiny(), nnx_tiny(), *tiny_inputs(), mapping=MAPPING)
    assert step.passed and all(p.reference is not None and p.bound == max(1e-4, 16 * p.reference)
                               for p in step.parameters), step.table()


def test_an_unpaired_parameter_fails_the_gradients_and_the_command_line_says_so(capsys):
    from parity_tests.porting import compare_gradients

    report = compare_gradients(torch_tiny(), nnx_tiny(), *tiny_inputs())  # blocks.N.proj is named dense
    assert not report.passed and all(p.passed for p in report.parameters)
    assert "verdict: FAILED: 4 PyTorch parameters without a JAX pair (blocks.0.proj.weight" in report.table()
    wrong = compare_gradients(torch_tiny(), nnx_tiny_wrong_epsilon(), *tiny_inputs(), mapping=MAPPING)
    assert not wrong.passed and "gradients: verdict: FAILED: embed.weight 4." in wrong.table(), wrong.table()
    here = "parity_tests.test_compare_api"
    code, out = _cli(capsys, "--torch", f"{here}:torch_tiny", "--flax", f"{here}:nnx_tiny", "--inputs",
                     f"{here}:tiny_inputs", "--mapping", f"{here}:MAPPING", "--gradients")
    assert code == 0, out
    code, out = _cli(capsys, "--torch", f"{here}:torch_tiny", "--flax", f"{here}:nnx_tiny", "--inputs",
                     f"{here}:tiny_inputs", "--mapping", f"{here}:PARTIAL", "--gradients")
    assert code == 1 and "FAILED: " in out and "PyTorch parameters without a JAX pair" in out.splitlines()[-1], out


PARTIAL = {r"blocks\.0\.proj": r"blocks.0.dense", r"head\.act": None}  # blocks.1.proj left without its pair


class NnxTinyFrozenHeadBias(NnxTiny):
    """Equal outputs, but the head's bias (PyTorch's last parameter) takes no gradient."""

    def __call__(self, ids):
        out = super().__call__(ids)
        h = out["hidden"]
        return {"logits": h @ self.head.kernel[...] + jax.lax.stop_gradient(self.head.bias[...]), "hidden": h}


def test_every_parameter_is_checked_the_last_included():
    from parity_tests.porting import compare_gradients

    assert [n for n, _ in torch_tiny().named_parameters()][-1] == "head.bias"
    report = compare_gradients(torch_tiny(), NnxTinyFrozenHeadBias(), *tiny_inputs(), mapping=MAPPING)
    assert [p.name for p in report.parameters if not p.passed] == ["head.bias"], report.table()
    assert report.failures()[0].startswith("head.bias 1.00e+00 > ") and len(report.failures()) == 1, report.table()


def test_one_adamw_step_with_weight_decay_and_a_port_that_must_fail_it():
    """At a learning rate of 1e-2 and weight decay of 0.1 a step that left out the decay on one
    side moves every weight by 1e-3 of itself; a port with one bias off fails."""
    from parity_tests.porting import compare_step

    report = compare_step(torch_tiny(), nnx_tiny(), *tiny_inputs(), mapping=MAPPING, learning_rate=1e-2,
                          weight_decay=0.1)
    assert report.passed and report.worst.error < 1e-5, report.table()
    wrong = nnx_tiny()
    wrong.head.bias.set_value(wrong.head.bias[...] + 0.05)
    report = compare_step(torch_tiny(), wrong, *tiny_inputs(), mapping=MAPPING, learning_rate=1e-2, weight_decay=0.1)
    assert not report.passed and [p.name for p in report.parameters if not p.passed] == ["head.bias"]
    assert "verdict: FAILED: head.bias" in report.table()


def test_a_decode_with_equal_tokens_and_logits_off_fails_naming_the_row_and_step():
    from parity_tests.porting.decoding import DecodeReport, DecodeResult

    off = DecodeResult("JAX, left-padded batch", 1, [4, 5, 6], [4, 5, 6], 0.5, 1e-4, [0.0, 0.5, 0.5])
    other = DecodeResult("JAX, the row alone", 0, [4, 7, 6], [4, 5, 6], 0.0, 1e-4, [0.0, 0.0, 0.0])
    good = DecodeResult("JAX, the row alone", 1, [4, 5, 6], [4, 5, 6], 0.0, 1e-4, [0.0, 0.0, 0.0])
    assert not off.passed and off.first_step == 1 and not other.passed and other.first_step == 1 and good.passed
    table = DecodeReport([good, off, other], 3).table()
    assert table.splitlines()[-1] == ("decoding: verdict: FAILED: JAX, left-padded batch row 1: differs from step 1 "
                                      "(logits 5.00e-01 > 1.00e-04); JAX, the row alone row 0: differs from step 1 "
                                      "(token 7 for 5)"), table


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16", "int64", "int32", "bool"])
def test_a_saved_reference_reads_back_bit_for_bit(tmp_path, dtype):
    from parity_tests.porting import load_reference
    from parity_tests.porting.recording import Call, Recording
    from parity_tests.porting.reference import write
    from parity_tests.tool.arrays import numpy_dtype

    values = np.array([0.0, 1.0, -2.5, 3.0e-3, 65504.0, 1e-30])
    x = values.astype(numpy_dtype(dtype)) if dtype != "bool" else values > 0.5
    call = Call("a.b", 0, "m.C", [("hidden_states", x)], x[::-1].copy(), ["input.0"], x, x)
    write(tmp_path, Recording([x], [("logits", x)], [call], dtype, {}, [("logits", x[::-1].copy())]))
    back = load_reference(tmp_path)
    read = [back.inputs[0], back.outputs[0][1], *[a for _, a in back.calls[0].inputs], back.calls[0].output,
            back.calls[0].output64, back.calls[0].inherited64, back.outputs64[0][1]]
    expected = [x, x, x, x[::-1], x, x, x[::-1]]
    assert all(a.dtype == e.dtype and a.tobytes() == e.tobytes() for a, e in zip(read, expected)), (read, x)
    assert back.calls[0].sources == ["input.0"] and back.dtype == dtype and back.outputs64[0][0] == "logits"


def test_dir_and_help_list_the_public_api():
    import pydoc

    import parity_tests

    public = {"compare", "compare_decoding", "compare_gradients", "compare_step", "compare_training",
              "load_reference", "print_suggestion", "record", "save_reference", "suggest_mapping", "verify",
              "Inputs"}
    assert public <= set(dir(parity_tests)) and "importlib" not in dir(parity_tests)
    text = pydoc.render_doc(parity_tests, renderer=pydoc.plaintext)
    assert all(name in text for name in public), text[:3000]


def test_mapping_auto_pairs_as_suggest_mapping_from_one_pytorch_run(monkeypatch):
    """``mapping="auto"`` pairs as ``suggest_mapping`` does (``blocks.N.proj`` with ``blocks.N.dense``),
    from the recording ``compare`` makes: PyTorch runs once."""
    from parity_tests.porting import suggest_mapping, torch_side

    theirs, port, inputs = torch_tiny(), nnx_tiny(), tiny_inputs()
    assert dict(suggest_mapping(theirs, port, *inputs)) == {r"blocks\.(\d+)\.proj": r"blocks.\1.dense"}
    runs, recorded = [], torch_side.record
    monkeypatch.setattr(torch_side, "record", lambda *a, **k: runs.append(1) or recorded(*a, **k))
    report = compare(theirs, port, *inputs, mapping="auto")
    pairs = [(m.name, m.jax_name) for m in report.modules]
    assert report.passed and len(pairs) == 8 and ("blocks.1.proj", "blocks.1.dense") in pairs, report.table()
    assert runs == [1]
    wrong = compare(theirs, nnx_tiny_wrong_epsilon(), *inputs, mapping="auto")
    assert wrong.first_divergence == "blocks.1.norm" and "FAILED" in wrong.table(), wrong.table()


def test_the_command_line_suggests_a_mapping_and_compares_with_it(capsys, tmp_path):
    here = "parity_tests.test_compare_api"
    models = ["--torch", f"{here}:torch_tiny", "--flax", f"{here}:nnx_tiny", "--inputs", f"{here}:tiny_inputs"]
    code, out = _cli(capsys, *models, "--suggest-mapping")
    assert code == 0 and eval(out) == {r"blocks\.(\d+)\.proj": r"blocks.\1.dense"}, out  # noqa: S307 (pasted)
    code, out = _cli(capsys, *models, "--mapping", "auto")
    assert code == 0 and "8 paired modules (8 passed" in out and "every comparison passed" in out, out
    code, out = _cli(capsys, "--torch", f"{here}:torch_tiny", "--flax", f"{here}:nnx_tiny_wrong_epsilon", "--inputs",
                     f"{here}:tiny_inputs", "--mapping", "auto")
    assert code == 1 and out.splitlines()[-1].startswith("FAILED: first divergence at blocks.1.norm;"), out


def test_the_command_line_trains_both_models_step_by_step(capsys):
    here = "parity_tests.test_compare_api"
    common = ["--torch", f"{here}:torch_tiny", "--inputs", f"{here}:tiny_inputs", "--mapping", f"{here}:MAPPING"]
    code, out = _cli(capsys, *common, "--flax", f"{here}:nnx_tiny", "--train", "3")
    assert code == 0 and "every comparison passed" in out, out
    code, out = _cli(capsys, *common, "--flax", f"{here}:nnx_tiny_wrong_epsilon", "--train", "3")
    assert code == 1 and "FAILED" in out.splitlines()[-1], out
    code, out = _cli(capsys, "--torch", f"{here}:torch_tiny", "--inputs", f"{here}:tiny_inputs", "--mapping", "auto",
                     "--flax", f"{here}:nnx_tiny", "--gradients", "--step", "--train", "2")
    assert code == 0 and "every comparison passed" in out, out
    code, out = _cli(capsys, *common, "--flax", f"{here}:NnxTinyDetached", "--train", "2")
    assert code == 1 and "every comparison passed" not in out and "FAILED" in out.splitlines()[-1], out
    code, out = _cli(capsys, *common, "--flax", f"{here}:nnx_tiny", "--train", "0")
    assert code == 2 and "--train takes a number of steps of at least 1, got 0" in out, out
