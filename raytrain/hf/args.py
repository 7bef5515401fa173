"""HF TrainingArguments' process attributes and the methods HF example scripts call on them
(get_process_log_level, main_process_first, parallel_mode, the set_* groups): a mixin of
args.TrainingArguments. transformers is never imported here, so `import raytrain` stays light."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from enum import Enum
from typing import Any, Iterator

logger = logging.getLogger(__name__)

#: HF's trainer_log_levels without "detail"; passive (-1): leave the level as it is.
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL, "passive": -1}


class ParallelMode(str, Enum):
    """transformers.training_args.ParallelMode's values (a str, so `== "distributed"` holds too)."""

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"
    SAGEMAKER_MODEL_PARALLEL = "sagemaker_model_parallel"
    SAGEMAKER_DATA_PARALLEL = "sagemaker_data_parallel"
    TPU = "tpu"


def live_dist():
    """torch.distributed when a process group is live, else None (without importing torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


class DebugOption(str, Enum):
    """transformers.debug_utils.DebugOption's values, for a raytrain without transformers."""

    UNDERFLOW_OVERFLOW = "underflow_overflow"
    TPU_METRICS_DEBUG = "tpu_metrics_debug"


def debug_options(value: Any) -> list:
    """HF's `debug`: a space-separated string (or a list) as DebugOption members, transformers' enum where it is
    installed; a ValueError names a bad option."""
    items = value.split() if isinstance(value, str) else list(value or [])
    if not items:
        return []
    try:
        from transformers.debug_utils import DebugOption as options
    except ImportError:
        options = DebugOption
    bad = [i for i in items if getattr(i, "value", i) not in {o.value for o in options}]
    if bad:
        raise ValueError(f"unknown option {bad[0]!r}; valid: {', '.join(o.value for o in options)}")
    return [options(getattr(i, "value", i)) for i in items]


def deprecated_alias(old: str = "gradient_checkpointing", new: str = "activation_checkpointing") -> None:
    """HF 5.23's FutureWarning for gradient_checkpointing*, the old names of activation_checkpointing*."""
    warnings.warn(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning, stacklevel=3)


