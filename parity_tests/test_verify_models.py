"""``mha-parity verify --config config.json --weights FILE``: every attention layer of a model
saved by transformers (``save_pretrained``: its config.json and safetensors, sharded or not)
against the layer of transformers' own model, one row per layer, and a port that reads one
setting of the config wrongly fails, naming the layer and the comparison; the same for a real
pre-trained model's checkpoint that a package ships."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os

import pytest
import torch
import transformers

from parity_tests.tool import cli, models

SMALL = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=3, intermediate_size=16, vocab_size=50)
MODELS = {
    # alternating sliding and full layers, soft-cap, query_pre_attn_scalar; written in 4 shards
    "gemma2": (transformers.Gemma2Config, dict(num_key_value_heads=2, head_dim=8, sliding_window=4,
                                               attn_logit_softcapping=5.0, query_pre_attn_scalar=12), "20KB"),
    # transposed Conv1D weights, learned positions, no rotary
    "gpt2": (transformers.GPT2Config, dict(n_positions=32), None),
    # pairs (2i, 2i + 1) rotating in the first rotary_dim features, its layers under transformer.h
    "gptj": (transformers.GPTJConfig, dict(n_positions=32, rotary_dim=4), None),
    # a quarter of each head rotating (its default), q/k/v biases, a LayerNorm per head
    "stablelm": (transformers.StableLmConfig, dict(num_key_value_heads=2, use_qkv_bias=True, qk_layernorm=True), None),
    # pairs rotating, a LayerNorm (heads, head_dim) on queries and keys
    "cohere": (transformers.CohereConfig, dict(num_key_value_heads=2, use_qk_norm=True), None),
}


def _saved(tmp_path_factory, name):
    config_cls, extra, shard = MODELS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**SMALL, **extra))
    with torch.no_grad():  # trained-like logits of a few units (init's 0.02 gives ~0.01: every cap and scale alike)
        for n, p in model.named_parameters():
            if "attn" in n and p.dim() == 2:
                p.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    weights = path / ("model.safetensors.index.json" if shard else "model.safetensors")
    return str(path / "config.json"), str(weights)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {name: _saved(tmp_path_factory, name) for name in MODELS}


def _verify(capsys, *args) -> tuple[int, str]:
    code = cli.main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("name", list(MODELS))
def test_every_layer_of_a_saved_model_against_transformers(saved, name, capsys, tmp_path):
    config, weights = saved[name]
    code, out = _verify(capsys, "--config", config, "--weights", weights, "--json", str(tmp_path / "r.json"))
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.startswith("layer ")]
    assert [row.split(" (")[0] for row in rows] == ["layer 0", "layer 1", "layer 2"], out
    assert all("passed" in row for row in rows)
    if name == "gemma2":  # the config's alternation, as the model applies it
        assert [row.split(")")[0].split("(")[1] for row in rows] == ["window 4", "full", "window 4"]
        assert "model-00001-of-00004.safetensors" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and len(report["layers"]) == 3
    for layer in report["layers"]:
        for key, value in layer["errors"].items():
            assert value < (1e-12 if key.startswith("JAX vs PyTorch") else 1e-4), (key, value)


def _misread(config: str, weights: str, **changes) -> models.Model:
    """The saved model as ``verify`` loads it, its config as a port that misreads ``changes`` reads it (transformers'
    model, the source, built from the config as saved)."""
    source = models.load(config, weights)
    return dataclasses.replace(source, raw=dict(source.raw, **changes))


def _failed_in_both_twins(source: models.Model, layer: int) -> str:
    """``verify``'s line for ``layer`` of ``source``, failed: both twins off the source, the twins agreeing."""
    _, (result,) = models.verify(source.config_path, None, layers=[layer], source=source)
    assert not result.passed, result.errors
    assert result.errors["JAX vs source: gradients"] > models.SOURCE_TOLERANCE
    assert result.errors["PyTorch vs source: gradients"] > models.SOURCE_TOLERANCE
    assert result.errors["JAX vs PyTorch, float64: gradients"] < 1e-12  # the twins agree: the port is wrong in both
    lines = cli.summary([result], 1.0)
    assert lines[-1] == "1 layer in 1.0 s: 1 FAILED", lines
    return lines[0]


