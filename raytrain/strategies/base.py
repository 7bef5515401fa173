"""The Strategy interface: everything that differs between backends, and nothing else.

The loop calls only these methods, so single-process, DDP, FSDP2 and DeepSpeed runs share one loop.
"""

from __future__ import annotations

import contextlib
import math
import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

#: Where each backend keeps optimizer state inside a checkpoint directory.
OPTIMIZER_FILE = "optimizer.pt"    # one torch optimizer state_dict (single process, DDP)
DCP_DIR = "dcp"                    # torch.distributed.checkpoint, sharded by rank (FSDP2)
DEEPSPEED_DIR = "deepspeed"        # DeepSpeed's own engine checkpoint (ZeRO partitions)


def unwrap_model(model: Any) -> Any:
    """The user's module inside a DDP / DeepSpeed wrapper (`.module`) and torch.compile (`._orig_mod`)."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def frozen_names(model: torch.nn.Module) -> set[str]:
    """The state_dict names of parameters that do not train (every name of a tied one)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


class Strategy:
    """One backend. Subclasses override what differs; the defaults are the single-process ones."""

    name = "single"
    #: True when the backend averages gradients over ranks (the loop then scales the loss by world size).
    averages_gradients = False

    def __init__(self, args):
        self.args = args
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        self.scaler: torch.amp.GradScaler | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        # Which rows of the data this rank takes: the same for a tensor-parallel group's ranks.
        self.dp_rank, self.dp_size = 0, 1
        #: The mesh's sizes (parallelism_config), recorded in checkpoints; None: plain data parallel.
        self.layout: dict[str, int] | None = None
        #: This rank's pipeline stages (strategies/pipeline.py) when pp_size > 1: the Trainer's steps run them.
        self.pipeline = None
        #: sp_size > 1: this rank's sequence group (strategies/sequence.py): batches sliced, attention by Ulysses.
        self.sequence = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def gradient_scale(self) -> int:
        """The ranks the backend averages gradients over (every rank of a sequence group holds other tokens);
        the loss is multiplied by it so that the average is the step's sum. 1 where the backend sums."""
        if not self.averages_gradients:
            return 1
        return self.dp_size * (self.sequence.size if self.sequence is not None else 1)

    def data_shard(self, training: bool) -> dict[str, int]:
        """Which rows this rank reads: by data-parallel rank; a sequence group's evaluation by rank, whole
        sequences (HF's: Ulysses is off in evaluation, disable_in_eval)."""
        if self.sequence is not None and not training:
            return {"rank": self.rank, "world_size": self.world_size}
        return {"rank": self.dp_rank, "world_size": self.dp_size}

    def split_sequences(self, source):
        """The training source as this rank reads it: under sp_size, each batch's slice of its sequences."""
        return source if self.sequence is None else self.sequence.shards(source)

    # -- set-up
    def setup(self, model: torch.nn.Module, optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer],
              optimizer: torch.optim.Optimizer | None = None):
        """Move/wrap the model, build the optimizer over the final parameters; return both."""
        raise NotImplementedError

    def _place(self, model: torch.nn.Module, optimizer_factory, optimizer=None):
        """What every backend does first: model on this rank's device, gradient checkpointing,
        then the optimizer over the placed parameters (unless the user gave one)."""
        model = model.to(self.device)
        if self.args.activation_checkpointing:
            enable_gradient_checkpointing(model, self.args.activation_checkpointing_kwargs)
        return model, optimizer if optimizer is not None else optimizer_factory(model)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return unwrap_model(model)

    def place_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """A model that only runs forwards beside the trained one (a reference or reward model), placed as TRL's
        prepare_model / prepare_fsdp / prepare_deepspeed place it: here on this rank's device, whole; a sharding
        backend shards it as it shards the trained model, so that every rank runs its forwards together."""
        return module.to(self.device)

    @contextlib.contextmanager
    def full_parameters(self):
        """Every rank holds the whole parameters inside, and the model's forward runs no collective: for a
        forward-only pass whose number of calls differs between ranks (generation, each rank stopping at its
        own EOS). Nothing to do where each rank holds a replica."""
        yield

    # -- the step
    def autocast(self):
        if self.args.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        if self.args.fp16:
            return torch.autocast(self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def no_sync(self):
        """Context for accumulation micro-steps that need no gradient synchronisation."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Unscale (fp16), clip when max_norm > 0, and return the total grad norm as a tensor."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"), foreach=True)

    def optimizer_step(self, grad_norm: torch.Tensor) -> bool:
        """Step unless the gradients are not finite; return whether a step was taken.

        Reads one scalar from the device (the norm's finiteness): skipping a step on non-finite
        gradients requires it. With fp16 the GradScaler decides instead, as torch does.
        """
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return self.scaler.get_scale() >= scale
        if not math.isfinite(grad_norm.item()):
            return False
        self.optimizer.step()
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- collectives (identity in one process)
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def reduce_loss(self, tensor: torch.Tensor) -> torch.Tensor:
        """The step losses of every rank summed (each holds its share; under PP, the last stage's ranks)."""
        return self.all_reduce(tensor)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def data_parallel_view(self, per_rank: list) -> list:
        """Of one item per rank (all_gather_object's), one per data-parallel rank."""
        return per_rank

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    # -- state for checkpoints
    def model_state_dict(self, all_ranks: bool = False, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The full, consolidated fp32 weights on CPU. A collective for sharded backends: every rank
        calls it; only rank 0 gets the dict unless `all_ranks` (the others get None). trainable_only:
        frozen parameters left out (a PEFT model's base: not copied nor gathered at each save)."""
        model = self.unwrap(self.model)
        frozen = frozen_names(model) if trainable_only else ()
        return {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in frozen}

    def load_model_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Full weights by name; strict=False: some of them (a PEFT adapter over a frozen base)."""
        self.unwrap(self.model).load_state_dict(state, strict=strict)

    def optimizer_state_dict(self) -> dict | None:
        """What goes in optimizer.pt (rank 0); None when the backend saves it sharded instead."""
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a full torch optimizer state_dict (optimizer.pt, as this backend or DDP saves it)."""
        self.optimizer.load_state_dict(state)

    def read_optimizer_state(self, path: str) -> Any:
        """Read the optimizer state of checkpoint `path`, whichever backend wrote it, in a form that
        `load_optimizer_state` applies; a CheckpointError when this backend cannot use it."""
        from ..checkpoint.store import CheckpointError, load_pickle

        if os.path.exists(os.path.join(path, OPTIMIZER_FILE)):
            return (OPTIMIZER_FILE, load_pickle(os.path.join(path, OPTIMIZER_FILE)))
        if os.path.isdir(os.path.join(path, DCP_DIR)):
            return (DCP_DIR, _read_dcp_optimizer(self.unwrap(self.model), self.optimizer,
                                                 os.path.join(path, DCP_DIR)))
        if os.path.isdir(os.path.join(path, DEEPSPEED_DIR)):
            raise CheckpointError(
                f"{os.path.join(path, DEEPSPEED_DIR)}: the optimizer state is DeepSpeed's own (ZeRO partitions), "
                f"which the {self.name} backend cannot read; resume with distributed.strategy=deepspeed, or start "
                "a new run from the checkpoint's model.safetensors (weights only)")
        raise CheckpointError(
            f"{os.path.join(path, OPTIMIZER_FILE)}: missing: the checkpoint holds only the model (save_only_model), "
            "so training cannot continue from it; load it with raytrain.load_weights and start a new run")

    def load_optimizer_state(self, state: Any) -> None:
        """Apply what `read_optimizer_state` returned."""
        kind, value = state
        if kind == OPTIMIZER_FILE:
            self.load_optimizer_state_dict(value)
        else:
            _set_optimizer_state(self.unwrap(self.model), self.optimizer, value)

    def save_sharded(self, directory: str, process_group: Any = None) -> Future | None:
        """Write backend-sharded state (DCP, DeepSpeed engine) into the checkpoint directory, on every
        rank; `read_optimizer_state` finds it there. Nothing for replicated backends. With `process_group`
        (a background save's side channel) a backend may stage its state now and return the future of
        a write in the background, on that group; None once written."""

    @property
    def has_sharded_state(self) -> bool:
        return False

    def teardown(self) -> None:
        pass


@dataclass(frozen=True)
class SideChannel:
    """Collectives of a background save, apart from training's: every rank's object, a barrier, and the
    process group under them (None where ranks are not processes, in tests)."""

    all_gather: Callable[[Any], list]
    barrier: Callable[[], None]
    group: Any = None


class TorchDistributedMixin:
    """Rank information and collectives over torch.distributed's default process group.

    The group is initialised by whoever started the workers (Ray Train's TorchTrainer, torchrun);
    LOCAL_RANK comes from the environment both of them set.
    """

    def _init_distributed(self, args) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"distributed.strategy={args.distributed.strategy}: torch.distributed is not "
                               "initialised; run with scaling.num_workers > 1 (Ray Train) or under torchrun")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        use_cuda = torch.cuda.is_available() and args.scaling.use_gpu
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        if (getattr(args, "parallelism_config", None) or {}).get("sp_size", 1) > 1:
            from .mesh import ParallelDims
            from .sequence import SequenceParallel

            dims = ParallelDims.resolve(args.parallelism_config, self.world_size)
            self.sequence = SequenceParallel(dims, self.rank, self.device)
            self.dp_rank, self.dp_size, self.layout = dims.dp_rank(self.rank), dims.dp, dims.as_dict()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A reduced copy of `tensor` (sum, mean, max or min over ranks)."""
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"all_reduce: op must be one of {sorted(ops)}, got {op!r}")
        out = torch.as_tensor(tensor).to(self.device, copy=True)
        dist.all_reduce(out, ops[op])
        return out / self.world_size if op == "mean" else out

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def side_channel(self) -> SideChannel:
        """all_gather_object and barrier on a gloo group of their own (every rank creates it, in step):
        for a background save (DCP's write, then the commit), which runs while the training thread runs
        its own collectives."""
        import torch.distributed as dist

        group = dist.new_group(backend="gloo")

        def all_gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=group)
            return out

        return SideChannel(all_gather, lambda: dist.barrier(group=group), group)

    def broadcast_object(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()


def _read_dcp_optimizer(model: torch.nn.Module, optimizer, directory: str) -> tuple[bool, dict]:
    """Optimizer state saved with torch.distributed.checkpoint, re-sharded to this run's layout
    (DCP maps the saved shards onto whatever the current parameters are: full tensors or DTensors).
    (flattened, state): a pipelined run saves it flattened (torch's flatten_optimizer_state_dict: one
    entry per parameter name, as torchtitan does), since its stages' parameter groups differ; a run of
    whole models saved the groups as lists of names, of which a stage keeps its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = "optimizer.param_groups.0.params" not in dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    # get_optimizer_state_dict first creates the state tensors of an optimizer that never stepped.
    template = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    own = set() if flat else {n for g in template["param_groups"] for n in g["params"]}
    state = {"optimizer": template}
    dcp.load(state, checkpoint_id=directory)
    if not flat:
        for group in state["optimizer"]["param_groups"]:
            group["params"] = [n for n in group["params"] if n in own]
    return flat, state["optimizer"]


def _set_optimizer_state(model: torch.nn.Module, optimizer, value: tuple[bool, dict]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    flat, state = value
    # A group with no parameters here (LoRA's undecayed; a stage's) has no flattened entries to bring its
    # settings back, and torch's unflattening cannot take it: set aside meanwhile, as it was.
    empty = {i: g for i, g in enumerate(optimizer.param_groups) if not g["params"]} if flat else {}
    optimizer.param_groups = [g for i, g in enumerate(optimizer.param_groups) if i not in empty]
    try:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    finally:
        for i in sorted(empty):
            optimizer.param_groups.insert(i, empty[i])


def enable_gradient_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any] | None = None) -> None:
    """As HF's Trainer: the model's activation_checkpointing_enable (every_n_layers and offload are its own
    arguments, the rest go to torch's checkpoint), else its older gradient_checkpointing_enable."""
    kwargs = dict(kwargs or {})
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload)
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError("activation_checkpointing: the model has no activation_checkpointing_enable() or "
                         "gradient_checkpointing_enable() method; add one or set activation_checkpointing: false")
    if kwargs:
        enable(gradient_checkpointing_kwargs=kwargs)
    else:
        enable()
