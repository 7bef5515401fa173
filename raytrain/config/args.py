"""TrainingArguments and its nested sections: the one validated description of a run.

Field names and defaults follow Hugging Face transformers' TrainingArguments (a dataclass, as
there). Every validation failure is a single-line ConfigError naming the field and what would be right.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from typing import Annotated, Any, Callable, Literal, get_args, get_origin, get_type_hints

import yaml
from pydantic import BaseModel, Field, create_model

from .sections import (ConfigError, DataConfig, DistributedConfig, ModelConfig, ScalingConfig, StrictModel,
    apply_overrides, unknown_field_message)
from ..hf.args import HFArgumentMethods
from .validation import ArgumentRules, mirror_aliases, warn_noop_fields

logger = logging.getLogger(__name__)

_Steps = Literal["no", "steps", "epoch"]
_LogLevel = Literal["passive", "debug", "info", "warning", "error", "critical"]
_SCHEDULES = Literal[
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "reduce_lr_on_plateau", "warmup_stable_decay", "cosine_with_min_lr",
    "cosine_warmup_with_min_lr", "greedy",
]


def _f(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None, **argparse: Any) -> Any:
    """A dataclass field with its help text (and argparse options) where HfArgumentParser and our --help read it."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help, **argparse})
    return field(default=default, metadata={"help": help, **argparse})


