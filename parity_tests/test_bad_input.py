"""Bad input fails alike in both frameworks: the same exception type, a message naming the
argument (and the shapes), and nothing the caller passed is modified.

The catalogue: ``CORE_CASES`` (the functional cores), ``CONSTRUCTOR_CASES`` and ``CALL_CASES``
(the modules), ``STATE_CASES`` (every loader of a state dict or file), ``TREE_CASES`` (Flax
parameter trees and head counts, JAX only), the mask helpers, and ``test_convert.py``'s
conversion errors. Bad inputs that reveal a defect
(an unclear error, frameworks failing differently) are in ``test_found_defects.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

import mha_jax
import mha_torch

B, H, Q, K, D = 2, 4, 3, 5, 8


def _core(layout_jax: bool, q=(B, Q, H, D), k=(B, K, H, D), v=None, dtype="float32", dtypes=None,
          objects=None, **kw):
    """Call a functional core with JAX-layout shapes (transposed for torch).

    ``dtypes`` overrides the dtype of some of ``"q"``, ``"k"``, ``"v"``; ``objects`` replaces
    arguments by non-arrays; ``implementation="memory-efficient"`` means ``"blockwise"`` in JAX
    and ``"sdpa"`` in PyTorch; NumPy ``mask``/``dropout_mask`` become each framework's array.
    """
    v = k if v is None else v
    dtypes, objects = dtypes or {}, objects or {}
    if kw.get("implementation") == "memory-efficient":
        kw["implementation"] = "blockwise" if layout_jax else "sdpa"
    if layout_jax:
        arrays = [jnp.zeros(s, dtype=dtypes.get(n, dtype)) for n, s in zip("qkv", (q, k, v))]
        convert = jnp.asarray
        if "dropout_p" in kw:
            kw["dropout_rate"] = kw.pop("dropout_p")
        if "need_weights" in kw:
            kw["return_weights"] = kw.pop("need_weights")
    else:
        swap = lambda s: s if len(s) != 4 else (s[0], s[2], s[1], s[3])  # noqa: E731
        arrays = [torch.zeros(swap(s), dtype=getattr(torch, dtypes.get(n, dtype))) for n, s in zip("qkv", (q, k, v))]
        convert = torch.from_numpy
    for name, x in kw.items():
        if isinstance(x, np.ndarray):
            kw[name] = convert(x)
    arrays = [objects.get(n, a) for n, a in zip("qkv", arrays)]
    core = mha_jax.dot_product_attention if layout_jax else mha_torch.dot_product_attention
    return core(*arrays, **kw)


# name: (arguments of _core, exception, message shared by both frameworks, or (JAX's, PyTorch's))
CORE_CASES = {
    "query rank 2": (dict(q=(Q, H * D)), ValueError, "query must have rank 3 (one example) or 4"),
    "key rank 5": (dict(k=(B, K, H, D, 1)), ValueError, "key must have rank 3 (one example) or 4"),
    "value rank 2": (dict(v=(K, H * D)), ValueError, "value must have rank 3 (one example) or 4"),
    "query rank 3 beside rank 4": (dict(q=(B, Q, H * D)), ValueError,
                                   "query, key and value must all have rank 4 or all rank 3 (one example)"),
    "value shape differs from key": (dict(v=(B, K + 1, H, D)), ValueError, "key and value must have the same shape"),
    "batch mismatch": (dict(k=(B + 1, K, H, D)), ValueError, "must match query"),
    "head_dim mismatch": (dict(k=(B, K, H, D + 1)), ValueError, "must match query"),
    "kv heads do not divide heads": (dict(k=(B, K, 3, D)), ValueError,
                                     "key/value heads (3) must divide query heads (4)"),
    "zero kv heads": (dict(k=(B, K, 0, D)), ValueError, "key/value heads (0) must divide query heads (4)"),
    "integer inputs": (dict(dtype="int32"), TypeError, "query must be a real floating-point array"),
    "complex inputs": (dict(dtype="complex64"), TypeError, "query must be a real floating-point array"),
    "integer key": (dict(dtypes={"k": "int64"}), TypeError, "key must be a real floating-point array"),
    "bool value": (dict(dtypes={"v": "bool"}), TypeError, "value must be a real floating-point array"),
    "float64 key beside float32": (dict(dtypes={"k": "float64"}), TypeError,
                                   "query, key and value must share one dtype"),
    "query a list": (dict(objects={"q": [[0.0]]}), TypeError,
                     ("query must be an array", "query must be a torch.Tensor")),
    "mask does not broadcast": (dict(mask=np.ones((B, 3, Q, K), bool)), ValueError,
                                "mask of shape (2, 3, 3, 5) does not broadcast"),
    "mask rank 5": (dict(mask=np.ones((1, B, H, Q, K), bool)), ValueError, "mask of shape (1, 2, 4, 3, 5)"),
    "mask batch mismatch": (dict(mask=np.ones((3, 1, 1, K), bool)), ValueError,
                            "mask of shape (3, 1, 1, 5) does not broadcast"),
    "mask one key too many": (dict(mask=np.zeros((Q, K + 1), np.float32)), ValueError,
                              "mask of shape (3, 6) does not broadcast"),
    "mask complex": (dict(mask=np.ones((Q, K), np.complex64)), TypeError,
                     "mask must be bool, integer or real floating"),
    "mask transposed": (dict(mask=np.ones((K, Q), bool)), ValueError, "mask of shape (5, 3) does not broadcast"),
    "mask a list": (dict(mask=[[True] * K] * Q), TypeError, ("mask must be an array", "mask must be a torch.Tensor")),
    "dropout rate 1": (dict(dropout_p=1.0), ValueError, "must be in [0, 1)"),
    "dropout rate negative": (dict(dropout_p=-0.1), ValueError,
                              ("dropout_rate must be in [0, 1)", "dropout_p must be in [0, 1)")),
    "dropout rate NaN": (dict(dropout_p=float("nan")), ValueError,
                         ("dropout_rate must be in [0, 1), got nan", "dropout_p must be in [0, 1), got nan")),
    "dropout mask float": (dict(dropout_p=0.1, dropout_mask=np.ones((Q, K), np.float32)), TypeError,
                           "dropout_mask must be bool"),
    "dropout mask shape": (dict(dropout_p=0.1, dropout_mask=np.ones((Q, Q), bool)), ValueError,
                           "dropout_mask of shape (3, 3)"),
    "dropout mask rank 5": (dict(dropout_p=0.1, dropout_mask=np.ones((1, B, H, Q, K), bool)), ValueError,
                            "dropout_mask of shape (1, 2, 4, 3, 5)"),
    "bias integer": (dict(bias=np.zeros((Q, K), np.int32)), TypeError, "bias must be a real floating-point array"),
    "bias does not broadcast": (dict(bias=np.zeros((Q, Q), np.float32)), ValueError,
                                "bias of shape (3, 3) does not broadcast"),
    "query positions one too many": (dict(query_positions=np.arange(Q + 1)), ValueError,
                                     "query_positions must have shape (q_len,) = (3,) or (batch, q_len) = (2, 3), "
                                     "got (4,)"),
    "key positions float": (dict(key_positions=np.arange(K, dtype=np.float32)), TypeError,
                            "key_positions must be an integer array"),
    "query positions batch of 3": (dict(query_positions=np.zeros((3, Q), np.int64)), ValueError,
                                   "query_positions must have shape"),
    "key positions rank 3": (dict(key_positions=np.zeros((B, K, 1), np.int64)), ValueError,
                             "key_positions must have shape"),
    "window negative": (dict(local_window_size=(-1, 2)), ValueError,
                        "local_window_size must be >= 0 on both sides, got (-1, 2)"),
    "window of three": (dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size must be an integer or a pair"),
    "window float": (dict(local_window_size=2.5), TypeError, "local_window_size must be an integer or a pair"),
    "segment ids one query short": (dict(query_segment_ids=np.zeros((B, Q - 1), np.int64),
                                         key_segment_ids=np.zeros((B, K), np.int64)),
                                    ValueError, "query_segment_ids must have shape (q_len,) = (3,) "
                                                "or (batch, q_len) = (2, 3), got (2, 2)"),
    "segment ids of the queries only": (dict(query_segment_ids=np.zeros((B, Q), np.int64)), ValueError,
                                        "query_segment_ids needs key_segment_ids too"),
    "segment ids bool": (dict(query_segment_ids=np.zeros((B, Q), bool), key_segment_ids=np.zeros((B, K), bool)),
                         TypeError, "query_segment_ids must be an integer array"),
    "lengths past kv_len": (dict(key_value_seq_lengths=np.array([K + 1, 1])), ValueError,
                            "key_value_seq_lengths must lie in [0, kv_len] = [0, 5], got [6, 1]"),
    "lengths negative": (dict(key_value_seq_lengths=np.array([2, -1])), ValueError,
                         "key_value_seq_lengths must lie in [0, kv_len]"),
    "lengths of 3 for a batch of 2": (dict(key_value_seq_lengths=np.array([1, 2, 3])), ValueError,
                                      "key_value_seq_lengths must have shape (batch,) = (2,), got (3,)"),
    "lengths float": (dict(key_value_seq_lengths=np.array([1.0, 2.0])), TypeError,
                      "key_value_seq_lengths must be an integer array"),
    "soft cap zero": (dict(logit_soft_cap=0), ValueError, "logit_soft_cap must be a positive finite number, got 0.0"),
    "soft cap negative": (dict(logit_soft_cap=-30.0), ValueError,
                          "logit_soft_cap must be a positive finite number, got -30.0"),
    "soft cap inf": (dict(logit_soft_cap=float("inf")), ValueError,
                     "logit_soft_cap must be a positive finite number, got inf"),
    "soft cap NaN": (dict(logit_soft_cap=float("nan")), ValueError,
                     "logit_soft_cap must be a positive finite number, got nan"),
    "soft cap a string": (dict(logit_soft_cap="50"), TypeError,
                          "logit_soft_cap must be a positive finite number, got '50'"),
    "soft cap a bool": (dict(logit_soft_cap=True), TypeError,
                        "logit_soft_cap must be a positive finite number, got True"),
    "sinks one too many": (dict(sinks=np.zeros(H + 1, np.float32)), ValueError,
                           "sinks must have shape (heads,) = (4,), one logit per query head, got (5,)"),
    "sinks per key/value head": (dict(k=(B, K, 2, D), sinks=np.zeros(2, np.float32)), ValueError,
                                 "sinks must have shape (heads,) = (4,), one logit per query head, got (2,)"),
    "sinks rank 2": (dict(sinks=np.zeros((1, H), np.float32)), ValueError,
                     "sinks must have shape (heads,) = (4,), one logit per query head, got (1, 4)"),
    "sinks a scalar": (dict(sinks=np.zeros((), np.float32)), ValueError,
                       "sinks must have shape (heads,) = (4,), one logit per query head, got ()"),
    "sinks integer": (dict(sinks=np.zeros(H, np.int32)), TypeError,
                      "sinks must be a real floating-point array, got dtype int32 with shape (4,)"),
    "sinks bool": (dict(sinks=np.zeros(H, bool)), TypeError,
                   "sinks must be a real floating-point array, got dtype bool"),
    "sinks a list": (dict(sinks=[0.0] * H), TypeError, ("sinks must be an array", "sinks must be a torch.Tensor")),
    "unknown implementation": (dict(implementation="turbo"), ValueError, "implementation must be one of"),
    "weights from the memory-efficient implementation": (
        dict(implementation="memory-efficient", need_weights=True), ValueError,
        ("return_weights=True", "need_weights=True")),
}


def _message(message, is_jax: bool) -> str:
    return message if isinstance(message, str) else message[0 if is_jax else 1]


@pytest.mark.parametrize("name", list(CORE_CASES))
def test_core_rejects_alike(name):
    kwargs, error, message = CORE_CASES[name]
    for layout_jax in (True, False):
        with pytest.raises(error) as info:
            _core(layout_jax, **dict(kwargs))
        assert _message(message, layout_jax) in str(info.value), (layout_jax, str(info.value))


def test_core_takes_one_example_of_rank_3():
    """Both twins take one example without its batch axis, in their layouts (jax.nn's ``(len, heads, head_dim)``,
    SDPA's ``(heads, len, head_dim)``): the batched call's first example."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, n, H, D)).astype(np.float32) for n in (Q, K, K))
    for layout_jax in (True, False):
        core = mha_jax.dot_product_attention if layout_jax else mha_torch.dot_product_attention
        convert = jnp.asarray if layout_jax else (lambda x: torch.from_numpy(np.ascontiguousarray(x.swapaxes(1, 2))))
        batched = np.asarray(core(*map(convert, (q, k, v)), is_causal=True))
        one = np.asarray(core(*(convert(x)[0] for x in (q, k, v)), is_causal=True))
        np.testing.assert_allclose(one, batched[0], rtol=1e-6, atol=1e-6)


def test_jax_dropout_without_rng_is_named():
    with pytest.raises(ValueError, match="dropout_rng"):
        _core(True, dropout_p=0.2)


def _jax_module(**kw):
    return mha_jax.MultiHeadAttention(kw.pop("num_heads", 4), kw.pop("in_features", 16), rngs=nnx.Rngs(0), **kw)


def _torch_module(**kw):
    rename = {"in_features": "embed_dim", "qkv_features": "qkv_dim", "in_kv_features": "kdim",
              "out_features": "out_dim", "dropout_rate": "dropout"}
    kw = {rename.get(k, k): v for k, v in kw.items()}
    return mha_torch.MultiHeadAttention(kw.pop("embed_dim", 16), kw.pop("num_heads", 4), **kw)


# name: (JAX constructor arguments, renamed for PyTorch; message, or (JAX's, PyTorch's)); all ValueError
CONSTRUCTOR_CASES = {
    "heads do not divide features": (dict(num_heads=5), "num_heads (5) must divide"),
    "kv heads do not divide heads": (dict(num_kv_heads=3), "num_kv_heads (3) must divide num_heads (4)"),
    "more kv heads than heads": (dict(num_kv_heads=8), "num_kv_heads (8) must divide num_heads (4)"),
    "zero heads": (dict(num_heads=0), "num_heads must be a positive integer"),
    "zero kv heads": (dict(num_kv_heads=0), "num_kv_heads must be a positive integer"),
    "float head count": (dict(num_heads=4.0), "num_heads must be a positive integer, got 4.0"),
    "bool head count": (dict(num_heads=True), "num_heads must be a positive integer, got True"),
    "qkv features not divisible": (dict(qkv_features=18), "num_heads (4) must divide"),
    "negative features": (dict(in_features=-4), "must be a positive integer"),
    "zero key features": (dict(in_kv_features=0),
                          ("in_kv_features must be a positive integer", "kdim must be a positive integer")),
    "zero output features": (dict(out_features=0),
                             ("out_features must be a positive integer", "out_dim must be a positive integer")),
    "dropout rate above 1": (dict(dropout_rate=1.5), "dropout"),
    "dropout rate negative": (dict(dropout_rate=-0.1), ("dropout_rate must be in [0, 1)", "dropout must be in [0, 1)")),
    "unknown implementation": (dict(implementation="turbo"), "implementation must be one of"),
}


@pytest.mark.parametrize("name", list(CONSTRUCTOR_CASES))
def test_constructors_reject_alike(name):
    kwargs, message = CONSTRUCTOR_CASES[name]
    for is_jax, build in ((True, _jax_module), (False, _torch_module)):
        with pytest.raises(ValueError) as info:
            build(**kwargs)
        assert _message(message, is_jax) in str(info.value), str(info.value)


def test_linen_rejects_unknown_implementation_when_built():
    """linen reads its other attributes at call time (the feature sizes come from the inputs);
    an unknown implementation has nothing to wait for."""
    with pytest.raises(ValueError, match="implementation must be one of"):
        mha_jax.linen.MultiHeadDotProductAttention(num_heads=4, implementation="turbo")


# name: (shapes of query, key, value (None: the default), call arguments (NumPy masks), exception,
#        message, the argument it names in (JAX, PyTorch))
CALL_CASES = {
    "query features": (((B, Q, 12), None, None), {}, ValueError, "has 12 features", ("inputs_q", "query")),
    "key features": (((B, Q, 16), (B, K, 10), None), {}, ValueError, "has 10 features", ("inputs_k", "key")),
    "value features": (((B, Q, 16), (B, K, 16), (B, K, 10)), {}, ValueError, "has 10 features", ("inputs_v", "value")),
    "zero features": (((B, Q, 0), None, None), {}, ValueError, "has 0 features", ("inputs_q", "query")),
    "query rank 1": (((16,), None, None), {}, ValueError, "must have rank 2 or more (*batch, length, features)",
                     ("inputs_q", "query")),
    "key batch axes differ": (((B, Q, 16), (B, 1, K, 16), None), {}, ValueError, "must share the batch axes",
                              ("inputs_k", "key")),
    "batch differs": (((B, Q, 16), (B + 1, K, 16), None), {}, ValueError, "must share the batch axes",
                      ("inputs_k", "key")),
    "mask batch axes": (((B, 3, Q, 16), None, None), {"mask": np.ones((B, 2, 1, Q, Q), bool)}, ValueError,
                        "whose batch axes (2, 2) do not broadcast to the inputs' batch axes (2, 3)", ("mask", "mask")),
    "value length differs": (((B, Q, 16), (B, K, 16), (B, K + 1, 16)), {}, ValueError, "must share kv_len",
                             ("inputs_v", "value")),
    "integer query": (((B, Q, 16), None, None), {"dtype": "int32"}, TypeError, "must be a real floating-point array",
                      ("inputs_q", "query")),
    "mask does not broadcast": (((B, Q, 16), None, None), {"mask": np.ones((B, 3, Q, Q), bool)}, ValueError,
                                "does not broadcast to (batch, heads, q_len, kv_len) = (2, 4, 3, 3)", ("mask", "mask")),
    "mask complex": (((B, Q, 16), None, None), {"mask": np.ones((Q, Q), np.complex64)}, TypeError,
                     "must be bool, integer or real floating", ("mask", "mask")),
    "dropout mask does not broadcast": (((B, Q, 16), None, None), {"dropout_mask": np.ones((Q, K), bool)}, ValueError,
                                        "does not broadcast", ("dropout_mask", "dropout_mask")),
}


@pytest.mark.parametrize("name", list(CALL_CASES))
def test_module_calls_reject_alike(name):
    shapes, kwargs, error, message, names = CALL_CASES[name]
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", "float32")
    for is_jax, module, array, convert in (
        (True, _jax_module(), lambda s: jnp.zeros(s, dtype), jnp.asarray),
        (False, _torch_module(), lambda s: torch.zeros(s, dtype=getattr(torch, dtype)), torch.from_numpy),
    ):
        args = [array(s) for s in shapes if s is not None]
        with pytest.raises(error) as info:
            module(*args, **{k: convert(v) for k, v in kwargs.items()})
        text = str(info.value)
        assert message in text and names[0 if is_jax else 1] in text, text


def test_module_call_with_a_list_is_named():
    for call, name in ((lambda: _jax_module()([[0.0]]), "inputs_q"), (lambda: _torch_module()([[0.0]]), "query")):
        with pytest.raises(TypeError, match=f"{name} must be a"):
            call()


def test_mask_helpers_reject_alike():
    for helper, zeros in ((mha_jax.padding_mask, jnp.zeros), (mha_torch.padding_mask, torch.zeros)):
        with pytest.raises(ValueError, match="valid must have rank 2"):
            helper(zeros((2, 3, 4)))
    for helper, zeros in ((mha_jax.padding_mask, jnp.zeros), (mha_torch.padding_mask, torch.zeros)):
        with pytest.raises(TypeError, match="valid must be bool or integer"):
            helper(zeros((2, 3)))
    for helper in (mha_jax.causal_mask, mha_torch.causal_mask):
        with pytest.raises(ValueError, match="q_len must be a positive integer"):
            helper(0, 4)
        with pytest.raises(ValueError, match="kv_len must be a positive integer"):
            helper(3, 2.5)


# --- loading weights: every loader of a state dict or file --------------------------------


def _state():
    return dict(mha_torch.MultiHeadAttention(16, 4).state_dict())


def _file(tmp_path, name, content: bytes | None = None):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    return path


def _safetensors_of(tmp_path, tensors):
    path = tmp_path / "foreign.safetensors"
    save_file(tensors, path)
    return path


def _pickle(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(_state(), path)
    return path


# name: (source from tmp_path, exception, message shared by every loader)
STATE_CASES = {
    "a list, not a mapping": (lambda p: list(_state().values()), TypeError, "state_dict_or_path must be a mapping"),
    "a PyTorch pickle": (_pickle, ValueError, "state_dict_or_path must be a .safetensors file"),
    "an empty file": (lambda p: _file(p, "empty.safetensors", b""), ValueError, "is not a readable safetensors file"),
    "a text file": (lambda p: _file(p, "text.safetensors", b"not tensors at all"), ValueError,
                    "is not a readable safetensors file"),
    "a directory": (lambda p: _file(p, "dir.safetensors"), ValueError, "is not a readable safetensors file"),
    "a missing file": (lambda p: p / "missing.safetensors", FileNotFoundError, "missing.safetensors' does not exist"),
    "a safetensors file of other tensors": (lambda p: _safetensors_of(p, {"embed.weight": torch.zeros(3, 2)}),
                                            ValueError, "missing key 'q_proj.weight'"),
    "a missing weight": (lambda p: {k: v for k, v in _state().items() if k != "k_proj.weight"}, ValueError,
                         "missing key 'k_proj.weight'"),
    "an unexpected key": (lambda p: dict(_state(), extra=torch.zeros(2)), ValueError, "unexpected key 'extra'"),
    "a weight of too few rows": (lambda p: dict(_state(), **{"k_proj.weight": torch.zeros(8, 16)}), ValueError,
                                 "'k_proj.weight' has shape (8, 16)"),
    "a bias of rank 2": (lambda p: dict(_state(), **{"q_proj.bias": torch.zeros(16, 1)}), ValueError,
                         "'q_proj.bias' has shape (16, 1)"),
    "biases on some projections only": (lambda p: {k: v for k, v in _state().items() if k != "k_proj.bias"},
                                        ValueError, "missing key 'k_proj.bias'"),
    "complex weights": (lambda p: dict(_state(), **{"v_proj.weight": torch.zeros(16, 16, dtype=torch.complex64)}),
                        TypeError, "'v_proj.weight' must be real floating-point, got dtype complex64"),
    "integer weights": (lambda p: dict(_state(), **{"q_proj.bias": torch.zeros(16, dtype=torch.int64)}),
                        TypeError, "'q_proj.bias' must be real floating-point, got dtype int64"),
}


def _params(module):
    if isinstance(module, torch.nn.Module):
        return {k: v.clone() for k, v in module.state_dict().items()}
    return jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("name", list(STATE_CASES))
def test_loaders_reject_bad_state_alike(name, tmp_path):
    """``mha_jax.from_torch``, ``mha_jax.load_weights`` and ``mha_torch.load_weights``
    raise the same exception naming the source or the key; the modules keep their weights."""
    source, error, message = STATE_CASES[name]
    source = source(tmp_path)
    jax_module, torch_module = _jax_module(), _torch_module()
    before = (_params(jax_module), _params(torch_module))
    for load in (
        lambda: mha_jax.from_torch(source, num_heads=4),
        lambda: mha_jax.load_weights(jax_module, source),
        lambda: mha_torch.load_weights(torch_module, source),
    ):
        with pytest.raises(error) as info:
            load()
        assert message in str(info.value), str(info.value)
    jax.tree.map(np.testing.assert_array_equal, _params(jax_module), before[0])
    for k, v in _params(torch_module).items():
        assert torch.equal(v, before[1][k]), k


def _tree():
    return mha_jax.from_torch(_state(), num_heads=4)


# Flax parameter trees and head counts (JAX only: PyTorch has no such argument).
TREE_CASES = {
    "to_torch: a kernel of rank 2": (lambda: mha_jax.to_torch(dict(_tree(), query={"kernel": np.zeros((16, 16))})),
                                     "params['query']['kernel'] must have rank 3"),
    "to_torch: an extra projection": (lambda: mha_jax.to_torch(dict(_tree(), dense={"kernel": np.zeros((2, 2))})),
                                      "params is not an attention parameter tree: unexpected 'dense'"),
    "from_torch: zero heads": (lambda: mha_jax.from_torch(_state(), num_heads=0),
                               "num_heads must be a positive integer"),
    "from_torch: kv heads do not divide heads": (lambda: mha_jax.from_torch(_state(), num_heads=4, num_kv_heads=3),
                                                 "num_kv_heads (3) must divide num_heads (4)"),
}


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_trees_and_head_counts_are_named(name):
    call, message = TREE_CASES[name]
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value), str(info.value)


# --- nothing the caller passed is modified ------------------------------------------------


def test_inputs_are_not_modified():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, Q, 16)).astype(np.float32)
    mask = rng.random((B, 1, Q, Q)) < 0.5
    tx, tmask = torch.from_numpy(x.copy()), torch.from_numpy(mask.copy())
    _torch_module()(tx, mask=tmask, need_weights=True)
    assert np.array_equal(tx.numpy(), x) and np.array_equal(tmask.numpy(), mask)
    jx = x.copy()
    _jax_module()(jnp.asarray(jx), mask=jnp.asarray(mask))
    assert np.array_equal(jx, x)


