"""The CLI's TRL configs: a YAML naming one of TRL's fields runs raytrain.trl's SFTTrainer or DPOTrainer."""

from __future__ import annotations

from ..config.args import ConfigError, TrainingArguments

# TRL 1.16's own SFTConfig / DPOConfig fields (tests/hf/test_trl.py compares them with trl's): only a config naming
# one imports trl, so an unknown field's error stays one line.
TRL_FIELDS = frozenset((
    "activation_offloading", "assistant_only_loss", "beta", "chat_template_path", "completion_only_loss",
    "dataset_kwargs", "dataset_num_proc", "dataset_text_field", "disable_dropout", "discopop_tau", "eos_token",
    "eval_packing", "f_alpha_divergence_coef", "f_divergence_type", "label_smoothing", "ld_alpha", "loss_type",
    "loss_weights", "max_length", "model_init_kwargs", "packing", "packing_strategy", "pad_to_multiple_of",
    "pad_token", "padding_free", "precompute_ref_batch_size", "precompute_ref_log_probs", "ref_model_mixup_alpha",
    "ref_model_sync_steps", "router_aux_loss_coef", "shuffle_dataset", "sync_ref_model", "truncation_mode",
    "trust_remote_code", "use_weighting"))


def trl_arguments(config: str, overrides: list[str], name: str) -> TrainingArguments | None:
    """SFTConfig / DPOConfig when the config names one of TRL's fields and trl is installed (raytrain.trl)."""
    if name not in TRL_FIELDS:
        return None
    try:
        from ..trl import config_from_yaml
    except ImportError as e:  # one line: the field is TRL's, and what to install
        raise ConfigError(f"{name}: a field of TRL's SFTConfig / DPOConfig; {e}") from None
    return config_from_yaml(config, overrides)


def trainer_for(args: TrainingArguments):
    from ..trainer import trainer_class

    if type(args).__module__ == "raytrain.trl":
        from ..trl import trainer_for as trl_trainer
        return trl_trainer(args)
    return trainer_class(args)
