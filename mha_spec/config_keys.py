"""Every key of a supported family's config accounted for: read by its record (``keys_read``), refused when set
(``keys_refused``), or not the attention's (``NOT_ATTENTION``, shared, and ``FAMILY_NOT_ATTENTION``), each
with its reason. ``parity_tests/test_hf_config_keys.py`` holds transformers' config classes to it."""

from __future__ import annotations

from mha_spec import families, records

_BASE = ("model_type", "hidden_size", "num_attention_heads", "num_hidden_layers", "layer_types")
# what ``rotary.rope_from_config`` reads
_ROPE = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "rotary_pct", "rotary_dim",
         "rotary_emb_base", "max_position_embeddings", "original_max_position_embeddings", "n_positions")
_LATENT = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _grouped(groups: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {key: why for why, keys in groups.items() for key in keys}


# Keys of many families' configs that do not change the self-attention's function: key -> why.
NOT_ATTENTION: dict[str, str] = _grouped({
    "transformers' bookkeeping (no arithmetic)": (
        "architectures", "transformers_version", "dtype", "_name_or_path", "return_dict", "output_hidden_states",
        "output_attentions", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
        "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "decoder_start_token_id",
        "sep_token_id", "cls_token_id", "mask_token_id", "initializer_range", "init_std", "initializer_cutoff_factor",
        "embedding_initializer_range", "embed_init_std", "init_device", "torch_dtype", "pretraining_tp",
        "output_router_logits", "router_aux_loss_coef", "slow_but_exact", "layerdrop", "classifier_dropout",
        "classifier_dropout_prob", "classifier_bias", "classifier_activation", "summary_type", "summary_use_proj",
        "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "summary_last_dropout"),
    "dropout: off at inference and in every comparison": (
        "attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "hidden_dropout_prob",
        "attention_probs_dropout_prob", "dropout", "activation_dropout", "embedding_dropout", "residual_dropout",
        "emb_pdrop", "resid_dropout", "embed_dropout", "mlp_dropout"),
    "the model around the attention: embeddings, norms, MLP, residuals, output head": (
        "vocab_size", "tie_word_embeddings", "intermediate_size", "hidden_act", "hidden_activation",
        "activation_function", "activation", "afn", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon",
        "norm_eps", "norm_epsilon", "mlp_bias", "n_inner", "ffn_dim", "dff", "type_vocab_size", "scale_embedding",
        "embedding_multiplier", "residual_multiplier", "logits_scaling", "logit_scale", "final_logit_softcapping",
        "use_parallel_residual", "parallel_attn", "num_ln_in_parallel_attn", "apply_residual_connection_post_layernorm",
        "do_layer_norm_before", "layer_norm_elementwise_affine", "_remove_final_layer_norm", "word_embed_proj_dim",
        "use_post_norm", "embedding_size", "lm_head_bias", "norm_type", "norm_bias", "no_bias", "expansion_ratio",
        "learned_pos_emb", "embedding_fraction", "hidden_activation", "swiglu_limit", "swiglu_alpha",
        "scale_depth", "dim_model_base", "scale_emb", "ffn_hidden_size", "intermediate_size_mlp",
        "intermediate_multiple_size", "decoder_bias", "mlp_layer_types", "max_seq_len", "n_ctx",
        "dense_intermediate_size"),
    "the MoE MLP: experts and routing (and multi-token prediction layers)": (
        "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "n_routed_experts",
        "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step", "shared_expert_intermediate_size",
        "num_shared_experts", "router_jitter_noise", "input_jitter_noise", "moe_layers", "interleave_moe_layer_step",
        "moe_k", "moe_topk", "moe_layer_interval", "moe_norm_min", "moe_layer_start_index", "moe_num_shared_experts",
        "moe_num_experts", "moe_layer_end_index", "moe_use_aux_free", "shared_intermediate_size",
        "shared_expert_combination_strategy", "expert_selection_fn", "prefix_dense_intermediate_size",
        "enable_moe_fp32_combine", "router_scaling_factor", "topk_method", "scoring_func", "num_nextn_predict_layers",
        "mtp_mlp_layer_types", "mtp_layer_types", "num_mtp_layers", "ffn_config",
        "moe_apply_router_weight_on_input", "moe_routed_scaling_factor", "moe_router_logit_softcapping"),
    "a multimodal model's other towers (vision, audio) and their tokens; its text model's attention is read from "
    "text_config": (
        "audio_chunk_size", "audio_config", "audio_merge_size", "audio_token_id", "boi_token_index", "eoi_token_index",
        "image_seq_length", "image_size", "image_token_id", "image_token_index", "mm_tokens_per_image", "num_channels",
        "patch_size", "projector_bias", "projector_hidden_act", "video_token_id", "vision_config",
        "vision_end_token_id", "vision_start_token_id"),
    "softmax arithmetic in float32 only: the same function": (
        "attention_softmax_in_fp32", "scale_attention_softmax_in_fp32", "reorder_and_upcast_attn"),
    "another module than the self-attention (cross-attention, adapters, task heads)": (
        "add_cross_attention", "is_decoder_only"),
    "the length of learned position embeddings, added before the attention (rotary records read it)": (
        "max_position_embeddings",),
    "a decoder's flag, always causal here (the BERT-like records read it)": ("is_decoder",),
    "derived by its config class from keys the record reads": ("qk_head_dim",),
    "a hybrid model's other layers: Mamba, convolution and linear attention mixers (refused by kind)": (
        "mamba_chunk_size", "mamba_conv_bias", "mamba_d_conv", "mamba_d_head", "mamba_d_state", "mamba_expand",
        "mamba_n_groups", "mamba_n_heads", "mamba_proj_bias", "mamba_dt_rank", "mamba_d_ssm", "mamba_norm_before_gate",
        "mamba_rms_norm", "mamba_head_dim", "mamba_hidden_act", "mamba_num_heads", "mamba_ssm_cache_dtype",
        "use_mamba_kernels", "use_mambapy", "use_associative_scan", "time_step_limit", "time_step_floor",
        "time_step_max", "time_step_min", "ssm_state_size", "n_groups", "chunk_size", "conv_kernel", "expand",
        "use_conv_bias", "use_bias", "residual_in_fp32", "rescale_prenorm_residual", "conv_L_cache", "conv_bias",
        "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier", "block_multiple_of", "linear_a_log_max",
        "linear_a_log_min", "linear_allow_neg_eigval", "linear_conv_kernel_dim", "linear_dt_init_floor",
        "linear_dt_max", "linear_dt_min", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_value_head_dim", "block_size", "num_logits_to_keep", "z_loss_coefficient", "mlp_hidden_act",
        "expert_layer_offset", "expert_layer_period", "num_dense_layers", "use_expert_bias", "moe_latent_size",
        "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap", "mtp_layers_block_type",
        "linear_head_dim", "linear_num_heads", "n_mamba_heads", "hidden_mamba_act"),
})

# Per family: keys of its config that do not change its self-attention, beyond ``NOT_ATTENTION``.
FAMILY_NOT_ATTENTION: dict[str, dict[str, str]] = {
    **dict.fromkeys(("gptj", "codegen"), _grouped({"its sinusoidal table: base 10000, no scaling, whatever "
                                                  "these say": ("rope_parameters", "rope_scaling", "rope_theta")})),
    "gpt_bigcode": {"num_key_value_heads": "GPTBigCodeAttention reads multi_query (one key head or as many as "
                                           "heads), not this"},
    "dbrx": {"num_key_value_heads": "DbrxAttention reads attn_config's kv_n_heads, not this"},
    "mpt": {"attn_impl": "the kernel (torch, flash, triton): the same function",
            "attn_type": "MptAttention reads it not: multi-head attention always"},
    "gemma3_text": {"attn_logit_softcapping": "kept by Gemma3TextConfig, never applied by Gemma3Attention "
                                              "(transformers 5.x), though Gemma 2 applies its own"},
    "xlm": _grouped({"XLM's embeddings, languages and prediction heads": (
        "asm", "n_langs", "use_lang_emb", "lang_id", "sinusoidal_embeddings", "gelu_activation", "unk_index",
        "mask_index", "is_encoder", "start_n_top", "end_n_top")}),
    "roc_bert": _grouped({"RoCBert's pronunciation and shape embeddings": (
        "enable_pronunciation", "enable_shape", "pronunciation_embed_dim", "pronunciation_vocab_size",
        "shape_embed_dim", "shape_vocab_size", "concat_input")}),
    "xmod": _grouped({"X-MOD's language adapters, after the attention": (
        "pre_norm", "adapter_reduction_factor", "adapter_layer_norm", "adapter_reuse_layer_norm",
        "ln_before_adapter", "languages", "default_language")}),
    "ernie": _grouped({"ERNIE's task embeddings": ("use_task_id", "task_type_vocab_size")}),
    "falcon_h1": _grouped({"multipliers its decoder layer applies around the attention module, and the SSM's": (
        "attention_in_multiplier", "attention_out_multiplier", "lm_head_multiplier", "mlp_multipliers",
        "projectors_bias", "ssm_in_multiplier", "ssm_multipliers", "ssm_out_multiplier")}),
    "minimax": _grouped({"its decoder layer's residual factors, around the attention": (
        "full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor",
        "mlp_alpha_factor", "mlp_beta_factor")}),
    "afmoe": _grouped({"its embeddings' muP scale and its experts' route scale": ("mup_enabled", "route_scale")}),
    "cohere_compass_text": {
        "pooling": "the pooling of its embedding model's outputs, after the decoder",
        "head_dim": "CohereCompassTextConfig sets it to hidden_size // num_attention_heads whatever it is given"},
    "lfm3": {"use_sandwich_norm": "RMS norms its decoder layer applies to the attention's output, after it"},
    "kimi_linear": _grouped({"its MoE routing and tokenizer length, not the attention's": (
        "model_max_length", "moe_renormalize", "num_expert_group", "num_experts_per_token")}),
    "recurrent_gemma": {
        **_grouped({"its recurrent blocks, initialisation and the output logits' soft-cap": (
            "conv1d_width", "final_w_init_variance_scale", "logits_soft_cap", "lru_width", "w_init_variance_scale")}),
        "head_dim": "RecurrentGemmaConfig sets it to hidden_size // num_attention_heads whatever it is given"},
    "nemotron_h": {"attention_bias": "NemotronHAttention (Jamba's) builds its projections without biases whatever "
                                     "it says"},
    "gemma3n_text": _grouped({"its decoder layer around the attention: AltUp, LAuReL, per-layer inputs, sparse "
                             "activations": (
        "activation_sparsity_pattern", "altup_active_idx", "altup_coef_clip", "altup_correct_scale",
        "altup_num_inputs", "hidden_size_per_layer_input", "laurel_rank", "vocab_size_per_layer_input")}),
    "minimax_m3_vl_text": _grouped({"the indexer of its sparse layers (those refused by kind)": (
        "index_block_size", "index_head_dim", "index_local_blocks", "index_n_heads", "index_topk_blocks")}),
    "rembert": _grouped({"RemBERT's decoupled embeddings": ("input_embedding_size", "output_embedding_size")}),
}


def keys_read(model_type: str) -> frozenset[str]:
    """The config keys the record of ``model_type`` reads (``families.layer_options``), its defaults and the
    keys it refuses when set included."""
    if model_type in records.MULTIMODAL:  # its text model's keys: its text family's record's
        return frozenset(("model_type", "text_config"))
    family = families.FAMILIES[model_type]
    keys = set(_BASE) | set(family.reads) | set(family.defaults) | keys_refused(model_type)
    keys |= {value for value in (family.qkv_bias, family.out_bias, family.kv_heads, family.soft_cap,
                                 family.qk_norm_flag, family.window_flag, family.layer_rope_theta, family.clip_qkv,
                                 family.nested, family.causal, family.latent_interleave, family.output_gate_flag,
                                 family.input_size, family.heads_per_layer)
              if isinstance(value, str)}
    keys.add(family.window_key)
    keys |= set(records.ALIASES.values()) | set(family.aliases.values())
    if family.reads_head_dim:
        keys.add("head_dim")
    if family.qk_norm is not None:
        keys.add(family.qk_norm_eps)
    if family.rope:
        keys |= set(_ROPE) | set(family.rope_default[0] if family.rope_default else ())
    if family.rope_fixed is not None:
        keys -= {"rope_parameters", "rope_scaling", "rope_theta", "rotary_emb_base"}
    if family.no_rope_layers:
        keys |= {"no_rope_layers", "no_rope_layer_interval"}
    if family.latent:
        keys |= set(_LATENT)
    for function in (family.scale, family.layer_types, family.kv_heads, family.alibi, family.query_scale,
                     family.standardize, family.check, family.out_bias, family.rope_forced, family.rope,
                     family.layer_count, family.output_gate):
        keys |= set(getattr(function, "keys", ()))
    return frozenset(keys)


def keys_refused(model_type: str) -> frozenset[str]:
    """The keys ``families.family_of`` refuses, naming them, when set (to a true value) in a config of
    ``model_type``."""
    if model_type in records.MULTIMODAL:  # its text model's: its text family's
        return frozenset()
    family = families.FAMILIES[model_type]
    return frozenset({key for key in records.REFUSED if key not in family.reads} | {k for k, _ in family.refuses})


def unaccounted(model_type: str, keys) -> list[str]:
    """Those of ``keys`` (a config's) that ``model_type``'s record neither reads nor refuses nor lists as not the
    attention's."""
    accounted = keys_read(model_type) | NOT_ATTENTION.keys() | FAMILY_NOT_ATTENTION.get(model_type, {}).keys()
    return sorted(set(keys) - accounted)
