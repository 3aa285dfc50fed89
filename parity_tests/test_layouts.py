"""Reading checkpoints in other naming schemes, nn.MultiheadAttention both ways, its masks, files.

Every foreign key name below is written out by hand, as the foreign library names it; fused
weights are built with ``np.concatenate``, the inverse of the split under test. Numerical
agreement with each foreign implementation is in ``test_foreign_oracles.py``.
"""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from flax.serialization import msgpack_serialize
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

import mha_jax
import mha_torch
from mha_spec import layouts
from parity_tests.tool.arrays import same_bits

ROOT = pathlib.Path(__file__).resolve().parent.parent
H, KV, D, E = 4, 2, 3, 10  # heads, kv heads, head_dim, in features


def canonical(kv_heads: int = KV, bias: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """A random mha_torch state dict: q (H*D, E), k/v (kv_heads*D, E), out (E, H*D)."""
    rng = np.random.default_rng(seed)
    shapes = {"q_proj": (H * D, E), "k_proj": (kv_heads * D, E), "v_proj": (kv_heads * D, E), "out_proj": (E, H * D)}
    state = {}
    for name, shape in shapes.items():
        state[f"{name}.weight"] = rng.normal(size=shape).astype(np.float32)
        if bias:
            state[f"{name}.bias"] = rng.normal(size=shape[0]).astype(np.float32)
    return state


def _cat(state, part, names):
    return np.concatenate([state[f"{n}.{part}"] for n in names])


def foreign(layout: str, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``state`` under the names another library gives it, written out by hand."""
    qkv = ("q_proj", "k_proj", "v_proj")
    if layout == "torch_mha":  # nn.MultiheadAttention(embed_dim, heads), kdim == vdim == embed_dim
        return {"in_proj_weight": _cat(state, "weight", qkv), "in_proj_bias": _cat(state, "bias", qkv),
                "out_proj.weight": state["out_proj.weight"], "out_proj.bias": state["out_proj.bias"]}
    if layout == "torch_mha_kdim":  # ... with kdim/vdim given: separate weights, one fused bias
        return {"q_proj_weight": state["q_proj.weight"], "k_proj_weight": state["k_proj.weight"],
                "v_proj_weight": state["v_proj.weight"], "in_proj_bias": _cat(state, "bias", qkv),
                "out_proj.weight": state["out_proj.weight"], "out_proj.bias": state["out_proj.bias"]}
    if layout == "hf":  # Llama, Mistral, ...
        return {k.replace("out_proj", "o_proj"): v for k, v in state.items()}
    if layout == "bert":  # BertModel: encoder.layer.N.attention.{self.query, ..., output.dense}
        names = {"q_proj": "self.query", "k_proj": "self.key", "v_proj": "self.value", "out_proj": "output.dense"}
        out = {f"encoder.layer.0.attention.{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in state.items()}
        out["encoder.layer.0.attention.output.LayerNorm.weight"] = np.ones(E, np.float32)
        out["encoder.layer.0.attention.output.LayerNorm.bias"] = np.zeros(E, np.float32)
        out["encoder.layer.1.attention.self.query.weight"] = state["q_proj.weight"] + 1  # another layer
        out["embeddings.word_embeddings.weight"] = np.zeros((8, E), np.float32)
        return out
    if layout == "fused_qkv":  # Phi-3 and the tutorials: qkv_proj rows [q; k; v], o_proj
        return {"qkv_proj.weight": _cat(state, "weight", qkv), "qkv_proj.bias": _cat(state, "bias", qkv),
                "o_proj.weight": state["out_proj.weight"], "o_proj.bias": state["out_proj.bias"]}
    if layout == "fused_kv":  # a cross-attention block: to_q, to_kv (rows [k; v]), to_out
        prefix = "blocks.3.attn."
        return {prefix + "to_q.weight": state["q_proj.weight"], prefix + "to_q.bias": state["q_proj.bias"],
                prefix + "to_kv.weight": _cat(state, "weight", qkv[1:]),
                prefix + "to_kv.bias": _cat(state, "bias", qkv[1:]),
                prefix + "to_out.weight": state["out_proj.weight"], prefix + "to_out.bias": state["out_proj.bias"]}
    raise AssertionError(layout)


# How each is read: the arguments, the same for both frameworks.
READ = {
    "torch_mha": dict(layout="torch_mha"),
    "torch_mha_kdim": dict(layout="torch_mha"),
    "hf": dict(layout="hf"),
    "bert": dict(layout="bert", prefix="encoder.layer.0.attention.", ignore=["output.LayerNorm"]),
    "fused_qkv": dict(layout="fused_qkv"),
    "fused_kv": dict(mapping={"q_proj": "to_q", "kv_proj": "to_kv", "out_proj": "to_out"}, prefix="blocks.3.attn."),
}


def _torch_module(kv_heads: int = KV, bias: bool = True, dtype=torch.float32):
    return mha_torch.MultiHeadAttention(E, H, num_kv_heads=kv_heads, qkv_dim=H * D, bias=bias, dtype=dtype)


@pytest.mark.parametrize("name", list(READ))
def test_each_layout_reads_into_both_frameworks_bitwise(name):
    kv = H if name.startswith("torch_mha") else KV  # nn.MultiheadAttention has no grouped heads
    state = canonical(kv)
    theirs = foreign(name, state)
    before = {k: v.copy() for k, v in theirs.items()}
    params = mha_jax.from_torch(theirs, num_heads=H, num_kv_heads=kv, **READ[name])
    back = mha_jax.to_torch(params)
    assert set(back) == set(state) and all(same_bits(back[k], state[k]) for k in state)
    module = _torch_module(kv)
    mha_torch.load_weights(module, {k: torch.from_numpy(v) for k, v in theirs.items()}, **READ[name])
    assert all(same_bits(module.state_dict()[k], state[k]) for k in state)
    model = mha_jax.MultiHeadAttention(H, E, H * D, num_kv_heads=kv, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, theirs, **READ[name])
    assert all(same_bits(v, state[k]) for k, v in mha_jax.to_torch(model).items())
    # nothing given was modified, and nothing returned shares its memory
    assert all(np.array_equal(before[k], theirs[k]) for k in theirs)
    params["key"]["bias"][...] = 7.0
    params["query"]["bias"][...] = 7.0
    assert all(np.array_equal(before[k], theirs[k]) for k in theirs)


def test_fused_rows_are_q_then_k_then_v():
    """One row per head is marked, so a split in another order cannot pass."""
    qkv = np.zeros(((H + 2 * KV) * D, E), np.float32)
    qkv[:, 0] = np.arange(qkv.shape[0])  # row index, in column 0
    state = {"qkv_proj.weight": qkv, "o_proj.weight": np.zeros((E, H * D), np.float32)}
    back = mha_jax.to_torch(mha_jax.from_torch(state, num_heads=H, num_kv_heads=KV, layout="fused_qkv"))
    assert back["q_proj.weight"][:, 0].tolist() == list(range(0, 12))
    assert back["k_proj.weight"][:, 0].tolist() == list(range(12, 18))
    assert back["v_proj.weight"][:, 0].tolist() == list(range(18, 24))


def test_layout_files_and_no_biases(tmp_path):
    """A .safetensors file in a foreign layout, without biases, loads on both sides."""
    state = canonical(H, bias=False)
    theirs = {"in_proj_weight": _cat(state, "weight", ("q_proj", "k_proj", "v_proj")),
              "out_proj.weight": state["out_proj.weight"]}
    path = tmp_path / "mha.safetensors"
    save_numpy(theirs, path)
    back = mha_jax.to_torch(mha_jax.from_torch(path, num_heads=H, layout="torch_mha"))
    assert set(back) == set(state) and all(same_bits(back[k], state[k]) for k in state)
    module = _torch_module(H, bias=False)
    mha_torch.load_weights(module, path, layout="torch_mha")
    assert all(same_bits(module.state_dict()[k], state[k]) for k in state)


# --- errors: the same message from both frameworks ------------------------------------------


def _both(state, **kwargs) -> list[str]:
    """The ValueError message of each framework's loader into a module, then ``from_torch``'s
    (which knows no module, so says nothing of the keys a module has or lacks)."""
    messages = []
    with pytest.raises(ValueError) as info:
        mha_jax.load_weights(mha_jax.MultiHeadAttention(H, E, H * D, num_kv_heads=KV, rngs=nnx.Rngs(0)), state,
                             **kwargs)
    messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        mha_torch.load_weights(_torch_module(), {k: torch.from_numpy(v) for k, v in state.items()}, **kwargs)
    messages.append(str(info.value))
    with pytest.raises(ValueError) as info:
        mha_jax.from_torch(state, num_heads=H, num_kv_heads=KV, **kwargs)
    return messages + [str(info.value)]


def _bert_without_ignore():
    return foreign("bert", canonical()), dict(layout="bert", prefix="encoder.layer.0.attention.")


ERRORS = {
    "bert LayerNorm not ignored": (
        _bert_without_ignore,
        ["unexpected key 'encoder.layer.0.attention.output.LayerNorm.bias'",
         "unexpected key 'encoder.layer.0.attention.output.LayerNorm.weight'", "ignore="],
    ),
    "bert without prefix": (
        lambda: (foreign("bert", canonical()), dict(layout="bert")),
        ["missing key 'self.query.weight'", "unexpected key 'embeddings.word_embeddings.weight'",
         "the layout's weights are found under prefix 'encoder.layer.0.attention.', 'encoder.layer.1.attention.'"],
    ),
    "prefix matches nothing": (
        lambda: (canonical(), dict(prefix="encoder.")),
        ["no key starts with prefix 'encoder.'", "'k_proj.bias'"],
    ),
    "ignore matches nothing": (
        lambda: (canonical(), dict(ignore=["output.LayerNorm"])),
        ["ignore entry 'output.LayerNorm' matches no key"],
    ),
    "add_bias_kv": (
        lambda: (dict(foreign("torch_mha", canonical(H)), bias_k=np.zeros((1, 1, 12), np.float32),
                      bias_v=np.zeros((1, 1, 12), np.float32)), dict(layout="torch_mha", ignore=["bias_"])),
        ["key 'bias_k' comes from add_bias_kv=True", "key 'bias_v' comes from add_bias_kv=True"],
    ),
    "weight given twice": (
        lambda: (dict(foreign("torch_mha", canonical(KV)), q_proj_weight=np.zeros((12, E), np.float32)),
                 dict(layout="torch_mha")),
        ["q_proj.weight is given twice, by 'in_proj_weight' and 'q_proj_weight'"],
    ),
    "fused rows do not split": (
        lambda: ({"qkv_proj.weight": np.zeros((25, E), np.float32), "o_proj.weight": np.zeros((E, 12), np.float32)},
                 dict(layout="fused_qkv")),
        ["'qkv_proj.weight' has shape (25, 10)", "4 + 2 + 2 = 8 x head_dim rows (num_heads=4, num_kv_heads=2)"],
    ),
    "missing weight, one missing bias": (
        lambda: ({k: v for k, v in foreign("hf", canonical()).items() if k not in ("o_proj.weight", "k_proj.bias")},
                 dict(layout="hf")),
        ["missing key 'o_proj.weight'", "missing key 'k_proj.bias'"],
    ),
    "torch_mha missing input weight": (
        lambda: ({"out_proj.weight": np.zeros((E, 12), np.float32)}, dict(layout="torch_mha")),
        ["missing key 'in_proj_weight' (or 'q_proj_weight')"],
    ),
    "unknown layout": (
        lambda: (canonical(), dict(layout="gpt2")),
        ["layout must be one of ['mha_torch', 'torch_mha', 'hf', 'bert', 'fused_qkv', 'flax', 'auto'], got 'gpt2'"],
    ),
    "mapping and layout": (
        lambda: (canonical(), dict(layout="hf", mapping={"qkv_proj": "c_attn", "out_proj": "c_proj"})),
        ["give layout or mapping, not both"],
    ),
    "mapping names q twice, out never": (
        lambda: (canonical(), dict(mapping={"qkv_proj": "attn", "q_proj": "q", "dense": "d"})),
        ["unknown entry 'dense'", "q_proj is named 2 times", "out_proj is not named"],
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_checkpoints_fail_alike_and_name_every_key(name):
    make, expected = ERRORS[name]
    state, kwargs = make()
    jax_message, torch_message, no_module = _both(state, **kwargs)
    assert jax_message == torch_message
    for part in expected:
        assert part in jax_message and part in no_module, (part, jax_message, no_module)


def test_a_wrong_query_weight_is_named_alone():
    """16 query rows where 4 heads x head_dim 3 = 12 fit: head_dim comes from what the key,
    value and output weights and the biases agree on, so the query weight is the one named,
    with its shape and the shape expected, the same in every loader."""
    state = dict(canonical(), **{"q_proj.weight": np.zeros((16, E), np.float32)})
    for message in _both(state):
        assert message == ("state_dict (layout 'mha_torch'): 'q_proj.weight' has shape (16, 10), expected (12, 10) "
                           "(num_heads=4 x head_dim=3 rows)")


def test_missing_and_misshaped_keys_in_one_error():
    """A missing weight does not hide a mis-shaped bias, a mis-shaped output weight or a key
    the module lacks; each is named once, as the file names it."""
    state = {k: v for k, v in foreign("hf", canonical()).items() if k != "k_proj.weight"}
    state.update({"q_proj.bias": np.zeros(7, np.float32), "o_proj.weight": np.zeros((E, 13), np.float32),
                  "q_norm.weight": np.ones(D, np.float32), "k_norm.weight": np.ones(D, np.float32)})
    jax_message, torch_message, no_module = _both(state, layout="hf")
    assert jax_message == torch_message
    for part in ("missing key 'k_proj.weight'",
                 "'q_proj.bias' has shape (7,), expected (12,) (num_heads=4 x head_dim=3 rows)",
                 "'o_proj.weight' has shape (10, 13), expected (10, 12) (num_heads=4 x head_dim=3 columns)"):
        assert jax_message.count(part) == 1 and no_module.count(part) == 1, (part, jax_message, no_module)
    assert "unexpected key 'q_norm.weight': the module has no q_norm.weight (normalize_qk=False)" in jax_message
    assert "k_proj.bias" not in jax_message and "v_proj" not in jax_message and "k_norm.weight' has" not in jax_message


def test_module_options_missing_from_the_file_are_named():
    """A module with sinks, or an output bias, that the file lacks: named with the option and
    the shape; a file without an output bias loads into a module without one."""
    state = canonical()
    for module in (mha_jax.MultiHeadAttention(H, E, H * D, num_kv_heads=KV, use_sinks=True, rngs=nnx.Rngs(0)),
                   mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV, qkv_dim=H * D, use_sinks=True)):
        with pytest.raises(ValueError,
                           match=r"missing key 'sinks': the module has sinks \(use_sinks\) of shape \(4,\)"):
            (mha_jax if isinstance(module, nnx.Module) else mha_torch).load_weights(module, state)
    no_out_bias = {k: v for k, v in state.items() if k != "out_proj.bias"}
    with pytest.raises(ValueError, match=r"missing key 'out_proj.bias': the module has out_proj.bias of shape \(10,\)"):
        mha_torch.load_weights(_torch_module(), no_out_bias)
    module = mha_torch.MultiHeadAttention(E, H, num_kv_heads=KV, qkv_dim=H * D, out_bias=False)
    mha_torch.load_weights(module, no_out_bias)
    model = mha_jax.MultiHeadAttention(H, E, H * D, num_kv_heads=KV, use_out_bias=False, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, no_out_bias)
    assert all(same_bits(module.state_dict()[k], v) and same_bits(mha_jax.to_torch(model)[k], v)
               for k, v in no_out_bias.items())


# layout -> what ``detect_layout`` says of the keys ``foreign`` writes
DETECTED = {"torch_mha": "torch_mha", "torch_mha_kdim": "torch_mha", "hf": "hf", "bert": "bert",
            "fused_qkv": "fused_qkv"}


@pytest.mark.parametrize("layout", ["auto", None], ids=["auto", "not given"])
@pytest.mark.parametrize("name", list(DETECTED))
def test_layout_auto_reads_what_the_keys_show(name, layout):
    """``layout="auto"``, and no layout given: the one the keys show, in ``from_torch`` and
    both ``load_weights`` (as ``mha-parity verify`` reads a file)."""
    kv = H if name.startswith("torch_mha") else KV
    state = canonical(kv)
    theirs = foreign(name, state)
    assert layouts.detect_layout(theirs) == DETECTED[name]
    kwargs = {k: v for k, v in READ[name].items() if k != "layout"}
    kwargs = kwargs if layout is None else dict(kwargs, layout=layout)
    back = mha_jax.to_torch(mha_jax.from_torch(theirs, num_heads=H, num_kv_heads=kv, **kwargs))
    assert all(same_bits(back[k], state[k]) for k in state)
    module = _torch_module(kv)
    mha_torch.load_weights(module, theirs, **kwargs)
    assert all(same_bits(module.state_dict()[k], state[k]) for k in state)
    model = mha_jax.MultiHeadAttention(H, E, H * D, num_kv_heads=kv, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, theirs, **kwargs)
    assert all(same_bits(v, state[k]) for k, v in mha_jax.to_torch(model).items())


def test_a_torch_multihead_attention_state_dict_as_it_is():
    """``torch.nn.MultiheadAttention``'s state dict, no layout given: its weights, in both
    frameworks, and its output."""
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    state = theirs.state_dict()
    params = mha_jax.from_torch(state, num_heads=4)
    named = mha_jax.from_torch(state, num_heads=4, layout="torch_mha")
    assert all(same_bits(params[m][k], named[m][k]) for m in named for k in named[m])
    ours = mha_torch.MultiHeadAttention(32, 4).eval()
    mha_torch.load_weights(ours, state)
    model = mha_jax.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, state)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        expected = theirs(x, x, x, need_weights=False)[0]
        assert torch.allclose(ours(x), expected, atol=1e-6)
    assert np.allclose(np.asarray(model(jnp.asarray(x.numpy()))), expected.numpy(), atol=1e-6)


def test_a_layout_not_given_that_the_keys_do_not_show_is_today_s_error_with_the_candidates():
    """No layout given and keys that fit several layouts or none: read as ``mha_torch`` (the
    default before layouts were read from the keys), whose error names each key and then the
    layouts the keys fit or may be, the same from every loader."""
    several = dict(canonical(), **{"o_proj.weight": canonical()["out_proj.weight"]})
    for message in _both(several):
        assert message.startswith("state_dict (layout 'mha_torch'): unexpected key 'o_proj.weight'")
        assert message.endswith("the keys fit more than one layout (mha_torch, hf); choose one with layout= "
                                "('k_proj.bias', 'k_proj.weight', 'o_proj.weight', 'out_proj.bias', ... (9 in all))")
    none = {"attn.q.weight": np.zeros((H * D, E), np.float32), "attn.qkv.weight": np.zeros((3 * H * D, E), np.float32)}
    for message in _both(none):
        assert "missing key 'q_proj.weight'" in message and "unexpected key 'attn.qkv.weight'" in message
        assert "the keys show no layout ('attn.q.weight', 'attn.qkv.weight'): likely layouts: fused_qkv;" in message
    assert mha_jax.to_torch(mha_jax.from_torch(several, num_heads=H, num_kv_heads=KV,
                                               ignore=["o_proj"])).keys() == canonical().keys()


def test_detect_layout_names_ours_flax_and_the_likely_layouts():
    detect = layouts.detect_layout
    assert detect(canonical()) == "mha_torch"
    assert detect(["params.query.kernel", "params.out.kernel"]) == "flax"
    with pytest.raises(ValueError, match=r"fit more than one layout \(mha_torch, hf\)"):
        detect(dict(canonical(), **{"o_proj.weight": 0}))
    with pytest.raises(ValueError) as info:
        detect(["attn.q.weight", "attn.qkv.weight"])
    assert "likely layouts: fused_qkv;" in str(info.value)
    assert "one of mha_torch, torch_mha, hf, bert, fused_qkv, flax" in str(info.value)
    with pytest.raises(ValueError, match="layout 'flax' is Flax parameter names"):
        mha_jax.from_torch({"query.kernel": np.zeros((E, H, D)), "out.kernel": np.zeros((H, D, E))}, num_heads=H,
                           layout="auto")
    with pytest.raises(ValueError, match="the keys look like layout 'hf'"):  # a layout given wrong
        mha_jax.from_torch(foreign("hf", canonical()), num_heads=H, num_kv_heads=KV, layout="bert")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prefix=3), TypeError, "prefix must be a str"),
    (dict(ignore="output.LayerNorm"), TypeError, "ignore must be a sequence of non-empty str"),
    (dict(mapping=[("q_proj", "q")]), TypeError, "mapping must be a mapping"),
])
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        mha_jax.from_torch(canonical(), num_heads=H, num_kv_heads=KV, **kwargs)
    with pytest.raises(error, match=message):
        mha_torch.load_weights(_torch_module(), canonical(), **kwargs)


def test_the_specification_imports_no_framework():
    """Both twins import the one specification package, so it may import neither framework."""
    for path in sorted((ROOT / "mha_spec").glob("*.py")):
        imports = [line for line in path.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert not [line for line in imports if "jax" in line or "torch" in line or "flax" in line], (path, imports)


# --- torch.nn.MultiheadAttention, both ways ---------------------------------------------------


@pytest.mark.parametrize("kdim", [None, 7])
def test_torch_mha_round_trip(kdim):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(12, 4, kdim=kdim, vdim=kdim, dropout=0.25, dtype=torch.float64)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_()
    theirs.eval()
    ours = mha_torch.from_torch_mha(theirs)
    assert (ours.embed_dim, ours.num_heads, ours.kdim, ours.dropout, ours.training) == (12, 4, kdim or 12, 0.25, False)
    assert ours.q_proj.weight.dtype == torch.float64
    again = mha_torch.to_torch_mha(ours)
    assert again.batch_first and again.dropout == 0.25 and not again.training
    assert again._qkv_same_embed_dim == (kdim is None)
    before = {k: v.clone() for k, v in theirs.state_dict().items()}
    with torch.no_grad():  # the copies share no memory with the modules they came from
        ours.q_proj.weight.add_(1.0)
        ours.out_proj.bias.add_(1.0)
    for name, tensor in before.items():
        assert torch.equal(again.state_dict()[name], tensor) and torch.equal(theirs.state_dict()[name], tensor), name


def test_torch_mha_options_we_do_not_have_are_errors():
    with pytest.raises(ValueError, match="add_bias_kv=True and add_zero_attn=True"):
        mha_torch.from_torch_mha(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True))
    with pytest.raises(ValueError, match="add_zero_attn=True"):  # it leaves no key in the state dict
        mha_torch.from_torch_mha(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention, got MultiHeadAttention"):
        mha_torch.from_torch_mha(mha_torch.MultiHeadAttention(8, 2))


def test_to_torch_mha_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError) as info:
        mha_torch.to_torch_mha(mha_torch.MultiHeadAttention(8, 4, num_kv_heads=2, qkv_dim=12, out_dim=6))
    message = str(info.value)
    for part in ("num_kv_heads=2 differs from num_heads=4", "qkv_dim=12 differs from embed_dim=8",
                 "out_dim=6 differs from embed_dim=8"):
        assert part in message
    with pytest.raises(TypeError, match="module must be an mha_torch.MultiHeadAttention"):
        mha_torch.to_torch_mha(torch.nn.MultiheadAttention(8, 2))


# --- masks in torch.nn.MultiheadAttention's convention -----------------------------------------

T, F_ = True, False
INF = float("-inf")
# (attn_mask, key_padding_mask, num_heads) -> ours (mask, bias); theirs True = ignore, ours True = attend
FROM_CASES = {
    "2-d bool": (np.array([[F_, T], [F_, F_]]), None, None, (np.array([[T, F_], [T, T]]), None)),
    "padding bool": (None, np.array([[F_, F_, T]]), None, (np.array([[[[T, T, F_]]]]), None)),
    "3-d bool": (np.array([[[T]], [[F_]], [[F_]], [[T]]]), None, 2,
                 (np.array([[[[F_]], [[T]]], [[[T]], [[F_]]]]), None)),
    "both bool": (np.array([[F_, T]]), np.array([[F_, F_], [T, F_]]), None,
                  (np.array([[[[T, F_]]], [[[F_, F_]]]]), None)),
    "float and bool": (np.array([[0.5, -1.0]], np.float32), np.array([[T, F_]]), None,
                       (np.array([[[[F_, T]]]]), np.array([[0.5, -1.0]], np.float32))),
    "float only": (None, np.array([[0.0, -2.0]]), None, (None, np.array([[[[0.0, -2.0]]]]))),
    "two floats": (np.array([[1.0, 0.0]]), np.array([[0.0, -2.0]]), None, (None, np.array([[[[1.0, -2.0]]]]))),
}


@pytest.mark.parametrize("name", list(FROM_CASES))
def test_mask_from_torch_mha(name):
    """A (mask, bias) pair: bool parts in ``mask``, float parts in ``bias`` (JAX reads a float
    mask as nonzero = attend, so an additive one must not come back as a mask)."""
    attn, padding, heads, expected = FROM_CASES[name]
    as_torch = lambda x: None if x is None else torch.from_numpy(x)  # noqa: E731
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    for ours in (mha_torch.mask_from_torch_mha(as_torch(attn), as_torch(padding), num_heads=heads),
                 mha_jax.mask_from_torch_mha(as_jax(attn), as_jax(padding), num_heads=heads)):
        for got, want in zip(ours, expected):
            assert (got is None) == (want is None), (ours, expected)
            if want is not None:
                got = np.asarray(got)
                assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), (got, want)
    assert mha_torch.mask_from_torch_mha() == (None, None) and mha_jax.mask_from_torch_mha() == (None, None)


# ours -> (shape, theirs)
TO_CASES = {
    "causal": (np.tri(2, 3, dtype=bool)[None, None], (2, 4, 2, 3), np.array([[F_, T, T], [F_, F_, T]])),
    "0/1 per batch": (np.array([[1, 0]])[:, None, None, :].repeat(2, 0) * np.array([1, 0])[:, None, None, None],
                      (2, 2, 1, 2), np.array([[[F_, T]], [[F_, T]], [[T, T]], [[T, T]]])),
}
# ours (mask, bias) -> (shape, theirs), a float attn_mask whenever there is a bias
TO_BIAS_CASES = {
    "bias": (None, np.array([0.0, -1.5], np.float32), (1, 1, 2, 2), np.array([[0.0, -1.5], [0.0, -1.5]], np.float32)),
    "mask and bias": (np.array([T, F_]), np.array([0.5, -1.5], np.float32), (1, 1, 2, 2),
                      np.array([[0.5, INF], [0.5, INF]], np.float32)),
}


@pytest.mark.parametrize("name", list(TO_CASES))
def test_mask_to_torch_mha(name):
    ours, shape, expected = TO_CASES[name]
    for theirs in (mha_torch.mask_to_torch_mha(torch.from_numpy(ours), shape),
                   mha_jax.mask_to_torch_mha(jnp.asarray(ours), shape)):
        theirs = np.asarray(theirs)
        assert theirs.dtype == expected.dtype and np.array_equal(theirs, expected), (theirs, expected)


@pytest.mark.parametrize("name", list(TO_BIAS_CASES))
def test_mask_and_bias_to_torch_mha(name):
    mask, bias, shape, expected = TO_BIAS_CASES[name]
    as_torch = lambda x: None if x is None else torch.from_numpy(x)  # noqa: E731
    as_jax = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    for theirs in (mha_torch.mask_to_torch_mha(as_torch(mask), shape, bias=as_torch(bias)),
                   mha_jax.mask_to_torch_mha(as_jax(mask), shape, bias=as_jax(bias))):
        theirs = np.asarray(theirs)
        assert theirs.dtype == expected.dtype and np.array_equal(theirs, expected), (theirs, expected)


@pytest.mark.parametrize("function, args, error, message", [
    ("mask_from_torch_mha", [np.zeros((4, 2, 2), bool)], ValueError,
     r"needs num_heads dividing its first axis; got shape \(4, 2, 2\) and num_heads=None"),
    ("mask_from_torch_mha", [np.zeros((2,), bool)], ValueError, r"attn_mask must have rank 2 .* got shape \(2,\)"),
    ("mask_from_torch_mha", [None, np.zeros((2, 3), np.int64)], TypeError,
     "key_padding_mask must be bool or floating, got dtype"),
    ("mask_from_torch_mha", [np.zeros((2, 3), bool), np.zeros((2, 4), bool)], ValueError,
     r"disagree on kv_len: shapes \(2, 3\) and \(2, 4\)"),
    ("mask_to_torch_mha", [np.ones((3, 2), bool), (1, 1, 2, 3)], ValueError,
     r"mask of shape \(3, 2\) does not broadcast"),
])
def test_mask_helpers_reject_alike(function, args, error, message):
    for package, convert in ((mha_torch, torch.from_numpy), (mha_jax, jnp.asarray)):
        converted = [convert(a) if isinstance(a, np.ndarray) else a for a in args]
        with pytest.raises(error, match=message):
            getattr(package, function)(*converted)


# --- files: .safetensors out of both sides, Flax parameter files into to_torch --------------


def test_safetensors_out_of_both_sides_and_back_bitwise(tmp_path):
    torch_layer = _torch_module(dtype=torch.bfloat16)
    save_torch(torch_layer.state_dict(), tmp_path / "torch.safetensors")
    params = mha_jax.from_torch(tmp_path / "torch.safetensors", num_heads=H, num_kv_heads=KV)
    save_numpy(mha_jax.to_torch(params), tmp_path / "jax.safetensors")  # bfloat16 (ml_dtypes) included
    again = _torch_module(dtype=torch.bfloat16)
    mha_torch.load_weights(again, tmp_path / "jax.safetensors")
    for name, tensor in torch_layer.state_dict().items():
        assert same_bits(again.state_dict()[name], tensor), name


@pytest.mark.parametrize("suffix", [".msgpack", ".safetensors"])
def test_flax_parameter_files_convert_to_torch(tmp_path, suffix):
    model = nnx.MultiHeadAttention(H, E, H * D, num_kv_heads=KV, decode=False, param_dtype=jnp.bfloat16,
                                   bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    tree = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    path = tmp_path / f"params{suffix}"
    if suffix == ".msgpack":
        path.write_bytes(msgpack_serialize({"params": tree}))  # linen variables, as flax saves them
    else:
        save_numpy({f"{a}.{b}": np.asarray(v) for a, d in tree.items() for b, v in d.items()}, path)
    from_file, direct = mha_jax.to_torch(path), mha_jax.to_torch(model)
    assert set(from_file) == set(direct)
    for name, value in direct.items():
        assert same_bits(value, from_file[name]), name


def test_bad_parameter_files_are_value_errors(tmp_path):
    bad = tmp_path / "params.msgpack"
    bad.write_bytes(b"\xc1 not msgpack")
    with pytest.raises(ValueError, match="is not a readable parameter file"):
        mha_jax.to_torch(bad)
    with pytest.raises(ValueError, match=r"params must be a \.msgpack or \.safetensors file"):
        mha_jax.to_torch(tmp_path / "params.pt")


def test_ranks_are_checked_after_renaming():
    """Named as the file names it; the shape a module expects when there is one."""
    state = dict(foreign("hf", canonical()), **{"o_proj.weight": np.zeros((E, 12, 1), np.float32)})
    with pytest.raises(ValueError, match=r"'o_proj.weight' has shape \(10, 12, 1\), expected rank 2"):
        mha_jax.from_torch(state, num_heads=H, num_kv_heads=KV, layout="hf")
    jax_message, torch_message, _ = _both(state, layout="hf")
    assert jax_message == torch_message == ("state_dict (layout 'hf'): 'o_proj.weight' has shape (10, 12, 1), "
                                            "expected (10, 12)")


def test_key_and_value_weights_without_rows_are_named():
    """Key/value weights with no rows fit no head count: each is named with the rows expected."""
    kv = ("k_proj", "v_proj")
    state = dict(canonical(bias=False), **{f"{p}.weight": np.zeros((0, E), np.float32) for p in kv})
    named = [f"'{p}.weight' has shape (0, 10), expected (6, 10) (num_kv_heads=2 x head_dim=3 rows)" for p in kv]
    for message in _both(state):
        assert message.endswith("; ".join(named)), message