@pytest.mark.parametrize("implementation", ["math", "sdpa"])
def test_torch_core_leaves_padded_garbage_where_it_was(implementation):
    """The core zeroes keys/values no query may see on its own copies: the caller's tensors
    keep their NaN, the mask and keep-mask are unchanged, and backward leaves them as well."""
    rng = np.random.default_rng(1)
    q, k, v = (torch.from_numpy(rng.normal(size=s)) for s in ((B, H, Q, D), (B, H, K, D), (B, H, K, D)))
    k[:, :, -2:], v[:, :, -2:] = float("nan"), float("inf")
    mask = torch.from_numpy(np.arange(K) < K - 2).expand(B, 1, Q, K).clone()
    keep = torch.from_numpy(rng.random((B, H, Q, K)) > 0.2)
    snapshot = [t.clone() for t in (q, k, v, mask, keep)]
    for t in (q, k, v):
        t.requires_grad_(True)
    extra = {"dropout_p": 0.2, "dropout_mask": keep} if implementation == "math" else {}
    mha_torch.dot_product_attention(q, k, v, mask=mask, implementation=implementation, **extra).sum().backward()
    for t, s in zip((q, k, v, mask, keep), snapshot):
        assert torch.equal(torch.nan_to_num(t.detach()), torch.nan_to_num(s)) and torch.equal(t.isnan(), s.isnan())


