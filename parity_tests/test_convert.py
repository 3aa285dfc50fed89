"""Weight conversion: bitwise round trips, every input form, and errors that list every problem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

import mha_jax
import mha_torch
from parity_tests.tool.arrays import same_bits

TORCH_DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def _torch_module(dtype=torch.float32, bias=True, kv_heads=2):
    torch.manual_seed(0)
    return mha_torch.MultiHeadAttention(
        16, 4, num_kv_heads=kv_heads, kdim=10, vdim=10, qkv_dim=24, out_dim=12, bias=bias, dtype=dtype
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_to_flax_to_torch_is_bitwise(dtype, bias):
    module = _torch_module(dtype, bias)
    with torch.no_grad():
        for p in module.parameters():  # awkward bits: -0.0 and subnormals survive too
            p.view(-1)[0] = -0.0
            p.view(-1)[1] = torch.finfo(dtype).tiny / 4
    state = module.state_dict()
    params = mha_jax.from_torch(state, num_heads=4, num_kv_heads=2)
    assert params["query"]["kernel"].shape == (16, 4, 6)
    assert params["key"]["kernel"].shape == (10, 2, 6)
    assert params["out"]["kernel"].shape == (4, 6, 12)
    assert ("bias" in params["query"]) == bias
    back = mha_jax.to_torch(params)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert same_bits(back[name], tensor), name
    reloaded = _torch_module(dtype, bias)
    mha_torch.load_weights(reloaded, back)
    for name, tensor in state.items():
        assert same_bits(reloaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("param_dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
def test_flax_to_torch_to_flax_is_bitwise(param_dtype):
    model = mha_jax.MultiHeadAttention(
        4, 16, 24, 12, num_kv_heads=2, in_kv_features=10, param_dtype=param_dtype,
        bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0),
    )
    state = mha_jax.to_torch(model)
    again = mha_jax.MultiHeadAttention(
        4, 16, 24, 12, num_kv_heads=2, in_kv_features=10, param_dtype=param_dtype, rngs=nnx.Rngs(1)
    )
    mha_jax.load_weights(again, state)
    a, b = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (model, again))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype == param_dtype
        assert same_bits(x, y)
    # linen variables and the raw dict give the same state dict
    linen_vars = {"params": mha_jax.from_torch(state, num_heads=4, num_kv_heads=2)}
    for name, value in mha_jax.to_torch(linen_vars).items():
        assert same_bits(value, state[name])


def test_safetensors_files_load_on_both_sides(tmp_path):
    module = _torch_module(torch.bfloat16)
    torch_file, numpy_file = tmp_path / "t.safetensors", tmp_path / "n.safetensors"
    save_torch(module.state_dict(), torch_file)
    params = mha_jax.from_torch(str(torch_file), num_heads=4, num_kv_heads=2)
    save_numpy(mha_jax.to_torch(params), numpy_file)
    reloaded = _torch_module(torch.float32)
    reloaded = reloaded.to(torch.bfloat16)
    mha_torch.load_weights(reloaded, numpy_file)
    for name, tensor in module.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    model = mha_jax.MultiHeadAttention(4, 16, 24, 12, num_kv_heads=2, in_kv_features=10,
                                       param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, torch_file)
    assert same_bits(model.query.kernel.get_value(), params["query"]["kernel"])


def test_loading_casts_to_the_module_dtype_and_copies():
    module = _torch_module(torch.float64)
    state = module.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    model = mha_jax.MultiHeadAttention(4, 16, 24, 12, num_kv_heads=2, in_kv_features=10, rngs=nnx.Rngs(0))
    mha_jax.load_weights(model, state)
    assert model.query.kernel.get_value().dtype == jnp.float32
    params = mha_jax.from_torch(state, num_heads=4, num_kv_heads=2)
    params["query"]["kernel"][...] = 7.0  # the result owns its memory
    for k, v in state.items():
        assert torch.equal(v, before[k]), k
    target = _torch_module(torch.float32)
    numpy_state = {k: v.numpy() for k, v in before.items()}
    mha_torch.load_weights(target, numpy_state)
    target.state_dict()["q_proj.weight"].add_(1.0)
    assert np.array_equal(numpy_state["q_proj.weight"], before["q_proj.weight"].numpy())


def test_from_torch_lists_every_problem():
    state = dict(_torch_module().state_dict())
    del state["k_proj.weight"]
    state["extra.weight"] = torch.zeros(2)
    state["v_proj.bias"] = torch.zeros(5)
    with pytest.raises(ValueError) as info:
        mha_jax.from_torch(state, num_heads=4, num_kv_heads=2)
    message = str(info.value)
    assert "missing key 'k_proj.weight'" in message and "unexpected key 'extra.weight'" in message


def test_from_torch_rejects_wrong_head_counts_and_shapes():
    state = _torch_module().state_dict()
    with pytest.raises(ValueError, match="no head_dim fits num_heads=5 and num_kv_heads=5 "
                                         "\\(shapes: 'q_proj.weight' \\(24, 16\\)"):
        mha_jax.from_torch(state, num_heads=5)
    with pytest.raises(ValueError) as info:
        mha_jax.from_torch(state, num_heads=4)  # two kv heads read as four
    assert "'k_proj.weight' has shape (12, 10), expected (24, 10) (num_kv_heads=4 x head_dim=6 rows)" in str(info.value)
    assert "the key/value rows fit num_kv_heads=2 (head_dim=6), not num_kv_heads=4" in str(info.value)
    assert "q_proj" not in str(info.value) and "out_proj" not in str(info.value)
    bad = dict(state, **{"q_proj.bias": torch.zeros(23), "out_proj.bias": torch.zeros(3)})
    with pytest.raises(ValueError) as info:
        mha_jax.from_torch(bad, num_heads=4, num_kv_heads=2)
    assert "'q_proj.bias' has shape (23,)" in str(info.value) and "'out_proj.bias' has shape (3,)" in str(info.value)


def test_load_weights_list_every_mismatch_in_both_frameworks():
    state = _torch_module().state_dict()
    small_jax = mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as info:
        mha_jax.load_weights(small_jax, state)
    jax_message = str(info.value)
    assert "'q_proj.weight' has shape (24, 16), expected (16, 16) (num_heads=4 x head_dim=4 rows)" in jax_message
    assert "'k_proj.weight' has shape (12, 10), expected (8, 16)" in jax_message and "'out_proj.weight'" in jax_message
    small_torch = mha_torch.MultiHeadAttention(16, 4, num_kv_heads=2, bias=False)
    with pytest.raises(ValueError) as info:
        mha_torch.load_weights(small_torch, state)
    message = str(info.value)
    assert ("unexpected key 'q_proj.bias'" in message
            and "'q_proj.weight' has shape (24, 16), expected (16, 16)" in message)
    small_jax = mha_jax.MultiHeadAttention(4, 16, num_kv_heads=2, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as info:
        mha_jax.load_weights(small_jax, state)
    assert str(info.value) == message


@pytest.mark.parametrize("bad", ["not-a-file.bin", 42])
def test_bad_sources_are_named(bad, tmp_path):
    with pytest.raises((ValueError, TypeError), match="state_dict_or_path"):
        mha_jax.from_torch(bad, num_heads=4)
    with pytest.raises((ValueError, TypeError), match="state_dict_or_path"):
        mha_torch.load_weights(_torch_module(), bad)


def test_truncated_safetensors_is_a_value_error(tmp_path):
    path = tmp_path / "w.safetensors"
    save_torch(_torch_module().state_dict(), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        mha_jax.from_torch(path, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        mha_torch.load_weights(_torch_module(), path)


def test_to_torch_rejects_foreign_trees():
    with pytest.raises(ValueError, match="missing 'out'"):
        mha_jax.to_torch({"query": {}, "key": {}, "value": {}, "dense": {}})
    with pytest.raises(TypeError, match="params must be a mapping"):
        mha_jax.to_torch([1, 2])
