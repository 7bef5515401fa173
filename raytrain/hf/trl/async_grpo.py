"""TRL 1.16's AsyncGRPOTrainer as a mixin over raytrain's Trainer, its rollouts generated ahead of training by a
pool of engines (rollouts.py) on a schedule fixed by logic (schedule.py): each step trains on the groups its
policy version generated, in their order, so the numbers are the same whatever the pool's size or speed, and a
checkpoint names everything still in flight. TRL's loss (the PPO-clipped ratio against the behaviour policy's
log-probabilities, per token over the micro-batch's completion tokens of every rank), its metrics and its
`rollout_worker` / `weight_transfer` objects (rollouts_trl.py) are kept."""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from transformers import AutoTokenizer, set_seed
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.trainer.utils import (add_fused_lm_head, create_model_from_path, get_callable_name, get_config_model_id,
                               identity)

from ...callbacks.base import TrainerCallback
from ...strategies.base import frozen_names, unwrap_model
from .async_eval import AsyncEvalMethods, check_datasets
from .async_loss import AsyncLossMethods, plain
from .common import TRLMethods, as_config, setup_peft
from .config import refuse_vllm
from .engine import Sampling, TransformersEngine
from .rollouts import LocalPool, ScheduledRollouts, samples_of
from .rollouts_trl import WorkerRollouts
from .schedule import Schedule

logger = logging.getLogger(__name__)


