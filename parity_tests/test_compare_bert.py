"""The pre-trained BERT that rxnfp ships against its Flax port (``examples/bert_mlm.py``), module
by module, and defects planted in the port found at the module where they are planted."""

import copy
import importlib.metadata
import os
import sys

import jax
import pytest

from parity_tests import compare
from parity_tests.porting import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import bert_mlm  # noqa: E402


@pytest.fixture(scope="module")
def bert():
    try:
        importlib.metadata.distribution("rxnfp")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("CI"):
            raise
        pytest.skip("rxnfp, which ships a pre-trained BERT, is not installed: pip install --no-deps rxnfp==0.1.0")
    torch_model = bert_mlm.transformers_model(*bert_mlm.shipped_bert())
    ids, mask, types = bert_mlm.inputs(torch_model.config.vocab_size)
    return torch_model, bert_mlm.port(torch_model), (ids, mask, types)


@pytest.fixture(scope="module")
def bert64(bert):
    """float64 on both sides: a LayerNorm epsilon of 1e-6 for 1e-12 moves a module's output by
    about 1e-7, below float32's rounding and far above float64's."""
    torch_model, port, inputs = bert
    torch64 = copy.deepcopy(torch_model).double()
    return record(torch64, *inputs), bert_mlm.port(torch64, "float64"), inputs


def test_every_module_and_the_logits_agree(bert):
    torch_model, port, (ids, mask, types) = bert
    report = compare(torch_model, port, ids, mask, types, mapping=bert_mlm.MAPPING, valid=mask.astype(bool))
    assert report.passed and report.first_divergence is None, report.table()
    names = [m.name for m in report.modules]
    for layer in range(12):
        for part in ("attention.self.query", "attention.output.dense", "attention.output.LayerNorm", "attention",
                     "intermediate", "output.LayerNorm", "output", ""):
            assert f"bert.encoder.layer.{layer}.{part}".rstrip(".") in names
    order = [names.index(n) for n in ("bert.encoder.layer.0.attention", "bert.encoder.layer.1.attention", "cls")]
    assert order == sorted(order)
    assert all(m.added < 1e-5 and m.inherited < 1e-5 for m in report.modules), report.table()
    g = report.logits
    assert g.relative < 1e-5 and g.kl_max < 1e-9 and g.top1 == 1.0 and g.topk == 1.0, g
    assert report.settings["dtype"] == "float32" and report.settings["jax_default_matmul_precision"] == "highest"


def test_a_clean_port_passes_in_float64(bert64):
    reference, port, _ = bert64
    report = compare(reference, port, mapping=bert_mlm.MAPPING, valid=reference.inputs[1].astype(bool))
    assert report.passed, report.table()
    assert max(m.added for m in report.modules) < 1e-13, report.table()


def _planted(monkeypatch, port, defect):
    layers = port.bert.encoder.layer
    if defect == "layernorm epsilon":
        monkeypatch.setattr(layers[4].attention.LayerNorm, "epsilon", 1e-6)
        return "bert.encoder.layer.4.attention.output.LayerNorm"
    if defect == "gelu tanh":
        monkeypatch.setattr(bert_mlm, "gelu", lambda x: jax.nn.gelu(x, approximate=True))
        return "bert.encoder.layer.0.intermediate"
    if defect == "residual twice":
        class Doubled(bert_mlm.Output):
            def __call__(self, hidden_states, input_tensor):
                return super().__call__(hidden_states, input_tensor) + input_tensor

        monkeypatch.setattr(layers[7].output, "__class__", Doubled)
        return "bert.encoder.layer.7.output"
    monkeypatch.setattr(layers[2].attention.attention, "scale", 1 / 64)  # 1 / head_dim for 1 / sqrt(head_dim)
    return "bert.encoder.layer.2.attention"


@pytest.mark.parametrize("defect", ["layernorm epsilon", "gelu tanh", "residual twice", "attention scale"])
def test_a_planted_defect_is_found_where_it_is(bert64, monkeypatch, defect):
    reference, port, _ = bert64
    where = _planted(monkeypatch, port, defect)
    report = compare(reference, port, mapping=bert_mlm.MAPPING, valid=reference.inputs[1].astype(bool))
    assert report.first_divergence == where, report.table()
    assert not report.module(where).passed and not report.passed
    before = report.modules[: [m.name for m in report.modules].index(where)]
    assert before and all(m.passed for m in before)
