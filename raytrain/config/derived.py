"""transformers 5.23's TrainingArguments.__post_init__, field by field: the values it derives and the combinations
it refuses, applied once the fields are validated (validation.py's model validator calls `apply`). A derived value
goes through __dict__ (an assignment would validate again); each refusal is one line naming the field."""

from __future__ import annotations

import logging
import os

from .sections import ConfigError, show_number
from ..hf import accelerate_config
from ..hf.names import kubeflow_available

#: Schedules that step on an evaluation's metric (HF's REDUCE_ON_PLATEAU and GREEDY).
METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")


def apply(a) -> None:
    """HF's derived values and checks, in HF's order, on the validated model `a`."""
    d = a.__dict__
    d["output_dir"] = os.path.expanduser(a.output_dir)
    if a.disable_tqdm is None:  # HF: its module logger's level above WARNING hides the bars
        d["disable_tqdm"] = logging.getLogger("transformers.training_args").getEffectiveLevel() > logging.WARNING
    if not a.do_eval and a.eval_strategy != "no":
        d["do_eval"] = True
    if a.eval_strategy == "steps" and not a.eval_steps:
        if not a.logging_steps:
            raise ConfigError("eval_steps: eval_strategy 'steps' needs eval_steps or logging_steps > 0")
        d["eval_steps"] = a.logging_steps
    if (a.load_best_model_at_end or a.lr_scheduler_type in METRIC_SCHEDULES) and a.metric_for_best_model is None:
        d["metric_for_best_model"] = "loss"
    if a.metric_for_best_model is not None and a.greater_is_better is None:
        d["greater_is_better"] = not a.metric_for_best_model.endswith("loss")
    if kubeflow_available() and "kubeflow" not in a.report_to:
        d["report_to"] = [*a.report_to, "kubeflow"]
    _check(a)
    if a.torch_compile_backend or a.torch_compile_mode:
        d["torch_compile"] = True
    if a.torch_compile and a.torch_compile_backend is None:
        d["torch_compile_backend"] = "inductor"
    if a.tf32:
        _check_tf32(a)
    if a.accelerator_config is not None:
        _configured_state(a)
        try:
            accelerate_config.check_run(a)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if a.use_cpu:
        d["dataloader_pin_memory"] = False


def _check(a) -> None:
    """HF's _validate_args (its bf16 device check aside: raytrain's bf16 runs on CPUs too)."""
    d = a.__dict__
    if a.logging_strategy == "steps" and a.logging_steps == 0:
        raise ConfigError("logging_steps: logging_strategy 'steps' needs logging_steps > 0 (a step count, or a "
                          "ratio < 1 of the run)")
    if a.save_strategy == "steps" and a.save_steps == 0:  # HF divides by it at the first step
        raise ConfigError("save_steps: save_strategy 'steps' needs save_steps > 0 (a step count, or a ratio < 1 "
                          "of the run)")
    for name in ("logging", "eval", "save"):
        value = getattr(a, f"{name}_steps")
        if getattr(a, f"{name}_strategy") == "steps" and value > 1:
            if value != int(value):
                raise ConfigError(f"{name}_steps: must be a whole step count when above 1 (a ratio is below 1), "
                                  f"got {show_number(value)}")
            d[f"{name}_steps"] = int(value)
    if a.fp16_full_eval and a.bf16_full_eval:
        raise ConfigError("fp16_full_eval and bf16_full_eval: set only one of them")
    if a.lr_scheduler_type in METRIC_SCHEDULES and a.eval_strategy == "no":
        raise ConfigError(f"lr_scheduler_type: {a.lr_scheduler_type} steps on an evaluation's metric; set "
                          "eval_strategy 'steps' or 'epoch'")
    if a.dataloader_prefetch_factor is not None and a.dataloader_num_workers == 0:
        raise ConfigError("dataloader_prefetch_factor: only data worker processes prefetch; set "
                          "dataloader_num_workers > 0 or leave it unset")


def _configured_state(a) -> None:
    """use_configured_state: the state the script configured is this process's. HF pops the key as it sets up the
    device (so the value kept lacks it)."""
    if not a.accelerator_config.pop("use_configured_state", False):
        return
    if a.scaling.num_workers > 1 or accelerate_config.configured_processes() > 1:
        raise ConfigError("accelerator_config: use_configured_state: accelerate's state is this process's, and "
                          "raytrain starts its own processes (scaling.num_workers); leave it false")


def _check_tf32(a) -> None:
    """As HF: TF32 needs an Ampere or newer GPU; the workers' GPUs count (scaling.use_gpu)."""
    if a.scaling.use_gpu:
        return
    import torch

    if a.use_cpu or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        raise ConfigError("tf32: TF32 matmuls need an Ampere or newer GPU (none here, and scaling.use_gpu is "
                          "false); leave tf32 unset")
