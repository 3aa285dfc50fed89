"""Config variants that released checkpoints carry, each family's transformers attention the oracle.

``CONFIG_REGRESSIONS``: configs that ``from_hf`` once read otherwise than transformers computes
them (silently wrong, or refused); each is replayed on every layer of its small model, both
twins against transformers' attention, outputs and gradients, from the config as transformers
saves it and without the per-layer keys its config class fills in (``layer_types``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from parity_tests import test_hf_families
from parity_tests.test_hf_families import WINDOW, Supported, check_family


@dataclass(frozen=True)
class ConfigRegression:
    id: str
    why: str  # the key, its value, and what went wrong before
    model_type: str
    record: Supported
    dtype: str = "float64"  # float32 where transformers' own arithmetic is float32 whatever the input (Llama 4's
    # rotation: complex64 tables and products)
    from_zero: bool = False  # every row's positions from 0 (Llama 4's temperature tuning reads the index)


_EXPERTS = dict(num_experts=2, num_experts_per_tok=1)
# a small Llama 4 text model: chunks of 16 (past the length), every 2nd layer without rotary
_LLAMA4 = dict(attn_temperature_tuning=False, attention_chunk_size=16, no_rope_layer_interval=2, use_qk_norm=False,
               num_local_experts=2, num_experts_per_tok=1)
# yarn rope parameters (an attention factor of 1.139) at base 100
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=8.0, beta_slow=1.0,
             rope_theta=100.0)
CONFIG_REGRESSIONS = [
    ConfigRegression(
        "qwen3_moe-use_sliding_window", "qwen3_moe use_sliding_window=True (its config class has no layer_types "
        "and no max_window_layers; its model slides every layer): max_window_layers defaulted to the layer count, "
        "no layer slid: 0.58 off (float64 output) on layer 0", "qwen3_moe",
        Supported("", dict(use_sliding_window=True, sliding_window=WINDOW, **_EXPERTS))),
    ConfigRegression(
        "qwen2_moe-use_sliding_window", "qwen2_moe use_sliding_window=True, max_window_layers=2: Qwen2MoeConfig "
        "slides the even layers below max_window_layers, Qwen2's rule (layers from max_window_layers on) slid none: "
        "0.48 off read from a config without layer_types",
        "qwen2_moe", Supported("", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                                        **_EXPERTS))),
    ConfigRegression(
        "dots1-sliding_window", "dots1 sliding_window=3, max_window_layers=1 (Dots1Config reads no "
        "use_sliding_window): layer 1 slides; read through Qwen's rule it needed use_sliding_window, none slid: 0.56 "
        "off without layer_types",
        "dots1", Supported("", dict(sliding_window=WINDOW, max_window_layers=1, n_routed_experts=2,
                                    num_experts_per_tok=1, n_shared_experts=1))),
    ConfigRegression(
        "gemma3_text-attn_logit_softcapping", "gemma3_text attn_logit_softcapping=2.0: Gemma3Attention "
        "(transformers 5.x) keeps it but never passes it to its attention; applied here: 0.26 off", "gemma3_text",
        Supported("", dict(attn_logit_softcapping=2.0, query_pre_attn_scalar=12))),
    ConfigRegression(
        "llama-llama3-equal-frequency-factors", "llama rope_parameters llama3 with low_freq_factor == "
        "high_freq_factor (no band to blend): refused (ValueError) though transformers computes it", "llama",
        Supported("", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=8.0,
                                                low_freq_factor=2.0, high_freq_factor=2.0,
                                                original_max_position_embeddings=8)))),
    ConfigRegression(
        "llama4_text-use_qk_norm", "llama4_text use_qk_norm=True (a weightless RMS norm of each head's queries and "
        "keys after the rotation, on its rotary layers): refused (\"Llama 4's QK-norm\")", "llama4_text",
        Supported("", dict(_LLAMA4, use_qk_norm=True, rms_norm_eps=1e-2), layers=2), "float32"),
    ConfigRegression(
        "llama4_text-attn_temperature_tuning", "llama4_text attn_temperature_tuning=True (floor_scale=2, "
        "attn_scale=0.5: its NoPE layers' queries scaled by position): refused", "llama4_text",
        Supported("", dict(_LLAMA4, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5), layers=2),
        "float32", from_zero=True),
    ConfigRegression(
        "llama4_text-use_qk_norm-yarn", "llama4_text use_qk_norm=True with yarn rope parameters (factor 4): its norm "
        "after the rotation undoes yarn's attention factor; normalized before the rotation here, the factor was "
        "kept: 0.063 off (float32 output) on its rotary layer", "llama4_text",
        Supported("", dict(_LLAMA4, use_qk_norm=True, rope_parameters=_YARN), layers=2), "float32"),
    ConfigRegression(
        "granite_swa-layer_rope_theta-rope_theta", "granite_swa layer_rope_theta [10000, 10000, 0] with rope_theta "
        "100 (its model rotates each layer at its own base, its global rotary unused): the comparison's float64 "
        "tables were the global rotary's, 0.21 off (0.05 with yarn)", "granite_swa",
        Supported("", dict(sliding_window=WINDOW, attention_multiplier=0.2, layer_rope_theta=[10000.0, 10000.0, 0.0],
                           rope_parameters=_YARN), layers=3)),
    ConfigRegression(
        "nanochat-yarn", "nanochat yarn rope parameters (factor 4): refused (its norm after the rotation undoes "
        "yarn's attention factor, which a norm before the rotation kept: 0.116 off)", "nanochat",
        Supported("", dict(rope_parameters=_YARN))),
    ConfigRegression(
        "ministral3-llama_4_scaling_beta", "ministral3 rope_parameters llama_4_scaling_beta=0.5 over "
        "original_max_position_embeddings=2 (queries scaled by position): refused", "ministral3",
        Supported("", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=2.0,
                                                original_max_position_embeddings=2, llama_4_scaling_beta=0.5,
                                                max_position_embeddings=16)))),
    ConfigRegression(
        "cohere2_moe-first_k_dense_replace", "cohere2_moe first_k_dense_replace=1 (prefix_dense_sliding_window_pattern "
        "1): its dense first layer is full and rotates (Cohere2MoeAttention's force_rope); read as Cohere 2's, it "
        "did not rotate: 0.61 off", "cohere2_moe",
        Supported("", dict(sliding_window=WINDOW, first_k_dense_replace=1, **_EXPERTS), layers=3)),
    ConfigRegression(
        "cwm-layer_types-derived", "cwm sliding_window=3 without layer_types: CwmConfig makes every 4th layer from "
        "0 full; read as Mistral's (every layer sliding), layer 0 slid: 0.70 off", "cwm",
        Supported("", dict(sliding_window=WINDOW), layers=5)),
    ConfigRegression(
        "kolibri1-layer_types-derived", "kolibri1 sliding_window=3 without layer_types: Kolibri1Config makes every "
        "5th layer full; read as EXAONE 4's (every 4th), layer 3 did not "
        "slide: 0.59 off", "kolibri1",
        Supported("", dict(sliding_window=WINDOW), layers=5)),
    *(ConfigRegression(
        f"{name}-clip_qkv", f"{name} clip_qkv=0.5 (the projections' outputs clamped): refused", name,
        Supported("", extra)) for name, extra in (
            ("olmo", dict(clip_qkv=0.5)), ("olmoe", dict(clip_qkv=0.5, num_experts=2, num_experts_per_tok=1)),
            ("mpt", dict(num_key_value_heads=None, head_dim=None, attn_config=dict(clip_qkv=0.5))))),
]


@pytest.mark.parametrize("case", CONFIG_REGRESSIONS, ids=[c.id for c in CONFIG_REGRESSIONS])
@pytest.mark.parametrize("bare", [False, True], ids=["saved", "bare"])
def test_config_regressions_equal_transformers(case, bare, monkeypatch):
    """The first two and the last two layers (every kind each config here has): float64 to 1e-12, float32
    outputs to 1e-6 and gradients to 1e-5."""
    layers = sorted({0, 1, case.record.layers - 2, case.record.layers - 1})
    with pytest.MonkeyPatch.context() as offsets:  # apart: check_family undoes ``monkeypatch`` after each layer
        if case.from_zero:
            offsets.setattr(test_hf_families, "OFFSETS", (0, 0))
        worst = check_family(case.model_type, case.record, (case.dtype,), monkeypatch, layers=layers, bare=bare)
    tolerance = (1e-12, 1e-12) if case.dtype == "float64" else (1e-6, 1e-5)
    assert all(e < t for e, t in zip(worst[case.dtype], tolerance)), (case.id, worst)


