"""A small Llama (transformers' ``LlamaForCausalLM``, weights from ``save_pretrained``) against its
Flax port (``examples/llama.py``): every module and the logits, gradients, one AdamW step, 16
greedy tokens against ``generate``; and defects planted in the port found at their module."""

import copy
import dataclasses
import os
import sys

import numpy as np
import pytest
import torch

from parity_tests import compare
from parity_tests.porting import compare_decoding, compare_gradients, compare_step, record

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import llama  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    llama.save_random(folder)
    return llama.transformers_model(folder), llama.from_pretrained(folder)


@pytest.fixture(scope="module")
def batch():
    """Two rows of 12 tokens, the second left-padded by 3 (its tokens at positions 0 to 8)."""
    return llama.inputs()


@pytest.fixture(scope="module")
def reference(models, batch):
    return record(models[0], *batch)


def test_every_module_and_the_logits_agree(models, batch):
    torch_model, port = models
    report = compare(torch_model, port, *batch, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.passed and report.first_divergence is None, report.table()
    attention = [m for m in report.modules if m.attention]
    assert [m.name for m in attention] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(m.tolerance == 1e-6 for m in attention)
    assert all(not m.attention and m.tolerance == 1e-5 for m in report.modules if "proj" in m.name)
    assert len(report.modules) == 28 and report.unpaired_jax == [], report.table()
    assert report.logits.top1 == 1.0 and report.logits.kl_max < 1e-10, report.logits


def test_gradients_and_one_adamw_step_agree(models, batch):
    torch_model, port = models
    before = {n: p.detach().clone() for n, p in torch_model.named_parameters()}
    # Adam's first step moves each parameter by about the learning rate times the sign of its
    # gradient, so an entry whose gradient is rounding-sized (2e-7 against a median 2e-2) moves by
    # lr * g / (|g| + eps) with g's relative rounding: the step's tolerance (1e-4), not the gradients'
    for check, worst in ((compare_gradients, 1e-5), (compare_step, 1e-4)):
        report = check(torch_model, port, *batch, mapping=llama.MAPPING, valid=batch[1].astype(bool))
        assert report.passed and len(report.parameters) == 21 and not report.unpaired_jax, report.table()
        assert report.worst.error < worst, report.table()
    assert all((p == before[n]).all() and p.grad is None for n, p in torch_model.named_parameters())


def test_sixteen_greedy_tokens_as_generate_alone_and_in_padded_batches(models):
    torch_model, port = models
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, llama.CONFIG["vocab_size"], n) for n in (5, 9, 3)]
    report = compare_decoding(torch_model, port, prompts, steps=16)
    assert report.passed, report.table()
    assert {r.what for r in report.results} == {"JAX, the row alone", "JAX, left-padded batch",
                                                "JAX, right-padded batch", "PyTorch, left-padded batch"}
    assert all(len(r.tokens) == 16 for r in report.results)
    assert report.table().splitlines()[-1] == "decoding: verdict: PASSED"
    left = compare_decoding(torch_model, port, prompts, steps=16, paddings=("left",))
    assert left.passed and "JAX, right-padded batch" not in {r.what for r in left.results}, left.table()
    with pytest.raises(ValueError, match="paddings must name 'left' and/or 'right'"):
        compare_decoding(torch_model, port, prompts, paddings=("middle",))


def test_a_defect_of_the_cached_step_is_named_at_its_step_and_module(models, monkeypatch):
    """An attention whose output is 1% larger when it decodes one token from its cache: the
    prompt's logits agree, step 1 differs, and the first module differing in it is that attention."""
    torch_model, port = models
    attention = port.model.layers[1].self_attn

    class Off(type(attention)):
        def __call__(self, x, *args, **kwargs):
            out = super().__call__(x, *args, **kwargs)
            return out * 1.01 if x.shape[1] == 1 else out

    monkeypatch.setattr(attention, "__class__", Off)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, llama.CONFIG["vocab_size"], n) for n in (5, 9, 3)]
    report = compare_decoding(torch_model, port, prompts[:1], steps=16, paddings=(), mapping=llama.MAPPING)
    (alone, _) = report.results
    assert not alone.passed and alone.tokens == alone.expected and alone.first_step == 1, report.table()
    assert alone.module == "model.layers.1.self_attn", report.table()
    forced = report.forced[0]
    assert report.table().splitlines()[-1] == (
        "decoding: verdict: FAILED: JAX, the row alone row 0: differs from step 1 (logits "
        f"{alone.step_errors[1]:.2e} > {alone.limits.bound(1):.2e}); first module differing in that step: "
        f"model.layers.1.self_attn; teacher-forced row 0: out of bounds from step 1 (logits {forced.errors[1]:.2e}, "
        f"bound {forced.limits.bound(1):.2e}, KL {forced.kl[1]:.2e}, top-1 agrees); first module differing in "
        "that step: model.layers.1.self_attn")
    assert forced.limits.bound(1) < 1e-5 and forced.limits.references[1] is not None  # measured, not the 1e-4


