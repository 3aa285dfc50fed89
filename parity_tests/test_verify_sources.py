"""``mha-parity verify --weights`` against the implementation the weights came from, and the
Python API for one's own attention: a wrong port (head count, swapped key and value, a
transposed weight, another scale) fails, naming the comparison; the right one passes."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

import mha_jax
import mha_torch
from parity_tests.tool import callables, cases, cli

E, H = 32, 4
FAST = ["--dtype", "float32", "--mask", "padding", "--workers", "1"]


class Handwritten(torch.nn.Module):
    """An attention written by hand in Hugging Face names (``q_proj`` ... ``o_proj``), called as
    ``layer(x, mask)``; ``transposed`` reads each weight as ``x @ W`` (GPT-2's Conv1D) and
    ``scale`` replaces ``1/sqrt(head_dim)``."""

    def __init__(self, heads: int = H, transposed: bool = False, scale: float | None = None):
        super().__init__()
        self.heads, self.transposed, self.scale = heads, transposed, scale
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, torch.nn.Linear(E, E))

    def project(self, layer, x):
        return x @ layer.weight + layer.bias if self.transposed else layer(x)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (self.project(p, x).view(b, s, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        scores = (q @ k.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.project(self.o_proj, out.transpose(1, 2).reshape(b, s, E))


def _random_(module, seed=0):
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape)) / np.sqrt(p.shape[-1])))
    return module


def four_heads():
    """``--source`` for the tests: the 4-head ``torch.nn.MultiheadAttention`` the weights came from."""
    return torch.nn.MultiheadAttention(E, H, batch_first=True)


def handwritten():
    return Handwritten()


def handwritten_transposed():
    return Handwritten(transposed=True)


def handwritten_unscaled():
    return Handwritten(scale=1.0)


def _verify(capsys, *args) -> tuple[int, str]:
    code = cli.main(["verify", *args])
    return code, capsys.readouterr().out


@pytest.fixture
def torch_mha_file(tmp_path):
    path = tmp_path / "mha.safetensors"
    save_file(_random_(four_heads()).state_dict(), path)
    return str(path)


def test_a_wrong_head_count_fails_against_the_source(torch_mha_file, capsys):
    """4-head weights read as 8 heads: the twins agree with each other and the oracle (both
    read 8 heads), the source (4 heads, from ``--source``) does not, and the report says which
    comparison failed and by how much."""
    source = ["--source", "parity_tests.test_verify_sources:four_heads"]
    code, out = _verify(capsys, "--weights", torch_mha_file, "--layout", "torch_mha", "--num-heads", "8", *source,
                        *FAST)
    assert code == 1
    assert "torch.nn.MultiheadAttention (4 heads)" in out
    failure = next(line for line in out.splitlines() if line.startswith("FAILED source/padding/float32"))
    assert "source vs" in failure and float(failure.split("off by ")[1].split()[0]) > 0.1
    assert "the twins and the oracle: 1 cases" in out and "1 passed, 0 failed" in out  # the twins alone pass
    code, out = _verify(capsys, "--weights", torch_mha_file, "--layout", "torch_mha", "--num-heads", "4", *source,
                        *FAST)
    assert code == 0 and "every comparison passed" in out


def test_without_a_source_spec_the_header_says_the_head_count_was_not_checked(torch_mha_file, capsys):
    code, out = _verify(capsys, "--weights", torch_mha_file, "--layout", "torch_mha", "--num-heads", "8", *FAST)
    assert code == 0
    assert "the head count was not checked" in out and "torch.nn.MultiheadAttention (8 heads)" in out


@pytest.mark.parametrize("factory, passes", [
    ("handwritten", True), ("handwritten_transposed", False), ("handwritten_unscaled", False),
])
def test_a_transposed_weight_or_another_scale_fails_against_the_source(tmp_path, capsys, factory, passes):
    """Hugging Face names read by ``--layout hf``: a source that reads its weights transposed,
    or scales by 1 instead of 1/sqrt(head_dim), is not what our modules compute."""
    path = tmp_path / "hf.safetensors"
    save_file(_random_(Handwritten(), seed=1).state_dict(), path)
    code, out = _verify(capsys, "--weights", str(path), "--layout", "hf", "--num-heads", str(H),
                        "--source", f"parity_tests.test_verify_sources:{factory}", *FAST)
    assert code == (0 if passes else 1), out
    assert ("FAILED source/padding/float32" in out) != passes


def test_swapped_key_and_value_fail_against_the_source(tmp_path, capsys):
    """``--mapping`` that reads ``k_proj`` as the value and ``v_proj`` as the key, in both packages:
    our two modules hold the same (swapped) bits and agree with the oracle on them; the source,
    ``LlamaAttention`` (the layout the keys show) built from the ``config.json`` beside the weights,
    does not. The right mapping passes."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = dict(hidden_size=E, num_attention_heads=H, num_key_value_heads=2, attention_bias=True)
    llama = _random_(LlamaAttention(LlamaConfig(**config, vocab_size=8, intermediate_size=8, num_hidden_layers=1),
                                    layer_idx=0), seed=2)
    save_file(llama.state_dict(), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    args = ["--weights", str(tmp_path / "model.safetensors"), "--num-heads", str(H), "--num-kv-heads", "2", *FAST]
    right, swapped = "q_proj=q_proj,k_proj=k_proj,v_proj=v_proj", "q_proj=q_proj,k_proj=v_proj,v_proj=k_proj"
    for names, passes in ((right, True), (swapped, False)):
        code, out = _verify(capsys, *args, "--mapping", names, "--mapping", "out_proj=o_proj")
        assert code == (0 if passes else 1), out
        assert "LlamaAttention (4 heads, from" in out and "layout hf, detected from the keys, read by --mapping" in out
        assert "loaded into both frameworks, bit for bit" in out
        assert ("FAILED source/padding/float32" in out) != passes
        assert "FAILED weights/" not in out  # the twins and the oracle alone would not have seen it


def test_mapping_of_names_no_layout_shows(tmp_path, capsys):
    """A file in names of its own (``wq`` ... ``wo``) read with ``--mapping``: no source is known, the twins and
    the oracle are compared; a malformed pair or ``--layout`` beside it is refused by name."""
    state = {new: tensor for (old, tensor) in _random_(Handwritten()).state_dict().items()
             for new in [old.replace("q_proj", "wq").replace("k_proj", "wk").replace("v_proj", "wv")
                         .replace("o_proj", "wo")]}
    save_file(state, tmp_path / "own.safetensors")
    args = ["--weights", str(tmp_path / "own.safetensors"), "--num-heads", str(H), *FAST]
    code, out = _verify(capsys, *args, "--mapping", "q_proj=wq,k_proj=wk,v_proj=wv,out_proj=wo")
    assert code == 0, out
    assert "layout mapped, read by --mapping" in out and "show no layout whose source is known" in out
    for wrong, message in ((["--mapping", "q_proj:wq"], "--mapping takes OURS=THEIRS"),
                           (["--mapping", "q_proj=wq,k_proj=wk,v_proj=wv,out_proj=wo", "--layout", "hf"],
                            "give --layout or --mapping, not both"),
                           (["--mapping", "q_proj=wq,k_proj=wk,out_proj=wo"], "--mapping: v_proj is not named")):
        code = cli.main(["verify", *args, *wrong])
        assert code == 2 and message in capsys.readouterr().err


def test_bert_source_and_a_markdown_report(tmp_path, capsys):
    """BERT's attention out of a whole (tiny) model, heads from its ``config.json`` given with
    ``--source``; ``--report`` writes the tables and a plot per dtype."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=8, hidden_size=E, num_attention_heads=H, intermediate_size=8, num_hidden_layers=1,
                        max_position_embeddings=8)
    save_file(_random_(BertModel(config), seed=3).state_dict(), tmp_path / "bert.safetensors")
    config.save_pretrained(tmp_path / "config")
    report = tmp_path / "report.md"
    code, out = _verify(capsys, "--weights", str(tmp_path / "bert.safetensors"), "--layout", "bert",
                        "--num-heads", str(H),
                        "--prefix", "encoder.layer.0.attention.", "--ignore", "output.LayerNorm",
                        "--source", str(tmp_path / "config" / "config.json"), "--report", str(report),
                        "--dtype", "float64", "--dtype", "float32", "--mask", "padding", "--mask", "bool",
                        "--workers", "1")
    assert code == 0, out
    assert "BertAttention (4 heads" in out
    text = report.read_text()
    assert "## against the source: 4 passed, 0 failed" in text and "| source/bool | float64 |" in text
    assert (tmp_path / "report-float32.png").stat().st_size > 1000 and "![float64](report-float64.png)" in text


def test_without_transformers_only_the_twins_are_compared(tmp_path, capsys, monkeypatch):
    path = tmp_path / "hf.safetensors"
    save_file(_random_(Handwritten()).state_dict(), path)
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    code, out = _verify(capsys, "--weights", str(path), "--layout", "hf", "--num-heads", str(H), *FAST)
    assert code == 0
    assert "transformers is not installed" in out and "only our two implementations and the oracle were compared" in out
    assert "against the source" not in out


def test_progress_is_a_line_per_case_when_not_a_terminal(capsys):
    code, out = _verify(capsys, "--dtype", "float32", "--mask", "none", "--mask", "causal", "--workers", "1")
    lines = [line for line in out.splitlines() if line.startswith("[")]
    n = len(cases.covering_grid(["none", "causal"], ["float32"]))
    assert n >= 4  # every configuration without a mask, and causal on some
    assert (code == 0 and len(lines) == n and lines[0].startswith(f"[1/{n}] ")
            and all(line.endswith(" ok") for line in lines))
    assert out.startswith("mha-parity verify: mha_jax against mha_torch")


def test_cli_messages_use_cli_words():
    message = "unexpected key 'x.y' (select one layer with prefix=, leave other keys out with ignore=); num_heads=4"
    assert cli.cli_words(message) == ("unexpected key 'x.y' (select one layer with --prefix, "
                                      "leave other keys out with --ignore); --num-heads 4")


# --- the Python API -------------------------------------------------------------------------------


def _ours(num_heads=H, swap=False, transpose=False, torch_dtype=torch.float32):
    """A 4-head mha_torch module and the mha_jax one it converts to (``num_heads``, ``swap``
    and ``transpose``, the query weight read as ``x @ W``, make the JAX side a wrong port of it)."""
    torch.manual_seed(0)
    module = mha_torch.MultiHeadAttention(E, H, dtype=torch_dtype).eval()
    state = mha_jax.to_torch(mha_jax.from_torch(module.state_dict(), num_heads=H))
    if swap:
        state["k_proj.weight"], state["v_proj.weight"] = state["v_proj.weight"], state["k_proj.weight"]
    if transpose:  # square (E x E): the shapes cannot tell
        state["q_proj.weight"] = np.ascontiguousarray(state["q_proj.weight"].T)
    model = mha_jax.MultiHeadAttention(num_heads, E, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, state)
    return module, model, state


@pytest.mark.parametrize("wrong", [None, "heads", "swap", "transpose", "scale"])
def test_python_api_catches_a_wrong_port(wrong, capsys):
    """Our PyTorch module against a JAX module converted from it: with 8 heads instead of 4,
    with key and value swapped, with the query weight transposed, or against a PyTorch side
    that scales by 1, the API fails and names the pair; converted right, it passes every mask form."""
    module, model, state = _ours(num_heads=8 if wrong == "heads" else H, swap=wrong == "swap",
                                 transpose=wrong == "transpose")
    unscaled = _as_handwritten(module, scale=1.0)

    def theirs(q, kv, mask):
        return unscaled(q, mask) if wrong == "scale" else module(q, kv, mask=mask)

    results = callables.verify(theirs, lambda q, kv, mask: model(q, kv, mask=mask), callables.Inputs(H, E), seed=1)
    out = capsys.readouterr().out
    assert out.startswith("your PyTorch attention against your JAX attention")
    assert [r.case.mask for r in results] == list(callables.MASKS)
    assert all(r.passed for r in results) == (wrong is None), out
    if wrong:
        assert "FAILED yours/" in out and "torch vs jax" in out


def test_python_api_with_weights_adds_the_oracle(tmp_path):
    module, model, state = _ours()
    report = tmp_path / "api.md"
    results = callables.verify(lambda q, kv, mask: module(q, kv, mask=mask),
                               lambda q, kv, mask: model(q, kv, mask=mask),
                               callables.Inputs(H, E), weights=state, report=str(report), echo=False)
    assert all(r.passed for r in results)
    assert set(results[0].details) == {"torch vs oracle", "jax vs oracle", "torch vs jax"}
    assert "| yours/padding+causal | float32 |" in report.read_text()


def _as_handwritten(module, scale):
    layer = Handwritten(scale=scale)
    with torch.no_grad():
        for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
            getattr(layer, theirs).weight.copy_(getattr(module, ours).weight)
            getattr(layer, theirs).bias.copy_(getattr(module, ours).bias)
    return layer


def test_markdown_report_without_matplotlib_says_so(tmp_path, monkeypatch):
    from parity_tests.tool import harness, report

    case = harness.Case(harness.CONFIGS["self"], "padding", "float32")
    result = harness.Result(case, {"jax vs torch": {"out": {"rel": 2e-6, "max_abs": 1e-7, "abs": 3e-7}}})
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    path = tmp_path / "r.md"
    written = report.write_markdown(str(path), report.Header("a title", ["a", "b"], "some shapes", 3), [result])
    text = path.read_text()
    assert written == [str(path)] and "(no plots: matplotlib cannot be imported here)" in text
    assert "| self/padding | float32 | 3.00e-07 | 2.00e-06 | 0.00e+00 | 2.00e-06 | jax vs torch: out | NO |" in text
    assert "- seed: 3" in text and "a title" in text


def test_a_source_that_does_not_fit_is_named(torch_mha_file, tmp_path, capsys):
    """A config.json for a layout it cannot describe, and a model whose shapes the weights do not
    fit, are errors (exit 2) that say so."""
    (tmp_path / "config.json").write_text("{}")
    args = ["--weights", torch_mha_file, "--layout", "torch_mha", "--num-heads", "4", *FAST]
    assert cli.main(["verify", *args, "--source", str(tmp_path / "config.json")]) == 2
    assert "a config.json describes --layout hf or bert, not torch_mha" in capsys.readouterr().err
    (tmp_path / "small.py").write_text("import torch\ndef build():\n"
                                       "    return torch.nn.MultiheadAttention(16, 4, batch_first=True)\n")
    assert cli.main(["verify", *args, "--source", f"{tmp_path / 'small.py'}:build"]) == 2
    assert "the weights do not fit --source" in capsys.readouterr().err


def test_fused_qkv_source(tmp_path, capsys):
    """The tutorials' fused layer (grouped, Phi-3's rows [q; k; v]) is the source of ``fused_qkv``."""
    from parity_tests.tool.sources import fused_qkv_attention

    save_file(_random_(fused_qkv_attention(E, H, 2), seed=4).state_dict(), tmp_path / "fused.safetensors")
    code, out = _verify(capsys, "--weights", str(tmp_path / "fused.safetensors"), "--layout", "fused_qkv",
                        "--num-heads", str(H), "--num-kv-heads", "2", *FAST)
    assert code == 0, out
    assert "fused-QKV tutorial layer (4 heads, 2 key/value heads)" in out and "the head count was not checked" in out


def test_a_source_class_that_cannot_hold_the_shapes_is_not_built(tmp_path, capsys):
    """Cross-attention weights in Hugging Face names: LlamaAttention has no key input of its own
    size, so only the twins and the oracle are compared, and the header says so."""
    module = mha_torch.MultiHeadAttention(12, 4, num_kv_heads=2, kdim=10, vdim=10)
    save_file({k.replace("out_proj", "o_proj"): v for k, v in module.state_dict().items()},
              tmp_path / "cross.safetensors")
    code, out = _verify(capsys, "--weights", str(tmp_path / "cross.safetensors"), "--layout", "hf", "--num-heads", "4",
                        "--num-kv-heads", "2", *FAST)
    assert code == 0, out
    assert "do not fit the hf source's class: it was not built" in out and "against the source" not in out