@dataclass
class TrainingArguments(HFArgumentMethods):
    """Everything a run needs, validated once at the edge; names and defaults as in HF.

    A dataclass, as HF's: `TrainingArguments("out", ...)`, `HfArgumentParser(TrainingArguments)` and
    `@dataclass class MyArgs(TrainingArguments)` work. `__post_init__` (and every later assignment)
    validates with pydantic and raises a one-line ConfigError naming the field.
    """

    output_dir: str = _f("trainer_output", "where checkpoints and logs are written")
    overwrite_output_dir: bool = _f(False, "delete the checkpoints already in output_dir before training")
    num_train_epochs: float = _f(3.0, "epochs to train (used when max_steps <= 0)")
    max_steps: int = _f(-1, "total optimizer steps; > 0 overrides num_train_epochs")
    per_device_train_batch_size: Annotated[int, Field(ge=1)] = _f(8, "training batch size per worker")
    per_device_eval_batch_size: Annotated[int, Field(ge=1)] = _f(8, "evaluation batch size per worker")
    gradient_accumulation_steps: Annotated[int, Field(ge=1)] = _f(1, "micro-batches per optimizer step")
    learning_rate: Annotated[float, Field(ge=0)] = _f(5e-5, "peak learning rate")
    weight_decay: Annotated[float, Field(ge=0)] = _f(0.0, "AdamW weight decay (not applied to biases and norms)")
    adam_beta1: Annotated[float, Field(ge=0, lt=1)] = _f(0.9, "Adam beta1")
    adam_beta2: Annotated[float, Field(ge=0, lt=1)] = _f(0.999, "Adam beta2")
    adam_epsilon: Annotated[float, Field(ge=0)] = _f(1e-8, "Adam epsilon")
    max_grad_norm: Annotated[float | None, Field(ge=0)] = _f(1.0, "gradient clipping norm; null or 0 disables")
    optim: str = _f("adamw_torch_fused", "any name of transformers' OptimizerNames, built as HF's Trainer "
                    "builds it (torch's names without transformers; others need their library)")
    optim_args: dict[str, Any] | str | None = _f(None, "extra optimizer arguments, a mapping or 'k=v,k2=v2' (as HF's "
                                                 "optim_args for the names of other libraries)")
    lr_scheduler_type: _SCHEDULES = _f("linear", "learning-rate schedule")
    lr_scheduler_kwargs: dict[str, Any] | str | None = _f(
        None, "extra schedule arguments, a mapping or a JSON string", factory=dict)
    warmup_steps: float = _f(0, "warmup: an int is a step count, a float in (0, 1) a ratio of total steps")
    warmup_ratio: float = _f(0.0, "warmup as a ratio of total steps (HF compatibility)")
    logging_strategy: _Steps = _f("steps", "when to log")
    logging_steps: Annotated[float, Field(ge=0)] = _f(
        500, "log every N steps; a float < 1 is a ratio of total steps")
    logging_first_step: bool = _f(False, "also log after the first step")
    eval_strategy: _Steps = _f("no", "when to evaluate")
    eval_steps: Annotated[float | None, Field(ge=0)] = _f(
        None, "evaluate every N steps (ratio if < 1); defaults to logging_steps")
    eval_delay: Annotated[float, Field(ge=0)] = _f(
        0, "epochs (eval_strategy epoch) or steps to wait before the first evaluation")
    eval_on_start: bool = _f(False, "evaluate once before the first training step (a sanity check)")
    batch_eval_metrics: bool = _f(
        False, "call compute_metrics(EvalPrediction, compute_result) per batch instead of once on everything")
    prediction_loss_only: bool = _f(False, "evaluate only the loss (no predictions kept, no compute_metrics)")
    eval_accumulation_steps: Annotated[int | None, Field(ge=1)] = _f(
        None, "accepted for HF compatibility; predictions always move to the CPU after every batch")
    label_smoothing_factor: Annotated[float, Field(ge=0, lt=1)] = _f(
        0.0, "label smoothing epsilon for the cross-entropy of the model's logits")
    save_strategy: Literal["no", "steps", "epoch", "best"] = _f("steps", "when to checkpoint")
    save_steps: Annotated[float, Field(ge=0)] = _f(
        500, "checkpoint every N steps; a float < 1 is a ratio of total steps")
    save_total_limit: Annotated[int | None, Field(ge=1)] = _f(
        None, "keep at most this many checkpoints in total, the best among them")
    load_best_model_at_end: bool = _f(False, "load the best checkpoint when training ends")
    metric_for_best_model: str | None = _f(None, "metric that ranks checkpoints; 'loss' when load_best_model_at_end")
    greater_is_better: bool | None = _f(
        None, "whether a larger metric is better; if unset, false for *loss metrics, else true")
    restore_callback_states_from_checkpoint: bool = _f(
        False, "on resume, restore the stateful callbacks (e.g. early stopping) with the checkpoint's arguments")
    seed: Annotated[int, Field(ge=0)] = _f(42, "random seed set at the start of training")
    data_seed: Annotated[int | None, Field(ge=0)] = _f(None, "seed for data shuffling; defaults to seed")
    data_order: Literal["raytrain", "hf"] = _f(
        "raytrain", "the training data's shuffle: raytrain's own, or hf: transformers' RandomSampler order (seeded "
        "with data_seed, else seed, plus the epoch, as accelerate does), to see the losses of an in-process HF run "
        "step for step")
    full_determinism: bool = _f(False, "use deterministic algorithms (slower)")
    bf16: bool = _f(False, "bfloat16 mixed precision")
    fp16: bool = _f(False, "float16 mixed precision with loss scaling (CUDA only)")
    tf32: bool | None = _f(None, "allow TF32 matmuls on Ampere+ GPUs (true needs one; false turns them off)")
    use_cpu: bool = _f(False, "train on the CPU even when a GPU is available")
    activation_checkpointing: bool | None = _f(
        None, "recompute activations in the backward pass to save memory", nargs="?", const=True)
    activation_checkpointing_kwargs: dict[str, Any] | str | None = _f(
        None, "arguments of the model's activation_checkpointing_enable: every_n_layers, offload, torch checkpoint's")
    gradient_checkpointing: bool | None = _f(
        None, "deprecated alias of activation_checkpointing (as in HF)", nargs="?", const=True)
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = _f(
        None, "deprecated alias of activation_checkpointing_kwargs (as in HF)")
    torch_compile: bool = _f(False, "compile the model with torch.compile")
    torch_compile_backend: str | None = _f(None, "torch.compile backend (sets torch_compile)")
    torch_compile_mode: str | None = _f(None, "torch.compile mode (sets torch_compile)")
    remove_unused_columns: bool = _f(
        True, "drop dataset columns the model's forward does not take, before collation (as HF)")
    label_names: list[str] | None = _f(None, "the batch keys that hold labels; default: labels")
    dataloader_drop_last: bool = _f(False, "drop the last incomplete batch")
    dataloader_num_workers: Annotated[int, Field(ge=0)] = _f(
        0, "worker processes that read and collate batches (the order stays deterministic)")
    dataloader_pin_memory: bool = _f(True, "pin host batches before copying them to the GPU")
    dataloader_persistent_workers: bool = _f(False, "keep the data worker processes between epochs")
    dataloader_prefetch_factor: Annotated[int | None, Field(ge=1)] = _f(
        None, "batches each data worker prepares ahead (default 2 with workers)")
    logging_nan_inf_filter: bool = _f(True, "leave nan/inf losses out of the logged mean")
    include_num_input_tokens_seen: str | bool = _f(
        "no", "count the input tokens of all ranks in state.num_input_tokens_seen and log it with "
        "train_tokens_per_second: no, all (true: every input_ids entry) or non_padding (attention_mask's ones)")
    skip_memory_metrics: bool = _f(True, "skip memory profiling metrics")
    auto_find_batch_size: bool = _f(False, "on out-of-memory, retry with a batch 10% smaller (as HF)")
    report_to: str | list[str] = _f(
        "none", "integrations to report to (HF's names): none, all (those installed), mlflow, tensorboard, wandb, "
                "trackio, comet_ml, clearml, dvclive, neptune, swanlab, codecarbon, azure_ml, dagshub, flyte, kubeflow")
    run_name: str | None = _f(None, "name of the run in the tracking integration")
    mlflow_log_best_checkpoint: bool = _f(False, "also log the best checkpoint to MLflow (artifact best_checkpoint/)")
    disable_tqdm: bool | None = _f(False, "hide progress bars")
    log_level: _LogLevel = _f("passive", "level of raytrain's logger on the main process (passive: leave it as it is)")
    save_async: bool = _f(False, "write checkpoints in a background thread")
    save_async_policy: Literal["wait", "skip"] = _f(
        "wait", "a save that arrives while a background save is still being written: 'wait' for it, or 'skip' "
                "this one (the run's last save and a new best are always written)")
    max_nonfinite_steps: Annotated[int | None, Field(ge=1)] = _f(
        None, "stop after this many consecutive steps skipped for non-finite gradients; unset: log and continue")
    save_only_model: bool = _f(False, "checkpoint only the model (cannot resume training)")
    save_merged_model: bool = _f(
        False, "a PEFT (LoRA) model: save_model also writes the adapter merged into the base model "
               "(merge_and_unload) in merged/ beside the adapter, a full model from_pretrained loads")
    ignore_data_skip: bool = _f(
        False, "on resume, restart the saved epoch from its first batch instead of continuing mid-epoch")

    # HF's fields that the Trainer itself does not read (scripts do), or that raytrain refuses when set to what
    # it cannot do (validation.REFUSED); _HF_NOOP_WARNINGS warns for the few that are ignored without another field.
    do_train: bool = _f(False, "read by your script, not by the Trainer (as in HF)")
    do_eval: bool = _f(False, "read by your script, not by the Trainer (as in HF)")
    do_predict: bool = _f(False, "read by your script, not by the Trainer (as in HF)")
    resume_from_checkpoint: str | None = _f(None, "read by your script, not by the Trainer (as in HF)")
    logging_dir: str | None = _f(None, "report_to tensorboard's directory; default OUTPUT_DIR/runs/DATE_HOST")
    log_level_replica: _LogLevel = _f(
        "warning", "get_process_log_level() on the other processes (raytrain logs on the main one)")
    log_on_each_node: bool = _f(True, "should_log / get_process_log_level: main process of each node, else of the run")
    local_rank: int = _f(-1, "accepted for HF compatibility (Ray Train assigns ranks)")
    push_to_hub: bool = _f(False, "not supported (true is refused): the model is saved in output_dir")
    hub_model_id: str | None = _f(None, "not supported (push_to_hub)")
    hub_strategy: Literal["end", "every_save", "checkpoint", "all_checkpoints"] = _f(
        "every_save", "not supported (push_to_hub)")
    hub_token: str | None = _f(None, "not supported (push_to_hub)")
    hub_private_repo: bool | None = _f(None, "not supported (push_to_hub)")
    hub_always_push: bool = _f(False, "not supported (push_to_hub)")
    hub_revision: str | None = _f(None, "not supported (push_to_hub)")
    eval_do_concat_batches: bool = _f(True, "predictions concatenated across batches (false is refused)")
    include_for_metrics: list[str] = _f(None, "not supported (only [] is accepted)", factory=list)
    average_tokens_across_devices: bool = _f(
        True, "count num_items_in_batch over every rank (and scale the loss by the process count, as HF); false: "
              "each rank normalises its own loss by its own items")
    ddp_find_unused_parameters: bool | None = _f(None, "passed to DDP when set (unset: torch's default, false)")
    ddp_broadcast_buffers: bool | None = _f(None, "passed to DDP as broadcast_buffers when set")
    ddp_bucket_cap_mb: int | None = _f(None, "passed to DDP as bucket_cap_mb when set")
    ddp_static_graph: bool | None = _f(None, "passed to DDP as static_graph when set")
    ddp_backend: Literal["nccl", "gloo", "mpi", "ccl", "hccl", "cncl", "mccl"] | None = _f(
        None, "the Ray workers' torch.distributed backend (default: gloo on CPU, nccl on GPU)")
    ddp_timeout: int = _f(1800, "seconds the Ray workers' process group waits in a collective before failing")
    fsdp: str | None = _f(
        None, "HF's FSDP switch (true, or its legacy options: full_shard, shard_grad_op, offload, auto_wrap): "
              "selects distributed.strategy fsdp")
    fsdp_config: dict[str, Any] | str | None = _f(
        None, "with fsdp: HF's FSDP options (a mapping or JSON path), read by transformers and given to "
              "distributed.fsdp (version 2, cpu_offload, reshard_after_forward, activation_checkpointing, "
              "transformer_layer_cls_to_wrap, min_num_params)")
    deepspeed: dict[str, Any] | str | None = _f(
        None, "a DeepSpeed config (mapping or JSON path): selects distributed.strategy deepspeed")
    accelerator_config: Any = _f(
        None, "accelerate's settings as HF takes them (a mapping, transformers' AcceleratorConfig or a JSON path): "
        "split_batches, dispatch_batches, even_batches, use_seedable_sampler, non_blocking, "
        "gradient_accumulation_kwargs, use_configured_state (docs/huggingface.md)")
    group_by_length: bool = _f(False, "HF 4's name of train_sampling_strategy: group_by_length")
    length_column_name: str = _f(
        "length", "group_by_length: the column holding each sample's length (else the length of its input_ids)")
    train_sampling_strategy: Literal["random", "group_by_length"] = _f(
        "random", "the training order: random (a seeded shuffle) or group_by_length (that shuffle in megabatches "
        "sorted by length, longest first, as HF's LengthGroupedSampler: less padding)")
    neftune_noise_alpha: Annotated[float | None, Field(gt=0)] = _f(
        None, "NEFTune: uniform noise of +-alpha/sqrt(length x hidden size) on the input embeddings while training")
    use_liger_kernel: bool = _f(
        False, "patch the model with Liger's Triton kernels when training (needs liger-kernel and a GPU); a "
               "loss-only evaluation passes skip_logits=True, as HF")
    liger_kernel_config: dict[str, bool] | None = _f(None, "use_liger_kernel: the kernels to apply (Liger's keywords)")
    optim_target_modules: None | str | list[str] = _f(
        None, "the modules whose weights GaLore / APOLLO project: names, a regex or 'all-linear'")
    parallelism_config: Any = _f(
        None, "the device mesh, as HF/accelerate: {dp_replicate_size, dp_shard_size (-1: the rest), tp_size}, "
        "their product the world size (scaling.num_workers); tp_size > 1: tensor parallelism with FSDP2; "
        "raytrain's pp_size > 1: pipeline stages, with pp_schedule (torch's names: 1F1B (default), GPipe, "
        "Interleaved1F1B, ...) and pp_microbatches (default: the per-rank batch, one sample each); sp_size > 1 "
        "(sp_backend deepspeed): each sequence split over sp_size ranks, attention by DeepSpeed's Ulysses; "
        "cp_size > 1 (CUDA, FSDP2): torch's context_parallel ring attention")
    tp_plan: dict[str, str] | str | None = _f(
        "auto", "tensor-parallel plan: auto (the model's base_model_tp_plan / _tp_plan) or module name patterns "
        "to colwise, rowwise, colwise_gather_output, embedding_rowwise, sequence_parallel, replicate")
    dataloader_in_order: bool = _f(True, "batches always come in order (deterministic); false is refused")
    dataloader_multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = _f(
        None, "start method of the data worker processes (dataloader_num_workers > 0); default: torch's")
    eval_use_gather_object: bool = _f(False, "accepted: evaluation results are always gathered as objects")
    enable_jit_checkpoint: bool = _f(
        False, "save at the next step and stop on a preemption: Ray workers always do on Ray's preemption "
        "notice (scaling.max_preemption_failures) and on SIGTERM, raytrain.run on SIGTERM; set, an "
        "in-process Trainer.train() from Python does too on SIGTERM (then exits 143)")
    use_cache: bool = _f(False, "set as the model's config.use_cache (a transformers model's generation cache)")
    trackio_space_id: str | None = _f(None, "report_to trackio: the Hugging Face Space to log to (HF's)")
    trackio_bucket_id: str | None = _f(None, "report_to trackio: the bucket its logs are kept in (HF's)")
    trackio_static_space_id: str | None | Literal[False] = _f(
        None, "report_to trackio: the static Space frozen at the end (false: none) (HF's)")
    torch_empty_cache_steps: int | None = _f(
        None, "empty the GPU's cache every N steps (torch.cuda.empty_cache, as HF): lower peak memory, slower")
    save_on_each_node: bool = _f(False, "accepted: rank 0 writes to shared storage")
    bf16_full_eval: bool = _f(
        False, "evaluate outside training with the model cast to bfloat16 (as HF, the cast stays)")
    fp16_full_eval: bool = _f(
        False, "evaluate outside training with the model cast to float16 (as HF, the cast stays)")
    project: str = _f("huggingface", "report_to trackio: the project to log to (HF's)")
    debug: str | list[str] = _f(
        "", "HF's debug options: underflow_overflow (transformers' DebugUnderflowOverflow watches every module "
            "while training and stops at the first inf/nan), tpu_metrics_debug (TPUs only: nothing here, as HF)")

    model: ModelConfig | None = _f(None, "model section: factory plus its keyword arguments")
    data: DataConfig | None = _f(None, "data section: factory plus its keyword arguments")
    scaling: ScalingConfig = _f(None, "workers and resources", factory=ScalingConfig)
    distributed: DistributedConfig = _f(None, "distributed backend", factory=DistributedConfig)

    def __post_init__(self) -> None:
        self._validate({})

    def __setattr__(self, name: str, value: Any) -> None:
        # Assignments after construction are validated as a whole, and rolled back when they fail.
        if name.startswith("_") or "_validated" not in self.__dict__:
            object.__setattr__(self, name, value)
        elif name in _schema().model_fields:
            self._validate({name: value})
        elif name in {f.name for f in fields(self)}:  # a field of a user's subclass
            object.__setattr__(self, name, value)
        elif isinstance(getattr(type(self), name, None), property):
            object.__setattr__(self, name, value)  # raises: read-only property
        else:
            raise ConfigError(unknown_field_message(_schema(), name))

    def _validate(self, changes: dict[str, Any]) -> None:
        schema = _schema()
        changes = mirror_aliases(changes)  # args.gradient_checkpointing = True sets activation_checkpointing too
        values = {name: changes.get(name, getattr(self, name)) for name in schema.model_fields}
        checked = schema(**values)
        for name in schema.model_fields:
            object.__setattr__(self, name, getattr(checked, name))
        object.__setattr__(self, "_validated", True)
        warn_noop_fields(self)

    def _set_fields(self, changes: dict[str, Any]) -> None:  # HF's set_* groups: validated together
        self._validate(changes)

    # --- derived values (HF's names) ------------------------------------------------------

    @property
    def train_batch_size(self) -> int:
        """Batch size per worker for training (HF: per device)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Batch size per worker for evaluation."""
        return self.per_device_eval_batch_size

    @property
    def label_keys(self) -> list[str]:
        return list(self.label_names) if self.label_names else ["labels"]

    def resolve_steps(self, max_steps: int) -> tuple[int, int, int]:
        """(logging_steps, eval_steps, save_steps) as ints; ratios become ceil(max_steps * ratio)."""

        def resolve(v: float) -> int:
            return math.ceil(max_steps * v) if v < 1 else int(v)

        eval_steps = self.eval_steps if self.eval_steps is not None else self.logging_steps
        return resolve(self.logging_steps), resolve(eval_steps), resolve(self.save_steps)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup step count: warmup_steps if a count, else ceil(ratio * num_training_steps)."""
        if isinstance(self.warmup_steps, int) and self.warmup_steps > 0:
            return self.warmup_steps
        ratio = self.warmup_steps or self.warmup_ratio
        return math.ceil(ratio * num_training_steps)

    # --- (de)serialization -----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON values (sections as mappings)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """HF's name: the fields as scalars, for tracking integrations."""
        return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in self.to_dict().items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainingArguments:
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a mapping of fields, got {type(d).__name__}")
        names = {f.name for f in fields(cls) if f.init}
        unknown = [k for k in d if k not in names]
        if unknown:
            raise ConfigError(unknown_field_message(_schema(), unknown[0]))
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> TrainingArguments:
        """Read a YAML config, apply "dotted.key=value" overrides, then validate."""
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {os.fspath(path)!r}") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            what = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"invalid YAML in {os.fspath(path)}{where}: {what}") from None
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError(f"{os.fspath(path)}: top level must be a mapping of fields, got {type(d).__name__}")
        return cls.from_dict(apply_overrides(d, overrides or []))


