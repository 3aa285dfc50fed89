"""The comparison reads an array in the other side's layout and never across it: properties over
random shapes and layouts (hypothesis), against NumPy's own transposes and reshapes, and the
parameters' orientations (a ``Linear``'s ``(out, in)``, a ``Conv1D``'s ``(in, out)``)."""

import numpy as np
import pytest
import torch
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from parity_tests.porting import parameter_pairs
from parity_tests.tool import arrays, axis_layouts, verdict

TOLERANCE = 1e-5
SIZES = st.integers(1, 5)


def _judged(jax_array, torch_array) -> str:
    """The row's outcome as ``compare`` would judge it: a layout error is not compared."""
    try:
        error = arrays.relative_error(jax_array, torch_array)
    except axis_layouts.LayoutError:
        return verdict.NOT_COMPARED
    return verdict.outcome(error, TOLERANCE)


@st.composite
def attention_arrays(draw):
    """PyTorch's ``(batch, heads, length, head_dim)`` and the same numbers in a port's layout:
    ``(batch, length, heads, head_dim)``, heads merged ``(batch, length, heads * head_dim)``, or as is."""
    b, h, n, d = (draw(SIZES) for _ in range(4))
    torch_array = np.random.default_rng(draw(st.integers(0, 2**16))).normal(size=(b, h, n, d)) + 0.5
    kind = draw(st.sampled_from(["as is", "BLHD", "BL(HD)", "BH(LD)"]))
    port = {"as is": torch_array, "BLHD": torch_array.transpose(0, 2, 1, 3),
            "BL(HD)": torch_array.transpose(0, 2, 1, 3).reshape(b, n, h * d),
            "BH(LD)": torch_array.reshape(b, h, n * d)}[kind]
    return torch_array, np.ascontiguousarray(port), kind


@settings(max_examples=200, deadline=None)
@given(attention_arrays())
def test_a_correct_array_in_any_layout_is_never_an_error(case):
    torch_array, port, _ = case
    assert _judged(port, torch_array) in (verdict.PASSED, verdict.NOT_COMPARED)


@settings(max_examples=200, deadline=None)
@given(attention_arrays(), st.integers(0, 2**16))
def test_a_wrong_array_is_never_a_pass(case, seed):
    torch_array, port, _ = case
    wrong = port.copy()
    flat = wrong.reshape(-1)
    flat[np.random.default_rng(seed).integers(flat.size)] += 1e-2 * np.abs(torch_array).max()
    assert _judged(wrong, torch_array) in (verdict.FAILED, verdict.NOT_COMPARED)


@settings(max_examples=200, deadline=None)
@given(attention_arrays())
def test_heads_reshaped_instead_of_transposed_is_never_a_pass(case):
    """The classic port defect: ``(batch, heads, length, head_dim)`` reshaped, not transposed, to
    ``(batch, length, heads, head_dim)``: the right shape, the elements in the wrong places."""
    torch_array, _, _ = case
    b, h, n, d = torch_array.shape
    misread = torch_array.reshape(b, n, h, d)
    if np.array_equal(misread, torch_array.transpose(0, 2, 1, 3)) or h == n:
        return  # heads or length 1: nothing is misread; heads == length: the array is PyTorch's own, bit for bit
    assert _judged(misread, torch_array) in (verdict.FAILED, verdict.NOT_COMPARED)


@settings(max_examples=200, deadline=None)
@given(attention_arrays())
def test_a_layout_that_fits_alone_is_compared(case):
    torch_array, port, kind = case
    b, h, n, d = torch_array.shape
    if len({b, h, n, d}) == 4 and min(b, h, n, d) > 1 and kind != "BH(LD)":
        assert _judged(port, torch_array) == verdict.PASSED, axis_layouts.candidates(port.shape, torch_array.shape)


