"""The CLI's TRL configs: a YAML naming one of TRL's fields runs raytrain.trl's SFTTrainer, DPOTrainer, GRPOTrainer,
RLOOTrainer or AsyncGRPOTrainer."""

from __future__ import annotations

from ..config.args import ConfigError, TrainingArguments

# TRL 1.16's own SFTConfig / DPOConfig / GRPOConfig / RLOOConfig / AsyncGRPOConfig fields, GRPO's reward_funcs and the
# async trainer's rollout section (tests/hf/test_trl.py compares them with raytrain.trl's): only a config naming one
# imports trl, so an unknown field's error stays one line.
TRL_FIELDS = frozenset((
    "dtype", "fork_threshold_tokens", "heartbeat_stale_after_s", "max_inflight_tasks", "max_staleness",
    "queue_maxsize", "request_timeout", "rollout", "token_budget", "weight_sync_steps", "weight_sync_timeout",
    "activation_offloading", "assistant_only_loss", "beta", "cache_implementation", "cast_lm_head_to_fp32",
    "chat_template_kwargs", "chat_template_path", "completion_only_loss", "dataset_kwargs", "dataset_num_proc",
    "dataset_text_field", "delta", "disable_dropout", "discopop_tau", "ds3_gather_for_generation", "entropy_coef",
    "entropy_coef_delta", "entropy_coef_max", "entropy_coef_min", "entropy_target", "eos_token", "epsilon",
    "epsilon_high", "eval_packing", "f_alpha_divergence_coef", "f_divergence_type", "generation_batch_size",
    "generation_kwargs", "importance_sampling_level", "label_smoothing", "ld_alpha", "log_completions",
    "log_completions_hub_repo", "log_multimodal", "log_unique_prompts", "loss_type", "loss_weights",
    "mask_truncated_completions", "max_completion_length", "max_length", "max_tool_calling_iterations", "min_p",
    "model_init_kwargs", "multi_objective_aggregation", "normalize_advantages", "num_completions_to_print",
    "num_generations", "num_generations_eval", "num_iterations", "off_policy_mask_threshold", "packing",
    "packing_strategy", "pad_to_multiple_of", "pad_token", "padding_free", "precompute_ref_batch_size",
    "precompute_ref_log_probs", "ref_model_mixup_alpha", "ref_model_sync_steps", "repetition_penalty",
    "reward_clip_range", "reward_funcs", "reward_weights", "router_aux_loss_coef", "sapo_temperature_neg",
    "sapo_temperature_pos", "scale_rewards", "shuffle_dataset", "steps_per_generation", "sync_ref_model",
    "temperature", "top_entropy_quantile", "top_k", "top_p", "transformers_continuous_batching_config",
    "truncation_mode", "trust_remote_code", "use_adaptive_entropy", "use_bias_correction_kl",
    "use_transformers_continuous_batching", "use_transformers_paged", "use_vllm", "use_weighting", "vespo_k_neg",
    "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos", "vllm_enable_sleep_mode",
    "vllm_gpu_memory_utilization", "vllm_group_port", "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_max_model_length", "vllm_mode",
    "vllm_model_impl", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
    "vllm_structured_outputs_regex", "vllm_tensor_parallel_size"))


def trl_arguments(config: str, overrides: list[str], name: str) -> TrainingArguments | None:
    """SFTConfig / DPOConfig / GRPOConfig / RLOOConfig / AsyncGRPOConfig when the config names one of TRL's fields and
    trl is installed (raytrain.trl)."""
    if name not in TRL_FIELDS:
        return None
    try:
        from ..trl import config_from_yaml
    except ImportError as e:  # one line: the field is TRL's, and what to install
        raise ConfigError(f"{name}: a field of TRL's SFTConfig / DPOConfig / GRPOConfig / RLOOConfig / "
                          f"AsyncGRPOConfig; {e}") from None
    return config_from_yaml(config, overrides)


def trainer_for(args: TrainingArguments):
    from ..trainer import trainer_class

    if type(args).__module__ == "raytrain.trl":
        from ..trl import trainer_for as trl_trainer
        return trl_trainer(args)
    return trainer_class(args)
