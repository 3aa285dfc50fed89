"""``compare_training``: the Llama port of ``examples/llama.py`` and the BERT port of
``examples/bert_mlm.py`` trained step by step beside transformers' models (tiny random configs),
and four differences of training set-up named at the step and parameter where they first show.

The float64 runs use a transformers Llama computed in float64 throughout: as shipped, its RMSNorm
and its rotary angles are computed in float32 whatever the model's dtype, and its eager attention
takes the softmax in float32, which leaves its float64 gradients float32-accurate (1e-7) and Adam
turns that into a drift of 1e-4 in one step. ``float64_throughout`` replaces those forwards by
the same formulas in the model's dtype (and uses PyTorch's SDPA attention)."""

import copy
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from parity_tests.porting import compare_training, training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import bert_mlm  # noqa: E402
import llama  # noqa: E402

# two batches of two rows of 12 tokens, no padding (the "lm" loss counts every position)
BATCHES = [(llama.inputs(seed=seed)[0],) for seed in (0, 1)]
LR32 = 1e-2
TX32 = optax.adamw(LR32, weight_decay=1e-2)  # one object: its update compiles once


def adamw32(params):
    return torch.optim.AdamW(params, lr=LR32, weight_decay=1e-2)


def _rms_norm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rotary(self, x, position_ids):
    angles = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)


def float64_throughout(model):
    """A float64 copy of a transformers Llama whose RMSNorms, rotary angles and attention all
    compute in float64 (transformers computes the first two, and eager attention's softmax, in float32)."""
    model = copy.deepcopy(model).double()
    model.set_attn_implementation("sdpa")
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(_rms_norm, module)
    model.model.rotary_emb.forward = types.MethodType(_rotary, model.model.rotary_emb)
    return model


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    return llama.random_pair(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama64(llama32):
    """Both sides in float64; the port read from NumPy views of PyTorch's own tensors (shared memory)."""
    torch_model = float64_throughout(llama32[0])
    state = {name: tensor.detach().numpy() for name, tensor in torch_model.state_dict().items()}
    return torch_model, llama.LlamaForCausalLM(torch_model.config.to_dict(), state, param_dtype=jnp.float64)


def _snapshot(torch_model, port):
    from parity_tests.porting import jax_side

    return ({n: p.detach().clone() for n, p in torch_model.named_parameters()},
            {n: np.array(v) for n, v in jax_side.as_flax(port).parameters().items()})


def _unchanged(torch_model, port, before) -> bool:
    now = _snapshot(torch_model, port)
    return (all(torch.equal(p, now[0][n]) for n, p in before[0].items())
            and all(np.array_equal(v, now[1][n]) for n, v in before[1].items()))


def test_float64_runs_with_equal_setups_stay_within_1e_8_and_leave_both_models_as_they_were(llama64):
    torch_model, port = llama64
    before = _snapshot(torch_model, port)
    report = compare_training(torch_model, port, BATCHES, steps=20, mapping=llama.MAPPING)
    assert report.passed and report.first_divergence is None, report.table()
    assert len(report.names) == 21 and not report.unpaired_torch and not report.unpaired_jax
    assert np.max(report.drift) < 1e-8 and report.reference_loss is None
    assert report.torch_loss[-1] < 0.8 * report.torch_loss[0]  # it trains
    assert np.allclose(report.jax_loss, report.torch_loss, rtol=1e-12, atol=0)
    assert _unchanged(torch_model, port, before)
    assert report.table().splitlines()[0].endswith("within its allowance") and "FAILED" not in report.table()
    assert report.as_json()["passed"] and report.as_json()["first_divergence"] is None


@pytest.mark.slow
def test_float64_runs_stay_within_1e_8_over_200_steps(llama64):
    report = compare_training(*llama64, BATCHES, steps=200, mapping=llama.MAPPING)
    assert report.passed and np.max(report.drift) < 1e-8, report.table()


def test_a_correct_float32_port_passes_30_steps_at_a_learning_rate_of_1e_2(llama32, tmp_path):
    torch_model, port = llama32
    before = _snapshot(torch_model, port)
    report = compare_training(torch_model, port, BATCHES, steps=30, torch_optimizer=adamw32, optax_optimizer=TX32,
                              mapping=llama.MAPPING)
    assert report.passed, report.table()
    assert _unchanged(torch_model, port, before)
    # rounding grows with the steps: the allowance measured on the float64 run grows past its floor
    assert np.max(report.allowance[-1]) > 100 * training.FLOORS["float32"] and len(report.reference_loss) == 30
    assert report.torch_loss[-1] < 0.5 * report.torch_loss[0]
    written = report.plot(tmp_path / "curves.png")
    assert written is None or os.path.getsize(written) > 0


def _per_tensor_clip(max_norm: float) -> optax.GradientTransformation:
    """Each gradient scaled to a norm of at most ``max_norm`` on its own (PyTorch's ``clip_grad_norm_``
    scales them all by their global norm)."""
    def update(updates, state, params=None):
        return jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / (jnp.linalg.norm(g) + 1e-6)), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _setup(difference: str, lr: float, tx) -> dict:
    """The two sides' set-ups, equal but for ``difference``."""
    adamw = lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=1e-2)  # noqa: E731
    if difference == "weight decay on different parameters":  # PyTorch leaves vectors (norm scales) undecayed
        return dict(torch_optimizer=lambda params: torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim > 1]},
             {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}], lr=lr, weight_decay=1e-2),
            optax_optimizer=tx)
    if difference == "epsilon inside the square root":
        return dict(torch_optimizer=adamw, optax_optimizer=optax.adamw(lr, eps=0.0, eps_root=1e-8, weight_decay=1e-2))
    if difference == "clipping per tensor against global norm":
        return dict(torch_optimizer=adamw, torch_clip=0.5,
                    optax_optimizer=optax.chain(_per_tensor_clip(0.5), optax.adamw(lr, weight_decay=1e-2)))
    # a linear warm-up over 4 steps: PyTorch's first step at lr / 4, optax's at 0
    return dict(torch_optimizer=adamw, torch_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                    opt, lambda step: min(1.0, (step + 1) / 4)),
                optax_optimizer=optax.adamw(optax.linear_schedule(0.0, lr, 4), weight_decay=1e-2))


