"""The public calls gather their masking arguments by name (``batch_axes.Masking``, every name given):
every parameter of each signature is either one of ``batch_axes.MASKING`` or one the body passes
on by name, so a parameter added to a signature and to neither list fails here."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import mha_jax
import mha_jax.linen
import mha_torch
from mha_spec import arguments, batch_axes

_MODULE_CALL = {"deterministic", "rngs", "sow_weights", "decode", "out_sharding", "qkv_sharding", "dropout_mask",
                "return_weights"}
# each public call and its parameters that are not masking arguments
CALLS = {
    mha_jax.dot_product_attention: {"query", "key", "value", "scale", "logit_soft_cap", "sinks", "dropout_rate",
                                    "dropout_rng", "dropout_mask", "return_weights", "precision", "implementation",
                                    "sequence_axis", "return_residual"},
    mha_torch.dot_product_attention: {"query", "key", "value", "scale", "logit_soft_cap", "sinks", "dropout_p",
                                      "dropout_mask", "need_weights", "implementation", "attn_mask", "enable_gqa"},
    mha_jax.MultiHeadAttention.__call__: {"self", "inputs_q", "inputs_k", "inputs_v"} | _MODULE_CALL,
    # _paged: paged_step's way into linen's one compact method, which makes the submodules
    mha_jax.linen.MultiHeadDotProductAttention.__call__: {"self", "inputs_q", "inputs_k", "inputs_v", "inputs_kv",
                                                          "deterministic", "dropout_rng", "sow_weights",
                                                          "dropout_mask", "return_weights", "_paged"},
    mha_torch.MultiHeadAttention.forward: {"self", "query", "key", "value", "need_weights", "dropout_mask", "cache"},
}


MODULE_CALLS = (mha_jax.MultiHeadAttention.__call__, mha_jax.linen.MultiHeadDotProductAttention.__call__,
                mha_torch.MultiHeadAttention.forward)


@pytest.mark.parametrize("call", CALLS, ids=lambda call: f"{call.__module__}.{call.__qualname__}")
def test_every_parameter_is_masking_or_passed_by_name(call):
    parameters = inspect.signature(call).parameters
    named = {name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    unknown = named - CALLS[call] - set(batch_axes.MASKING)
    assert not unknown, f"{call.__qualname__}: parameters neither in batch_axes.MASKING nor passed on: {unknown}"
    if call in MODULE_CALLS:  # the position terms by name, **masking: each one is picked as MASKING names it
        assert parameters["masking"].kind is inspect.Parameter.VAR_KEYWORD
        assert set(arguments.PositionMasking.__annotations__) <= set(batch_axes.MASKING) - named


def test_a_module_call_names_an_unknown_keyword():
    x = np.zeros((1, 3, 8), np.float32)
    modules = {
        "MultiHeadAttention.__call__": mha_jax.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0)),
        "MultiHeadAttention.forward": mha_torch.MultiHeadAttention(8, 2),
    }
    for name, module in modules.items():
        with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'query_position'"):
            module(x if "call" in name else torch.from_numpy(x), query_position=np.arange(3))
    linen = mha_jax.linen.MultiHeadDotProductAttention(num_heads=2)
    with pytest.raises(TypeError, match="MultiHeadDotProductAttention.__call__\\(\\) got an unexpected keyword "
                                        "argument 'key_segment_id'"):
        linen.init(jax.random.key(0), x, key_segment_id=np.zeros((1, 3), np.int32))


def test_masking_takes_every_name_and_no_other():
    given = dict.fromkeys(batch_axes.Masking._fields)
    assert batch_axes.Masking(**given)._asdict() == given
    with pytest.raises(TypeError, match="scale"):
        batch_axes.Masking(**given, scale=3)
    with pytest.raises(TypeError, match="alibi_slopes"):
        batch_axes.Masking(**{n: None for n in batch_axes.Masking._fields if n != "alibi_slopes"})
    own = dict(mask=1, bias=2, is_causal=False, dropout_mask=4)
    picked = batch_axes.call_masking((2, 0), 8, None, dict(local_window_size=None), **own)
    assert picked["local_window_size"] == (2, 0) and picked["attention_chunk_size"] == 8 and picked["mask"] == 1
    assert batch_axes.call_masking((2, 0), None, None, dict(local_window_size=3), **own)["local_window_size"] == 3
    with pytest.raises(TypeError, match="dropout_mask"):
        batch_axes.call_masking((2, 0), None, None, dict(local_window_size=3), mask=1, bias=2, is_causal=False)


def test_a_module_call_passes_its_masking_keywords_on():
    """A position keyword given to each module call reaches the attention: ``key_value_seq_lengths`` of 2
    (and a window of (1, 0)) give what the same call gives with the equivalent boolean ``mask``."""
    x = np.random.default_rng(0).standard_normal((1, 4, 8)).astype(np.float32)
    pos = np.arange(4)
    allowed = (pos[None, :] < 2) & (pos[:, None] - pos[None, :] <= 1) & (pos[:, None] >= pos[None, :])
    masking = dict(key_value_seq_lengths=np.array([2]), local_window_size=(1, 0), is_causal=True)
    nnx_module = mha_jax.MultiHeadAttention(2, 8, rngs=nnx.Rngs(0))
    torch_module = mha_torch.MultiHeadAttention(8, 2)
    linen = mha_jax.linen.MultiHeadDotProductAttention(num_heads=2)
    params = linen.init(jax.random.key(0), x)
    pairs = {
        "nnx": (nnx_module(x, **masking), nnx_module(x, mask=allowed)),
        "linen": (linen.apply(params, x, **masking), linen.apply(params, x, mask=allowed)),
        "torch": tuple(module_out.detach().numpy() for module_out in (
            torch_module(torch.from_numpy(x), is_causal=True, local_window_size=(1, 0),
                         key_value_seq_lengths=torch.tensor([2])),
            torch_module(torch.from_numpy(x), mask=torch.from_numpy(allowed)))),
    }
    for name, (by_keywords, by_mask) in pairs.items():
        assert np.abs(np.asarray(by_keywords) - np.asarray(by_mask)).max() <= 1e-6, name
