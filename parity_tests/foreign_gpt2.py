"""A port of transformers' GPT-2 in Flax NNX without ``mha_jax``, as another team would write it: a
fixture of the tests, not a test file.

Its names are its own (``wte``, ``blocks.N.norm1``, ``blocks.N.attn.qkv``, ``blocks.N.mlp.fc``,
``norm``); its attention keeps GPT-2's fused projection (``qkv``, one kernel ``(in, 3 * hidden)``
as GPT-2's ``Conv1D`` keeps ``(in, out)``), splits it into queries, keys and values ``(batch,
length, heads, head_dim)`` (transformers: ``(batch, heads, length, head_dim)``) and writes its
keys and values to its cache (an ``nnx.Variable`` of the attention) on every call, attending over
what the cache holds but its padding; the model empties every cache at the start of each call but
a decoding one (``init_cache``, then ``decode=True`` with each token's position, -1 for padding: rows
alone or in a padded batch). The logits are the hidden states against ``wte`` (tied).
``build(torch_model, defect)`` loads it from a ``state_dict`` and plants one of ``DEFECTS``, or
``PADDING_DEFECT``, where ``WHERE`` says.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity_tests.gpt2_port import CONFIG, inputs, transformers_model  # noqa: F401  (the same model and inputs)

SLOTS = 32  # key/value slots of each attention's cache
DEFECTS = ("q and k swapped in the split", "mlp activation")
# a defect only a padded batch shows: the attention attends to the padding its cache holds
PADDING_DEFECT = "padding attended"
WHERE = {"q and k swapped in the split": "transformer.h.1.attn", "mlp activation": "transformer.h.0.mlp",
         PADDING_DEFECT: "transformer.h.0.attn"}
MAPPING = {
    r"transformer\.wte": "wte",
    r"transformer\.wpe": "wpe",
    r"transformer\.h\.(\d+)\.ln_1": r"blocks.\1.norm1",
    r"transformer\.h\.(\d+)\.ln_2": r"blocks.\1.norm2",
    r"transformer\.h\.(\d+)\.attn\.c_attn": r"blocks.\1.attn.qkv",
    r"transformer\.h\.(\d+)\.attn\.c_proj": r"blocks.\1.attn.proj",
    r"transformer\.h\.(\d+)\.attn": r"blocks.\1.attn",
    r"transformer\.h\.(\d+)\.mlp\.c_fc": r"blocks.\1.mlp.fc",
    r"transformer\.h\.(\d+)\.mlp\.c_proj": r"blocks.\1.mlp.out",
    r"transformer\.h\.(\d+)\.mlp": r"blocks.\1.mlp",
    r"transformer\.h\.(\d+)": r"blocks.\1",
    r"transformer\.ln_f": "norm",
    r"transformer": None,  # the port has no module around its blocks
}


class Cache(nnx.Variable):
    """``k``, ``v`` ``(batch, SLOTS, heads, head_dim)``, ``real`` ``(batch, SLOTS)`` (False: padding)
    and ``end``, the slots filled."""


class Attention(nnx.Module):
    def __init__(self, n: int, heads: int, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, n // heads
        self.qkv = nnx.Linear(n, 3 * n, rngs=rngs)
        self.proj = nnx.Linear(n, n, rngs=rngs)
        self.order = (0, 1, 2)  # which third of qkv is the query, the key, the value
        self.cache = Cache(self.empty(1))
        self.attend_padding = False  # a planted defect: the padding cached is attended to

    def empty(self, batch: int) -> dict:
        kv = jnp.zeros((batch, SLOTS, self.heads, self.head_dim), jnp.float32)
        return dict(k=kv, v=kv, real=jnp.zeros((batch, SLOTS), bool), end=jnp.int32(0))

    def __call__(self, x: jax.Array, real: jax.Array | None = None) -> jax.Array:
        """``x`` ``(batch, length, hidden)``: its keys and values appended to the cache, its queries
        attending causally over the cache's tokens that are not padding (``real``: False, default none)."""
        b, n, _ = x.shape
        real = jnp.ones((b, n), bool) if real is None or self.attend_padding else real
        parts = jnp.split(self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim), 3, axis=2)
        q, k, v = (parts[i][:, :, 0] for i in self.order)
        state = self.cache.get_value()
        if state["k"].shape[0] != b:
            state = self.empty(b)
        at = state["end"]
        zero = jnp.zeros_like(at)
        state = dict(k=jax.lax.dynamic_update_slice(state["k"], k, (zero, at, zero, zero)),
                     v=jax.lax.dynamic_update_slice(state["v"], v, (zero, at, zero, zero)),
                     real=jax.lax.dynamic_update_slice(state["real"], real, (zero, at)), end=at + n)
        self.cache.set_value(state)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, state["k"]) / math.sqrt(self.head_dim)
        visible = (jnp.arange(SLOTS)[None, :] <= (at + jnp.arange(n))[:, None])[None] & state["real"][:, None, :]
        visible = visible[:, None]
        scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), state["v"])
        return self.proj(out.reshape(b, n, -1))


