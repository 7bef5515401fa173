"""What TRL 1.16's GRPOTrainer and RLOOTrainer share, as a mixin over raytrain's Trainer: their set-up, the data
(TRL's RepeatSampler, one generation batch per steps_per_generation micro-steps), generation with transformers'
generate() inside training_step, and what an exact resume needs (rank_state: the rollout buffer, the micro-step
counter that is the position in it, the metrics not yet logged; the generation RNG is torch's, in rng_state).
TRL's own methods run on this trainer where they need only its attributes (grpo.py / rloo.py bind them); what
reaches accelerate or transformers' Trainer through super() is rewritten here and in rewards.py."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
import types
from collections import defaultdict, deque
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from transformers import AutoProcessor, GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin, set_seed
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import (add_fused_lm_head, create_model_from_path, disable_dropout_in_model, get_config_model_id,
                               identity, pad, print_prompt_completions_sample)

from ...strategies.base import unwrap_model
from ..accelerator import Accelerator
from .common import TRLMethods, as_config, check_prompt_datasets, from_path_kwargs, setup_peft
from .config import refuse_config
from .rewards import RewardMethods

logger = logging.getLogger(__name__)


def _gather_object(obj: list) -> list:
    """accelerate's gather_object over torch.distributed: every rank's list, concatenated."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return [x for part in parts for x in part]


def rank_collectives(fn: Callable) -> Callable:
    """TRL's function with the accelerate collectives it calls by module name (gather, gather_object) answered by
    torch.distributed: the same code, on raytrain's process group (in one process they return their input)."""
    names = {**fn.__globals__, "gather": Accelerator().gather, "gather_object": _gather_object}
    return types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)


