"""``compare`` on a port it was not written for (``parity_tests/foreign_port.py``: transformers' Qwen3 in
Flax NNX with its own names, an attention called ``attn(x, cache, segment_ids)`` that writes its cache
on every call): the correct port passes with one row and with two padded rows, each planted defect
is named at the module that holds it with and without an input adapter, and ``suggest_mapping``
pairs the port's modules with transformers' when nobody has written the mapping."""

import io
import re

import numpy as np
import pytest
import torch

from parity_tests import compare
from parity_tests import foreign_port as fp
from parity_tests.porting import names, settings
from parity_tests.porting.suggest import Suggestion, format_suggestion, kind, print_suggestion, suggest_mapping
from parity_tests.tool import verdict

ATTENTIONS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]


torch_model, batch, reference = fp.fixtures(fp)


@pytest.fixture(scope="module")
def port(torch_model):
    return fp.build(torch_model)


@pytest.fixture(scope="module")
def suggestion(reference, port):
    return suggest_mapping(reference, port)


def _never_passed_unmeasured(report) -> None:
    """No row reads as passed without an added error; a row without one is failed (by the data flow)
    or not compared, and says which in the table."""
    for m in report.modules:
        assert m.added is not None or m.outcome in (verdict.FAILED, verdict.NOT_COMPARED), report.table()
        assert m.added is not None or not m.passed, report.table()