class MLP(nnx.Module):
    def __init__(self, n: int, rngs: nnx.Rngs):
        self.fc = nnx.Linear(n, 4 * n, rngs=rngs)
        self.out = nnx.Linear(4 * n, n, rngs=rngs)
        self.approximate = True  # GPT-2's gelu_new: the tanh form

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.gelu(self.fc(x), approximate=self.approximate))


class Block(nnx.Module):
    def __init__(self, n: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(n, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.attn = Attention(n, heads, rngs)
        self.norm2 = nnx.LayerNorm(n, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.mlp = MLP(n, rngs)

    def __call__(self, x: jax.Array, real: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(self.norm1(x), real=real)
        return x + self.mlp(self.norm2(x))


class GPT2(nnx.Module):
    """``ids`` ``(batch, length)`` -> logits ``(batch, length, vocab)``."""

    def __init__(self):
        n, rngs = CONFIG["n_embd"], nnx.Rngs(0)
        self.wte = nnx.Embed(CONFIG["vocab_size"], n, rngs=rngs)
        self.wpe = nnx.Embed(CONFIG["n_positions"], n, rngs=rngs)
        self.blocks = nnx.List([Block(n, CONFIG["n_head"], rngs) for _ in range(CONFIG["n_layer"])])
        self.norm = nnx.LayerNorm(n, epsilon=1e-5, use_fast_variance=False, rngs=rngs)

    def __call__(self, ids: jax.Array, position_ids: jax.Array | None = None, *, decode: bool = False) -> jax.Array:
        """A forward pass (every cache emptied first); ``decode=True``: ``ids`` appended to the
        caches ``init_cache`` made, at ``position_ids`` (-1: padding, never attended to)."""
        positions = jnp.arange(ids.shape[1])[None] if position_ids is None else position_ids
        real = None if position_ids is None else position_ids >= 0
        x = self.wte(ids) + self.wpe(jnp.maximum(positions, 0))
        for block in self.blocks:
            if not decode:
                block.attn.cache.set_value(block.attn.empty(ids.shape[0]))
            x = block(x, real=real)
        return self.wte.attend(self.norm(x))

    def init_cache(self, batch: int, max_length: int) -> None:
        """Empty caches for ``batch`` rows (``compare_decoding``'s protocol; at most ``SLOTS`` tokens)."""
        if max_length > SLOTS:
            raise ValueError(f"max_length {max_length} is more than the cache's {SLOTS} slots")
        for block in self.blocks:
            block.attn.cache.set_value(block.attn.empty(batch))


def build(torch_model, defect: str | None = None) -> GPT2:
    """The port of ``torch_model`` (its ``state_dict``, copied: a Conv1D's weight is a kernel as it is),
    with ``defect`` (one of ``DEFECTS``) planted."""
    port = GPT2()
    state = {k: v.detach().cpu().numpy() for k, v in torch_model.state_dict().items()}
    renamed = {"wte.embedding": "transformer.wte.weight", "wpe.embedding": "transformer.wpe.weight",
               "norm.scale": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias"}
    parts = {"norm1": "ln_1", "norm2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.out": "mlp.c_proj"}
    for i in range(CONFIG["n_layer"]):
        for ours, theirs in parts.items():
            for leaf, their_leaf in (("kernel", "weight"), ("scale", "weight"), ("bias", "bias")):
                renamed[f"blocks.{i}.{ours}.{leaf}"] = f"transformer.h.{i}.{theirs}.{their_leaf}"
    for path, variable in nnx.to_flat_state(nnx.state(port, nnx.Param)):
        variable.set_value(jnp.asarray(np.array(state[renamed[".".join(map(str, path))]], copy=True)))
    if defect == "q and k swapped in the split":
        port.blocks[1].attn.order = (1, 0, 2)
    elif defect == "mlp activation":
        port.blocks[0].mlp.approximate = False
    elif defect == PADDING_DEFECT:
        port.blocks[0].attn.attend_padding = True
    elif defect is not None:
        raise ValueError(f"defect must be one of {(*DEFECTS, PADDING_DEFECT)} or None, got {defect!r}")
    return port