class RolloutMethods(RewardMethods, TRLMethods):
    """GRPO / RLOO on raytrain's loop. Subclasses set _trl (trl's trainer class), _kind and _set_algorithm."""

    config_class: type
    _trl: type
    _kind: str
    _sync_gradients = True  # accelerate's flag for this micro-batch (TRL's adaptive entropy reads it)

    # ------------------------------------------------------------ set-up (TRL's __init__, in its order)
    def _setup_rollout(self, model: Any, reward_funcs: Any, args: Any, train_dataset: Any, eval_dataset: Any,
                       processing_class: Any, reward_processing_classes: Any, callbacks: list | None,
                       optimizers: tuple, quantization_config: Any, peft_config: Any,
                       model_init: Callable | None = None) -> None:
        """TRL's __init__; `model_init` (HF's, raytrain's addition for sweeps): the model when `model` is None, and
        a fresh one per trial, set up here again (rebuild)."""
        self._inputs = {"reward_funcs": reward_funcs, "train_dataset": train_dataset, "eval_dataset": eval_dataset,
                        "processing_class": processing_class, "reward_processing_classes": reward_processing_classes,
                        "quantization_config": quantization_config, "peft_config": peft_config}
        if model is None and model_init is None:
            raise ValueError(f"model: {self._kind}Trainer needs a model (or model_init, a function returning one)")
        if model is None:
            self.model_init = model_init
            model = super().call_model_init()  # the Trainer's: model_init(), or model_init(None) as HF calls it
        args = as_config(self.config_class, args, model, self._kind)
        self._refuse(args, train_dataset, eval_dataset)
        set_seed(args.seed)  # as TRL: before the model and PEFT's random adapter weights
        model = self._load_model(model, args, quantization_config)
        quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
        if processing_class is None:
            processing_class = AutoProcessor.from_pretrained(get_config_model_id(model.config), truncation_side="left",
                                                             padding_side="left",
                                                             trust_remote_code=args.trust_remote_code)
        if isinstance(processing_class, ProcessorMixin):
            raise ValueError(f"processing_class: vision-language processors are not supported by raytrain.trl's "
                             f"{self._kind}Trainer; pass a tokenizer")
        if not isinstance(processing_class, PreTrainedTokenizerBase):
            raise TypeError(f"processing_class: expected a tokenizer, got {type(processing_class).__name__}")
        self._tokenizer, self._is_vlm = processing_class, False
        self._image_pad_token_id = self._video_pad_token_id = None
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        model.config.get_text_config().pad_token_id = self._tokenizer.pad_token_id
        model.generation_config.pad_token_id = self._tokenizer.pad_token_id
        eos = model.generation_config.eos_token_id  # every eos id of the model ends a completion
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = eos if self._tokenizer.eos_token_id in eos else [self._tokenizer.eos_token_id, *eos]
        if peft_config is None and hasattr(model, "peft_config") and args.beta != 0.0:
            model.add_adapter("ref", model.peft_config["default"])  # as TRL: the reference is a frozen copy
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        model = setup_peft(model, peft_config, args, [])
        if quantized:  # QLoRA: adapters in bf16, the DoRA magnitude kept (TRL's rule)
            for name, param in model.named_parameters():
                if param.requires_grad and "lora_magnitude_vector" not in name:
                    param.data = param.data.to(torch.bfloat16)
        self._setup_rewards(reward_funcs, reward_processing_classes, args)
        # no tools, rollout function or environments (refused): the attributes TRL's code reads
        self.rollout_func, self.tools, self._standalone_tools, self.chat_template = None, [], [], None
        self.environment_factories, self.environments, self._multi_environment = None, None, False
        self.max_completion_length, self.num_generations = args.max_completion_length, args.num_generations
        self.num_generations_eval = args.num_generations_eval or self.num_generations
        self.chat_template_kwargs = args.chat_template_kwargs or {}
        self.temperature, self.top_p, self.top_k, self.min_p = args.temperature, args.top_p, args.top_k, args.min_p
        self.repetition_penalty, self.pad_to_multiple_of = args.repetition_penalty, args.pad_to_multiple_of
        self.use_transformers_continuous_batching, self.use_vllm = False, False
        self.mask_truncated_completions, self.shuffle_dataset = args.mask_truncated_completions, args.shuffle_dataset
        self.num_iterations, self.epsilon_low = args.num_iterations, args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self._set_aux_loss(model, args)
        if hasattr(model, "peft_config") and _adapter_on_lm_head(model):
            raise ValueError("peft_config: an adapter on lm_head is not supported (TRL computes the log-probabilities "
                             "from lm_head.weight directly); remove 'lm_head' from target_modules")
        self._set_algorithm(args)
        self._step, self._buffered_inputs = 0, None
        self._signature_columns = ["prompt", "image", "images"]  # TRL's
        super().__init__(model=model, args=args, data_collator=identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self.beta = args.beta
        self.ref_model = self._reference(args, quantization_config)
        if args.disable_dropout:
            disable_dropout_in_model(self.model)
            if self.ref_model is not None:
                disable_dropout_in_model(self.ref_model)
        base = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model
        add_fused_lm_head(base, temperature=self.temperature, outputs=("log_probs", "entropy"))
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model, temperature=self.temperature)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens, self._current_train_step_time = 0, 0.0
        self.log_completions, self.log_multimodal = args.log_completions, args.log_multimodal
        self.log_unique_prompts, self.num_completions_to_print = args.log_unique_prompts, args.num_completions_to_print
        self._logs = self._new_logs()
        self._pending_extra_logs, self._pending_metrics = defaultdict(list), defaultdict(list)
        # TRL's set_seed(seed, device_specific=True): each rank samples its own completions
        set_seed(args.seed + self.accelerator.process_index)
        kwargs = {"max_new_tokens": self.max_completion_length, "do_sample": True,
                  "pad_token_id": self._tokenizer.pad_token_id, "bos_token_id": self._tokenizer.bos_token_id,
                  "eos_token_id": self.eos_token_ids, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                  "cache_implementation": args.cache_implementation, **(args.generation_kwargs or {})}
        self.generation_config = GenerationConfig(**kwargs, disable_compile=True)
        self.generation_kwargs = kwargs
        self.model.add_model_tags(self._tag_names)
        if self.accelerator.is_main_process and self.log_completions and self._kind == "GRPO":
            os.makedirs(os.path.join(args.output_dir, "completions"), exist_ok=True)
        self.model_init = model_init

    # ------------------------------------------------------------ sweeps: a fresh model set up as TRL's __init__ does
    hp_objective = ("eval_reward", "maximize")  # a sweep's default: the mean reward of the evaluation's completions

    def _rebuild(self, args: Any, model: Any, callbacks: list | None = None) -> None:
        self.forget_caches()
        self._setup_rollout(model, args=args, callbacks=callbacks, optimizers=(None, None), **self._inputs)

    def hp_search_setup(self, args: Any, model: Any, callbacks: list | None = None, trial_name: str | None = None,
                        trial_params: dict | None = None) -> None:
        """A sweep trial's trainer: TRL's whole set-up again on the trial's model and arguments (beta decides the
        reference model, num_generations the batch arithmetic), with this trainer's other arguments."""
        self._rebuild(args, model, callbacks)
        self.trial_name, self.trial_params = trial_name, trial_params

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """HF's fresh model for each train() of a trainer built with model_init, set up as TRL's __init__ sets up
        its model (PEFT, the reference, the fused head); this trainer's callbacks kept."""
        model, handler, model_init = super().call_model_init(trial), self.callback_handler, self.model_init
        self._rebuild(self.args, model)
        self.callback_handler, self.model_init = handler, model_init
        return self.model

    def _refuse(self, args: Any, train_dataset: Any, eval_dataset: Any) -> None:
        """One line for each of TRL's GRPO / RLOO features that raytrain.trl does not run, before any work."""
        refuse_config(args, self._kind)
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        check_prompt_datasets({"train_dataset": train_dataset, "eval_dataset": eval_dataset},
                              f"raytrain.trl's {self._kind}Trainer", "TRL's RepeatSampler indexes it")

    @staticmethod
    def _load_model(model: Any, args: Any, quantization_config: Any) -> torch.nn.Module:
        if not isinstance(model, str):
            if args.model_init_kwargs is not None or quantization_config is not None:
                logger.warning("model_init_kwargs / quantization_config are ignored: the model is already built")
            return model
        return create_model_from_path(model, **from_path_kwargs(args, quantization_config))

    def _reference(self, args: Any, quantization_config: Any) -> torch.nn.Module | None:
        """beta > 0: the adapter disabled under PEFT (None here), else TRL's reload of the model from its path, or
        for a model built in memory (no path) a frozen copy of it as it is now."""
        if self.beta == 0.0 or hasattr(self.model, "peft_config"):
            return None
        path = get_config_model_id(self.model.config)
        if not path:
            ref = copy.deepcopy(self.model)
        else:
            kwargs = from_path_kwargs(args, quantization_config)
            kwargs.setdefault("dtype", self.model.dtype)
            kwargs.setdefault("attn_implementation", self.model.config._attn_implementation)
            ref = create_model_from_path(path, **kwargs)
        return ref.eval().requires_grad_(False)

    def _new_logs(self) -> dict:
        size = self.args.generation_batch_size
        return {"images": deque(maxlen=size), "prompt": deque(maxlen=size), "completion": deque(maxlen=size),
                "rewards": defaultdict(lambda: deque(maxlen=size)), "advantages": deque(maxlen=size),
                "extra": defaultdict(lambda: deque(maxlen=size))}

    # ------------------------------------------------------------ data: TRL's RepeatSampler order
    def get_train_dataloader(self):
        """TRL's: each batch is a generation batch (per_device_train_batch_size x steps_per_generation rows, in
        RepeatSampler's order: num_generations copies of each prompt, the batch repeated for num_iterations x
        steps_per_generation micro-steps); the rows are handed over as they are (TRL's identity collator)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if self.accelerator.num_processes > 1:  # TRL's per-rank seed (set at init in one process), on this rank
            set_seed(self.args.seed + self.accelerator.process_index)  # before a resume restores the RNG
        return self._build_source(self.train_dataset, self._train_batch_size * self.args.steps_per_generation,
                                  "train_dataset", shuffle=True, training=True)

    def _build_source(self, dataset, batch_size: int, name: str, shuffle: bool, training: bool, sampler=None):
        if sampler is None:
            sampler = self._get_train_sampler(dataset) if training else self._get_eval_sampler(dataset)
        return super()._build_source(dataset, batch_size, name, shuffle, training, sampler=sampler)

    # ------------------------------------------------------------ the step: generate at TRL's micro-steps
    def prepare_inputs(self, inputs: list) -> list:
        """The rows as read: TRL's _prepare_inputs (generation, the buffer) runs inside training_step, where HF
        calls it, so that it sees the micro-step counter of the step being trained."""
        return inputs

    def count_loss_items(self, inputs: Any) -> None:
        return None  # the loss normalises itself (TRL's loss types)

    def loss_needs_num_items(self) -> bool:
        return False

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """TRL's: the micro-batch from the buffer (generated at the first micro-step of each generation batch), then
        raytrain's forward and backward; _step counts micro-steps (the position in the buffer)."""
        start = time.perf_counter()
        if not model.training:  # as HF: before _prepare_inputs (TRL's mode check)
            model.train()
        ga = self.current_gradient_accumulation_steps
        self._sync_gradients = (self._step + 1) % ga == 0
        inputs = self._prepare_inputs(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - start
        if self._step % ga == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    @property
    def loss_is_scaled_for_ga(self) -> bool | None:
        return self._trl.loss_is_scaled_for_ga  # TRL's (GRPO's loss is; RLOO's is scaled by training_step, as HF)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, which training_step scales and backpropagates as HF's does."""
        return self._trl.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        self._place_frozen()  # on first use, by the run's backend
        return self._score(inputs)

    def _to_device(self, batch: Any) -> Any:
        return super(TRLMethods, self)._prepare_inputs(batch)  # the Trainer's: TRL's super()._prepare_inputs

    @contextlib.contextmanager
    def _generation_model(self) -> Iterator[torch.nn.Module]:
        """The module generate() runs on (TRL's unwrap_model_for_generation): the backend's wrapper removed,
        gradient checkpointing off, a sharding backend's parameters whole (Strategy.full_parameters: FSDP2 unshards,
        ZeRO-3 gathers unless ds3_gather_for_generation is false, as in TRL)."""
        model = unwrap_model(self.model_wrapped if self.model_wrapped is not None else self.model)
        whole = self._whole_for_generation()
        gathered = self.get_strategy().full_parameters() if whole else contextlib.nullcontext()
        with gathered, disable_gradient_checkpointing(model, self.args.gradient_checkpointing_kwargs):
            yield model

    def _whole_for_generation(self) -> bool:
        strategy = self.get_strategy()
        return strategy.model is not None and (self.args.ds3_gather_for_generation or strategy.name != "deepspeed")

    def _sample(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """TRL's transformers path: prompts left-padded, sampled with the run's GenerationConfig (torch's RNG),
        everything after the first EOS dropped."""
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        multiple = self.pad_to_multiple_of
        ids = pad(tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left", pad_to_multiple_of=multiple)
        mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left",
                   pad_to_multiple_of=multiple)
        inputs = self._to_device({"input_ids": ids, "attention_mask": mask})
        # whole parameters on each rank: no rank waits for another's forward passes (transformers would keep FSDP
        # ranks in step); ZeRO-3 without gathering: each forward gathers its layers, the ranks kept in step (TRL's)
        synced = not self._whole_for_generation() and self.accelerator.num_processes > 1
        with self._generation_model() as model, torch.no_grad(), self.accelerator.autocast():
            out = model.generate(**inputs, generation_config=self.generation_config, synced_gpus=synced)
        completion_ids = out[:, inputs["input_ids"].size(1):]
        is_eos = torch.isin(completion_ids, torch.tensor(self.eos_token_ids, device=completion_ids.device))
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=completion_ids.device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        positions = torch.arange(is_eos.size(1), device=completion_ids.device).expand(is_eos.size(0), -1)
        keep = (positions <= eos_idx.unsqueeze(1)).cpu()
        return [c[m].tolist() for c, m in zip(completion_ids.cpu(), keep)]

    # ------------------------------------------------------------ exact resume: what a checkpoint keeps per rank
    def rank_state(self) -> dict:
        """The rollout buffer (the generation batch's micro-batches still to train on), the micro-step counter
        (the position in it), the metrics not yet logged and TRL's adaptive-entropy controller."""
        state = {"world_size": self.accelerator.num_processes, "step": self._step,
                 "buffer": _to(self._buffered_inputs, "cpu"),
                 "metrics": {k: list(v) for k, v in self._metrics["train"].items()},
                 "entropy": [float(getattr(self, "entropy_coef", 0.0)),
                             float(getattr(self, "_last_world_entropy", math.inf))]}
        if self.log_completions:
            state["logs"] = _plain_logs(self._logs)
        return state

    def load_rank_state(self, state: dict | None) -> None:
        if state is None:
            logger.warning("the checkpoint holds no rollout buffer for this rank: completions are generated anew at "
                           "the next step (TRL's resume)")
            return
        self._step = state["step"]
        self._metrics["train"] = defaultdict(list, {k: list(v) for k, v in state["metrics"].items()})
        if hasattr(self, "entropy_coef"):
            self.entropy_coef, self._last_world_entropy = state["entropy"]
        if "logs" in state:
            self._logs = _load_logs(self._new_logs(), state["logs"])
        if state["world_size"] != self.accelerator.num_processes:
            logger.warning("the rollout buffer was saved by %d ranks, this run has %d: completions are generated "
                           "anew at the next step", state["world_size"], self.accelerator.num_processes)
            self._buffered_inputs = None
            return
        self._buffered_inputs = _to(state["buffer"], self.accelerator.device)

    # ------------------------------------------------------------ TRL's log
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's: its metrics averaged (NaN left out) into the log, eval_-prefixed in evaluation; the completions
        printed (rich) and, for GRPO, written to output_dir/completions as Parquet with log_completions."""
        mode = "train" if self.model.training else "eval"
        metrics = {}
        for key, values in self._metrics[mode].items():
            valid = [v for v in values if not math.isnan(v)]
            metrics[key] = sum(valid) / len(valid) if valid else None
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs.update(metrics)
        super(TRLMethods, self).log(logs, start_time)  # the Trainer's (TRLMethods' log is SFT's and DPO's)
        self._metrics[mode].clear()
        if self.accelerator.is_main_process and self.log_completions:
            self._log_completions()

    def _log_completions(self) -> None:
        import importlib.util

        step = self.state.global_step
        if importlib.util.find_spec("rich") is not None:
            print_prompt_completions_sample(self._logs["prompt"], self._logs["completion"], self._logs["rewards"],
                                            self._logs["advantages"], step, self.num_completions_to_print,
                                            extra=dict(self._logs["extra"]))
        if self._kind == "GRPO":
            import pandas as pd

            table = {"step": [step] * len(self._logs["prompt"]), "prompt": list(self._logs["prompt"]),
                     "completion": list(self._logs["completion"]),
                     **{k: list(v) for k, v in self._logs["rewards"].items()},
                     **{k: list(v) for k, v in self._logs["extra"].items()},
                     "advantage": list(self._logs["advantages"])}
            pd.DataFrame(table).to_parquet(os.path.join(self.args.output_dir, "completions",
                                                        f"completions_{step:05d}.parquet"))


def _adapter_on_lm_head(model: Any) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(model.get_output_embeddings(), BaseTunerLayer)


def _to(value: Any, device: Any) -> Any:
    """Tensors (in lists and dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _plain_logs(logs: dict) -> dict:
    """The completions table's columns as lists (a checkpoint holds plain data only: unplain extra columns and
    images are left out)."""
    import json

    out = {k: list(logs[k]) for k in ("prompt", "completion", "advantages")}
    out["rewards"] = {k: list(v) for k, v in logs["rewards"].items()}
    extra = {}
    for k, v in logs["extra"].items():
        try:
            json.dumps(list(v))
            extra[k] = list(v)
        except TypeError:
            continue
    out["extra"] = extra
    return out


def _load_logs(logs: dict, saved: dict) -> dict:
    for k in ("prompt", "completion", "advantages"):
        logs[k].extend(saved[k])
    for group in ("rewards", "extra"):
        for k, v in saved[group].items():
            logs[group][k].extend(v)
    return logs
