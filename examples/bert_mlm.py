"""A masked-language BERT in Flax (nnx) on ``mha_jax``, and its check against transformers.

The port mirrors transformers' ``BertForMaskedLM`` module for module and name for name, except
the attention: where transformers splits it into ``attention.self`` (query, key, value) and
``attention.output`` (dense, LayerNorm), the port holds one ``mha_jax.MultiHeadAttention``
(``attention.attention``, built by ``mha_jax.from_hf``) and the LayerNorm beside it; ``MAPPING``
tells ``parity_tests.porting`` how those names pair. Run ``python examples/bert_mlm.py`` to compare
the pre-trained BERT that ``rxnfp`` ships (``pip install --no-deps rxnfp==0.1.0``) with its port.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hf_weights import load_modules

import mha_jax

# transformers' names -> the port's, where they differ
MAPPING = {
    r"(.*)\.attention\.self\.(query|key|value)": r"\1.attention.attention.\2",
    r"(.*)\.attention\.output\.dense": r"\1.attention.attention.out",
    r"(.*)\.attention\.output\.LayerNorm": r"\1.attention.LayerNorm",
    r"(.*)\.attention\.(self|output)": None,  # no module of the port computes these parts alone
}


def gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)  # transformers' "gelu" is the exact (erf) form


def layer_norm(c: Mapping, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(c["hidden_size"], epsilon=c["layer_norm_eps"], param_dtype=c["param_dtype"], rngs=rngs)


class Embeddings(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        h = c["hidden_size"]
        self.word_embeddings = nnx.Embed(c["vocab_size"], h, param_dtype=c["param_dtype"], rngs=rngs)
        self.position_embeddings = nnx.Embed(c["max_position_embeddings"], h, param_dtype=c["param_dtype"], rngs=rngs)
        self.token_type_embeddings = nnx.Embed(c["type_vocab_size"], h, param_dtype=c["param_dtype"], rngs=rngs)
        self.LayerNorm = layer_norm(c, rngs)

    def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        """``(batch, length)`` token and segment ids -> ``(batch, length, hidden)``."""
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(jnp.arange(input_ids.shape[-1])))


class Attention(nnx.Module):
    """Self-attention, then the residual and a LayerNorm (transformers' ``BertAttention``)."""

    def __init__(self, c: Mapping, layer: int, state: Mapping | None, rngs: nnx.Rngs):
        self.attention = mha_jax.from_hf(c, state, layer=layer, rngs=rngs, param_dtype=c["param_dtype"])
        self.LayerNorm = layer_norm(c, rngs)

    def __call__(self, hidden_states: jax.Array, *, mask: jax.Array) -> jax.Array:
        return self.LayerNorm(self.attention(hidden_states, mask=mask) + hidden_states)


class Intermediate(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.dense = nnx.Linear(c["hidden_size"], c["intermediate_size"], param_dtype=c["param_dtype"], rngs=rngs)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        return gelu(self.dense(hidden_states))


class Output(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.dense = nnx.Linear(c["intermediate_size"], c["hidden_size"], param_dtype=c["param_dtype"], rngs=rngs)
        self.LayerNorm = layer_norm(c, rngs)

    def __call__(self, hidden_states: jax.Array, input_tensor: jax.Array) -> jax.Array:
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class Layer(nnx.Module):
    def __init__(self, c: Mapping, layer: int, state: Mapping | None, rngs: nnx.Rngs):
        self.attention = Attention(c, layer, state, rngs)
        self.intermediate = Intermediate(c, rngs)
        self.output = Output(c, rngs)

    def __call__(self, hidden_states: jax.Array, *, mask: jax.Array) -> jax.Array:
        attended = self.attention(hidden_states, mask=mask)
        return self.output(self.intermediate(attended), attended)


class Encoder(nnx.Module):
    def __init__(self, c: Mapping, state: Mapping | None, rngs: nnx.Rngs):
        self.layer = nnx.List([Layer(c, i, state, rngs) for i in range(c["num_hidden_layers"])])

    def __call__(self, hidden_states: jax.Array, *, mask: jax.Array) -> jax.Array:
        for layer in self.layer:
            hidden_states = layer(hidden_states, mask=mask)
        return hidden_states


class Bert(nnx.Module):
    def __init__(self, c: Mapping, state: Mapping | None, rngs: nnx.Rngs):
        self.embeddings = Embeddings(c, rngs)
        self.encoder = Encoder(c, state, rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        # every query attends to the row's tokens, not its padding: (batch, 1, 1, length)
        mask = attention_mask[:, None, None, :].astype(bool)
        return self.encoder(self.embeddings(input_ids, token_type_ids), mask=mask)


class Transform(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.dense = nnx.Linear(c["hidden_size"], c["hidden_size"], param_dtype=c["param_dtype"], rngs=rngs)
        self.LayerNorm = layer_norm(c, rngs)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        return self.LayerNorm(gelu(self.dense(hidden_states)))


class Predictions(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.transform = Transform(c, rngs)
        self.decoder = nnx.Linear(c["hidden_size"], c["vocab_size"], param_dtype=c["param_dtype"], rngs=rngs)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        return self.decoder(self.transform(hidden_states))


class Head(nnx.Module):
    def __init__(self, c: Mapping, rngs: nnx.Rngs):
        self.predictions = Predictions(c, rngs)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        return self.predictions(hidden_states)


class BertForMaskedLM(nnx.Module):
    """``(input_ids, attention_mask, token_type_ids)``, each ``(batch, length)`` integers ->
    logits ``(batch, length, vocab)``."""

    def __init__(self, config: Mapping, state: Mapping | None = None, *, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        c = dict(config, model_type="bert", param_dtype=param_dtype)
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.bert = Bert(c, state, rngs)
        self.cls = Head(c, rngs)
        if state is not None:
            load(self, state, param_dtype)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, token_type_ids: jax.Array) -> jax.Array:
        return self.cls(self.bert(input_ids, attention_mask, token_type_ids))


def load(model: BertForMaskedLM, state: Mapping, param_dtype=jnp.float32) -> None:
    """Everything but the attention (which ``mha_jax.from_hf`` loaded) from transformers' state
    dict (names -> arrays), in ``param_dtype``; the attention block's LayerNorm is transformers'
    ``attention.output.LayerNorm``."""
    load_modules(model, state, param_dtype, key=lambda name: name.replace(".attention.LayerNorm",
                                                                          ".attention.output.LayerNorm"))


def shipped_bert() -> tuple[str, str]:
    """rxnfp's pre-trained BERT: its ``config.json`` and ``pytorch_model.bin``."""
    import importlib.metadata

    folder = importlib.metadata.distribution("rxnfp").locate_file("rxnfp/models/transformers/bert_pretrained")
    return str(folder / "config.json"), str(folder / "pytorch_model.bin")


def transformers_model(config_path: str, weights: str, dtype: str = "float32"):
    """transformers' ``BertForMaskedLM`` (eager attention) with the checkpoint's weights."""
    import json

    import torch
    import transformers

    with open(config_path) as f:
        config = transformers.BertConfig(**json.load(f), attn_implementation="eager")
    model = transformers.BertForMaskedLM(config)
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=False)
    return model.to(getattr(torch, dtype)).eval()


def port(torch_model, dtype: str = "float32") -> BertForMaskedLM:
    """The Flax port holding the PyTorch model's weights (its state dict, tied decoder included)."""
    from parity_tests.tool.arrays import to_numpy

    state = {k: to_numpy(v) for k, v in torch_model.state_dict().items()}
    return BertForMaskedLM(torch_model.config.to_dict(), state, param_dtype=jnp.dtype(dtype))


def inputs(vocab: int, batch: int = 2, length: int = 12, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Token ids, an attention mask whose second row ends in 4 padding tokens, segment ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, length))
    mask = np.ones((batch, length), np.int64)
    mask[1, -4:] = 0
    types = np.zeros((batch, length), np.int64)
    types[:, length // 2:] = 1
    return ids, mask, types


def main() -> None:
    from parity_tests import compare

    torch_model = transformers_model(*shipped_bert())
    ids, mask, types = inputs(torch_model.config.vocab_size)
    report = compare(torch_model, port(torch_model), ids, mask, types, mapping=MAPPING, valid=mask.astype(bool))
    print(report.table())


if __name__ == "__main__":
    main()