DIFFERENCES = ["weight decay on different parameters", "epsilon inside the square root",
               "clipping per tensor against global norm", "warm-up one step apart"]
# every difference shows at the first step: weight decay at the first vector PyTorch leaves
# undecayed, the others at the first parameter (each moves every parameter with a gradient)
FIRST = {"weight decay on different parameters": "model.layers.0.input_layernorm.weight"}


@pytest.mark.parametrize("difference", DIFFERENCES)
def test_a_setup_difference_in_float64_is_named_at_its_first_step_and_parameter(llama64, difference):
    torch_model, port = llama64
    report = compare_training(torch_model, port, BATCHES, steps=2, mapping=llama.MAPPING,
                              **_setup(difference, 1e-3, training._default_optax(1e-3, 1e-2)))
    divergence = report.first_divergence
    assert not report.passed and divergence is not None, report.table()
    assert (divergence.step, divergence.name) == (1, FIRST.get(difference, "model.embed_tokens.weight")), report.table()
    assert report.verdict().split(":")[1].strip() == "FAILED" and str(divergence) in report.verdict()
    if difference in FIRST:  # exactly the vectors, and nothing else, leave at step 1
        off = {n for n, d, a in zip(report.names, report.drift[0], report.allowance[0]) if d > a}
        assert off == {n for n, p in torch_model.named_parameters() if p.ndim == 1}, report.table()


@pytest.mark.parametrize("difference", DIFFERENCES)
def test_a_setup_difference_in_float32_is_named_within_three_steps(llama32, difference):
    report = compare_training(*llama32, BATCHES, steps=3, mapping=llama.MAPPING, **_setup(difference, LR32, TX32))
    assert report.first_divergence is not None and report.first_divergence.step <= 3, report.table()
    assert "FAILED" in report.table().splitlines()[0]
    if difference in FIRST:
        assert report.first_divergence.name.endswith("layernorm.weight"), report.table()


BERT = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, type_vocab_size=2)


def _bert(tie: bool):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(**BERT, tie_word_embeddings=tie, attn_implementation="eager")
    torch_model = transformers.BertForMaskedLM(config).eval()
    return torch_model, bert_mlm.port(torch_model)


def _torch_token_loss(outputs, ids, mask, types):
    """Cross-entropy of each real (unpadded) token against itself, averaged."""
    losses = torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), ids.flatten(), reduction="none")
    return (losses * mask.flatten()).sum() / mask.sum()


