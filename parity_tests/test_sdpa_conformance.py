"""``mha_torch.dot_product_attention`` in the place of ``F.scaled_dot_product_attention``: SDPA's own
calls, run through both side by side in float64.

- ``SAME``: calls both take; the outputs and the gradients of query, key, value (and a float
  ``attn_mask``) agree to 1e-12, and ``torch.autograd.detect_anomaly`` stays quiet, with ours
  through both implementations.
- ``REFUSED``: calls SDPA refuses; ours refuses them too, with a message naming the argument.
- ``STRICTER``: calls SDPA takes and ours refuses, on purpose (a rank it does not know, a batch it
  would broadcast, a probability or a scale with no meaning).
- The differences kept on purpose, each a test of its own: key/value heads grouped without
  ``enable_gqa``, an integer mask, and ``attn_mask`` with ``is_causal`` (their conjunction).
- ``dropout_p``: SDPA's draws and ours differ; the meaning is tested (each weight dropped or scaled
  by ``1 / (1 - p)``, at the rate ``p``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mha_torch
from mha_torch import attention

ours = mha_torch.dot_product_attention
B, H, KV_H, L, S, E, EV = 2, 4, 2, 5, 7, 8, 6
F64 = torch.float64


def _randn(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


def _qkv(q=(B, H, L, E), k=(B, H, S, E), v=None):
    v = k[:-1] + (EV,) if v is None else v
    return _randn(*q), _randn(*k), _randn(*v)


def _keys_kept(shape, p=0.3):
    """A bool mask with no row of keys all excluded."""
    allowed = torch.rand(shape) > p
    allowed[..., 0] = True
    return allowed


def _tril(q_len, kv_len):
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril()


# name: () -> (positional arguments, keyword arguments), as SDPA's callers pass them
SAME = {
    "no mask": lambda: (_qkv(), {}),
    "bool attn_mask by position": lambda: ((*_qkv(), _keys_kept((B, 1, L, S))), {}),
    "bool attn_mask by name, (1, kv_len)": lambda: (_qkv(), dict(attn_mask=_keys_kept((1, S)))),
    "bool attn_mask per head": lambda: (_qkv(), dict(attn_mask=_keys_kept((B, H, L, S)))),
    "float attn_mask by position": lambda: ((*_qkv(), _randn(L, S)), {}),
    "float attn_mask with -inf": lambda: (
        (*_qkv(), torch.where(_keys_kept((B, 1, L, S)), _randn(B, 1, L, S), -torch.inf)), {}),
    "float32 attn_mask for float64 inputs": lambda: ((*_qkv(), _randn(L, S, dtype=torch.float32)), {}),
    "a row with every key excluded (bool)": lambda: ((*_qkv(), _keys_kept((L, S)).index_fill(0, torch.tensor(2),
                                                                                            False)), {}),
    "a row with every key at -inf (float)": lambda: (
        (*_qkv(), _randn(L, S).index_fill(0, torch.tensor(2), -torch.inf)), {}),
    "positional attn_mask, dropout_p, is_causal": lambda: ((*_qkv(k=(B, H, L, E)), None, 0.0, True), {}),
    "is_causal, q_len < kv_len (top-left)": lambda: (_qkv(), dict(is_causal=True)),
    "is_causal, q_len > kv_len (top-left)": lambda: (_qkv(q=(B, H, S, E), k=(B, H, L, E)), dict(is_causal=True)),
    "scale": lambda: (_qkv(), dict(scale=0.3)),
    "scale 0": lambda: (_qkv(), dict(scale=0.0)),
    "enable_gqa": lambda: (_qkv(k=(B, KV_H, S, E)), dict(enable_gqa=True)),
    "enable_gqa, is_causal": lambda: (_qkv(k=(B, KV_H, L, E)), dict(is_causal=True, enable_gqa=True)),
    "enable_gqa, bool attn_mask": lambda: (_qkv(k=(B, KV_H, S, E)), dict(attn_mask=_keys_kept((B, 1, L, S)),
                                                                          enable_gqa=True)),
    "enable_gqa with as many key/value heads": lambda: (_qkv(), dict(enable_gqa=True)),
    "enable_gqa=False": lambda: (_qkv(), dict(enable_gqa=False)),
    "rank 3 (one example)": lambda: (_qkv(q=(H, L, E), k=(H, S, E)), {}),
    "rank 3, attn_mask (heads, q_len, kv_len)": lambda: ((*_qkv(q=(H, L, E), k=(H, S, E)), _keys_kept((H, L, S))), {}),
    "rank 3, float attn_mask": lambda: ((*_qkv(q=(H, L, E), k=(H, S, E)), _randn(L, S)), {}),
    "rank 3, is_causal": lambda: (_qkv(q=(H, L, E), k=(H, L, E)), dict(is_causal=True)),
    "rank 3, enable_gqa": lambda: (_qkv(q=(H, L, E), k=(KV_H, S, E)), dict(enable_gqa=True)),
    "one query": lambda: (_qkv(q=(B, H, 1, E)), {}),
    "no keys": lambda: (_qkv(k=(B, H, 0, E)), {}),
    "no queries": lambda: (_qkv(q=(B, H, 0, E)), {}),
}


def _grads(out, inputs):
    """The gradients of a fixed projection of ``out`` with respect to ``inputs`` (zeros where none flows)."""
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True, materialize_grads=True)


def _differentiable(args, kwargs):
    """Fresh copies of the call's floating tensors, requiring gradients, and the call over them."""
    args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    kwargs = {n: a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for n, a in kwargs.items()}
    leaves = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor) and a.requires_grad]
    return args, kwargs, leaves