class AsyncGRPOMethods(AsyncLossMethods, AsyncEvalMethods, TRLMethods):
    """TRL's AsyncGRPOTrainer arguments and behaviour; `config_class` (the facade's AsyncGRPOConfig) converts plain
    args, `_pool_class` (the facade's: Ray actors) runs the engines when rollout.num_workers > 0."""

    config_class: type
    _pool_class: type | None = None
    _tag_names = ["trl", "async-grpo"]
    hp_objective = ("eval_reward", "maximize")

    def __init__(self, model: Any = None, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 processing_class: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 peft_config: Any = None, tools: list[Callable] | None = None, environment_factory: Any = None,
                 rollout_worker: Any = None, weight_transfer: Any = None, *, eval_dataset: Any = None,
                 model_init: Callable | None = None):
        for name, value in (("tools", tools), ("environment_factory", environment_factory)):
            if value:
                raise ValueError(f"{name}: not supported by raytrain.trl's AsyncGRPOTrainer (tool calling and "
                                 "environments are not run; completions come from the model's generate())")
        self._inputs = {"reward_funcs": reward_funcs, "train_dataset": train_dataset, "eval_dataset": eval_dataset,
                        "processing_class": processing_class, "peft_config": peft_config,
                        "rollout_worker": rollout_worker, "weight_transfer": weight_transfer}
        self._setup_async(model, args, callbacks, optimizers, model_init, **self._inputs)

    # ------------------------------------------------------------ set-up (TRL's __init__, in its order)
    def _setup_async(self, model, args, callbacks, optimizers, model_init, reward_funcs, train_dataset, eval_dataset,
                     processing_class, peft_config, rollout_worker, weight_transfer) -> None:
        if model is None and model_init is None:
            raise ValueError("model: AsyncGRPOTrainer needs a model (or model_init, a function returning one)")
        if model is None:
            self.model_init = model_init
            model = super().call_model_init()
        args = as_config(self.config_class, args, model, "AsyncGRPO")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required (its prompts are what the rollouts generate from)")
        check_datasets({"train_dataset": train_dataset, "eval_dataset": eval_dataset})
        if rollout_worker is None:
            refuse_vllm(args)
        if args.use_liger_kernel:
            raise ValueError("use_liger_kernel: not supported by AsyncGRPOTrainer (TRL's neither)")
        set_seed(args.seed)  # as TRL: before the model and PEFT's random adapter weights
        if isinstance(model, str):
            kwargs = {"trust_remote_code": args.trust_remote_code, "dtype": args.dtype, **(args.model_init_kwargs or {})}
            model = create_model_from_path(model, **kwargs)
        text_config = self._set_aux_loss(model, args)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(get_config_model_id(model.config),
                                                             trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        text_config.pad_token_id = processing_class.pad_token_id
        model.generation_config.pad_token_id = processing_class.pad_token_id
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = eos if processing_class.eos_token_id in eos else [processing_class.eos_token_id, *eos]
        model = setup_peft(model, peft_config, args, [])
        base = model.get_base_model() if hasattr(model, "peft_config") else model
        if hasattr(model, "peft_config"):
            from peft.tuners.tuners_utils import BaseTunerLayer

            if isinstance(model.get_output_embeddings(), BaseTunerLayer):
                raise ValueError("peft_config: an adapter on lm_head is not supported (the log-probabilities are "
                                 "computed from lm_head.weight); remove 'lm_head' from target_modules")
        if "forward" not in base.__dict__:  # TRL's fused head: log-probs and entropy without the whole logits
            add_fused_lm_head(base, temperature=args.temperature, outputs=("log_probs", "entropy"))
        self.reward_funcs, self.reward_func_names = _reward_functions(reward_funcs)
        self.temperature, self.epsilon_low = args.temperature, args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.rollout_worker, self.weight_transfer = rollout_worker, weight_transfer
        self.model_version = 0
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._signature_columns = ["slot"]
        super().__init__(model=model, args=args, data_collator=identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers)
        self.add_callback(_RolloutControl(self))
        self._epoch_groups = None
        if self.args.max_steps <= 0:  # TRL's: the epochs over the prompts, in steps
            self._epoch_groups = math.ceil(self.args.num_train_epochs * len(train_dataset))
            # a TRL rollout worker may give several rows per completion (TRL's ceiling of 32; the epochs then end
            # when that many distinct groups are trained); the schedule gives exactly one
            rows = 1 if rollout_worker is None else 32
            samples = self._epoch_groups * args.num_generations * rows
            self.args.max_steps = max(1, math.ceil(samples / self._samples_per_step()))
        self.model_init = model_init
        self._rollouts = self._saved_rollouts = self._published = None
        self._step_samples, self._samples_step, self._epoch_done = [], 0, False
        self._trained_groups, self._groups_before_resume = set(), 0
        self._engine_model = None
        self.model.add_model_tags(self._tag_names)

    def _samples_per_step(self) -> int:
        """TRL's samples per optimizer step: per_device_train_batch_size x accumulation x data-parallel ranks."""
        args = self.args
        ranks = self.get_strategy().dp_size if self._strategy is not None else args.world_size
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * ranks

    def _schedule(self) -> Schedule:
        args, per_step = self.args, self._samples_per_step()
        return Schedule(seed=args.seed, num_prompts=len(self.train_dataset),
                        groups_per_step=per_step // args.num_generations, max_staleness=args.max_staleness,
                        weight_sync_steps=args.weight_sync_steps)

    # ------------------------------------------------------------ sweeps: a fresh model set up as __init__ does
    def actor_bundles(self) -> list[dict]:
        """The rollout actors' resources, reserved beside a sweep trial's own (its placement group holds them)."""
        rollout = self.args.rollout
        bundle = {"CPU": rollout.num_cpus_per_worker, "GPU": rollout.num_gpus_per_worker,
                  **(rollout.resources_per_worker or {})}
        return [{k: v for k, v in bundle.items() if v}] * rollout.num_workers if self.rollout_worker is None else []

    def _rebuild(self, args: Any, model: Any, callbacks: list | None = None) -> None:
        self.forget_caches()
        self._setup_async(model, args, callbacks, (None, None), self.model_init, **self._inputs)

    def hp_search_setup(self, args: Any, model: Any, callbacks: list | None = None, trial_name: str | None = None,
                        trial_params: dict | None = None) -> None:
        self._rebuild(args, model, callbacks)
        self.trial_name, self.trial_params = trial_name, trial_params

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        model, handler, model_init = super().call_model_init(trial), self.callback_handler, self.model_init
        self._rebuild(self.args, model)
        self.callback_handler, self.model_init = handler, model_init
        return self.model

    # ------------------------------------------------------------ data: the run's sample slots, in order
    def get_train_dataloader(self):
        """Rows {"slot": i}, i the sample's position in the run: step n holds slots (n - 1) x S .. n x S - 1 (S:
        samples per step), rank r of micro-batch k the b slots from (k x ranks + r) x b. The samples themselves come
        from the rollouts, step by step (training_step)."""
        from datasets import Dataset

        self._keep_engine_model()
        slots = Dataset.from_dict({"slot": list(range(self.args.max_steps * self._samples_per_step()))})
        return self._build_source(slots, self._train_batch_size, "train_dataset", shuffle=False, training=True)

    def _keep_engine_model(self, force: bool = False) -> None:
        """On the rank that drives the rollouts, before the backend wraps or shards the model: a copy to generate
        with, without the fused head (its forward is bound to the training model)."""
        if not force and ((self._strategy is not None and self._strategy.rank != 0) or self.rollout_worker is not None):
            return
        model = copy.deepcopy(unwrap_model(self.model)).cpu()
        for module in model.modules():
            module.__dict__.pop("forward", None)
        self._engine_model = model

    def prepare_inputs(self, inputs: list) -> list:
        return inputs

    def count_loss_items(self, inputs: Any) -> None:
        return None  # the loss normalises itself (TRL's: the micro-batch's completion tokens on every rank)

    def loss_needs_num_items(self) -> bool:
        return False

    # ------------------------------------------------------------ the step: this rank's samples of the step
    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """This rank's micro-batch of the step's samples (the step from global_step: TRL's ignore_data_skip
        restarts the slots at a resume), then raytrain's forward and backward."""
        step = self.state.global_step + 1
        if self.rollout_worker is not None:
            batch = self._worker_micro(step)
        else:
            if step != self._samples_step:
                self._begin_step(step)
            per_step, slots = self._samples_per_step(), [row["slot"] for row in inputs]
            ranks = self.get_strategy().dp_size
            k = (slots[0] % per_step) // (len(slots) * ranks)  # the micro-batch's index in the step
            micro = self._step_samples[k * len(slots) * ranks:(k + 1) * len(slots) * ranks]
            batch = self._pack([self._step_samples[i % per_step] for i in slots], micro)
        return super().training_step(model, batch, num_items_in_batch)

    def _begin_step(self, step: int) -> None:
        """The policy published when the schedule says (a collective), then the step's samples: taken from the
        rollouts by rank 0 and sent to every rank."""
        strategy, schedule = self.get_strategy(), self._schedule()
        if self._published is None:  # (re)started: what had been published before this step
            self._published = schedule.published(step - 1) if step > 1 else -1
        newest = schedule.published(step)
        if newest > self._published:
            self._publish(newest)
        samples = None
        if strategy.rank == 0:
            rollouts = self._rollout_source()
            samples = samples_of(rollouts.take(step), self.reward_func_names, RolloutSample)
            self._metrics["train"]["perf/rollout_wait_s"].append(rollouts.waited)
        if strategy.world_size > 1:
            samples = strategy.broadcast_object(samples)
        self._record_step(samples, self.model_version)
        self._step_samples, self._samples_step = [plain(s) for s in samples], step

    def _worker_micro(self, step: int) -> dict:
        """A TRL rollout worker's micro-batch (TRL's planner over its queue, one row per rank), synced as TRL syncs:
        at the first step, then after every weight_sync_steps steps; the epochs counted in distinct groups."""
        strategy = self.get_strategy()
        if step != self._samples_step:
            if self._published is None or (step - 1) % self.args.weight_sync_steps == 0:
                self._publish(step)
            self._samples_step = step
        rows, done = None, False
        if strategy.rank == 0:
            rows = self._rollout_source().take_micro()
            self._trained_groups.update(s["group_id"] for row in rows for s in row)
            done = self._epoch_groups is not None and \
                self._groups_before_resume + len(self._trained_groups) >= self._epoch_groups
            self._record_micro([s["metrics"] for row in rows for s in row])
        if strategy.world_size > 1:
            rows, done = strategy.broadcast_object((rows, done))
        self._epoch_done = done
        rows = [[plain(s) for s in row] for row in rows]
        return self._pack(rows[strategy.dp_rank], [s for row in rows for s in row])

    def _publish(self, version: int) -> None:
        strategy = self.get_strategy()
        if strategy.rank == 0:
            self._rollout_source()  # made (actors started) before the sync is timed
        start = time.perf_counter()
        if self.rollout_worker is not None:  # TRL's: the version counts the syncs, the first one at train begin
            if strategy.rank == 0:
                self.model_version = self._rollout_source().sync(self._streamed_weights)
            else:
                for _ in self._streamed_weights():  # the collectives of a sharded backend's whole parameters
                    pass
        else:
            weights = self._trainable_weights()
            if strategy.rank == 0:
                self._rollout_source().publish(version, weights)
            self.model_version = version
        self._published = version
        self._metrics["train"]["perf/weight_sync_s"].append(time.perf_counter() - start)

    def _streamed_weights(self):
        """(name, tensor) of every parameter, whole (TRL's _streaming_iter), for a TRL weight_transfer."""
        strategy = self.get_strategy()
        with strategy.full_parameters():
            for name, param in unwrap_model(self.model_wrapped or self.model).named_parameters():
                yield name, param.detach()

    def _rollout_source(self):
        """Rank 0's rollouts, made on first use: a TRL rollout_worker's queue, else the schedule over a pool (one
        engine here with rollout.num_workers 0, Ray actors otherwise)."""
        if self._rollouts is not None:
            return self._rollouts
        for callback in self.callback_handler.callbacks:  # this trainer (a Ray worker's copy) stops its own pool
            if isinstance(callback, _RolloutControl):
                callback.trainer = self
        args = self.args
        if self.rollout_worker is not None:
            self._rollouts = WorkerRollouts(self.rollout_worker, self.weight_transfer, self.get_strategy().dp_size,
                                            args.per_device_train_batch_size, args.token_budget, args.max_staleness,
                                            args.heartbeat_stale_after_s, self._metrics["train"], args.report_to)
            if self._saved_rollouts is not None:
                self._rollouts.load_state_dict(self._saved_rollouts)
            return self._rollouts
        engine = self._engine_factory()
        if args.rollout.num_workers == 0:
            pool = LocalPool(engine(), keep=args.max_staleness + 2)
        else:
            if self._pool_class is None:
                raise ValueError("rollout.num_workers: rollout workers on Ray need raytrain.trl's AsyncGRPOTrainer")
            pool = self._pool_class(engine, args.rollout, heartbeat_s=args.heartbeat_stale_after_s,
                                    name=self.trial_name, keep=args.max_staleness + 2)
        ahead = max(args.max_inflight_tasks, self._samples_per_step()) // args.num_generations
        self._rollouts = ScheduledRollouts(self._schedule(), pool, self.train_dataset, args.max_steps, ahead,
                                           self._per_call())
        if self._saved_rollouts is not None:
            self._rollouts.load_state_dict(self._saved_rollouts)
        elif self.state.global_step > 0:
            self._rollouts.restart_without_state(self.state.global_step, self._publish_now)
        self._saved_rollouts = None
        return self._rollouts

    def _per_call(self) -> int:
        """Groups generated together: rollout.groups_per_call, else a step's groups."""
        return self.args.rollout.groups_per_call or self._schedule().groups_per_step

    def _engine_factory(self) -> Callable[[], TransformersEngine]:
        """What makes a TransformersEngine over the kept copy of the model, with the run's sampling settings (sent
        to each rollout actor: it holds no trainer)."""
        args = self.args
        sampling = Sampling(num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            repetition_penalty=args.repetition_penalty, chat_template_kwargs=args.chat_template_kwargs,
                            threads=max(1, int(args.rollout.num_cpus_per_worker)))
        return functools.partial(TransformersEngine, self._engine_model, self.processing_class, self.reward_funcs,
                                 self.reward_func_names, sampling, self.eos_token_ids, args.max_steps)

    def _publish_now(self, version: int) -> None:
        self._rollouts.publish(version, self._trainable_weights())

    def _trainable_weights(self) -> dict | None:
        """The trainable weights, whole (a collective once the backend placed the model; rank 0 gets the dict)."""
        strategy = self.get_strategy()
        if strategy.model is None:  # not trained yet: the model as given
            frozen = frozen_names(self.model)
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items() if k not in frozen}
        return strategy.model_state_dict(trainable_only=True)

    # ------------------------------------------------------------ exact resume: rank 0 keeps the rollouts' state
    def rank_state(self) -> dict:
        state = {"metrics": {k: list(v) for k, v in self._metrics["train"].items()},
                 "trained_groups": self._groups_before_resume + len(self._trained_groups)}
        if self._rollouts is not None:
            state["rollouts"] = self._rollouts.state_dict(self.state.global_step)
        return state

    def load_rank_state(self, state: dict | None) -> None:
        self._published = None
        if state is None:
            return
        self._metrics["train"] = defaultdict(list, {k: list(v) for k, v in state["metrics"].items()})
        self._groups_before_resume, self._trained_groups = state.get("trained_groups", 0), set()
        self._saved_rollouts = state.get("rollouts")

    # ------------------------------------------------------------ TRL's log
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's: each metric reduced over the window as its name says (totals summed, max/min extremes, else the
        mean; NaN left out), a TRL rollout_worker's own metrics drained first, eval_-prefixed in evaluation."""
        mode = "train" if self.model.training else "eval"
        if self._rollouts is not None and hasattr(self._rollouts, "drain_metrics"):
            self._rollouts.drain_metrics(self._metrics["train"])
        metrics = {}
        for key, values in self._metrics[mode].items():
            valid = [v for v in values if isinstance(v, tuple) or not math.isnan(v)]
            metrics[key] = _reduce_metric(key, valid) if valid else None
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs.update(metrics)
        self._log_plain(logs, start_time)
        self._metrics[mode].clear()

    def _log_plain(self, logs: dict, start_time: float | None = None) -> None:
        super(TRLMethods, self).log(logs, start_time)  # the Trainer's

    def stop_rollouts(self) -> None:
        """The rollout pool stopped; what it generated and when, kept (rollout_timeline: (step, group, worker,
        started, finished), wall-clock seconds, on rank 0)."""
        if self._rollouts is not None:
            self.rollout_timeline = list(getattr(self._rollouts, "timeline", []))
            self.rollout_restarts = getattr(getattr(self._rollouts, "pool", None), "restarts", 0)
            self._rollouts.stop()
        self._rollouts = None

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:  # also when training fails: a pool's actors hold their CPUs until released
            self.stop_rollouts()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_rollouts"] = state["_engine_model"] = None  # this process's: made again where they are used
        return state


class _RolloutControl(TrainerCallback):
    """TRL's epoch stop (a TRL rollout worker's run ends after num_train_epochs passes over the prompts, counted in
    distinct groups trained; the last step saved) and the rollout pool stopped when training ends."""

    def __init__(self, trainer: AsyncGRPOMethods):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._epoch_done:
            control.should_training_stop = True
            if args.save_strategy == "steps":
                control.should_save = True

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.stop_rollouts()


def _reward_functions(reward_funcs: Any) -> tuple[list[Callable], list[str]]:
    if reward_funcs is None:
        reward_funcs = []
    elif not isinstance(reward_funcs, list):
        reward_funcs = [reward_funcs]
    if not reward_funcs:
        raise ValueError("reward_funcs: give at least one reward function")
    for i, func in enumerate(reward_funcs):
        if isinstance(func, (str, torch.nn.Module)) or not callable(func):
            raise TypeError(f"reward_funcs[{i}]: AsyncGRPOTrainer takes reward functions (TRL's signature), got "
                            f"{type(func).__name__}; score with a reward model inside a function instead")
    return list(reward_funcs), [get_callable_name(f) for f in reward_funcs]
