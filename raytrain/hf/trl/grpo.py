"""TRL 1.16's GRPOTrainer as a mixin over raytrain's Trainer: TRL's own sampler, prompt tokenization, scoring and
group-normalised advantages (_generate_and_score_completions, its accelerate collectives answered by
torch.distributed), loss types and metrics, called on this trainer; the shared rollout machinery is rollout.py."""

from __future__ import annotations

import logging
from typing import Any, Callable

from trl import GRPOTrainer as _TRL

from .rollout import RolloutMethods, rank_collectives

logger = logging.getLogger(__name__)

class GRPOMethods(RolloutMethods):
    """TRL 1.16's GRPOTrainer arguments and behaviour; `config_class` (the facade's GRPOConfig) converts plain args."""

    config_class: type
    _trl = _TRL
    _kind = "GRPO"
    _tag_names = ["trl", "grpo"]

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list[Callable] | None = None, rollout_func: Callable | None = None,
                 environment_factory: Any = None, *, model_init: Callable | None = None):
        for name, value in (("tools", tools), ("rollout_func", rollout_func),
                            ("environment_factory", environment_factory)):
            if value:
                raise ValueError(f"{name}: not supported by raytrain.trl's GRPOTrainer (tool calling, custom rollouts "
                                 "and environments are not run; completions come from the model's generate())")
        self._setup_rollout(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                            reward_processing_classes, callbacks, optimizers, quantization_config, peft_config,
                            model_init)

    def _set_algorithm(self, args: Any) -> None:
        """GRPO's loss and advantage settings (their values checked by the config), with TRL's warnings."""
        self.loss_type, self.multi_objective_aggregation = args.loss_type, args.multi_objective_aggregation
        self.scale_rewards, self.importance_sampling_level = args.scale_rewards, args.importance_sampling_level
        self.off_policy_mask_threshold = args.off_policy_mask_threshold
        self.top_entropy_quantile, self.entropy_coef = args.top_entropy_quantile, args.entropy_coef
        self.use_adaptive_entropy = args.use_adaptive_entropy
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self._last_world_entropy, self._entropy_window_stats = float("inf"), None
        self.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
        if args.loss_type == "luspo" and args.importance_sampling_level != "sequence":
            logger.warning("loss_type 'luspo' is meant for importance_sampling_level='sequence' (the paper's setup)")
        if args.loss_type == "vespo" and args.importance_sampling_level != "token":
            logger.warning("loss_type 'vespo' computes sequence-level weights itself: use importance_sampling_level "
                           "'token'")
        if args.importance_sampling_level == "sequence" and args.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            logger.warning("importance_sampling_level 'sequence' with loss_type %r weights each sequence by its "
                           "length; GSPO's setup is loss_type 'grpo'", args.loss_type)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return self._sample(prompt_ids), None  # no sampling log-probs (TRL's transformers path)

    # TRL's own code, run on this trainer (no super() inside, accelerate only through self.accelerator)
    _get_train_sampler = _TRL._get_train_sampler
    _get_eval_sampler = _TRL._get_eval_sampler
    _prepare_inputs = _TRL._prepare_inputs
    _tokenize_prompts = _TRL._tokenize_prompts
    _generate = _TRL._generate
    _score = rank_collectives(_TRL._generate_and_score_completions)
    _get_per_token_logps_and_entropies = _TRL._get_per_token_logps_and_entropies
    get_high_entropy_mask = _TRL.get_high_entropy_mask
    get_off_policy_mask = _TRL.__dict__["get_off_policy_mask"]  # staticmethods, as TRL declares them
    get_gamma_weights = _TRL.__dict__["get_gamma_weights"]
    _compute_loss = _TRL._compute_loss
    _log_completion_extra = _TRL._log_completion_extra
    _log_metric = _TRL._log_metric
    prediction_step = _TRL.prediction_step
