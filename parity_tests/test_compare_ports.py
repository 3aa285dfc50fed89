"""``compare`` on ports written in shapes ours are not. ``parity_tests/foreign_apertus.py`` keeps
``(batch, length, heads, head_dim)`` through its per-head norms where transformers' Apertus keeps
``(batch, heads, length, head_dim)``. Every row of the correct port passes or says why it is not
compared (the norms read in their layout, which the row names); a norm over the wrong axis is named
at that norm; ``suggest_mapping`` pairs the norms across the layouts; training agrees.
``parity_tests/foreign_gpt2.py`` keeps GPT-2's fused projection and writes its cache on every call:
every row passes, each defect is named at its module, training agrees."""

import numpy as np
import pytest
import torch

from parity_tests import foreign_apertus as fa
from parity_tests import foreign_gpt2 as fg
from parity_tests import foreign_port as fp
from parity_tests.porting import compare, compare_decoding, compare_training, suggest_mapping
from parity_tests.tool import verdict

NORMS = [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_norm", "k_norm")]


torch_model, batch, reference = fp.fixtures(fa)


def test_the_port_gives_transformers_logits_and_each_defect_changes_them(torch_model, batch):
    ids, mask = batch
    valid = mask.astype(bool)
    with torch.no_grad():
        theirs = torch_model(torch.from_numpy(ids), torch.from_numpy(mask)).logits.numpy()[valid]
    error = lambda port: np.abs(np.asarray(port(ids, mask))[valid] - theirs).max() / np.abs(theirs).max()  # noqa: E731
    assert error(fa.build(torch_model)) < 1e-5
    for defect in fa.DEFECTS:
        assert error(fa.build(torch_model, defect)) > 1e-3, defect


def test_every_row_of_the_correct_port_passes_or_says_why_not(torch_model, reference, batch):
    report = compare(reference, fa.build(torch_model), mapping=fa.MAPPING, valid=batch[1].astype(bool))
    assert report.passed, report.table()
    for m in report.modules:
        assert m.passed or (m.outcome == verdict.NOT_COMPARED and m.note), report.table()
    for name in NORMS:  # transformers' (2, heads, 12, 8) against the port's (2, 12, heads, 8)
        row = report.module(name)
        assert row.passed and row.layout == "axes (0, 2, 1, 3)" and row.inherited < 1e-6, report.table()
        assert "[axes (0, 2, 1, 3)]" in report.table()
    attention = report.module("model.layers.1.self_attn")
    assert attention.passed and attention.added < 1e-6, report.table()


@pytest.mark.parametrize("defect", fa.DEFECTS)
def test_a_planted_defect_is_named_at_its_module(torch_model, reference, batch, defect):
    report = compare(reference, fa.build(torch_model, defect), mapping=fa.MAPPING, valid=batch[1].astype(bool))
    assert report.first_divergence == fa.WHERE[defect], report.table()
    assert f"first divergence at {fa.WHERE[defect]}" in report.table()


def test_the_suggestion_pairs_the_norms_across_their_layouts(torch_model, reference):
    suggestion = suggest_mapping(reference, fa.build(torch_model))
    for name in NORMS:
        assert suggestion.pairs.get(name) == name.replace("self_attn", "attn"), suggestion.pairs


def test_training_agrees_and_a_defect_diverges_at_the_first_step(torch_model, batch):
    # no padding: the "lm" loss counts every position, and a padded one is computed differently by each side
    batches = [(ids, np.ones_like(ids)) for ids, _ in (fa.inputs(seed=s) for s in (0, 1))]
    report = compare_training(torch_model, fa.build(torch_model), batches, steps=10, mapping=fa.MAPPING)
    assert report.passed and not report.unpaired_torch and not report.unpaired_jax, report.table()
    assert len(report.names) == 3 + 10 * 2  # per layer: 4 projections, 4 norms, 2 MLP
    wrong = compare_training(torch_model, fa.build(torch_model, "q-norm over the heads axis"), batches, steps=2,
                             mapping=fa.MAPPING)
    assert wrong.first_divergence is not None and wrong.first_divergence.step == 1, wrong.table()
    assert any("step 1" in f for f in wrong.failures()), wrong.failures()


# a GPT-2 port with its own fused projection, keeping (batch, length, heads, head_dim) and writing its cache

@pytest.fixture(scope="module")
def gpt2():
    return fg.transformers_model()


def test_the_fused_port_passes_every_row_and_names_each_defect(gpt2):
    ids = fg.inputs()
    report = compare(gpt2, fg.build(gpt2), ids, mapping=fg.MAPPING)
    assert report.passed, report.table()
    assert all(m.passed for m in report.modules) and len(report.modules) == 21, report.table()
    for defect in fg.DEFECTS:
        wrong = compare(gpt2, fg.build(gpt2, defect), ids, mapping=fg.MAPPING)
        assert wrong.first_divergence == fg.WHERE[defect], (defect, wrong.table())


def test_the_fused_port_trains_as_transformers_and_a_defect_is_named_at_step_one(gpt2):
    batches = [(fg.inputs(seed=s),) for s in (0, 1)]
    report = compare_training(gpt2, fg.build(gpt2), batches, steps=10, mapping=fg.MAPPING)
    assert report.passed and not report.unpaired_torch and not report.unpaired_jax, report.table()
    assert len(report.names) == 28  # c_attn's weight and bias against qkv's kernel and bias, as they are
    wrong = compare_training(gpt2, fg.build(gpt2, "q and k swapped in the split"), batches, steps=2,
                             mapping=fg.MAPPING)
    assert wrong.first_divergence.step == 1, wrong.table()


def _prompts(low: int, vocab: int) -> list[np.ndarray]:
    """Two prompts, of 5 and 3 tokens: the second is left-padded by 2 in a batch."""
    rng = np.random.default_rng(1)
    return [rng.integers(low, vocab, n) for n in (5, 3)]


def _padded_row_named(report, where: str, step: int) -> None:
    """The shorter row fails in the left-padded batch only, from ``step``, named at ``where``."""
    failed = [r for r in report.results if not r.passed]
    assert [(r.what, r.row) for r in failed] == [("JAX, left-padded batch", 1)], report.table()
    assert (failed[0].first_step, failed[0].module) == (step, where), report.table()
    assert all(f.passed for f in report.forced), report.table()


def test_the_fused_port_decodes_as_generate_free_and_teacher_forced_and_each_defect_is_named(gpt2):
    """Its cache written on every call, alone and in a left-padded batch, each step's logits judged by
    the verdict's bound (the correct port's within 2.6e-7 of transformers', PyTorch's own rounding
    about 1.5e-7): an exact GELU moves the logits 1.0-2.2e-6, within rounding at some steps, and the
    prompt compared module by module names it at step 0; padding attended to is named in the padded batch."""
    prompts = _prompts(1, fg.CONFIG["vocab_size"])
    run = lambda port, prompts, paddings: compare_decoding(gpt2, port, prompts, steps=6,  # noqa: E731
                                                           paddings=paddings, mapping=fg.MAPPING)
    report = run(fg.build(gpt2), prompts, ("left",))
    assert report.passed and len(report.results) == 6 and max(report.forced[0].kl) < 1e-12, report.table()
    for defect in fg.DEFECTS:
        report = run(fg.build(gpt2, defect), prompts[:1], ())
        (alone, _), (forced,) = report.results, report.forced
        assert not report.passed and forced.first_step == 0 and forced.module == fg.WHERE[defect], report.table()
        assert alone.passed or alone.module == fg.WHERE[defect], report.table()
    _padded_row_named(run(fg.build(gpt2, fg.PADDING_DEFECT), prompts, ("left",)), fg.WHERE[fg.PADDING_DEFECT], 0)


def test_the_apertus_port_decodes_and_a_defect_of_its_cached_steps_is_named_at_its_norm(torch_model, monkeypatch):
    """Decoded one row at a time, free-running and teacher-forced: each planted defect is named at
    step 0 at its module; a q-norm over the heads axis only in cached steps (one token a call) is
    named at step 1 at that norm, whose PyTorch output ``(1, heads, length, head_dim)`` is cut to its
    last position along the length axis. In a left-padded batch the correct port passes, and positions
    that count the padding are named at the first attention at step 1 (rotary positions shifted alike
    leave the prompt's scores as they are: the first token decoded is where they part)."""
    prompts = _prompts(3, fa.CONFIG["vocab_size"])
    run = lambda port: compare_decoding(torch_model, port, prompts[:1], steps=6, paddings=(),  # noqa: E731
                                        mapping=fa.MAPPING)
    for defect in fa.DEFECTS:
        report = run(fa.build(torch_model, defect))
        (alone, _), (forced,) = report.results, report.forced
        assert (alone.first_step, alone.module, forced.first_step, forced.module) == (0, fa.WHERE[defect], 0,
                                                                                      fa.WHERE[defect]), report.table()
    port = fa.build(torch_model)
    norm = port.model.layers[1].attn.q_norm

    class CachedStepsOnly(type(norm)):
        def __call__(self, x):
            self.axis = -2 if x.shape[1] == 1 else -1
            return super().__call__(x)

    monkeypatch.setattr(norm, "__class__", CachedStepsOnly)
    report = run(port)
    (alone, _), (forced,) = report.results, report.forced
    where = "model.layers.1.self_attn.q_norm"
    assert (alone.first_step, alone.module, forced.first_step, forced.module) == (1, where, 1, where), report.table()
    padded = lambda port: compare_decoding(torch_model, port, prompts, steps=6, paddings=("left",),  # noqa: E731
                                           mapping=fa.MAPPING)
    report = padded(fa.build(torch_model))
    assert report.passed and len(report.results) == 6, report.table()
    _padded_row_named(padded(fa.build(torch_model, fa.PADDING_DEFECT)), fa.WHERE[fa.PADDING_DEFECT], 1)


def test_a_layout_declared_in_the_mapping_compares_rows_whose_heads_equal_their_length(torch_model):
    """Four tokens and four query heads: the port's query norms ``(2, 4, 4, 8)`` read as transformers'
    as they are and with their axes exchanged. Without a declaration those rows are not compared (the
    row names the layouts); with ``(0, 2, 1, 3)`` declared they are compared in it, and a norm over the
    wrong axis is named there. (The key norms, of 2 heads, have one layout either way.)"""
    ids, mask = fa.inputs(length=4)[0], np.ones((2, 4), np.int64)  # no padding: (2, 4) starts both norms' shapes
    key = r"model\.layers\.(\d+)\.self_attn\.(q_norm|k_norm)"
    declared = {**fa.MAPPING, key: (fa.MAPPING[key], None, (0, 2, 1, 3))}
    run = lambda port, mapping: compare(torch_model, port, ids, mask, mapping=mapping)  # noqa: E731
    undeclared = run(fa.build(torch_model), fa.MAPPING)
    queries = [name for name in NORMS if name.endswith("q_norm")]
    for name in queries:
        row = undeclared.module(name)
        assert row.outcome == verdict.NOT_COMPARED and row.added is None, undeclared.table()
        assert "more than one layout, and axes (0, 2, 1, 3)" in row.note and "declare one" in row.note, row.note
    assert "not compared (3, neither passed nor failed): " + ", ".join(queries) in undeclared.table()
    report = run(fa.build(torch_model), declared)
    assert report.passed and [m.name for m in report.not_compared] == ["model"], report.table()
    for name in NORMS:
        row = report.module(name)
        assert row.passed and row.layout == "axes (0, 2, 1, 3)" and max(row.added, row.inherited) < 1e-6, \
            report.table()
    assert "model.layers.0.attn.q_norm [axes (0, 2, 1, 3)]" in report.table()
    wrong = run(fa.build(torch_model, "q-norm over the heads axis"), declared)
    assert wrong.first_divergence == fa.WHERE["q-norm over the heads axis"], wrong.table()
