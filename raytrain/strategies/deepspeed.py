"""DeepSpeed ZeRO stages 1, 2 and 3 (with optimizer / parameter CPU offload) behind the Strategy interface.

The config comes from `distributed.deepspeed` (a mapping or a JSON file). Its "auto" values, and the
batch/accumulation/clipping/precision keys it leaves out, are filled from TrainingArguments; an explicit
value that contradicts them is an error. Without an "optimizer" section the optimizer is raytrain's own
(args.optim with its weight-decay groups), as with every other backend; with one, DeepSpeed builds it
(on CPU as torch's AdamW: "torch_adam": true). raytrain's lr_scheduler_type drives the learning rate.

The engine does its own gradient reduction, clipping and stepping: backward maps to engine.backward
(unscaled: the loop already weights each micro-batch by its share of the step), optimizer_step to
engine.step, and the engine runs with managed_gradient_accumulation=false so that one step() ends
each update step whatever its number of micro-batches. Checkpoints carry DeepSpeed's own engine
checkpoint (deepspeed/) for resuming, and model.safetensors with the consolidated fp32 weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..checkpoint.io import HostStaging, lower_thread_priority
from ..deps import require
from ..optim.optimizers import get_parameter_groups
from .base import DEEPSPEED_DIR, Strategy, TorchDistributedMixin, enable_gradient_checkpointing
from .sequence import init_comm

AUTO = "auto"


class DeepSpeedStrategy(TorchDistributedMixin, Strategy):
    name = "deepspeed"
    averages_gradients = True  # the engine averages gradients over data-parallel ranks

    def __init__(self, args):
        require("deepspeed", "distributed.strategy deepspeed")  # ZeRO-3's private hooks (_add_hooks below)
        super().__init__(args)
        self._init_distributed(args)
        if self.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
        self.config = build_config(args, self.world_size, on_cpu=self.device.type == "cpu")
        self.engine = None
        self._staging: HostStaging | None = None  # a background save's host buffers, and its writer thread
        self._writer: ThreadPoolExecutor | None = None

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    # -- set-up
    def setup(self, model, optimizer_factory, optimizer=None):
        import deepspeed

        init_comm(self.device)
        if self.args.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        kwargs: dict[str, Any] = {"model": model, "config": copy.deepcopy(self.config)}
        if "optimizer" in self.config:
            if optimizer is not None:
                raise ValueError("distributed.deepspeed has an optimizer section and Trainer got an optimizer "
                                 "too; keep one of them")
            kwargs["model_parameters"] = get_parameter_groups(model, self.args.weight_decay)
        else:
            kwargs["optimizer"] = optimizer if optimizer is not None else optimizer_factory(model)
        engine, _, _, _ = deepspeed.initialize(**kwargs)
        self.engine = self.model = engine
        # The torch optimizer inside ZeRO's wrapper: its param_groups are the ones ZeRO steps with, so
        # the loop's LR scheduler drives it directly.
        self.optimizer = engine.basic_optimizer
        return engine, self.optimizer

    def unwrap(self, model):
        return getattr(model, "module", model)

    def place_frozen(self, module):
        """ZeRO-3: a DeepSpeed engine of its own with the run's config (no optimizer) and TRL's prepare_deepspeed
        bucket sizes, its parameters partitioned over the ranks; other stages: whole on the device."""
        if self.stage != 3:
            return module.to(self.device)
        import deepspeed

        config = {k: v for k, v in copy.deepcopy(self.config).items() if k not in ("optimizer", "scheduler")}
        hidden = getattr(getattr(module, "config", None), "hidden_size", None)
        if isinstance(hidden, int):
            config["zero_optimization"].update(reduce_bucket_size=hidden * hidden,
                                               stage3_param_persistence_threshold=10 * hidden,
                                               stage3_prefetch_bucket_size=int(0.9 * hidden * hidden))
        engine, *_ = deepspeed.initialize(model=module.to(self.device), config=config)
        engine.eval()  # the engine's eval() returns None
        return engine

    @contextlib.contextmanager
    def full_parameters(self):
        """ZeRO-3: every partition gathered (deepspeed.zero.GatheredParameters) and the engine's fetch / release
        hooks taken off inside, as TRL's unwrap_model_for_generation does; other stages hold whole parameters."""
        if self.stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.unwrap(self.engine).parameters())):
            offload = _parameter_offload(self.engine)
            _remove_hooks(offload)
            try:
                yield
            finally:
                _add_hooks(offload)

    # -- the step
    def backward(self, loss):
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, max_norm):
        """The engine clips inside step() (config gradient_clipping); the norm is filled in there."""
        return torch.full((), float("nan"))

    def optimizer_step(self, grad_norm) -> bool:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            grad_norm.fill_(float(norm))
        return bool(self.engine.was_step_applied())

    def zero_grad(self):
        pass  # engine.step() already cleared the gradients

    # -- state for checkpoints
    def model_state_dict(self, all_ranks: bool = False, trainable_only: bool = False):
        """The fp32 weights (ZeRO's master copy where there is one), gathered from every rank's
        partition: a collective, so every rank calls it."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrap(self.engine)
        full: dict[int, torch.Tensor] = {}
        out = {}
        for name, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.nn.Parameter) and trainable_only and not value.requires_grad:
                continue
            if isinstance(value, torch.nn.Parameter):
                if id(value) not in full:
                    fp32 = safe_get_full_fp32_param(value)
                    if fp32 is None:  # stage 0 without a master copy: the parameter is the weight
                        fp32 = value
                    full[id(value)] = fp32.detach().float().cpu()
                out[name] = full[id(value)]
            else:
                out[name] = value.detach().cpu()
        return out if (self.is_main or all_ranks) else None

    def load_model_state_dict(self, state, strict: bool = True):
        """Weights into the fp32 master partitions and the (gathered) low-precision parameters."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        module = self.unwrap(self.engine)
        params = {k: v for k, v in module.named_parameters() if strict or k in state}
        missing = sorted(set(params) - set(state))
        if missing:
            raise KeyError(f"weights missing for {missing[:5]}")
        for name, param in params.items():
            value = state[name].to(self.device)
            safe_set_full_fp32_param(param, value.float())
            gather = deepspeed.zero.GatheredParameters([param], modifier_rank=0) if hasattr(param, "ds_id") \
                else contextlib.nullcontext()
            with gather, torch.no_grad():
                param.data.copy_(value.to(param.dtype))
        buffers = {k: v for k, v in state.items() if k not in params}
        if buffers:
            module.load_state_dict(buffers, strict=False)

    def optimizer_state_dict(self):
        return None  # in the engine checkpoint

    def read_optimizer_state(self, path: str):
        from ..checkpoint.store import CheckpointError

        directory = os.path.join(path, DEEPSPEED_DIR)
        if not os.path.isdir(directory):
            raise CheckpointError(
                f"{directory}: missing: the checkpoint was not written by DeepSpeed, and its optimizer state "
                "cannot be put into ZeRO's partitions; resume with the backend that wrote it, or start a new "
                "run from its model.safetensors (weights only)")
        return path

    def load_optimizer_state(self, path):
        loaded, _ = self.engine.load_checkpoint(path, tag=DEEPSPEED_DIR, load_optimizer_states=True,
                                                load_lr_scheduler_states=False, load_module_strict=True)
        if loaded is None:
            raise ValueError(f"DeepSpeed could not load its checkpoint from {path}/{DEEPSPEED_DIR}")

    @property
    def has_sharded_state(self) -> bool:
        return True

    def save_sharded(self, directory: str, process_group=None) -> Future | None:
        """DeepSpeed's engine checkpoint into deepspeed/. With `process_group` (a background save): the
        engine runs its save as usual (its collectives on the training thread), but each file's state is
        copied to reused host buffers instead of written, and a thread of this strategy writes them; the
        future is done once they are written (the commit fsyncs and checksums them). None of DeepSpeed
        0.19's own asynchronous engines fits here (docs/checkpoints.md says why)."""
        if process_group is None:
            self.engine.save_checkpoint(directory, tag=DEEPSPEED_DIR, save_latest=False)
            return None
        real = self.engine.checkpoint_engine
        deferred = _deferred_engine_class()(getattr(real, "zipfile_serialization", False))
        self.engine.checkpoint_engine = deferred
        try:
            self.engine.save_checkpoint(directory, tag=DEEPSPEED_DIR, save_latest=False)
        finally:
            self.engine.checkpoint_engine = real
        if self._staging is None:
            self._staging = HostStaging()
            self._writer = ThreadPoolExecutor(1, "raytrain-zero-save", initializer=lower_thread_priority)
        files = self._staging.copy(deferred.files)  # one pass: storage shared between files stays shared
        return self._writer.submit(_write_deferred, files, deferred.zipfile, self._staging.ready)


