"""Rotary position embeddings (``mha_jax.rope``, ``mha_torch.rope``) against transformers' own code,
and the twins against each other.

transformers is the oracle twice over: its init functions (``ROPE_INIT_FUNCTIONS``, and the
default of ``LlamaRotaryEmbedding``) for the frequencies and attention factors, and its rotary
modules with their ``apply_rotary_pos_emb`` (Llama's rotate-half, GPT-NeoX's partial rotary,
GPT-J's interleaved ``rotate_every_two``) for the rotation. Nothing is downloaded: the configs are
built here. In float64, where transformers computes in float32, its formula is evaluated in
float64 from its float32 frequencies.
"""

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox import modeling_gpt_neox as neox
from transformers.models.gptj import modeling_gptj as gptj
from transformers.models.llama import modeling_llama as llama

import mha_jax
import mha_torch

B, L, H, D = 2, 7, 3, 16
MAX_POS = 32  # dynamic scales beyond it
OMAX = 16  # original_max_position_embeddings: longrope switches factors beyond it
THETA = 10000.0

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OMAX},
    "yarn_all_keys": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OMAX, "beta_fast": 8,
        "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 1.3, "truncate": False,
    },
    "yarn_derived_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": OMAX,
                            "attention_factor": 0.8},
    "longrope": {
        "rope_type": "longrope", "original_max_position_embeddings": OMAX,
        "short_factor": [1.0 + 0.25 * i for i in range(D // 2)], "long_factor": [1.5 + 2.5 * i for i in range(D // 2)],
    },
    "longrope_factor": {
        "rope_type": "longrope", "original_max_position_embeddings": OMAX, "factor": 1.5, "attention_factor": 1.1,
        "short_factor": [1.0 + 0.25 * i for i in range(D // 2)], "long_factor": [1.5 + 2.5 * i for i in range(D // 2)],
    },
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": OMAX},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.75, "factor": 2.0},
}
# Positions up to 36 (past both thresholds), and per row up to 15 (below both).
OFFSET = np.arange(L) + 30
PER_ROW = np.stack([np.arange(L), np.arange(L) + 9])
POSITIONS = {"offset": OFFSET, "per_row": PER_ROW}


def _config(scaling: dict) -> dict:
    """A Llama ``config.json`` dict with these rope parameters (transformers 5 naming)."""
    return {
        "model_type": "llama", "hidden_size": H * D, "num_attention_heads": H, "head_dim": D,
        "max_position_embeddings": MAX_POS, "rope_parameters": {**scaling, "rope_theta": THETA},
    }


def _llama_config(scaling: dict) -> LlamaConfig:
    config = copy.deepcopy(_config(scaling))
    config.pop("model_type")
    return LlamaConfig(**config)


def _x(seed=0, shape=(B, L, H, D)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


def _to_torch(x: np.ndarray, dtype=torch.float64) -> torch.Tensor:
    """JAX layout (batch, len, heads, head_dim) -> torch's (batch, heads, len, head_dim)."""
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).to(dtype)


def _from_torch(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy().transpose(0, 2, 1, 3)


def _rel(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _ulps(ours, theirs) -> int:
    ours, theirs = (np.asarray(a, np.float32).view(np.int32).astype(np.int64) for a in (ours, theirs))
    return int(np.abs(ours - theirs).max())


# --- frequencies and attention factors ---------------------------------------------------------


def _init_function(config: LlamaConfig, rope_type: str, seq_len=None):
    """transformers' init function for the type; ``default`` is the model's own."""
    if rope_type == "default":
        return llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


@pytest.mark.parametrize("name", SCALINGS)
def test_frequencies_equal_transformers(name):
    """``inv_freq`` and ``attention_factor`` equal what transformers' init function returns
    (torch twin bitwise, JAX within 1 ulp), and at each sequence length, below, at and past the
    thresholds, what a ``LlamaRotaryEmbedding`` holds after a forward pass over it
    (``dynamic_rope_update`` calls the init function with the length as a tensor)."""
    rope_type = SCALINGS[name]["rope_type"]
    hf_config = _llama_config(SCALINGS[name])
    ours = {"torch": mha_torch.RotaryEmbedding.from_config(_config(SCALINGS[name])),
            "jax": mha_jax.RotaryEmbedding.from_config(_config(SCALINGS[name]))}
    inv_freq, factor = _init_function(hf_config, rope_type)
    assert torch.equal(ours["torch"].inv_freq, inv_freq)
    assert _ulps(ours["jax"].inv_freq, inv_freq) <= 1
    assert ours["torch"].attention_factor == ours["jax"].attention_factor == factor
    for seq_len in (5, OMAX, OMAX + 1, MAX_POS, MAX_POS + 1, 100):
        module = llama.LlamaRotaryEmbedding(hf_config)
        module(torch.zeros(1), torch.arange(seq_len)[None])
        assert torch.equal(ours["torch"].frequencies(seq_len), module.inv_freq), seq_len
        assert _ulps(ours["jax"].frequencies(seq_len), module.inv_freq) <= 1, seq_len
        assert ours["torch"].attention_factor == module.attention_scaling
        if seq_len > (ours["torch"].seq_len_threshold() or np.inf):
            grown, _ = _init_function(hf_config, rope_type, torch.tensor(seq_len))
            assert torch.equal(module.inv_freq, grown)


# Published models' rope parameters (head_dim, theta, max_position_embeddings, scaling).
LARGE = {
    "llama3.1": (128, 500000.0, 131072, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "qwen2_yarn": (128, 1e6, 131072, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "gemma3_linear": (256, 1e6, 131072, {"rope_type": "linear", "factor": 8.0}),
    "phi3_longrope": (96, 1e4, 131072, {
        "rope_type": "longrope", "original_max_position_embeddings": 4096,
        "short_factor": [1.0 + 0.01 * i for i in range(48)], "long_factor": [1.0 + 0.5 * i for i in range(48)]}),
}


@pytest.mark.parametrize("name", LARGE)
def test_frequencies_of_published_sizes(name):
    """At published models' sizes and thetas, where XLA's float32 power and torch's part by an
    ulp on some frequencies: torch twin bitwise, JAX within 1 ulp."""
    head_dim, theta, max_pos, scaling = LARGE[name]
    config = {"head_dim": head_dim, "hidden_size": 4 * head_dim, "num_attention_heads": 4,
              "max_position_embeddings": max_pos, "rope_parameters": {**scaling, "rope_theta": theta}}
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](LlamaConfig(**copy.deepcopy(config)), None)
    for package in (mha_torch, mha_jax):
        rope = package.RotaryEmbedding.from_config(config)
        assert rope.attention_factor == factor
        assert _ulps(rope.inv_freq, inv_freq) <= (0 if package is mha_torch else 1)


def test_lengths_grow_as_in_transformers_stateful_module():
    """Prefill then decoding steps, one position at a time across the thresholds: each call of the
    stateless embedding equals transformers' module, whose cache only ever grows here. After a
    longer sequence, transformers' dynamic NTK keeps that sequence's frequencies, where the
    stateless embedding computes each call's own."""
    for name in ("dynamic", "longrope"):
        hf_config = _llama_config(SCALINGS[name])
        module = llama.LlamaRotaryEmbedding(hf_config)
        rope = mha_torch.RotaryEmbedding.from_config(_config(SCALINGS[name]))
        x = _to_torch(_x(1, (1, 1, H, D)), torch.float32)
        for steps in [torch.arange(OMAX - 2)] + [torch.tensor([n]) for n in range(OMAX - 2, MAX_POS + 3)]:
            cos, sin = module(x, steps[None])
            theirs, _ = llama.apply_rotary_pos_emb(x.expand(1, H, len(steps), D), x, cos, sin)
            assert torch.equal(rope(x.expand(1, H, len(steps), D), steps), theirs), (name, steps)
    # Where they part: dynamic after a longer sequence, transformers keeps its frequencies.
    module = llama.LlamaRotaryEmbedding(_llama_config(SCALINGS["dynamic"]))
    rope = mha_torch.RotaryEmbedding.from_config(_config(SCALINGS["dynamic"]))
    module(x, torch.arange(100)[None])
    module(x, torch.tensor([[MAX_POS + 4]]))
    assert torch.equal(module.inv_freq, rope.frequencies(100))
    assert not torch.equal(module.inv_freq, rope.frequencies(MAX_POS + 5))


# --- rotation against transformers --------------------------------------------------------------


def _transformers_float64(inv_freq: torch.Tensor, positions: torch.Tensor,
                          factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRotaryEmbedding.forward`` in float64 from its float32 frequencies: cos, sin
    ``(batch, len, 2 * len(inv_freq))``."""
    angles = positions.double()[..., None] * inv_freq.double()
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def _ours(x: np.ndarray, positions: np.ndarray, rope_torch, rope_jax, dtype) -> dict[str, np.ndarray]:
    """Both twins on ``x`` (JAX layout) in ``dtype``, back in JAX layout as float64."""
    torch_dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return {
        "torch": _from_torch(rope_torch(_to_torch(x, torch_dtype), torch.from_numpy(positions))),
        "jax": np.asarray(rope_jax(jnp.asarray(x, dtype), jnp.asarray(positions)), np.float64),
    }


def _check_rotation(module, apply, ropes, x: np.ndarray, positions: np.ndarray) -> None:
    """Both twins against a transformers rotary module and its ``apply_rotary_pos_emb``: float32
    to 1e-6, float64 against its formula evaluated in float64 to 1e-12."""
    position_ids = torch.from_numpy(np.broadcast_to(positions, (1, L) if positions.ndim == 1 else (B, L)).copy())
    q = _to_torch(x, torch.float32)
    theirs, _ = apply(q, q, *module(q, position_ids))
    for framework, ours in _ours(x, positions, *ropes, "float32").items():
        assert _rel(ours, _from_torch(theirs)) < 1e-6, framework
    cos, sin = _transformers_float64(module.inv_freq, position_ids, module.attention_scaling)
    theirs, _ = apply(_to_torch(x), _to_torch(x), cos, sin)
    for framework, ours in _ours(x, positions, *ropes, "float64").items():
        assert _rel(ours, _from_torch(theirs)) < 1e-12, framework


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("name", SCALINGS)
def test_llama_rotation(name, positions):
    """Rotate-half against ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``, every scaling."""
    ropes = (mha_torch.RotaryEmbedding.from_config(_config(SCALINGS[name])),
             mha_jax.RotaryEmbedding.from_config(_config(SCALINGS[name])))
    _check_rotation(llama.LlamaRotaryEmbedding(_llama_config(SCALINGS[name])), llama.apply_rotary_pos_emb, ropes, _x(2),
                    POSITIONS[positions])


NEOX = {
    "model_type": "gpt_neox", "hidden_size": H * D, "num_attention_heads": H, "rotary_pct": 0.5,
    "rotary_emb_base": 500.0, "max_position_embeddings": MAX_POS,
}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "dynamic", "factor": 2.0}])
def test_gpt_neox_partial_rotation(scaling):
    """GPT-NeoX rotates the first ``rotary_pct`` of each head (rotate-half within it), here with
    its default frequencies and with dynamic scaling past ``max_position_embeddings``."""
    config = {**NEOX, "rope_scaling": scaling}
    hf_config = GPTNeoXConfig(**{k: v for k, v in copy.deepcopy(config).items() if k != "model_type"})
    ropes = (mha_torch.RotaryEmbedding.from_config(config), mha_jax.RotaryEmbedding.from_config(config))
    assert ropes[0].rotary_dim == D // 2 and not ropes[0].interleaved
    for positions in POSITIONS.values():
        _check_rotation(neox.GPTNeoXRotaryEmbedding(hf_config), neox.apply_rotary_pos_emb, ropes, _x(3), positions)


GPTJ = {"model_type": "gptj", "n_embd": H * D, "n_head": H, "rotary_dim": D // 2, "n_positions": 64}


def _gptj(x: torch.Tensor, positions: np.ndarray, rotary_dim: int, dtype) -> torch.Tensor:
    """GPT-J's attention on ``x`` ``(batch, len, heads, head_dim)``: sin and cos looked up in
    ``create_sinusoidal_positions`` (recomputed in float64 from its float32 frequencies for float64),
    ``apply_rotary_pos_emb`` on the first ``rotary_dim`` features."""
    position_ids = torch.from_numpy(np.broadcast_to(positions, (B, L)).copy())
    if dtype == torch.float32:
        sincos = gptj.create_sinusoidal_positions(64, rotary_dim)[position_ids]
    else:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64) / rotary_dim))
        angles = position_ids.double()[..., None] * inv_freq.double()
        sincos = torch.cat((angles.sin(), angles.cos()), dim=-1)
    sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)
    rotated = gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def test_gpt_j_interleaved_rotation():
    """GPT-J's ``rotate_every_two`` (pairs 2i, 2i + 1) on its first ``rotary_dim`` features."""
    rope_torch, rope_jax = mha_torch.RotaryEmbedding.from_config(GPTJ), mha_jax.RotaryEmbedding.from_config(GPTJ)
    assert rope_torch.interleaved and rope_torch.rotary_dim == D // 2 and rope_torch.head_dim == D
    x = _x(4)
    for positions in POSITIONS.values():
        for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
            theirs = _gptj(torch.from_numpy(x).to(dtype), positions, D // 2, dtype).double().numpy()
            for framework, ours in _ours(x, positions, rope_torch, rope_jax, str(dtype).removeprefix("torch.")).items():
                assert _rel(ours, theirs) < tolerance, (framework, dtype)


# --- JAX against torch ---------------------------------------------------------------------------

TWIN_TOLERANCES = {"float64": 1e-13, "float32": 1e-6, "bfloat16": 2e-2}


@pytest.mark.parametrize("name", ["default", "dynamic", "yarn_all_keys"])
def test_jax_matches_torch(name):
    """Eager JAX against torch in each dtype, at both position sets, rotate-half and interleaved,
    whole and partial heads; the output keeps the input's dtype. (The other scalings differ only
    in their frequencies, compared above.)"""
    for interleaved, rotary_dim in ((False, D), (True, D // 2 + 2)):
        arguments = dict(rotary_dim=rotary_dim, theta=THETA, interleaved=interleaved, max_position_embeddings=MAX_POS)
        scaling = SCALINGS[name]
        rope_torch = mha_torch.RotaryEmbedding(D, scaling=scaling, **arguments)
        rope_jax = mha_jax.RotaryEmbedding(D, scaling=scaling, **arguments)
        for positions in POSITIONS.values():
            for dtype, tolerance in TWIN_TOLERANCES.items():
                x = _x(5)
                out = _ours(x, positions, rope_torch, rope_jax, dtype)
                assert _rel(out["jax"], out["torch"]) < tolerance, (interleaved, dtype)
                assert rope_jax(jnp.asarray(x, dtype), positions).dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("name", ["dynamic", "longrope_factor", "yarn"])
def test_jit_with_traced_positions(name):
    """Jitted once with the embedding a static argument and positions traced: below and past the
    thresholds (the frequencies switch inside the compiled function), equal to torch's."""
    rope_torch = mha_torch.RotaryEmbedding.from_config(_config(SCALINGS[name]))
    rope_jax = mha_jax.RotaryEmbedding.from_config(_config(SCALINGS[name]))
    traces = []
    apply = jax.jit(lambda rope, x, positions: traces.append(rope) or rope(x, positions), static_argnums=0)
    x = _x(6)
    for positions in (np.arange(L), np.arange(L) + 12, OFFSET):
        theirs = _from_torch(rope_torch(_to_torch(x, torch.float32), torch.from_numpy(positions)))
        ours = apply(rope_jax, jnp.asarray(x, jnp.float32), jnp.asarray(positions))
        assert _rel(ours, theirs) < 1e-6, positions
    assert len(traces) == 1
    seq_len = jnp.asarray(OFFSET.max() + 1)
    assert _ulps(jax.jit(rope_jax.frequencies)(seq_len), rope_torch.frequencies(int(seq_len))) <= 1


def test_without_x64():
    """As JAX runs by default, without float64: the frequencies as with it, except dynamic's past
    ``max_position_embeddings``, whose grown base XLA raises to a power in float32 (within 2e-6 of
    torch's, where it is bitwise with x64). Rotations just past the threshold within 1e-6 of
    torch's; at position 5000 further (about 1e-5), yet nearer than torch's float32 rotation is
    to the same rotation in float64."""
    with jax.enable_x64(False):
        for name in SCALINGS:
            rope_torch = mha_torch.RotaryEmbedding.from_config(_config(SCALINGS[name]))
            rope_jax = mha_jax.RotaryEmbedding.from_config(_config(SCALINGS[name]))
            for seq_len in (5, MAX_POS + 1, 2**20):
                ours, theirs = rope_jax.frequencies(seq_len), rope_torch.frequencies(seq_len)
                if name == "dynamic" and seq_len > MAX_POS:
                    assert np.abs(np.asarray(ours) / theirs.numpy() - 1).max() < 2e-6
                else:
                    assert _ulps(ours, theirs) <= 1, (name, seq_len)
        rope_torch = mha_torch.RotaryEmbedding.from_config(_config(SCALINGS["dynamic"]))
        rope_jax = mha_jax.RotaryEmbedding.from_config(_config(SCALINGS["dynamic"]))
        apply = jax.jit(lambda x, positions: rope_jax(x, positions))
        x = _x(14)
        for offset in (MAX_POS + 8, 5000):
            positions = np.arange(L) + offset
            ours = apply(jnp.asarray(x, jnp.float32), jnp.asarray(positions, jnp.int32))
            theirs = _from_torch(rope_torch(_to_torch(x, torch.float32), torch.from_numpy(positions)))
            exact = _from_torch(rope_torch(_to_torch(x), torch.from_numpy(positions)))
            assert ours.dtype == jnp.float32
            assert _rel(ours, theirs) < (1e-6 if offset < 100 else _rel(theirs, exact)), offset


@pytest.mark.parametrize("name, interleaved", [("dynamic", False), ("yarn", True)])
def test_gradient_matches_torch(name, interleaved):
    """d(sum(w * rope(x))) / dx, float64, JAX against torch autograd, partial rotary."""
    arguments = dict(rotary_dim=D // 2, interleaved=interleaved, scaling=SCALINGS[name],
                     max_position_embeddings=MAX_POS)
    rope_torch, rope_jax = mha_torch.RotaryEmbedding(D, **arguments), mha_jax.RotaryEmbedding(D, **arguments)
    x, w = _x(7), _x(8)
    ours = jax.grad(lambda x: jnp.sum(rope_jax(x, jnp.asarray(OFFSET)) * w))(jnp.asarray(x))
    x_torch = _to_torch(x).requires_grad_()
    (rope_torch(x_torch, torch.from_numpy(OFFSET)) * _to_torch(w)).sum().backward()
    assert _rel(ours, _from_torch(x_torch.grad)) < 1e-13


# --- properties -----------------------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_scores_depend_only_on_relative_position(framework):
    """q·k after rotation is unchanged when every position moves by the same shift (default type)."""
    rope = {"jax": mha_jax, "torch": mha_torch}[framework].RotaryEmbedding(D)
    q, k = _x(9), _x(10)

    def scores(shift: int) -> np.ndarray:
        positions = np.arange(L) + shift
        if framework == "jax":
            rq, rk = (np.asarray(rope(jnp.asarray(a), jnp.asarray(positions))) for a in (q, k))
        else:
            rq, rk = (_from_torch(rope(_to_torch(a), torch.from_numpy(positions))) for a in (q, k))
        return np.einsum("bqhd,bkhd->bhqk", rq, rk)

    assert _rel(scores(13), scores(0)) < 1e-12
    assert _rel(scores(1000), scores(0)) < 1e-11


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_partial_rotary_leaves_the_tail_untouched(dtype):
    """Features past ``rotary_dim`` come back bit for bit, in both frameworks and conventions."""
    x = _x(11)
    for interleaved in (False, True):
        ropes = (mha_torch.RotaryEmbedding(D, rotary_dim=6, interleaved=interleaved),
                 mha_jax.RotaryEmbedding(D, rotary_dim=6, interleaved=interleaved))
        out = _ours(x, OFFSET, *ropes, dtype)
        expected = np.asarray(jnp.asarray(x, dtype), np.float64)[..., 6:]
        for framework in ("torch", "jax"):
            np.testing.assert_array_equal(out[framework][..., 6:], expected, err_msg=framework)
            assert not np.array_equal(out[framework][..., :6], np.asarray(jnp.asarray(x, dtype), np.float64)[..., :6])


def test_default_positions_and_batch_axes():
    """No positions means ``arange(len)``; JAX takes any leading batch axes, positions
    broadcasting over them; nothing passed is modified."""
    rope = mha_jax.RotaryEmbedding(D)
    x = jnp.asarray(_x(12, (2, B, L, H, D)))
    np.testing.assert_array_equal(rope(x), rope(x, jnp.arange(L)))
    per_row = jnp.asarray(PER_ROW)
    np.testing.assert_array_equal(rope(x, per_row)[1], rope(x[1], per_row))
    rope_torch = mha_torch.RotaryEmbedding(D)
    x_torch = _to_torch(_x(12))
    before, positions = x_torch.clone(), torch.from_numpy(PER_ROW.copy())
    assert torch.equal(rope_torch(x_torch), rope_torch(x_torch, torch.arange(L)))
    rope_torch(x_torch, positions)
    assert torch.equal(x_torch, before) and torch.equal(positions, torch.from_numpy(PER_ROW))


# --- configs ---------------------------------------------------------------------------------------


def test_from_config_reads_each_naming():
    """transformers 5's ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``
    (with ``type``) give one embedding; configs without rotary keys give None; the config dict is
    left as it was; the embedding is hashable, equals its constructor's, copies and pickles."""
    new = _config(SCALINGS["llama3"])
    old = {**new, "rope_theta": THETA,
           "rope_scaling": {"type": "llama3", **{k: v for k, v in SCALINGS["llama3"].items() if k != "rope_type"}}}
    del old["rope_parameters"]
    snapshot = copy.deepcopy(old)
    for package in (mha_jax, mha_torch):
        rope = package.RotaryEmbedding.from_config(new)
        assert rope == package.RotaryEmbedding.from_config(old) == package.RotaryEmbedding(
            D, theta=THETA, scaling=SCALINGS["llama3"], max_position_embeddings=MAX_POS)
        assert hash(rope) == hash(package.RotaryEmbedding.from_config(old))
        assert copy.deepcopy(rope) == pickle.loads(pickle.dumps(rope)) == rope
        assert package.RotaryEmbedding.from_config({"model_type": "bert", "hidden_size": 48,
                                                    "num_attention_heads": 3}) is None
    assert old == snapshot


def test_from_config_model_conventions():
    """GPT-NeoX ``rotary_pct``/``rotary_emb_base``, Phi's default fraction, GPT-J ``rotary_dim``
    and interleaving, Phi-3's top-level ``original_max_position_embeddings`` and old type names."""
    rope = mha_jax.RotaryEmbedding.from_config(NEOX)
    assert (rope.rotary_dim, rope.theta, rope.interleaved) == (D // 2, 500.0, False)
    rope = mha_jax.RotaryEmbedding.from_config({"model_type": "phi", "hidden_size": 64, "num_attention_heads": 2,
                                                "rope_theta": 1e4})
    assert (rope.head_dim, rope.rotary_dim) == (32, 16)
    rope = mha_jax.RotaryEmbedding.from_config(GPTJ)
    assert (rope.head_dim, rope.rotary_dim, rope.interleaved, rope.max_position_embeddings) == (D, D // 2, True, 64)
    phi3 = {
        "model_type": "phi3", "hidden_size": H * D, "num_attention_heads": H, "max_position_embeddings": 128,
        "original_max_position_embeddings": OMAX,
        "rope_scaling": {"type": "su", "short_factor": SCALINGS["longrope"]["short_factor"],
                         "long_factor": SCALINGS["longrope"]["long_factor"]},
    }
    rope = mha_torch.RotaryEmbedding.from_config(phi3)
    assert rope.rope_type == "longrope" and rope.scaling["original_max_position_embeddings"] == OMAX
    assert rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(128 / OMAX) / np.log(OMAX)))


# --- bad input ------------------------------------------------------------------------------------

CONSTRUCTOR_ERRORS = {
    "rotary_dim_too_large": ({"rotary_dim": 18}, ValueError,
                             "rotary_dim must be an even integer in [2, head_dim] = [2, 16], got 18"),
    "rotary_dim_odd": ({"rotary_dim": 5}, ValueError,
                       "rotary_dim must be an even integer in [2, head_dim] = [2, 16], got 5"),
    "theta_zero": ({"theta": 0.0}, ValueError, "theta must be a finite number > 0, got 0.0"),
    "theta_negative": ({"theta": -1}, ValueError, "theta must be a finite number > 0, got -1"),
    "unknown_type": ({"scaling": {"rope_type": "mrope"}}, ValueError,
                     "scaling['rope_type'] must be one of ('default', 'linear', 'dynamic', 'yarn', 'longrope', "
                     "'llama3', 'proportional'), got 'mrope'"),
    "no_type": ({"scaling": {"factor": 2.0}}, ValueError, "scaling['rope_type'] must be one of"),
    "missing_key": ({"scaling": {"rope_type": "yarn", "factor": 2.0}}, ValueError,
                    "scaling for rope_type 'yarn' is missing required key(s) 'original_max_position_embeddings'"),
    "missing_keys": ({"scaling": {"rope_type": "llama3", "factor": 8.0}}, ValueError,
                     "scaling for rope_type 'llama3' is missing required key(s) 'low_freq_factor', 'high_freq_factor', "
                     "'original_max_position_embeddings'"),
    "unread_key": ({"scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 4}}, ValueError,
                   "scaling for rope_type 'linear' has key(s) 'beta_fast', which transformers does not read for it "
                   "(it reads 'factor')"),
    "dynamic_without_max": ({"scaling": SCALINGS["dynamic"]}, ValueError,
                            "rope_type 'dynamic' needs max_position_embeddings"),
    "factor_list_length": ({"scaling": {**SCALINGS["longrope"], "long_factor": [1.0, 2.0]}}, ValueError,
                           "scaling['long_factor'] (rope_type 'longrope') must have rotary_dim // 2 = 8 entries, "
                           "got 2"),
    "factor_not_a_number": ({"scaling": {"rope_type": "linear", "factor": "2"}}, ValueError,
                            "scaling['factor'] (rope_type 'linear') must be a finite number, got '2'"),
}


@pytest.mark.parametrize("name", CONSTRUCTOR_ERRORS)
def test_constructors_reject_alike(name):
    kwargs, error, message = CONSTRUCTOR_ERRORS[name]
    for package in (mha_jax, mha_torch):
        with pytest.raises(error) as info:
            package.RotaryEmbedding(D, **kwargs)
        assert str(info.value).startswith(message), package.__name__


def test_from_config_rejects_alike():
    nested = {**_config(SCALINGS["default"]), "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                                  "sliding_attention": {"rope_type": "default"}}}
    headless = {"rope_theta": 1e4}
    for config, message in ((nested, "config's rope parameters are given per layer type "
                                     "('full_attention', 'sliding_attention')"),
                            (headless, "config names neither head_dim nor hidden_size and num_attention_heads"),
                            ([("rope_theta", 1e4)], "config must be a mapping (a config.json dict), got list")):
        messages = set()
        for package in (mha_jax, mha_torch):
            with pytest.raises((ValueError, TypeError)) as info:
                package.RotaryEmbedding.from_config(config)
            messages.add((type(info.value), str(info.value)))
        assert len(messages) == 1 and next(iter(messages))[1].startswith(message)


CALL_ERRORS = {
    "positions_float": (lambda x: np.arange(L, dtype=np.float32), TypeError,
                        "positions must be an integer array, got dtype float32 with shape (7,)"),
    "positions_length": (lambda x: np.arange(L + 1), ValueError,
                         "positions must have shape (len,) = (7,) or (*batch, len) with batch axes broadcasting "
                         "to (2,), got (8,)"),
    "positions_batch": (lambda x: np.zeros((3, L), np.int64), ValueError,
                        "positions must have shape (len,) = (7,) or (*batch, len) with batch axes broadcasting "
                        "to (2,), got (3, 7)"),
    "positions_rank": (lambda x: np.zeros((1, B, L), np.int64), ValueError,
                       "positions must have shape (len,) = (7,) or (*batch, len) with batch axes broadcasting to (2,), "
                       "got (1, 2, 7)"),
}


@pytest.mark.parametrize("name", CALL_ERRORS)
def test_calls_reject_alike(name):
    make, error, message = CALL_ERRORS[name]
    x = _x(13)
    positions = make(x)
    with pytest.raises(error) as jax_info:
        mha_jax.RotaryEmbedding(D)(jnp.asarray(x), jnp.asarray(positions))
    with pytest.raises(error) as torch_info:
        mha_torch.RotaryEmbedding(D)(_to_torch(x), torch.from_numpy(positions))
    assert str(jax_info.value) == str(torch_info.value) == message


def test_bad_x_is_named():
    for call in (lambda: mha_jax.RotaryEmbedding(D)(jnp.zeros((B, L, H, D), jnp.int32)),
                 lambda: mha_torch.RotaryEmbedding(D)(torch.zeros((B, H, L, D), dtype=torch.int32))):
        with pytest.raises(TypeError, match=r"^x must be a real floating-point array, got dtype int32"):
            call()
    with pytest.raises(ValueError, match=r"^x must have shape \(\*batch, len, heads, head_dim\) with head_dim = 16, "
                                         r"got \(2, 7, 3, 8\)"):
        mha_jax.RotaryEmbedding(D)(jnp.zeros((B, L, H, 8)))
    with pytest.raises(ValueError, match=r"^x must have shape \(\*batch, heads, len, head_dim\) with head_dim = 16, "
                                         r"got \(3, 7, 16\)"):
        mha_torch.RotaryEmbedding(D)(torch.zeros((H, L, D)))