@pytest.mark.parametrize("implementation", attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(SAME))
def test_sdpa_calls_give_sdpa_results(name, implementation):
    torch.manual_seed(0)
    args, kwargs = SAME[name]()
    args, kwargs, leaves = _differentiable(args, kwargs)
    theirs = F.scaled_dot_product_attention(*args, **kwargs)
    with torch.autograd.detect_anomaly(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # detect_anomaly announces itself
        mine = ours(*args, **kwargs, implementation=implementation)
        my_grads = _grads(mine, leaves)
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    for m, t in zip(my_grads, _grads(theirs, leaves)):
        assert torch.isfinite(m).all()
        torch.testing.assert_close(m, t, rtol=1e-12, atol=1e-12)


def test_mha_torch_keywords_stay_beside_sdpas():
    """Ours by their own names: ``mask=`` is ``attn_mask``, ``is_causal``/``dropout_p`` by name as before."""
    torch.manual_seed(0)
    q, k, v = _qkv(k=(B, KV_H, L, E))
    allowed = _keys_kept((B, 1, L, L))
    expected = F.scaled_dot_product_attention(q, k, v, allowed & _tril(L, L), enable_gqa=True)
    for call in (dict(mask=allowed, is_causal=True, dropout_p=0.0), dict(attn_mask=allowed, is_causal=True)):
        torch.testing.assert_close(ours(q, k, v, **call), expected, rtol=1e-12, atol=1e-12)
    out, weights = ours(q[0], k[0], v[0], mask=allowed[0], is_causal=True, need_weights=True)
    assert out.shape == (H, L, EV) and weights.shape == (H, L, L)
    torch.testing.assert_close(out, expected[0], rtol=1e-12, atol=1e-12)


def test_positional_scale_is_refused_as_sdpa_refuses():
    q, k, v = _qkv()
    for fn in (F.scaled_dot_product_attention, ours):
        with pytest.raises(TypeError, match="positional argument"):
            fn(q, k, v, None, 0.0, False, 0.5)


# name: (() -> (args, kwargs), our exception, our message); SDPA refuses each (any exception)
REFUSED = {
    "attn_mask of a wrong shape": (lambda: ((*_qkv(), torch.ones(3, S, dtype=torch.bool)), {}), ValueError,
                                   "attn_mask of shape (3, 7) does not broadcast to (batch, heads, q_len, kv_len)"),
    "key/value heads do not divide the heads": (
        lambda: (_qkv(k=(B, 3, S, E)), dict(enable_gqa=True)), ValueError,
        "key/value heads (3) must divide query heads (4)"),
    "key/value heads fewer with enable_gqa=False": (
        lambda: (_qkv(k=(B, KV_H, S, E)), dict(enable_gqa=False)), ValueError,
        "enable_gqa=False needs as many key/value heads as query heads"),
    "key of another head_dim": (lambda: (_qkv(k=(B, H, S, 3), v=(B, H, S, EV)), {}), ValueError,
                                "must match query"),
    "key float32, query float64": (lambda: ((_randn(B, H, L, E), _randn(B, H, S, E, dtype=torch.float32),
                                             _randn(B, H, S, EV)), {}), TypeError, "must share one dtype"),
    "integer inputs": (lambda: (tuple(x.long() for x in _qkv()), {}), TypeError,
                       "query must be a real floating-point array, got dtype int64"),
    "is_causal an integer": (lambda: (_qkv(), dict(is_causal=1)), TypeError, "is_causal must be a bool, got int"),
    "enable_gqa an integer": (lambda: (_qkv(), dict(enable_gqa=1)), TypeError,
                              "enable_gqa must be a bool or None, got int"),
    "dropout_p a string": (lambda: (_qkv(), dict(dropout_p="a")), TypeError, "dropout_p must be a number in [0, 1)"),
    "rank 3 inputs, a batched attn_mask": (
        lambda: ((*_qkv(q=(H, L, E), k=(H, S, E)), torch.ones(1, H, L, S, dtype=torch.bool)), {}), ValueError,
        "attn_mask of shape (1, 4, 5, 7) does not broadcast to (heads, q_len, kv_len) = (4, 5, 7)"),
    "dropout_p above 1": (lambda: (_qkv(), dict(dropout_p=1.5)), ValueError, "dropout_p must be in [0, 1), got 1.5"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_sdpa_refuses_is_refused(name):
    make, error, message = REFUSED[name]
    args, kwargs = make()
    with pytest.raises(Exception):  # noqa: B017 (SDPA's RuntimeError or TypeError)
        F.scaled_dot_product_attention(*args, **kwargs)
    with pytest.raises(error) as info:
        ours(*args, **kwargs)
    assert message in str(info.value)


# name: (() -> (args, kwargs), our exception, our message); SDPA takes each
STRICTER = {
    "rank 2": (lambda: (_qkv(q=(L, E), k=(S, E)), {}), ValueError,
               "query must have rank 3 (one example) or 4 (batch, heads, q_len, head_dim), got shape (5, 8)"),
    "rank 5": (lambda: (_qkv(q=(1, B, H, L, E), k=(1, B, H, S, E)), {}), ValueError,
               "query must have rank 3 (one example) or 4 (batch, heads, q_len, head_dim), got shape (1, 2, 4, 5, 8)"),
    "rank 3 query, rank 4 key and value (SDPA broadcasts)": (
        lambda: ((_randn(H, L, E), _randn(B, H, S, E), _randn(B, H, S, EV)), {}), ValueError,
        "query, key and value must all have rank 4 or all rank 3 (one example)"),
    "a key batch of 1 for a query batch of 2 (SDPA broadcasts)": (
        lambda: (_qkv(k=(1, H, S, E), v=(1, H, S, EV)), {}), ValueError, "must match query"),
    "dropout_p 1 (SDPA: all dropped)": (lambda: (_qkv(), dict(dropout_p=1.0)), ValueError,
                                        "dropout_p must be in [0, 1), got 1.0"),
    "dropout_p negative": (lambda: (_qkv(), dict(dropout_p=-0.1)), ValueError, "dropout_p must be in [0, 1), got -0.1"),
    "scale inf (SDPA: NaN)": (lambda: (_qkv(), dict(scale=float("inf"))), ValueError, "scale must be finite"),
    "no key/value heads, enable_gqa (SDPA: an output)": (lambda: (_qkv(k=(B, 0, S, E)), dict(enable_gqa=True)),
                                                         ValueError, "key/value heads (0) must divide"),
}


@pytest.mark.parametrize("name", list(STRICTER))
def test_what_ours_refuses_on_purpose(name):
    make, error, message = STRICTER[name]
    args, kwargs = make()
    F.scaled_dot_product_attention(*args, **kwargs)  # SDPA takes it
    with pytest.raises(error) as info:
        ours(*args, **kwargs)
    assert message in str(info.value)


def test_attn_mask_and_mask_together_are_refused():
    q, k, v = _qkv()
    allowed = _keys_kept((L, S))
    with pytest.raises(TypeError, match="attn_mask and mask are one argument"):
        ours(q, k, v, allowed, mask=allowed)


# --- the differences kept on purpose: calls SDPA refuses, which ours takes with one meaning ---


@pytest.mark.parametrize("implementation", attention.IMPLEMENTATIONS)
def test_grouped_heads_without_enable_gqa(implementation):
    """SDPA's default ``enable_gqa=False`` refuses fewer key/value heads; ours (None) groups them, as
    SDPA with ``enable_gqa=True`` does. ``enable_gqa=False`` given refuses (``REFUSED``)."""
    q, k, v = _qkv(k=(B, KV_H, S, E))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(ours(q, k, v, implementation=implementation), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", attention.IMPLEMENTATIONS)
def test_an_integer_mask_attends_where_nonzero(implementation):
    """SDPA refuses an integer ``attn_mask``; ours reads it as bool, nonzero = attend."""
    q, k, v = _qkv()
    allowed = _keys_kept((B, 1, L, S))
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        F.scaled_dot_product_attention(q, k, v, allowed.long() * 3)
    expected = F.scaled_dot_product_attention(q, k, v, allowed)
    torch.testing.assert_close(ours(q, k, v, allowed.long() * 3, implementation=implementation), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", attention.IMPLEMENTATIONS)
@pytest.mark.parametrize("q_len", [L, S])
def test_attn_mask_with_is_causal_is_their_conjunction(implementation, q_len):
    """SDPA documents a refusal of ``attn_mask`` with ``is_causal``; its math kernel refuses, some of its CPU
    calls take the two as their conjunction. Ours always takes them: the conjunction, causality top-left."""
    q, k, v = _qkv(q=(B, H, q_len, E))
    causal = _tril(q_len, S)
    for allowed in (_keys_kept((q_len, S)), _keys_kept((B, 1, q_len, S)), _randn(q_len, S)):
        explicit = allowed & causal if allowed.dtype == torch.bool else allowed.masked_fill(~causal, -torch.inf)
        expected = F.scaled_dot_product_attention(q, k, v, explicit)
        try:
            theirs = F.scaled_dot_product_attention(q, k, v, allowed, is_causal=True)
        except RuntimeError as e:
            assert "attn_mask should not be set when is_causal=True" in str(e)
        else:
            torch.testing.assert_close(theirs, expected, rtol=1e-12, atol=1e-12)
        mine = ours(q, k, v, allowed, 0.0, True, implementation=implementation)
        torch.testing.assert_close(mine, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", attention.IMPLEMENTATIONS)
def test_an_attn_mask_of_rank_1_broadcasts(implementation):
    """SDPA indexes ``attn_mask``'s last two axes (an IndexError at rank 1); ours broadcasts it as NumPy does."""
    q, k, v = _qkv()
    allowed = _keys_kept((S,))
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(q, k, v, allowed)
    expected = F.scaled_dot_product_attention(q, k, v, allowed[None])
    torch.testing.assert_close(ours(q, k, v, allowed, implementation=implementation), expected,
                               rtol=1e-12, atol=1e-12)


# --- dropout: the meaning, not the draws ---


@pytest.mark.parametrize("implementation", attention.IMPLEMENTATIONS)
def test_dropout_p_drops_weights_at_its_rate_and_scales_the_rest(implementation):
    """With ``value`` the identity the output is the weights applied: each SDPA's weight or 0, the kept
    scaled by ``1 / (1 - p)``, about a fraction ``p`` dropped (4096 weights: 4 standard deviations is 3%),
    for SDPA's draws and ours alike; a seed repeats ours."""
    p, n = 0.3, 16
    q, k = _randn(4, H, n, E), _randn(4, H, n, E)
    v = torch.eye(n, dtype=F64).expand(4, H, n, n)
    weights = F.scaled_dot_product_attention(q, k, v)
    for fn in (F.scaled_dot_product_attention, lambda *a: ours(*a, implementation=implementation)):
        torch.manual_seed(1)
        out = fn(q, k, v, None, p)
        kept = out != 0
        torch.testing.assert_close(out[kept], weights[kept] / (1 - p), rtol=1e-12, atol=0)
        assert abs(1 - kept.double().mean().item() - p) < 0.03
    torch.manual_seed(1)
    again = ours(q, k, v, None, p, implementation=implementation)
    torch.manual_seed(1)
    torch.testing.assert_close(ours(q, k, v, None, p, implementation=implementation), again, rtol=0, atol=0)


def test_dropout_mask_applies_the_mask_given():
    q, k, v = _qkv()
    keep = torch.rand(B, H, L, S) > 0.3
    weights = torch.softmax(q @ k.transpose(-1, -2) / E ** 0.5, dim=-1)
    expected = (weights * keep / 0.7) @ v
    torch.testing.assert_close(ours(q, k, v, None, 0.3, dropout_mask=keep), expected, rtol=1e-12, atol=1e-12)


# --- torch.compile ---


def test_compiled_sdpa_call_gives_sdpa_results():
    """``torch.compile`` of ours, called as SDPA is (CPU inductor: a C++ compiler), forward and backward."""
    import shutil

    if shutil.which("g++") is None and shutil.which("cc") is None:
        pytest.skip("torch.compile on a CPU needs a C++ compiler (g++ or cc), none on PATH")
    torch.manual_seed(0)
    q, k, v = _qkv(k=(B, KV_H, S, E))
    allowed = _keys_kept((B, 1, L, S))
    args, _, leaves = _differentiable((q, k, v, allowed, 0.0, False), {})
    compiled = torch.compile(ours)
    mine = compiled(*args, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(*args, enable_gqa=True)
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    for m, t in zip(_grads(mine, leaves), _grads(theirs, leaves)):
        torch.testing.assert_close(m, t, rtol=1e-12, atol=1e-12)


# --- every masking term of ours: detect_anomaly quiet, forward and backward, in both implementations ---


def _no_row(shape):
    """A bool mask that excludes every key of query 2 (and some others)."""
    return _keys_kept(shape).index_fill(-2, torch.tensor(2), False)


# name: () -> keyword arguments of ours (the inputs: query (B, H, L, E), key and value (B, KV_H, S, ...))
MASK_FORMS = {
    "mask, a row with no key": lambda: dict(mask=_no_row((B, 1, L, S))),
    "float mask, a row at -inf": lambda: dict(mask=torch.where(_no_row((L, S)), _randn(L, S), -torch.inf)),
    "bias, a row at -inf": lambda: dict(bias=torch.where(_no_row((B, H, L, S)), _randn(B, H, L, S), -torch.inf)),
    "mask and bias": lambda: dict(mask=_no_row((B, 1, L, S)), bias=_randn(H, L, S)),
    "is_causal": lambda: dict(is_causal=True),
    "is_causal at positions, no key for the first queries": lambda: dict(
        is_causal=True, query_positions=torch.arange(L) - 2, key_positions=torch.arange(S)),
    "local window": lambda: dict(local_window_size=(1, 0), query_positions=torch.arange(L) + 2),
    "segments, a query of a segment with no key": lambda: dict(
        query_segment_ids=torch.tensor([[0, 0, 1, 1, 3], [0, 1, 1, 2, 2]]),
        key_segment_ids=torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2, 2]])),
    "lengths, one of 0": lambda: dict(key_value_seq_lengths=torch.tensor([4, 0])),
    "chunks, causal": lambda: dict(attention_chunk_size=2, is_causal=True),
    "sinks, a row with no key": lambda: dict(sinks=_randn(H), mask=_no_row((L, S))),
    "soft-cap, a row with no key": lambda: dict(logit_soft_cap=2.0, mask=_no_row((L, S))),
    "ALiBi, causal": lambda: dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64), is_causal=True),
    "every term": lambda: dict(
        mask=_no_row((B, 1, L, S)), bias=_randn(H, L, S), is_causal=True, query_positions=torch.arange(L) + 2,
        local_window_size=(3, 0), key_value_seq_lengths=torch.tensor([6, 3]), attention_chunk_size=4,
        sinks=_randn(H), alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)),
}


def _anomaly_free(implementation, q, k, v, terms):
    """(output, gradients of q, k, v and a floating mask or bias) of ours under detect_anomaly: a NaN
    formed by a backward step raises there."""
    args, kwargs, leaves = _differentiable((q, k, v), terms)
    with torch.autograd.detect_anomaly(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # detect_anomaly announces itself
        out = ours(*args, **kwargs, implementation=implementation)
        grads = _grads(out, leaves)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    return out, grads


@pytest.mark.parametrize("name", list(MASK_FORMS))
def test_every_mask_form_is_anomaly_free_and_alike_in_both_implementations(name):
    torch.manual_seed(0)
    q, k, v = _qkv(k=(B, KV_H, S, E))
    terms = MASK_FORMS[name]()
    out, grads = _anomaly_free("math", q, k, v, terms)
    _, weights = ours(q, k, v, **terms, implementation="math", need_weights=True)
    no_key = weights.sum(-1) == 0  # (B, H, L): rows with no key (with sinks, the sink's share is not there)
    if "no key" in name or "a row" in name or "of 0" in name:
        assert no_key.any() and (out[no_key] == 0).all() and (grads[0][no_key] == 0).all()
    if "logit_soft_cap" in terms:  # SDPA cannot apply tanh to the logits
        return
    out_sdpa, grads_sdpa = _anomaly_free("sdpa", q, k, v, terms)
    torch.testing.assert_close(out_sdpa, out, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_sdpa, grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_row_whose_allowed_keys_have_the_lowest_bias_is_sdpas_softmax_over_them():
    """A finite bias below ``-0.1 * finfo.max`` counts as that value (``"math"`` stands a lower finite value for an
    excluded key): a row whose every allowed key has transformers' ``finfo.min`` gets the softmax over those keys,
    as SDPA gives it, not the 0 of a row with no key; both implementations, every row."""
    q, k, v = _qkv()
    allowed = _keys_kept((L, S))
    bias = torch.zeros(L, S, dtype=F64).index_fill(0, torch.tensor(2), torch.finfo(F64).min)
    theirs = F.scaled_dot_product_attention(q, k, v, bias.masked_fill(~allowed, -torch.inf))
    assert theirs[:, :, 2].abs().sum() > 0
    for implementation in ("sdpa", "math"):
        torch.testing.assert_close(ours(q, k, v, allowed, bias=bias, implementation=implementation), theirs,
                                   rtol=1e-12, atol=1e-12)
    assert (bias[2] == torch.finfo(F64).min).all()  # the caller's bias is not floored in place