def _logits(torch_model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        return torch_model(torch.from_numpy(ids), torch.from_numpy(mask)).logits.numpy()


# the port itself (a fixture of the tests below: it must be right before compare is judged on it)

def _error(model, ids, mask, theirs) -> float:
    """The largest difference of ``model``'s logits from ``theirs`` at the tokens, over their largest."""
    valid = mask.astype(bool)
    with settings.numerics():  # compare's precision: the operations compiled once for both
        mine = np.asarray(model(ids, mask))
    return float(np.abs(mine[valid] - theirs[valid]).max() / np.abs(theirs[valid]).max())


@pytest.mark.parametrize("rows", [1, 2])
def test_the_port_gives_transformers_logits(torch_model, port, batch, rows):
    ids, mask = (a[:rows] for a in batch)
    assert _error(port, ids, mask, _logits(torch_model, ids, mask)) < 1e-5


def test_each_planted_defect_changes_the_logits(torch_model, batch):
    theirs = _logits(torch_model, *batch)
    for defect in fp.DEFECTS:
        assert _error(fp.build(torch_model, defect), *batch, theirs) > 1e-3, defect


def test_the_adapter_turns_transformers_attention_call_into_the_ports(port, reference):
    for layer, call in zip(port.model.layers, [c for c in reference.calls if c.name in ATTENTIONS]):
        args, kwargs = fp.adapter(dict(call.inputs))
        valid = reference.inputs[1].astype(bool)
        mine = np.asarray(layer.attn(*args, **kwargs))[valid]
        assert np.abs(mine - call.output[valid]).max() < 1e-6 * np.abs(call.output).max() * 10


# compare on the port

@pytest.mark.parametrize("mapping", [fp.MAPPING, fp.ADAPTED], ids=["names only", "adapters"])
@pytest.mark.parametrize("rows", [1, 2])
def test_the_correct_port_passes_with_one_row_and_with_two_padded_rows(torch_model, port, batch, rows, mapping):
    """The port's attention writes its cache on every call: re-run on PyTorch's inputs, it must see
    the cache as it was when its call began, not as the whole run left it."""
    ids, mask = (a[:rows] for a in batch)
    report = compare(torch_model, port, ids, mask, mapping=mapping, valid=mask.astype(bool))
    assert report.passed and report.first_divergence is None, report.table()
    assert "FAILED" not in report.table()
    assert [m.name for m in report.modules if m.name in ATTENTIONS] == ATTENTIONS
    _never_passed_unmeasured(report)
    layers = [m for m in report.modules if re.fullmatch(r"model\.layers\.\d+(\.self_attn)?", m.name)]
    if mapping is fp.ADAPTED:  # with an adapter every attention and decoder layer adds an error of its own
        assert len(layers) == 4 and all(m.added is not None and m.added < 1e-5 for m in layers), report.table()
    else:  # segment_ids (rows, 12) is never filled with transformers' position_ids, whatever their shapes
        assert all(m.outcome == verdict.NOT_COMPARED and "integer argument" in m.note for m in layers), \
            report.table()


@pytest.mark.parametrize("mapping", [fp.MAPPING, fp.ADAPTED], ids=["names only", "adapters"])
@pytest.mark.parametrize("defect", fp.DEFECTS)
def test_a_planted_defect_is_named_at_the_module_that_holds_it(torch_model, reference, batch, defect, mapping):
    report = compare(reference, fp.build(torch_model, defect), mapping=mapping, valid=batch[1].astype(bool))
    where = fp.WHERE[defect]
    assert report.first_divergence == where, report.table()
    assert not report.passed and "FAILED" in report.table(), report.table()
    rows = [m.name for m in report.modules]
    assert all(m.outcome != verdict.FAILED for m in report.modules[: rows.index(where)]), report.table()
    assert report.table().splitlines()[-2].startswith(f"verdict: FAILED: first divergence at {where}")
    _never_passed_unmeasured(report)
    if where in ATTENTIONS:  # measured with the adapter, found by the data flow without one
        row = report.module(where)
        assert (row.added is not None and row.added > row.bound) if mapping is fp.ADAPTED else row.by_flow, \
            report.table()


def test_a_pair_whose_arrays_cannot_match_is_not_compared_and_never_passed(reference, port, batch):
    """``model.rotary_emb`` (its cosines, 192 numbers) paired by hand with the port's final norm
    (1,536): no comparison, so the row is neither passed nor failed, and the table says so."""
    mapping = {**{k: v for k, v in fp.MAPPING.items() if k != r"model\.norm"}, r"model\.rotary_emb": "model.final_norm"}
    report = compare(reference, port, mapping=mapping, valid=batch[1].astype(bool))
    row = report.module("model.rotary_emb")
    assert row.added is None and row.inherited is None and not row.passed, report.table()
    assert row.outcome == verdict.NOT_COMPARED, report.table()
    assert report.passed and "not compared" in report.table(), report.table()


# suggest_mapping

def test_the_suggested_mapping_pairs_the_port_by_kind_shape_and_order(suggestion, reference):
    assert isinstance(suggestion, Suggestion)
    assert suggestion[r"model\.layers\.(\d+)\.self_attn"] == r"model.layers.\1.attn"
    assert suggestion[r"model\.norm"] == "model.final_norm"
    assert suggestion[r"model\.layers\.(\d+)\.mlp\.up_proj"] == r"model.layers.\1.mlp.up"
    assert len(suggestion) == 14 and all(value is not None for value in suggestion.values())
    by_hand, suggested = names.check_mapping(fp.MAPPING), names.check_mapping(suggestion)
    for call in reference.calls:
        if call.name in suggestion.pairs:
            assert names.jax_name(call.name, suggested) == names.jax_name(call.name, by_hand) == \
                suggestion.pairs[call.name]
    assert suggestion.unpaired == ["model.rotary_emb", "model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"]
    assert suggestion.unpaired_jax == [] and suggestion.mismatched == []


def test_the_suggestion_prints_as_a_dict_to_paste(reference, port, suggestion):
    out = io.StringIO()
    printed = print_suggestion(reference, port, file=out)
    text = out.getvalue()
    assert text == format_suggestion(suggestion) + "\n" and printed == suggestion
    assert eval(text) == dict(suggestion)  # noqa: S307 (the text is what a user pastes)
    assert "# unpaired PyTorch module model.rotary_emb: no JAX module fits" in text


def test_compare_runs_with_the_suggested_mapping(reference, port, suggestion, batch):
    valid = batch[1].astype(bool)
    suggested = compare(reference, port, mapping=suggestion, valid=valid)
    by_hand = compare(reference, port, mapping=fp.MAPPING, valid=valid)
    assert suggested.passed, suggested.table()
    assert [(m.name, m.jax_name) for m in suggested.modules] == [(m.name, m.jax_name) for m in by_hand.modules]
    assert len(suggested.modules) == 32


def test_mapping_auto_pairs_as_the_suggestion(reference, port, suggestion, torch_model, batch):
    valid = batch[1].astype(bool)
    auto = compare(reference, port, mapping="auto", valid=valid)
    suggested = compare(reference, port, mapping=suggestion, valid=valid)
    assert auto.passed, auto.table()
    assert [(m.name, m.jax_name) for m in auto.modules] == [(m.name, m.jax_name) for m in suggested.modules]
    report = compare(reference, fp.build(torch_model, "mlp activation"), mapping="auto", valid=valid)
    assert report.first_divergence == fp.WHERE["mlp activation"], report.table()


def test_a_layer_without_its_k_norm_call_is_paired_by_name_alone(reference, torch_model):
    suggestion = suggest_mapping(reference, fp.build(torch_model, "skipped k-norm"))
    assert "model.layers.1.self_attn.k_norm" in suggestion.unpaired
    assert suggestion[r"model\.layers\.0\.self_attn\.k_norm"] == "model.layers.0.attn.k_norm"
    assert not any(re.fullmatch(p, "model.layers.1.self_attn.k_norm") for p in suggestion)


class _TorchTiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _jax_tiny():
    import jax.numpy as jnp
    from flax import nnx

    class Count(nnx.Variable):
        pass

    class Tiny(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
            self.ln_f = nnx.LayerNorm(4, rngs=rngs)
            self.head = nnx.Linear(4, 3, rngs=rngs)
            self.calls = Count(jnp.int32(0))

        def __call__(self, x):
            self.calls.set_value(self.calls.get_value() + 1)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.ln_f(x))

    return Tiny(nnx.Rngs(0))


def test_modules_whose_arrays_cannot_match_are_listed_not_paired():
    tiny = _jax_tiny()
    x = np.ones((2, 4), np.float32)
    suggestion = suggest_mapping(_TorchTiny().eval(), tiny, x)
    assert dict(suggestion) == {r"blocks\.(\d+)": r"layers.\1", "norm": "ln_f", "head": None}
    assert suggestion.unpaired == ["head"] and suggestion.unpaired_jax == ["head"]
    assert suggestion.mismatched == [("head", "head", (2, 5), (2, 3))]
    assert "# unpaired PyTorch module head: the JAX module of this name returns (2, 3), PyTorch's (2, 5)" in \
        format_suggestion(suggestion)
    assert int(tiny.calls.get_value()) == 0  # the port's state as it was


@pytest.mark.parametrize("cls, name, expected", [
    ("torch.nn.modules.linear.Linear", "model.layers.0.self_attn.q_proj", "linear"),
    ("flax.nnx.nn.linear.Linear", "model.layers.0.attn.q", "linear"),
    ("torch.nn.modules.sparse.Embedding", "model.embed_tokens", "embedding"),
    ("transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm", "model.norm", "norm"),
    ("transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding", "model.rotary_emb", "rotary"),
    ("transformers.models.qwen3.modeling_qwen3.Qwen3Attention", "model.layers.0.self_attn", "attention"),
    ("transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer", "model.layers.0", "block"),
    ("parity_tests.foreign_port.MLP", "model.layers.0.mlp", "mlp"),
    ("my.Thing", "h.3.attn", "attention"),
    ("my.Thing", "h.3.ln_1", "norm"),
    ("my.Thing", "h.3", "other"),
])
def test_the_kind_of_a_module(cls, name, expected):
    assert kind(cls, name) == expected


def test_an_integer_argument_is_filled_only_from_the_input_of_its_name():
    import inspect

    from parity_tests.porting import jax_side

    def attn(x, segment_ids):
        return x

    def embed(tokens):
        return tokens

    x, ids = np.ones((1, 12, 4), np.float32), np.ones((1, 12), np.int32)
    positions = [("hidden_states", 2 * x), ("position_ids", np.arange(12)[None])]
    with pytest.raises(ValueError, match=r"argument 1 \(1, 12\).*only from the input of its name \(segment_ids\)"):
        jax_side.substitute(inspect.signature(attn), (x, ids), positions)
    filled = jax_side.substitute(inspect.signature(attn), (x, ids), [*positions, ("segment_ids", 3 * ids)])
    assert float(filled[0].max()) == 2 and int(filled[1].max()) == 3  # x by size, segment_ids by name
    (tokens,) = jax_side.substitute(inspect.signature(embed), (ids,), [("input", 5 * ids)])
    assert int(tokens.max()) == 5  # the one input of a call that has one