def test_numpy_inputs_to_jax_are_not_modified():
    """NumPy arrays handed to the JAX core and module (which may share their memory) keep their
    values, NaN padding included."""
    rng = np.random.default_rng(2)
    q, k = rng.normal(size=(B, Q, H, D)), rng.normal(size=(B, K, H, D))
    k[:, -2:] = np.nan
    mask = np.arange(K) < K - 2
    copies = [a.copy() for a in (q, k, mask)]
    jax.block_until_ready(mha_jax.dot_product_attention(q, k, k, mask=mask))
    for a, c in zip((q, k, mask), copies):
        np.testing.assert_array_equal(a, c)


def test_returned_weights_do_not_alias_their_source():
    """``to_torch``'s and ``from_torch``'s results own their memory: writing to them changes
    neither the module nor the state dict they came from, nor a module loaded from them."""
    module = _jax_module()
    state = mha_jax.to_torch(module)
    kernel = np.array(module.query.kernel.get_value())
    state["q_proj.weight"][...] = 7.0
    np.testing.assert_array_equal(module.query.kernel.get_value(), kernel)
    target = _jax_module(in_features=16)
    numpy_state = mha_jax.to_torch(module)
    mha_jax.load_weights(target, numpy_state)
    numpy_state["k_proj.weight"][...] = 7.0
    np.testing.assert_array_equal(target.key.kernel.get_value(), module.key.kernel.get_value())