_dataclass_init = TrainingArguments.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args: Any, **kwargs: Any) -> None:
    # A misspelt keyword gets the closest field's name (a TypeError too, as HF's dataclass raises).
    names = {f.name for f in fields(TrainingArguments)}
    for key in kwargs:
        if key not in names:
            raise UnknownFieldError(unknown_field_message(_schema(), key))
    _dataclass_init(self, *args, **kwargs)


TrainingArguments.__init__ = _init  # type: ignore[method-assign]


class UnknownFieldError(ConfigError, TypeError):
    """A keyword that is no field of TrainingArguments."""


def _plain(v: Any) -> Any:
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if hasattr(v, "to_dict") and hasattr(v, "__dataclass_fields__"):  # transformers' AcceleratorConfig, as HF
        return v.to_dict()
    if isinstance(v, BaseModel):
        return v.model_dump(mode="json")
    if isinstance(v, Enum):
        return v.value
    if type(v).__module__ == "torch" and type(v).__name__ == "dtype":  # a subclass's dtype field, as HF
        return str(v).removeprefix("torch.")
    return copy.deepcopy(v)


class _Rules(ArgumentRules):
    @classmethod
    def field_names(cls) -> list[str]:  # what an unknown field's suggestion is chosen from
        return _field_names()


#: Fields validated as a wider type than the dataclass states (HfArgumentParser reads the dataclass's):
#: warmup_steps a number (_check_warmup_steps makes whole numbers ints); fsdp and debug as HF takes them.
_VALIDATED_AS = {"warmup_steps": float, "fsdp": bool | str | list[str] | None, "debug": str | list[str] | None}


