"""TRL 1.16's RLOOTrainer as a mixin over raytrain's Trainer: TRL's own scoring with the leave-one-out baseline and
the KL penalty in the reward (_generate_and_score_completions, its accelerate collectives answered by
torch.distributed), its sequence-level clipped loss and metrics, called on this trainer; the shared rollout
machinery (RLOO in TRL 1.16 is GRPO's with another advantage) is rollout.py."""

from __future__ import annotations

from typing import Any, Callable

from trl import RLOOTrainer as _TRL

from .rollout import RolloutMethods, rank_collectives


class RLOOMethods(RolloutMethods):
    """TRL 1.16's RLOOTrainer arguments and behaviour; `config_class` (the facade's RLOOConfig) converts plain args."""

    config_class: type
    _trl = _TRL
    _kind = "RLOO"
    _tag_names = ["trl", "rloo"]

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, *, model_init: Callable | None = None):
        self._setup_rollout(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                            reward_processing_classes, callbacks, optimizers, quantization_config, peft_config,
                            model_init)

    def _set_algorithm(self, args: Any) -> None:
        self.normalize_advantages, self.reward_clip_range = args.normalize_advantages, args.reward_clip_range

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
        return self._sample(prompt_ids)

    # TRL's own code, run on this trainer (no super() inside, accelerate only through self.accelerator)
    _get_train_sampler = _TRL._get_train_sampler
    _get_eval_sampler = _TRL._get_eval_sampler
    _prepare_inputs = _TRL._prepare_inputs
    _tokenize_prompts = _TRL._tokenize_prompts
    _generate = _TRL._generate
    _score = rank_collectives(_TRL._generate_and_score_completions)
    _get_per_token_logps_and_entropies = _TRL._get_per_token_logps_and_entropies
    _compute_loss = _TRL._compute_loss
    _log_completion_extra = _TRL._log_completion_extra
    _log_metric = _TRL._log_metric
    prediction_step = _TRL.prediction_step
