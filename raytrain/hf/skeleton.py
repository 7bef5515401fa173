"""What the official HF example scripts (run_glue.py, run_ner.py ...) call on a Trainer beyond train and
evaluate: log_metrics / save_metrics / save_state, create_model_card, trainer.accelerator, HF's info
lines, and the small helpers; a mixin of trainer.Trainer (which stays under the file-size limit)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import torch

from . import accelerate_config
from .accelerator import Accelerator
from .metrics import format_metrics, write_metrics
from .objects import register_output_capture
from .optim import optimizer_cls_and_kwargs
from ..optim.optimizers import decay_parameter_names

# HF's name: transformers.logging settings (and HF's tests) govern the Trainer's HF messages.
logger = logging.getLogger("transformers.trainer")


class ExampleScriptMethods:
    """HF Trainer's members used by example scripts and their callbacks; the Trainer provides args,
    state, model, optimizer and get_strategy."""

    current_flos: float = 0.0   # flops since the last store_flos (the loop adds to state.total_flos itself)
    is_in_train: bool = False   # True between train()'s entry and exit, as HF

    # ------------------------------------------------------------ the process
    def __setstate__(self, state: dict) -> None:
        """Unpickled in another process (a Ray worker, a sweep trial): its transformers models registered there
        (objects.register_output_capture)."""
        self.__dict__.update(state)
        register_output_capture(*state.values())

    @property
    def accelerator(self) -> Accelerator:
        """A stand-in for accelerate's Accelerator, one per Trainer (see docs/huggingface.md for what it covers)."""
        if "_accelerator" not in self.__dict__:
            self.__dict__["_accelerator"] = Accelerator(self)
        return self.__dict__["_accelerator"]

    def create_accelerator_and_postprocess(self) -> None:
        """HF's: the Trainer's Accelerator; accelerator_config's gradient_accumulation_kwargs num_steps becomes
        gradient_accumulation_steps (the Trainer accumulates; accelerate's num_steps is 1), as HF."""
        self.__dict__["_accelerator"] = Accelerator(self)
        kwargs = accelerate_config.settings(self.args.accelerator_config)["gradient_accumulation_kwargs"] or {}
        if "num_steps" in kwargs:
            if self.args.gradient_accumulation_steps > 1:
                raise ValueError("accelerator_config: The `AcceleratorConfig`'s `num_steps` is set but "
                                 "`gradient_accumulation_steps` is greater than 1; set only one of them")
            self.args.gradient_accumulation_steps = kwargs["num_steps"]

    def is_world_process_zero(self) -> bool:
        return self.get_strategy().is_main

    def is_local_process_zero(self) -> bool:
        return self.get_strategy().local_rank == 0

    # ------------------------------------------------------------ metrics and files
    def metrics_format(self, metrics: dict[str, float]) -> dict[str, Any]:
        """HF's formatting for log_metrics: memory in MB, runtimes as h:mm:ss.xx, floats to 4 digits."""
        return format_metrics(metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Print `metrics` as HF does: a header, then aligned `key = value` lines (main process)."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        shown = self.metrics_format(metrics)
        k_width = max((len(str(k)) for k in shown), default=0)
        v_width = max((len(str(v)) for v in shown.values()), default=0)
        for key in sorted(shown):
            print(f"  {key: <{k_width}} = {shown[key]:>{v_width}}")

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Write `{split}_results.json` (and merge into all_results.json) in output_dir (main process)."""
        if self.is_world_process_zero():
            write_metrics(self.args.output_dir, split, metrics, combined)

    def save_state(self) -> None:
        """Write trainer_state.json into output_dir (main process)."""
        if self.is_world_process_zero():
            os.makedirs(self.args.output_dir, exist_ok=True)
            self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: str | list[str] | None = None, dataset: str | list[str] | None = None,
                          dataset_args: str | list[str] | None = None) -> None:
        """Write a draft README.md in output_dir as HF does (main process); the license is not looked up
        on the Hub."""
        from .model_card import write_model_card
        write_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                         finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                         dataset_args=dataset_args)

    def store_flos(self) -> None:
        """Add current_flos (summed over processes) to state.total_flos, as HF."""
        flos = torch.tensor(float(self.current_flos), dtype=torch.float64)
        total = self.get_strategy().all_reduce(flos.to(self.get_strategy().device))
        self.state.total_flos += float(total)
        self.current_flos = 0

    # ------------------------------------------------------------ data and model
    def num_examples(self, dataloader: Any) -> int:
        """Samples in the whole dataset behind `dataloader` (a raytrain source or a DataLoader), else
        batches x per_device_train_batch_size, as HF."""
        n = getattr(dataloader, "num_samples", None)
        if n is not None:
            return n
        try:
            inner = getattr(dataloader, "loader", dataloader)
            return len(inner.dataset)
        except (NameError, AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per update step over all processes, as HF; a TP group's and a pipeline's ranks share their batch."""
        config = getattr(args, "parallelism_config", None) or {}
        shared = config.get("tp_size", 1) * config.get("pp_size", 1)
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * (args.world_size // shared)

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """The names of the parameters the optimizer decays, by HF's rule: not in a LayerNorm, not named
        like a bias or a norm."""
        return decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: torch.nn.Module | None = None) -> tuple[Any, dict]:
        """The optimizer class and keyword arguments args.optim (with optim_args) names, as HF's Trainer
        resolves them (transformers' own resolution for the names of other libraries)."""
        return optimizer_cls_and_kwargs(args, model)

    def get_optimizer_group(self, param: str | torch.nn.Parameter | None = None):
        """The optimizer's group holding `param`, or every group's parameters, as HF."""
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        if param is not None:
            for group in self.optimizer.param_groups:
                if any(param is p for p in group["params"]):
                    return group
        return [group["params"] for group in self.optimizer.param_groups]

    def get_learning_rates(self) -> list[float]:
        if self.optimizer is None:
            raise ValueError("Trainer optimizer is None, please make sure you have setup the optimizer before.")
        return [group["lr"] for group in self.optimizer.param_groups]

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The contexts compute_loss runs under (the backend's autocast), for overrides that call the model."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.get_strategy().autocast())
        return stack

    # ------------------------------------------------------------ HF's info lines (worker/protocol.py hooks)
    def log_training_start(self, dataloader: Any, num_update_steps_per_epoch: int) -> None:
        """HF's "***** Running training *****" block, with its numbers, for the run the loop planned."""
        self.is_in_train = True
        args, state = self.args, self.state
        total_batch = self.get_total_train_batch_size(args)
        if _has_length(dataloader):
            num_examples, epochs = self.num_examples(dataloader), state.num_train_epochs
        else:  # a stream: HF's numbers for a dataloader without a length
            num_examples, epochs = total_batch * args.max_steps, sys.maxsize
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        logger.info("***** Running training *****")
        logger.info(f"  Num examples = {num_examples:,}")
        logger.info(f"  Num Epochs = {epochs:,}")
        logger.info(f"  Num update steps per epoch = {num_update_steps_per_epoch:,}")
        logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
        logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch:,}")
        logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
        logger.info(f"  Total optimization steps = {state.max_steps:,}")
        logger.info(f"  Number of trainable parameters = {params:,}")

    def log_evaluation_start(self, dataloader: Any, description: str) -> None:
        """HF's "***** Running Evaluation *****" (or Prediction) block."""
        logger.info(f"\n***** Running {'Prediction' if description == 'predict' else description} *****")
        if _has_length(dataloader):
            logger.info(f"  Num examples = {self.num_examples(dataloader)}")
        else:
            logger.info("  Num examples: Unknown")
        logger.info(f"  Batch size = {self.args.eval_batch_size}")


def _has_length(dataloader: Any) -> bool:
    try:
        return len(dataloader) is not None
    except TypeError:
        return False