def test_the_layout_is_found_named_or_refused_with_both_shapes():
    x = np.arange(2 * 12 * 4 * 8, dtype=float).reshape(2, 12, 4, 8)
    assert axis_layouts.describe(x.shape, (2, 4, 12, 8)) == "axes (0, 2, 1, 3)"
    assert axis_layouts.describe((2, 4, 12, 8), (2, 12, 32)) == "axes (0, 2, 1, 3), last two axes merged"
    assert axis_layouts.describe((2, 12, 32), (2, 4, 12, 8)) == "last axis split into (4, 8), axes (0, 2, 1, 3)"
    assert axis_layouts.describe((12, 32), (1, 12, 32)) == "axes of size 1 taken out or put in"
    with pytest.raises(axis_layouts.LayoutError, match=r"\(2, 4, 32\) gives PyTorch's \(2, 4, 4, 8\) in 2 layouts"):
        axis_layouts.fit(np.zeros((2, 4, 32)), (2, 4, 4, 8))
    # a declared axis order chooses among them
    y = np.random.default_rng(0).normal(size=(2, 4, 4, 8))
    assert arrays.relative_error(y.transpose(0, 2, 1, 3).reshape(2, 4, 32), y, layout=(0, 2, 1, 3)) == 0.0
    with pytest.raises(axis_layouts.LayoutError, match=r"no layout of the JAX array \(2, 5\) gives PyTorch's \(3, 4\)"):
        arrays.relative_error(np.zeros((2, 5)), np.zeros((3, 4)))
    with pytest.raises(axis_layouts.LayoutError, match="no layout"):
        arrays.relative_error(np.zeros((10,)), np.zeros((3,)))


def test_valid_positions_follow_the_layout():
    """``valid`` ``(batch, length)`` selects the same tokens of PyTorch's ``(batch, heads, length, d)``
    as of the port's ``(batch, length, heads, d)``: padding left out on both."""
    rng = np.random.default_rng(1)
    torch_array = rng.normal(size=(2, 4, 12, 8))
    port = torch_array.transpose(0, 2, 1, 3).copy()
    port[1, :3] += 5.0  # the padded positions differ
    valid = np.ones((2, 12), bool)
    valid[1, :3] = False
    assert arrays.relative_error(port, torch_array, valid) == 0.0
    assert arrays.relative_error(port, torch_array) > 0.1


@pytest.mark.parametrize("kind, stored", [("linear", "out_in"), ("conv1d", "in_out")])
@pytest.mark.parametrize("shape", [(6, 10), (8, 8), (32, (4, 8))])
def test_a_kernel_is_read_in_its_module_orientation(kind, stored, shape):
    """A kernel ``(in, out)`` (or ``(in, heads, head_dim)``) against PyTorch's weight: ``(out, in)``
    for a Linear, ``(in, out)`` for a Conv1D; a square one by its kind."""
    n_in, n_out = shape[0], int(np.prod(shape[1])) if isinstance(shape[1], tuple) else shape[1]
    kernel_shape = (n_in, *shape[1]) if isinstance(shape[1], tuple) else (n_in, n_out)
    kernel = np.random.default_rng(2).normal(size=kernel_shape)
    weight = kernel.reshape(n_in, n_out).T if stored == "out_in" else kernel.reshape(n_in, n_out)
    assert np.array_equal(parameter_pairs.kernel(kernel, weight.shape, kind), weight)
    if n_in == n_out:  # square: the other kind reads it the other way, and the comparison fails
        other = "conv1d" if kind == "linear" else "linear"
        assert not np.array_equal(parameter_pairs.kernel(kernel, weight.shape, other), weight)


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_a_fused_query_key_value_is_split_as_from_hf_splits_it(family):
    """BLOOM's and Falcon's (grouped: 2 key heads of 4) ``query_key_value`` against ``from_hf``'s
    ``query``, ``key`` and ``value``: one row each, no error; the port's query and key exchanged: an error."""
    import torch
    import transformers
    from flax import nnx

    import mha_jax
    from mha_spec import families

    config = (transformers.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=64) if family == "bloom" else
              transformers.FalconConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=64,
                                        new_decoder_architecture=True, num_kv_heads=2))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours = {}
    for layer in range(2):
        prefix = families.layer_options(families.read_config(model.config.to_dict()), layer).prefix
        attention = mha_jax.from_hf(model.config.to_dict(), state, layer=layer)
        ours.update({prefix + ".".join(map(str, path)): np.asarray(v[...])
                     for path, v in nnx.to_flat_state(nnx.state(attention, nnx.Param))})
    names = [n for n in state if ".self_attention." in n]
    pairs, unpaired = parameter_pairs.pair(model, names, list(ours), None)
    assert not unpaired and {p.name for p in pairs} == set(names)
    fused = [p for p in pairs if "query_key_value.weight" in p.name]
    assert len(fused) == 2 and fused[0].jax_name.endswith("query.kernel, transformer.h.0.self_attention.key.kernel, "
                                                          "transformer.h.0.self_attention.value.kernel"), fused[0]
    assert all(p.error(state, ours) == 0.0 for p in pairs)
    q, k = "transformer.h.0.self_attention.query.kernel", "transformer.h.0.self_attention.key.kernel"
    if ours[q].shape == ours[k].shape:
        swapped = {**ours, q: ours[k], k: ours[q]}
        assert fused[0].error(state, swapped) > 0.1
    else:  # grouped: fewer key heads; a query scaled by 2 instead
        assert fused[0].error(state, {**ours, q: 2 * ours[q]}) > 0.1