def _parameter_offload(engine):
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_hooks(offload) -> None:
    """TRL's remove_hooks (trl.models.utils): ZeRO-3's per-module hooks off, and its start-of-forward hook too (its
    check of the module trace is a collective, which TRL's ranks keep in step with transformers' synced_gpus).
    DeepSpeed's internals: no public API turns them off and back on."""
    module = offload.module
    external = [p for _, p in module.ds_external_parameters()] if hasattr(module, "ds_external_parameters") else []
    for param in [*module.parameters(recurse=True), *external]:
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _add_hooks(offload) -> None:
    """TRL's add_hooks: the hooks back (the start-of-forward one first, as DeepSpeed's setup_zero_stage3_hooks
    registers it), the prefetch trace (recorded on training's module order) invalidated."""
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload.fwd_pre_hook = offload.module.register_forward_pre_hook(
        lambda module, *args: offload.get_param_coordinator().reset_step())
    offload._register_deepspeed_module(offload.module)


@functools.cache
def _deferred_engine_class():
    """A DeepSpeed checkpoint engine that keeps what save_checkpoint asks it to write, (path, state) by
    reference, for the caller to copy once the engine's save has returned (nothing changes in between).
    Made on first use: deepspeed is imported only once DS_ACCELERATOR is set."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class DeferredFiles(CheckpointEngine):
        def __init__(self, zipfile: bool):
            super().__init__()
            self.name, self.zipfile, self.files = "raytrain-deferred", zipfile, []

        def create(self, info) -> None:
            pass

        def save(self, state_dict, path: str) -> None:
            self.files.append((path, state_dict))

        def load(self, path: str, map_location=None):
            raise NotImplementedError("only saves go through this engine")

        def commit(self, info) -> bool:
            return True

    return DeferredFiles


def _write_deferred(files: list, zipfile: bool, ready) -> None:
    ready()  # device-to-host copies have landed
    for path, state in files:
        torch.save(state, path, _use_new_zipfile_serialization=zipfile)


# ---------------------------------------------------------------- config


def build_config(args, world_size: int, on_cpu: bool) -> dict:
    """The DeepSpeed config with "auto" (and missing) values taken from TrainingArguments."""
    source = args.distributed.deepspeed
    if source is None:
        config: dict = {"zero_optimization": {"stage": 2}}
    elif isinstance(source, str):
        try:
            with open(source) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"distributed.deepspeed: cannot read the JSON config {source!r} ({e})") from e
    else:
        config = copy.deepcopy(source)
    if "scheduler" in config:
        raise ValueError("distributed.deepspeed.scheduler: remove it; raytrain's lr_scheduler_type and "
                         "warmup settings drive the learning rate for every backend")
    micro, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    _fill(config, "train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    _fill(config, "gradient_accumulation_steps", ga, "gradient_accumulation_steps")
    _fill(config, "train_batch_size", micro * ga * world_size,
          "per_device_train_batch_size x gradient_accumulation_steps x num_workers")
    _fill(config, "gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    for key, flag in (("bf16", args.bf16), ("fp16", args.fp16)):
        section = config.setdefault(key, {})
        _fill(section, "enabled", flag, key, prefix=f"{key}.")
    if "optimizer" in config:
        params = config["optimizer"].setdefault("params", {})
        _fill(params, "lr", args.learning_rate, "learning_rate", prefix="optimizer.params.")
        _fill(params, "betas", [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2",
              prefix="optimizer.params.")
        _fill(params, "eps", args.adam_epsilon, "adam_epsilon", prefix="optimizer.params.")
        _fill(params, "weight_decay", args.weight_decay, "weight_decay", prefix="optimizer.params.")
        if on_cpu:
            params["torch_adam"] = True  # DeepSpeed's fused/CPU Adam kernels need a compiler here
    zero = config.setdefault("zero_optimization", {})
    if zero.get("stage", 0) != 2:
        zero.setdefault("overlap_comm", False)  # required with unmanaged accumulation except in stage 2
    offload = any(zero.get(k, {}).get("device", "none") != "none"
                  for k in ("offload_optimizer", "offload_param"))
    if offload and ("optimizer" not in config or on_cpu):
        config.setdefault("zero_force_ds_cpu_optimizer", False)  # torch's AdamW on offloaded state
    config["managed_gradient_accumulation"] = False
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return config


def _fill(section: dict, key: str, value, source: str, prefix: str = "") -> None:
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif current != value and not (isinstance(value, float) and isinstance(current, (int, float))
                                   and float(current) == value):
        raise ValueError(f"distributed.deepspeed.{prefix}{key}={current!r} contradicts {source} ({value!r}); "
                         f'set it to "auto" or to the same value')