class HFArgumentMethods:
    """What HF's TrainingArguments computes from its fields; the fields are args.TrainingArguments'."""

    # --- the process ------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Processes training together: the live process group's size, else scaling.num_workers."""
        dist = live_dist()
        return dist.get_world_size() if dist is not None else self.scaling.num_workers

    @property
    def process_index(self) -> int:
        dist = live_dist()
        return dist.get_rank() if dist is not None else 0

    @property
    def local_process_index(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0)) if live_dist() is not None else 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes files (the main process)."""
        return self.process_index == 0

    @property
    def should_log(self) -> bool:
        """The main process of each node (log_on_each_node) or of the run, as HF."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def device(self):
        """The torch device this process trains on."""
        import torch

        if not self.use_cpu and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 with CUDA (one per Ray worker), else 0."""
        return int(self.device.type == "cuda")

    @property
    def parallel_mode(self) -> Enum:
        """HF's ParallelMode: DISTRIBUTED with several processes, else NOT_PARALLEL. HF's own enum when the
        caller has loaded transformers.training_args (so `== ParallelMode.DISTRIBUTED` holds), else ours."""
        hf = sys.modules.get("transformers.training_args")
        modes = getattr(hf, "ParallelMode", ParallelMode)
        return modes("distributed" if self.world_size > 1 else "not_parallel")

    @property
    def should_use_distributed(self) -> bool:
        return self.scaling.num_workers > 1

    @property
    def mixed_precision(self) -> str:
        """HF's: fp16 / bf16, else accelerate's ACCELERATE_MIXED_PRECISION, else "no"."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")

    @property
    def ddp_timeout_delta(self):
        import datetime

        return datetime.timedelta(seconds=self.ddp_timeout)

    @property
    def place_model_on_device(self) -> bool | None:
        """As HF: None, the Trainer decides (here the strategy places the model)."""
        return None

    def get_process_log_level(self) -> int:
        """log_level on the main process (should_log), log_level_replica elsewhere; passive: the current
        level of raytrain's logger (HF: of transformers')."""
        level = LOG_LEVELS[self.log_level if self.should_log else self.log_level_replica]
        return logging.getLogger("raytrain").getEffectiveLevel() if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """With a live process group, replicas wait at a barrier until the main process (of this node when
        `local`) has run the block, as HF (e.g. a datasets.map whose cache the replicas then load)."""
        dist = live_dist()
        if dist is None or dist.get_world_size() <= 1:
            yield
            return
        is_main = (self.local_process_index if local else self.process_index) == 0
        try:
            if not is_main:
                logger.debug("%d: waiting for the main process to perform %s", self.process_index, desc)
                dist.barrier()
            yield
        finally:
            if is_main:
                logger.debug("%d: main process completed %s, releasing all replicas", self.process_index, desc)
                dist.barrier()

    # --- HF's set_* groups: each returns self; the changes are validated together ------------------

    def _set_fields(self, changes: dict[str, Any]) -> None:
        """Assign several fields at once (TrainingArguments validates them together)."""
        for name, value in changes.items():
            setattr(self, name, value)

    def set_training(self, learning_rate: float = 5e-5, batch_size: int = 8, weight_decay: float = 0,
                     num_epochs: float = 3, max_steps: int = -1, gradient_accumulation_steps: int = 1, seed: int = 42,
                     activation_checkpointing: bool = False, gradient_checkpointing: bool | None = None):
        if gradient_checkpointing is not None:
            deprecated_alias()
            activation_checkpointing = gradient_checkpointing
        self._set_fields(dict(
            do_train=True, learning_rate=learning_rate, per_device_train_batch_size=batch_size,
            weight_decay=weight_decay, num_train_epochs=num_epochs, max_steps=max_steps,
            gradient_accumulation_steps=gradient_accumulation_steps, seed=seed,
            activation_checkpointing=activation_checkpointing, gradient_checkpointing=activation_checkpointing))
        return self

    def set_evaluate(self, strategy: str = "no", steps: int = 500, batch_size: int = 8,
                     accumulation_steps: int | None = None, delay: float | None = None, loss_only: bool = False):
        strategy = getattr(strategy, "value", strategy)
        _check_steps(strategy, steps)
        self._set_fields(dict(
            eval_strategy=strategy, do_eval=strategy != "no", eval_steps=steps, per_device_eval_batch_size=batch_size,
            eval_accumulation_steps=accumulation_steps, eval_delay=delay, prediction_loss_only=loss_only))
        return self

    def set_testing(self, batch_size: int = 8, loss_only: bool = False):
        self._set_fields(dict(do_predict=True, per_device_eval_batch_size=batch_size, prediction_loss_only=loss_only))
        return self

    def set_save(self, strategy: str = "steps", steps: int = 500, total_limit: int | None = None,
                 on_each_node: bool = False):
        strategy = getattr(strategy, "value", strategy)
        _check_steps(strategy, steps)
        self._set_fields(dict(save_strategy=strategy, save_steps=steps, save_total_limit=total_limit,
                              save_on_each_node=on_each_node))
        return self

    def set_logging(self, strategy: str = "steps", steps: int = 500, report_to: str | list[str] = "none",
                    level: str = "passive", first_step: bool = False, nan_inf_filter: bool = False,
                    on_each_node: bool = False, replica_level: str = "passive"):
        strategy = getattr(strategy, "value", strategy)
        _check_steps(strategy, steps)
        self._set_fields(dict(
            logging_strategy=strategy, logging_steps=steps, report_to=report_to, log_level=level,
            logging_first_step=first_step, logging_nan_inf_filter=nan_inf_filter, log_on_each_node=on_each_node,
            log_level_replica=replica_level))
        return self

    def set_push_to_hub(self, model_id: str, strategy: str = "every_save", token: str | None = None,
                        private_repo: bool | None = None, always_push: bool = False, revision: str | None = None):
        self._set_fields(dict(
            push_to_hub=True, hub_model_id=model_id, hub_strategy=getattr(strategy, "value", strategy),
            hub_token=token, hub_private_repo=private_repo, hub_always_push=always_push, hub_revision=revision))
        return self

    def set_optimizer(self, name: str = "adamw_torch", learning_rate: float = 5e-5, weight_decay: float = 0,
                      beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8, args: str | None = None):
        self._set_fields(dict(optim=name, learning_rate=learning_rate, weight_decay=weight_decay, adam_beta1=beta1,
                              adam_beta2=beta2, adam_epsilon=epsilon, optim_args=args))
        return self

    def set_lr_scheduler(self, name: str = "linear", num_epochs: float = 3.0, max_steps: int = -1,
                         warmup_steps: float = 0):
        self._set_fields(dict(lr_scheduler_type=name, num_train_epochs=num_epochs, max_steps=max_steps,
                              warmup_steps=warmup_steps))
        return self

    def set_dataloader(self, train_batch_size: int = 8, eval_batch_size: int = 8, drop_last: bool = False,
                       num_workers: int = 0, pin_memory: bool = True, persistent_workers: bool = False,
                       prefetch_factor: int | None = None, multiprocessing_context: str | None = None,
                       in_order: bool = True, auto_find_batch_size: bool = False, ignore_data_skip: bool = False,
                       sampler_seed: int | None = None):
        self._set_fields(dict(
            per_device_train_batch_size=train_batch_size, per_device_eval_batch_size=eval_batch_size,
            dataloader_drop_last=drop_last, dataloader_num_workers=num_workers, dataloader_pin_memory=pin_memory,
            dataloader_persistent_workers=persistent_workers, dataloader_prefetch_factor=prefetch_factor,
            dataloader_multiprocessing_context=multiprocessing_context, dataloader_in_order=in_order,
            auto_find_batch_size=auto_find_batch_size, ignore_data_skip=ignore_data_skip, data_seed=sampler_seed))
        return self


def _check_steps(strategy: str, steps: float) -> None:
    if strategy == "steps" and steps == 0:
        raise ValueError("Setting `strategy` as 'steps' requires a positive value for `steps`.")