def test_valid_positions_are_placed_by_the_layout_when_heads_equal_length():
    """heads == length: PyTorch's ``(batch, heads, length, d)`` starts with ``(batch, length)`` too, so
    the padding is placed through the port's ``(batch, length, heads * d)`` and the declared layout, never
    on the heads; where neither side tells its length axis, nothing is compared."""
    rng = np.random.default_rng(3)
    torch_array = rng.normal(size=(2, 4, 4, 8))
    port = torch_array.transpose(0, 2, 1, 3).reshape(2, 4, 32).copy()
    valid = np.ones((2, 4), bool)
    valid[1, :1] = False
    padded, live = port.copy(), port.copy()
    padded[1, 0] += 5.0
    live[1, 1, :8] += 5.0
    assert arrays.relative_error(padded, torch_array, valid, layout=(0, 2, 1, 3)) == 0.0
    assert arrays.relative_error(live, torch_array, valid, layout=(0, 2, 1, 3)) > 0.1
    assert arrays.relative_error(padded, torch_array, np.ones((2, 4), bool), layout=(0, 2, 1, 3)) > 0.1
    with pytest.raises(axis_layouts.LayoutError, match=r"valid \(2, 4\) \(batch, length\) reads more than one axis"):
        arrays.relative_error(padded.reshape(2, 4, 4, 8), torch_array, valid, layout=(0, 2, 1, 3))


class _TorchHeads(torch.nn.Module):
    """``(batch, length, 8)`` -> ``(batch, heads 4, length, 2)``, PyTorch's layout."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).view(x.shape[0], x.shape[1], 4, 2).transpose(1, 2)


class _TorchHeadsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.heads, self.out = torch.nn.Embedding(11, 8), _TorchHeads(), torch.nn.Linear(8, 11)

    def forward(self, ids):
        q = self.heads(self.embed(ids))
        return {"logits": self.out(q.transpose(1, 2).reshape(ids.shape[0], ids.shape[1], 8))}


class _NnxHeads(nnx.Module):
    """The port keeps the heads merged, ``(batch, length, 8)``; ``defect`` adds 1 at ``(row, position)``."""

    def __init__(self, w, defect):
        self.proj, self.defect = nnx.Linear(8, 8, rngs=nnx.Rngs(0)), defect
        self.proj.kernel.set_value(w["heads.proj.weight"].T)
        self.proj.bias.set_value(w["heads.proj.bias"])

    def __call__(self, x):
        out = self.proj(x)
        return out if self.defect is None else out.at[self.defect].add(1.0)


class _NnxHeadsModel(nnx.Module):
    def __init__(self, defect=None):
        w = {k: v.detach().numpy() for k, v in _TorchHeadsModel().state_dict().items()}
        self.embed, self.out = nnx.Embed(11, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 11, rngs=nnx.Rngs(0))
        self.embed.embedding.set_value(w["embed.weight"])
        self.out.kernel.set_value(w["out.weight"].T)
        self.out.bias.set_value(w["out.bias"])
        self.heads = _NnxHeads(w, defect)

    def __call__(self, ids):
        return {"logits": self.out(self.heads(self.embed(ids)))}


@pytest.mark.parametrize("defect, passes", [(None, True), ((1, 0), True), ((1, 1), False)])
def test_compare_leaves_padding_out_when_heads_equal_length(defect, passes):
    """``compare`` with a padded row and heads == length: a correct port passes; a defect only at the
    padded position is not reported; one at a live position fails at the heads row."""
    from parity_tests import compare

    ids = np.random.default_rng(0).integers(1, 11, (2, 4))
    ids[1, 0] = 0
    valid = ids != 0
    report = compare(_TorchHeadsModel().eval(), _NnxHeadsModel(defect), ids, valid=valid,
                     mapping={r"heads": ("heads", None, (0, 2, 1, 3))})
    heads = next(m for m in report.modules if m.name == "heads")
    assert heads.layout == "last axis split into (4, 2), axes (0, 2, 1, 3)" and heads.added is not None, heads
    assert report.passed is passes, report
    if not passes:
        assert report.first_divergence == "heads", report
