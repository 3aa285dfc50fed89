"""A transformers model whose SDPA attention runs ``mha_torch.dot_product_attention``: transformers'
``sdpa_attention_forward`` calls ``torch.nn.functional.scaled_dot_product_attention`` with its own
positional and keyword arguments (``attn_mask``, ``dropout_p``, ``scale``, ``is_causal``, and
``enable_gqa`` where it groups heads); put ours in that place, its code runs ours unchanged.

A tiny ``LlamaForCausalLM`` (random weights from a config, nothing downloaded, float64, grouped
key/value heads): the logits with ours equal the stock SDPA run's (1e-12) and the eager run's
(transformers' RMSNorm and eager softmax compute in float32 whatever the input: both kept in float64
here, or float32's rounding would hide any difference below it), without a padding mask
(``is_causal`` alone, ``enable_gqa``), with a left-padded batch (a bool ``attn_mask``, key/value
heads repeated) and for one decoded token after it (a query of one token: transformers packs each
group's query heads as one head's queries).
"""

from __future__ import annotations

import pytest
import torch

import mha_torch

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
BATCH, LENGTH, PAD = 2, 7, 3  # the second row's first PAD tokens are padding


@pytest.fixture(autouse=True)
def _rms_norm_in_float64(monkeypatch):
    """``LlamaRMSNorm`` in its input's dtype (transformers' casts to float32)."""
    from transformers.models.llama import modeling_llama

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def _model(attn_implementation: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG, attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval()


def _inputs(padded: bool):
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(BATCH, LENGTH, dtype=torch.long)
    if padded:
        valid[1, :PAD] = 0
    return ids, valid


def _ours_in_sdpas_place(monkeypatch, implementation=None) -> list:
    """Ours as ``torch.nn.functional.scaled_dot_product_attention`` (``implementation``: None, the default, or
    one named); the list gets each call's count of positional arguments and its keywords."""
    calls = []

    def counted(*args, **kwargs):
        calls.append((len(args), sorted(kwargs)))
        return mha_torch.dot_product_attention(*args, **kwargs, implementation=implementation)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


def _eager_logits(ids, valid, decode: bool):
    """The eager run's logits, its softmax in float64 (in float32, the padding queries' rows of float64's
    lowest value would be NaN)."""
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, dtype=None, **kwargs):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "softmax", softmax64)
        return _logits(_model("eager"), ids, valid, decode)


def _logits(model, ids, valid, decode: bool):
    """The logits of ``ids`` (batch, length, vocab), or with ``decode`` those of the last token alone after the
    others went through the cache."""
    with torch.no_grad():
        if not decode:
            return model(input_ids=ids, attention_mask=valid).logits
        past = model(input_ids=ids[:, :-1], attention_mask=valid[:, :-1], use_cache=True).past_key_values
        return model(input_ids=ids[:, -1:], attention_mask=valid, past_key_values=past).logits


@pytest.mark.parametrize("implementation", [None, "math"])
@pytest.mark.parametrize("padded, decode", [(False, False), (True, False), (True, True)],
                         ids=["no padding", "left padding", "one token decoded after left padding"])
def test_llama_logits_with_ours_in_sdpas_place(monkeypatch, padded, decode, implementation):
    ids, valid = _inputs(padded)
    sdpa = _model("sdpa")
    stock = _logits(sdpa, ids, valid, decode)
    eager = _eager_logits(ids, valid, decode)
    calls = _ours_in_sdpas_place(monkeypatch, implementation)
    mine = _logits(sdpa, ids, valid, decode)
    assert len(calls) == CONFIG["num_hidden_layers"] * (2 if decode else 1)
    assert all(positional == 3 and "attn_mask" in kwargs for positional, kwargs in calls)
    if not padded:
        assert all("enable_gqa" in kwargs for _, kwargs in calls)
    real = valid[:, -mine.shape[1]:].bool()  # eager and SDPA differ at the padding queries, which see no key
    torch.testing.assert_close(mine, stock, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine[real], eager[real], rtol=1e-12, atol=1e-12)
    assert not torch.equal(stock, _logits(_model("sdpa"), ids.flip(1), valid, decode))  # the inputs matter