def _jax_token_loss(logits, ids, mask, types):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, ids)
    return (losses * mask).sum() / mask.sum()


def test_the_bert_port_trains_as_transformers_does_with_its_own_loss():
    torch_model, port = _bert(tie=False)
    batches = [bert_mlm.inputs(BERT["vocab_size"], seed=seed) for seed in (0, 1)]
    report = compare_training(torch_model, port, batches, steps=10, loss=(_torch_token_loss, _jax_token_loss),
                              mapping=bert_mlm.MAPPING)
    assert report.passed and not report.unpaired_torch and not report.unpaired_jax, report.table()
    # untied, transformers keeps cls.predictions.bias, which its forward never reads
    assert report.unused_torch == ["cls.predictions.bias"] and "not compared" in report.table()
    assert len(report.names) == 43 and report.torch_loss[-1] < report.torch_loss[0]


def test_a_port_that_unties_transformers_tied_decoder_is_named_at_the_embedding():
    """transformers' BERT ties its decoder to the word embeddings (one parameter, two gradients);
    the port holds two, both compared with that one parameter, and trains them apart from the first step."""
    torch_model, port = _bert(tie=True)
    batches = [bert_mlm.inputs(BERT["vocab_size"], seed=0)]
    # tied, the decoder's bias is cls.predictions.bias too: it pairs with the port's decoder bias
    mapping = {**bert_mlm.MAPPING, r"cls\.predictions": "cls.predictions.decoder"}
    report = compare_training(torch_model, port, batches, steps=2, loss=(_torch_token_loss, _jax_token_loss),
                              mapping=mapping)
    assert report.unpaired_jax == [], report.unpaired_jax
    tied = report.jax_names[report.names.index("bert.embeddings.word_embeddings.weight")]
    assert tied == "bert.embeddings.word_embeddings.embedding, cls.predictions.decoder.kernel", tied
    divergence = report.first_divergence
    assert (divergence.step, divergence.name) == (1, "bert.embeddings.word_embeddings.weight"), report.table()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="steps"):
        compare_training(None, None, BATCHES, steps=0)
    with pytest.raises(TypeError, match="loss"):
        compare_training(None, None, BATCHES, loss="mse")
    with pytest.raises(ValueError, match="torch_clip"):
        compare_training(None, None, BATCHES, torch_clip=-1.0)
    with pytest.raises(ValueError, match="batches"):
        compare_training(None, None, [])


def test_the_page_example_runs(monkeypatch, capsys):
    page = os.path.join(ROOT, "docs", "training-comparison.md")
    code = open(page).read().split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(ROOT)  # the block finds examples/ from the repository's root
    exec(compile(code, page, "exec"), {})
    assert capsys.readouterr().out.splitlines()[0].startswith("training, 10 steps, 21 parameters (float32): passed")


def _off_at_step(tx: optax.GradientTransformation, step: int, leaf: str) -> optax.GradientTransformation:
    """``tx``, but at ``step`` (1: the first) the update of the parameter whose path reads ``leaf`` is doubled."""
    def init(params):
        return tx.init(params), jnp.zeros([], jnp.int32)

    def update(updates, state, params=None):
        inner, count = state
        updates, inner = tx.update(updates, inner, params)
        factor = jnp.where(count == step - 1, 2.0, 1.0)
        updates = jax.tree_util.tree_map_with_path(
            lambda path, u: u * factor if jax.tree_util.keystr(path) == leaf else u, updates)
        return updates, (inner, count + 1)

    return optax.GradientTransformation(init, update)


def test_every_step_is_checked_the_last_included(llama64):
    """A divergence planted only at the last step, in the final norm (the last parameter in PyTorch's order but
    the tied ``lm_head.weight``), is named at that step and parameter."""
    torch_model, port = llama64
    tx = _off_at_step(training._default_optax(1e-3, 1e-2), 3, "['model']['norm']['scale'].value")
    report = compare_training(torch_model, port, BATCHES, steps=3, mapping=llama.MAPPING, optax_optimizer=tx)
    assert report.names[-2:] == ["model.norm.weight", "lm_head.weight"], report.names
    divergence = report.first_divergence
    assert (divergence.step, divergence.name) == (3, "model.norm.weight"), report.table()
    assert not report.passed and "first divergence at step 3, model.norm.weight" in report.failures()[0]
    assert all(d <= a for d, a in zip(report.drift[1], report.allowance[1])), report.table()  # step 2 was within