def _planted(monkeypatch, port, defect):
    layers = port.model.layers
    if defect == "rotary halves interleaved":
        attention = layers[1].self_attn
        monkeypatch.setattr(attention, "rotary", dataclasses.replace(attention.rotary, interleaved=True))
        return "model.layers.1.self_attn"
    if defect == "residual twice":
        class Doubled(llama.DecoderLayer):
            def __call__(self, hidden_states, **kwargs):
                return super().__call__(hidden_states, **kwargs) + hidden_states

        monkeypatch.setattr(layers[0], "__class__", Doubled)
        return "model.layers.0"
    monkeypatch.setattr(layers[1].self_attn, "scale", 1 / layers[1].self_attn.head_dim)
    return "model.layers.1.self_attn"


@pytest.mark.parametrize("defect", ["rotary halves interleaved", "residual twice", "attention scale"])
def test_a_planted_defect_is_found_where_it_is(models, reference, batch, monkeypatch, defect):
    port = models[1]
    where = _planted(monkeypatch, port, defect)
    report = compare(reference, port, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.first_divergence == where, report.table()
    names = [m.name for m in report.modules]
    assert all(m.passed for m in report.modules[: names.index(where)]) and not report.passed


NO_TORCH = """
import json, sys
sys.modules["torch"] = None  # importing torch fails from here on, as where it is not installed
sys.path.insert(0, {examples!r})
import llama
from parity_tests import compare
from parity_tests.porting import load_reference
reference = load_reference({reference!r})
report = compare(reference, llama.from_pretrained({folder!r}), mapping=llama.MAPPING,
                 valid=reference.inputs[1].astype(bool))
assert sys.modules["torch"] is None and "transformers" not in sys.modules
print(json.dumps(report.as_json()))
"""


def test_a_saved_reference_is_compared_where_torch_cannot_be_imported(models, batch, tmp_path):
    import json
    import subprocess

    from parity_tests.porting import load_reference, save_reference

    torch_model, port = models
    folder = tmp_path / "model"
    torch_model.save_pretrained(folder)
    saved = save_reference(tmp_path / "reference", torch_model, *batch)
    assert sorted(os.listdir(tmp_path / "reference")) == ["arrays.safetensors", "reference.json"]
    loaded = load_reference(tmp_path / "reference")
    assert [c.key for c in loaded.calls] == [c.key for c in saved.calls] and loaded.dtype == "float32"
    assert all(np.array_equal(a, b) for a, b in zip(loaded.inputs, batch)) and loaded.inputs[0].dtype == np.int64
    script = NO_TORCH.format(examples=os.path.dirname(llama.__file__), reference=str(tmp_path / "reference"),
                             folder=str(folder))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert run.returncode == 0, run.stderr[-3000:]
    away = json.loads(run.stdout.strip().splitlines()[-1])
    here = compare(torch_model, port, *batch, mapping=llama.MAPPING, valid=batch[1].astype(bool)).as_json()
    assert away["passed"] and away["settings"]["saved_reference"] and "torch_allow_tf32_matmul" in away["settings"]
    assert [(m["name"], m["added"], m["inherited"]) for m in away["modules"]] == [
        (m["name"], m["added"], m["inherited"]) for m in here["modules"]]
    assert away["logits"] == here["logits"]


def test_a_reference_or_a_model_in_another_dtype_is_an_error(models, reference):
    torch_model, port = models
    with pytest.raises(ValueError, match="the saved reference is float32, not the bfloat16 asked for"):
        compare(reference, port, dtype="bfloat16")
    with pytest.raises(ValueError, match="the PyTorch side holds float32 parameters, not the float64 asked for"):
        compare(torch_model, port, *reference.inputs, dtype="float64")
    half = copy.deepcopy(torch_model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="the JAX side holds float32 parameters, not the bfloat16 asked for"):
        compare(half, port, *reference.inputs)


def test_the_precision_is_set_recorded_and_put_back(models, reference):
    import jax

    torch_model, port = models
    old = torch.backends.cuda.matmul.allow_tf32, jax.config.jax_default_matmul_precision
    torch.backends.cuda.matmul.allow_tf32 = True
    jax.config.update("jax_default_matmul_precision", "bfloat16")
    try:
        report = compare(torch_model, port, *reference.inputs, mapping=llama.MAPPING)
        assert torch.backends.cuda.matmul.allow_tf32 and jax.config.jax_default_matmul_precision == "bfloat16"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old[0]
        jax.config.update("jax_default_matmul_precision", old[1])
    s = report.settings
    assert s["jax_default_matmul_precision"] == "highest" and s["torch_allow_tf32_matmul"] is False
    assert s["torch_allow_tf32_cudnn"] is False and s["torch_dtype"] == s["jax_dtype"] == "float32"


def test_a_sliding_window_is_compared_and_a_port_without_it_found(tmp_path, batch, monkeypatch):
    """A Mistral (the same port, its config's window of 4 read by ``mha_jax.from_hf``) on rows of 12
    tokens, longer than the window; the port with the window dropped diverges at the attention."""
    llama.save_random_mistral(tmp_path)
    torch_model, port = llama.transformers_model(tmp_path), llama.from_pretrained(tmp_path)
    assert type(torch_model).__name__ == "MistralForCausalLM"
    report = compare(torch_model, port, *batch, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.passed, report.table()
    monkeypatch.setattr(port.model.layers[1].self_attn, "local_window_size", None)
    report = compare(torch_model, port, *batch, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.first_divergence == "model.layers.1.self_attn", report.table()


@pytest.fixture(scope="module")
def large_logits(tmp_path_factory, batch):
    """The Llama with every query and key projection 50 times larger: attention logits of a trained
    model's size, whose float32 softmax rounds to 1.6e-6 and more, beyond the fixed 1e-6."""
    import transformers

    folder = tmp_path_factory.mktemp("large")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama.CONFIG, attn_implementation="eager"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(50.0)
            layer.self_attn.k_proj.weight.mul_(50.0)
    model.save_pretrained(folder)
    return record(llama.transformers_model(folder), *batch), folder


def test_large_logits_pass_within_pytorchs_own_rounding_and_a_planted_epsilon_is_named(large_logits, monkeypatch):
    reference, folder = large_logits
    port = llama.from_pretrained(folder)
    valid = reference.inputs[1].astype(bool)
    report = compare(reference, port, mapping=llama.MAPPING, valid=valid)
    attention = [m for m in report.modules if m.attention]
    assert report.passed and max(m.added for m in attention) > 1e-6, report.table()  # beyond the fixed tolerance
    assert all(m.reference > 1e-6 and m.added <= m.bound == 16 * m.reference for m in attention), report.table()
    monkeypatch.setattr(port.model.layers[1].post_attention_layernorm, "epsilon", 2e-5)
    report = compare(reference, port, mapping=llama.MAPPING, valid=valid)
    assert report.first_divergence == "model.layers.1.post_attention_layernorm", report.table()


def test_a_late_defect_is_named_at_its_step_and_module_teacher_forced(models, monkeypatch):
    """An attention whose output is 1% larger once it decodes at position 10 or beyond: fed
    PyTorch's tokens, the port's logits leave their bound at step 6 (prompt of 5: step s decodes
    position 4 + s), KL and top-k agreement per step say how far, and the module is that attention."""
    import jax.numpy as jnp

    torch_model, port = models
    attention = port.model.layers[1].self_attn

    class Late(type(attention)):
        def __call__(self, x, *args, **kwargs):
            out = super().__call__(x, *args, **kwargs)
            positions = kwargs.get("query_positions")
            if x.shape[1] != 1 or positions is None:
                return out
            return jnp.where((positions >= 10)[..., None], out * 1.01, out)

    monkeypatch.setattr(attention, "__class__", Late)
    prompt = np.random.default_rng(1).integers(3, llama.CONFIG["vocab_size"], 5)
    report = compare_decoding(torch_model, port, [prompt], steps=12, paddings=(), mapping=llama.MAPPING)
    (forced,) = report.forced
    assert forced.first_step == 6 and forced.module == "model.layers.1.self_attn", report.table()
    assert max(forced.kl[:6]) < 1e-9 < forced.kl[6] and len(forced.kl) == 12, forced.kl
    assert all(e < 1e-5 for e in forced.errors[:6]), forced.errors
    assert not report.passed and "teacher-forced row 0: out of bounds from step 6" in report.table().splitlines()[-1]