@functools.cache
def _schema() -> type[StrictModel]:
    """The pydantic model that validates TrainingArguments: its fields, types and help, plus _Rules."""
    hints = get_type_hints(TrainingArguments, include_extras=True)
    spec = {}
    for f in fields(TrainingArguments):
        if f.default_factory is not MISSING:
            info = Field(default_factory=f.default_factory, description=f.metadata["help"])
        else:
            info = Field(default=f.default, description=f.metadata["help"])
        spec[f.name] = (_VALIDATED_AS.get(f.name, hints[f.name]), info)
    return create_model("TrainingArguments", __base__=_Rules, **spec)


# --- help ------------------------------------------------------------------------------


SECTIONS: dict[str, type[StrictModel]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "scaling": ScalingConfig,
    "distributed": DistributedConfig,
}


def _field_names() -> list[str]:
    names = list(_schema().model_fields)
    for section, model in SECTIONS.items():
        names += [f"{section}.{n}" for n in model.model_fields]
    return names


def _show(value: Any) -> str:
    """A default as the user would write it in YAML."""
    return value if isinstance(value, str) else json.dumps(value)


def cli_help() -> str:
    """One line per field, nested sections as dotted names, for the CLI's --help."""
    rows = []
    for name in _field_names():
        section, _, leaf = name.rpartition(".")
        if not section and name in SECTIONS:
            continue
        info = (SECTIONS[section] if section else _schema()).model_fields[leaf]
        text = info.description or ""
        if get_origin(info.annotation) is Literal:
            text += f" (one of: {', '.join(map(str, get_args(info.annotation)))})"
        if info.is_required():
            rows.append((name, f"{text} (required)"))
        else:
            rows.append((name, f"{text} (default: {_show(info.get_default(call_default_factory=True))})"))
    rows += [(f"{s}.<key>", f"any other key is passed to the {s} factory as a keyword argument") for s in ("model", "data")]
    width = max(len(n) for n, _ in rows) + len("=VALUE")
    return "\n".join(f"  --set {n + '=VALUE':<{width}}   {t}" for n, t in rows)
