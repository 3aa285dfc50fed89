"""transformers' GPT-2 against a port built on our attention (``parity_tests/gpt2_port.py``): its fused
``c_attn`` and ``Conv1D`` weights ``(in, out)`` are read as ``from_hf`` reads them, its ``wte`` and
``lm_head`` are one parameter; every parameter pairs without a hand mapping, the forward pass, the
gradients and 30 training steps agree, and a defect only training shows is named by the command line."""

import numpy as np
import pytest
import torch

from parity_tests import gpt2_port
from parity_tests.porting import command, compare, compare_gradients, compare_training
from parity_tests.tool import verdict

PARAMETERS = 4 + 12 * gpt2_port.CONFIG["n_layer"]  # wte, wpe, ln_f's two; per layer 2 norms of 2, 4 projections of 2


@pytest.fixture(scope="module")
def models():
    torch_model = gpt2_port.transformers_model()
    return torch_model, gpt2_port.build(torch_model)


def test_the_port_gives_transformers_logits(models):
    torch_model, port = models
    ids = gpt2_port.inputs()
    with torch.no_grad():
        theirs = torch_model(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(np.asarray(port(ids)) - theirs).max() < 1e-5 * np.abs(theirs).max()


def test_every_row_passes_or_says_why_it_is_not_compared(models):
    report = compare(*models, gpt2_port.inputs(), mapping=gpt2_port.MAPPING)
    assert report.passed, report.table()
    for m in report.modules:
        assert m.passed or (m.outcome == verdict.NOT_COMPARED and m.note), report.table()
    # the output projection's input: GPT-2's (batch, length, 32), ours (batch, length, 4 heads, 8)
    out = report.module("transformer.h.0.attn.c_proj")
    assert out.passed and out.added < 1e-6, report.table()


def test_every_parameter_pairs_and_the_gradients_agree(models):
    report = compare_gradients(*models, gpt2_port.inputs(), mapping=gpt2_port.MAPPING)
    assert report.passed and not report.unpaired_torch and not report.unpaired_jax, report.table()
    assert len(report.parameters) == PARAMETERS
    fused = {p.name: p.jax_name for p in report.parameters}["transformer.h.0.attn.c_attn.weight"]
    assert fused == ", ".join(f"transformer.h.0.attn.{p}.kernel" for p in ("query", "key", "value")), fused


def test_thirty_float32_steps_with_equal_setups_stay_within_the_allowance(models):
    report = compare_training(*models, [(gpt2_port.inputs(seed=s),) for s in (0, 1)], steps=30,
                              mapping=gpt2_port.MAPPING)
    assert report.passed and report.first_divergence is None, report.table()
    assert len(report.names) == PARAMETERS and not report.unpaired_torch and not report.unpaired_jax
    assert not report.unused_torch, report.unused_torch
    first = np.abs(np.subtract(report.jax_loss[:10], report.torch_loss[:10])) / np.abs(report.torch_loss[:10])
    assert first.max() < 1e-5, first
    assert report.torch_loss[-1] < 0.9 * report.torch_loss[0]  # it trains
    assert report.failures() == []


def test_a_parameter_without_gradient_is_named_by_the_command_line(capsys):
    spec = "parity_tests.gpt2_port:"
    parser_args = ["--torch", spec + "torch_model", "--flax", spec + "port_with_a_frozen_bias",
                   "--inputs", spec + "batch", "--mapping", "parity_tests.gpt2_port:MAPPING", "--train", "3"]
    import argparse

    commands = argparse.ArgumentParser().add_subparsers()
    command.add_parser(commands, "")
    args = commands.choices["compare"].parse_args(parser_args)
    assert command.run(args) == 1
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAILED: ") and "see above" not in last, out
    assert "training: first divergence at step 1, transformer.h.1.mlp.c_fc.bias" in last, last
    assert "verdict: PASSED" in out  # the forward pass is right: only training shows the defect