@pytest.mark.parametrize("setting, changes", [
    ("rotary base", dict(rope_parameters=dict(rope_type="default", rope_theta=9000.0))),
    ("scale", dict(query_pre_attn_scalar=8)),  # 1/sqrt(8) instead of 1/sqrt(12)
    ("window", dict(sliding_window=5)),  # a key more than the model's sliding window
    ("soft-cap", dict(attn_logit_softcapping=50.0)),
])
def test_a_port_that_misreads_one_setting_fails(saved, setting, changes):
    config, weights = saved["gemma2"]
    failed = _failed_in_both_twins(_misread(config, weights, **changes), 0)
    assert failed.startswith("FAILED: layer 0: ") and "PyTorch vs source" in failed and "JAX vs source" in failed


def test_python_api_one_row_per_layer(saved):
    config, weights = saved["gpt2"]
    source, results = models.verify(config, weights, layers=[2, 0])
    assert [r.layer for r in results] == [2, 0] and all(r.passed for r in results)
    assert type(source.model).__name__ == "GPT2LMHeadModel"


def test_bad_arguments_are_named(saved, capsys):
    config, weights = saved["gpt2"]
    code, out = _verify(capsys, "--config", config, "--weights", weights, "--layer", "3")
    assert code == 2 and "--layer 3: the model has layers 0 to 2" in out
    with pytest.raises(SystemExit):
        cli.main(["verify", "--config", config])
    assert "--config needs --weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["verify", "--config", config, "--weights", weights, "--layout", "hf"])
    assert "--layout cannot go with it" in capsys.readouterr().err


def test_without_transformers_it_says_what_to_install(saved, capsys, monkeypatch):
    config, weights = saved["gpt2"]
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    code, out = _verify(capsys, "--config", config, "--weights", weights)
    assert code == 2 and 'transformers, which is not installed (pip install "transformers>=5")' in out


def _shipped_bert() -> tuple[str, str]:
    """A real model's checkpoint that a package ships: rxnfp's pre-trained BERT (12 layers, 4 heads,
    hidden 256, a ``pytorch_model.bin`` and a config from before transformers' ``model_type``),
    inside its wheel. README's test command installs it (``--no-deps``: only its files are read)."""
    try:
        dist = importlib.metadata.distribution("rxnfp")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            raise
        pytest.skip("rxnfp, which ships a pre-trained BERT, is not installed: pip install --no-deps rxnfp==0.1.0")
    folder = dist.locate_file("rxnfp/models/transformers/bert_pretrained")
    return str(folder / "config.json"), str(folder / "pytorch_model.bin")


def test_every_layer_of_a_shipped_pretrained_bert_against_transformers(capsys, tmp_path):
    config, weights = _shipped_bert()
    code, out = _verify(capsys, "--config", config, "--weights", weights, "--json", str(tmp_path / "r.json"))
    assert code == 0, out
    assert "transformers' BertForMaskedLM" in out and "bidirectional" in out, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and [r["layer"] for r in report["layers"]] == list(range(12))
    for layer in report["layers"]:
        for key, value in layer["errors"].items():
            assert value < (1e-12 if key.startswith("JAX vs PyTorch") else 1e-4), (layer["layer"], key, value)


@pytest.mark.parametrize("setting, changes", [
    ("head count", dict(num_attention_heads=8)),  # the same weights, cut in 8 heads
    ("causality", dict(is_decoder=True)),  # an encoder read as a decoder
])
def test_a_wrong_port_of_the_shipped_bert_fails(setting, changes):
    config, weights = _shipped_bert()
    failed = _failed_in_both_twins(_misread(config, weights, **changes), 5)
    assert failed.startswith("FAILED: layer 5: "), (setting, failed)


def test_a_hybrid_model_is_verified_on_its_attention_layers(tmp_path, capsys):
    """LFM2 (convolution layers 0 and 2, attention at layer 1): with no ``--layer`` the rows are its attention
    layers alone, passed; a convolution layer asked for by ``--layer`` is refused naming its kind."""
    torch.manual_seed(0)
    config = transformers.Lfm2Config(**SMALL, num_key_value_heads=2, full_attn_idxs=[1])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    args = ("--config", str(tmp_path / "config.json"), "--weights", str(tmp_path / "model.safetensors"))
    code, out = _verify(capsys, *args)
    assert code == 0, out
    assert [line.split(" (")[0] for line in out.splitlines() if line.startswith("layer ")] == ["layer 1"], out
    code, out = _verify(capsys, *args, "--layer", "0")
    assert code != 0 and "'conv' layer, not softmax attention" in out, out
