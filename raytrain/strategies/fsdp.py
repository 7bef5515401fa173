"""FSDP2 (torch.distributed.fsdp.fully_shard): parameters, gradients and optimizer state sharded over ranks.

Options, from `distributed.fsdp`:
  reshard_after_forward    true (default): full sharding; false: parameters stay gathered between
                           forward and backward (gradient/optimizer sharding only, less communication)
  cpu_offload              keep sharded parameters, gradients and optimizer state in CPU memory
  mixed_precision          {param_dtype, reduce_dtype} (e.g. bfloat16 / float32); bf16: true implies
                           {param_dtype: bfloat16, reduce_dtype: float32}
  activation_checkpointing recompute each wrapped block's activations in the backward pass
  wrap_classes             class names of the blocks to shard separately (e.g. [DecoderLayer]);
                           transformer_layer_cls_to_wrap is accepted as HF's name for it
  min_num_params           or: shard separately every submodule holding at least this many parameters
2-D (parallelism_config with tp_size > 1, or dp_replicate_size > 1 for HSDP): the model's tensor-parallel
plan is applied on the mesh's tp dim first, then fully_shard on its data-parallel dims (torchtitan's order).
3-D (pp_size > 1): the model is first cut to this rank's pipeline stages (strategies/pipeline.py), then
TP, then FSDP2 per stage, each stage's view its own FSDP root (torchtitan's order).
Split sequences (sp_size; cp_size on CUDA, strategies/sequence.py): FSDP2 shards over the data-parallel and
sequence ranks together (torchtitan's dp_shard_cp).
Checkpoints: model.safetensors is the consolidated full state dict (rank 0); the optimizer state is
saved sharded with torch.distributed.checkpoint into the checkpoint's dcp/ directory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import tp as tensor_parallel
from .base import DCP_DIR, Strategy, TorchDistributedMixin, enable_gradient_checkpointing
from .mesh import ParallelDims

logger = logging.getLogger(__name__)

OPTIONS = ("reshard_after_forward", "cpu_offload", "mixed_precision", "activation_checkpointing",
           "wrap_classes", "transformer_layer_cls_to_wrap", "min_num_params")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


class FSDPStrategy(TorchDistributedMixin, Strategy):
    name = "fsdp"
    averages_gradients = True  # the reduce-scatter averages gradients over ranks

    def __init__(self, args):
        super().__init__(args)
        self.options = dict(args.distributed.fsdp or {})
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"distributed.fsdp: unknown option(s) {unknown}; valid: {', '.join(OPTIONS)}")
        if args.fp16:
            raise ValueError("fp16 with distributed.strategy=fsdp: use bf16 (or distributed.fsdp.mixed_precision)")
        self._mixed_precision()  # validates the dtypes now, before any worker is set up
        self._init_distributed(args)
        self._dcp_stager = None
        self.dims = ParallelDims.resolve(args.parallelism_config, self.world_size)
        self.dims.check_local(int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None)
        self.dp_rank, self.dp_size = self.dims.dp_rank(self.rank), self.dims.dp
        self._dp_group = self.dims.dp_group(self.rank) if self.dims.tp > 1 or self.dims.pp > 1 or self.dims.cp > 1 \
            else None
        self._loss_group = self.dims.loss_group(self.rank) if self.dims.pp > 1 else None
        self._pp_group = None
        self._frozen_kwargs: dict | None = None  # fully_shard's options for a reference / reward model
        self.layout = self.dims.as_dict()
        self._mesh = None
        if self.dims.cp > 1:  # torch's ring attention over the mesh's cp dim (strategies/sequence.py)
            from .sequence import ContextParallel

            if self.device.type != "cuda":
                raise ValueError("parallelism_config.cp_size: context parallelism needs CUDA (scaling.use_gpu and a "
                                 "GPU per worker); on CPU and gloo split the sequence with sp_size")
            self._mesh = self.dims.build_mesh(self.device.type)
            self.sequence = ContextParallel(self._mesh["cp"], self.dims.cp)

    # -- set-up
    def setup(self, model, optimizer_factory, optimizer=None):
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard,
                                            register_fsdp_forward_method)

        if optimizer is not None:
            raise ValueError("distributed.strategy=fsdp: a ready-made optimizer refers to the unsharded "
                             "parameters; leave Trainer(optimizers=...) empty so it is built after sharding")
        if self.dims.pp > 1:  # cut to this rank's stages first: what it does not run is never placed
            from .pipeline import Pipeline

            self.pipeline = Pipeline(model, self.dims, self.dims.pp_rank(self.rank),
                                     self.args.per_device_train_batch_size)
        model = model.to(self.device)
        if self.pipeline is not None and self.args.activation_checkpointing:  # HF's switch, on the stages' layers
            enable_gradient_checkpointing(model, self.args.activation_checkpointing_kwargs)
        blocks = self._blocks(model)
        if self.options.get("activation_checkpointing"):
            for block in blocks or [model]:
                _checkpoint_forward(block)
        # under PP, parameters stay gathered across a step's microbatches unless asked (torchtitan's default)
        kwargs = {"mesh": self._dp_mesh(model),
                  "reshard_after_forward": bool(self.options.get("reshard_after_forward", self.dims.pp == 1))}
        mp = self._mixed_precision()
        if mp is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(**mp)
        if self.options.get("cpu_offload") and self.device.type == "cpu":
            logger.warning("distributed.fsdp.cpu_offload: ignored without GPUs (everything is in CPU memory)")
        elif self.options.get("cpu_offload"):
            kwargs["offload_policy"] = CPUOffloadPolicy()
        roots = [model]
        if self.pipeline is not None:
            roots = self.pipeline.make_stages(self.device, self._pp_group)
            if self.pipeline.tied_trainable:
                self.pipeline.tied_group = self.dims.tied_group(self.rank)
            self.pipeline.sync_group = torch.distributed.group.WORLD if self.dims.dp > 1 else None
        if self.dims.shards > 1:  # tp alone: no data-parallel dim to shard over
            for block in blocks:
                fully_shard(block, **kwargs)
            for root in roots:
                fully_shard(root, **kwargs)
            if self.pipeline is None and callable(getattr(model, "generate", None)):
                # generate() enters at the root, as forward does (a PEFT model's reaches its blocks without it)
                register_fsdp_forward_method(model, "generate")
        if self.dims.shards > 1 and self.dims.tp == 1 and self.pipeline is None:
            self._frozen_kwargs = {**kwargs, "reshard_after_forward": True}
        self.optimizer = optimizer_factory(model)
        if self.dims.tp > 1:
            tensor_parallel.unfuse_mixed_groups(self.optimizer)
        if self.args.torch_compile and self.pipeline is not None:
            logger.warning("torch_compile: not applied under pipeline parallelism (pp_size > 1)")
        self.model = torch.compile(model) if self.args.torch_compile and self.pipeline is None else model
        return self.model, self.optimizer

    def place_frozen(self, module):
        """FSDP2 over the trained model's data-parallel mesh, its decoder blocks (_no_split_modules) each sharded
        on their own, as TRL's prepare_fsdp; whole where the layout has TP or PP (the reference then needs no
        plan of its own)."""
        from torch.distributed.fsdp import fully_shard

        module = module.to(self.device)
        kwargs = self._frozen_kwargs
        if kwargs is None:
            return module
        names = set(getattr(module, "_no_split_modules", None) or [])
        for block in reversed([m for m in module.modules() if m is not module and type(m).__name__ in names]):
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
        return module

    def _dp_mesh(self, model):
        """The mesh FSDP shards over; with TP in the layout, the model's plan is applied first."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.dims
        if dims.tp == 1 and dims.dp_replicate == 1 and dims.pp == 1 and dims.cp == 1:
            return init_device_mesh(self.device.type, (self.world_size,))
        mesh = self._mesh or dims.build_mesh(self.device.type)
        if dims.cp > 1:  # FSDP2 shards over the data-parallel and context ranks together (torchtitan's dp_shard_cp)
            return mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        self._pp_group = mesh["pp"].get_group() if dims.pp > 1 else None
        if dims.tp > 1:
            tensor_parallel.apply_tp(model, mesh["tp"], self.args.tp_plan)
        return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]

    def _blocks(self, model) -> list[torch.nn.Module]:
        """The submodules sharded on their own (each its own all-gather), innermost first."""
        names = self.options.get("wrap_classes") or self.options.get("transformer_layer_cls_to_wrap")
        if isinstance(names, str):
            names = [names]
        names = names or list(getattr(model, "_no_split_modules", None) or [])
        min_params = self.options.get("min_num_params")
        if names:
            found = [m for m in model.modules() if m is not model and type(m).__name__ in set(names)]
            if not found:
                raise ValueError(f"distributed.fsdp.wrap_classes: no submodule of {type(model).__name__} is a "
                                 f"{' or '.join(names)}")
            return list(reversed(found))
        if not min_params:
            return []
        blocks, covered = [], set()
        for module in _post_order(model):
            if module is model:
                continue
            own = [p for p in module.parameters() if id(p) not in covered]
            if sum(p.numel() for p in own) >= int(min_params):
                blocks.append(module)
                covered.update(id(p) for p in own)
        return blocks

    def _mixed_precision(self) -> dict | None:
        mp = self.options.get("mixed_precision")
        if mp is None and self.args.bf16:
            mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
        if mp is None or mp is False:
            return None
        if isinstance(mp, str):
            mp = {"param_dtype": mp, "reduce_dtype": "float32"}
        out = {}
        for key in ("param_dtype", "reduce_dtype"):
            if mp.get(key) is not None:
                if mp[key] not in _DTYPES:
                    raise ValueError(f"distributed.fsdp.mixed_precision.{key}: one of {sorted(_DTYPES)}, got {mp[key]!r}")
                out[key] = _DTYPES[mp[key]]
        return out

    def unwrap(self, model):
        return getattr(model, "_orig_mod", model)

    @contextlib.contextmanager
    def full_parameters(self):
        """FSDP2's unshard: each FSDP module's parameters all-gathered once (in the same order on every rank) and
        kept through every forward inside (no reshard after forward), resharded at the end."""
        from torch.distributed.fsdp import FSDPModule

        root = self.unwrap(self.model)
        if self.dims.shards == 1 or not isinstance(root, FSDPModule):
            yield
            return
        root.set_reshard_after_forward(False)
        modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.unshard()
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
            root.set_reshard_after_forward(bool(self.options.get("reshard_after_forward", self.dims.pp == 1)))
            root.set_reshard_after_forward(False, recurse=False)  # torch's rule for the root (gathered for backward)

    # -- the step
    def no_sync(self):
        if self.dims.shards == 1 or self.pipeline is not None:  # a pipeline step reduces its own gradients
            return contextlib.nullcontext()
        return _requires_gradient_sync(self.unwrap(self.model), False)

    def clip_grad_norm(self, max_norm):
        if self.dims.tp > 1 or self.pipeline is not None:  # DTensors on two meshes (dp x tp, dp); stages apart
            uncounted = set()
            if self.pipeline is not None:
                self.pipeline.sync_tied()
                uncounted = self.pipeline.uncounted()
            return tensor_parallel.clip_grad_norm([p for p in self.model.parameters() if p.grad is not None],
                                                  max_norm, self._pp_group, self.device, uncounted)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(total, "full_tensor"):  # a DTensor: the norm of this rank's shards, reduced to all
            total = total.full_tensor()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_([p for p in self.model.parameters() if p.grad is not None],
                                                 max_norm, total, foreach=True)
        return total

    # -- collectives: sums over the data-parallel group (a TP group's ranks hold the same values)
    def all_reduce(self, tensor, op: str = "sum"):
        import torch.distributed as dist

        if self._dp_group is None or op not in ("sum", "mean"):
            return super().all_reduce(tensor, op)
        out = torch.as_tensor(tensor).to(self.device, copy=True)
        dist.all_reduce(out, dist.ReduceOp.SUM, group=self._dp_group)
        return out / self.dp_size if op == "mean" else out

    def reduce_loss(self, tensor):
        """Under PP the last stage's ranks hold the loss (the others zero): summed over every stage."""
        import torch.distributed as dist

        if self.dims.cp > 1:  # each rank of a context group holds its tokens' share
            return TorchDistributedMixin.all_reduce(self, tensor)
        if self.pipeline is None:
            return self.all_reduce(tensor)
        out = torch.as_tensor(tensor).to(self.device, copy=True)
        dist.all_reduce(out, dist.ReduceOp.SUM, group=self._loss_group)
        return out

    def data_parallel_view(self, per_rank: list) -> list:
        """One item per data-parallel rank: a TP group's first rank's, of the last pipeline stage."""
        last = self.dims.pp - 1
        return [x for r, x in enumerate(per_rank) if self.dims.tp_rank(r) == 0 and self.dims.pp_rank(r) == last]

    # -- state for checkpoints
    def model_state_dict(self, all_ranks: bool = False, trainable_only: bool = False):
        """Gathered from the shards; on CPU and on rank 0 only unless `all_ranks`. A collective."""
        if self.pipeline is not None:
            return self._gather_stages(all_ranks, trainable_only)
        options = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(self.unwrap(self.model), options=options)
        if not state:
            return None
        return {k: v.detach().cpu() for k, v in state.items()}

    def _gather_stages(self, all_ranks: bool, trainable_only: bool):
        """Each stage's full weights (gathered within it), then every stage's on rank 0 (or on all)."""
        import torch.distributed as dist

        self.pipeline.reshard()
        options = StateDictOptions(full_state_dict=True, cpu_offload=False, ignore_frozen_params=trainable_only)
        state = get_model_state_dict(self.unwrap(self.model), options=options)
        leader = self.dims.dp_rank(self.rank) == 0 and self.dims.tp_rank(self.rank) == 0
        mine = {k: v.detach().cpu() for k, v in state.items()} if leader else None
        if all_ranks:
            parts = self.all_gather_object(mine)
        else:
            parts = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
        if parts is None:
            return None
        return self.pipeline.tied_state({k: v for part in parts if part for k, v in part.items()})

    def load_model_state_dict(self, state, strict: bool = True):
        model = self.unwrap(self.model)
        if self.pipeline is not None:  # the whole model's weights: this rank's stages take theirs
            own = set(model.state_dict())
            state = {k: v for k, v in state.items() if k in own}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def optimizer_state_dict(self):
        return None  # saved sharded, by save_sharded

    def load_optimizer_state(self, state):
        super().load_optimizer_state(state)
        if self.dims.tp > 1:  # the saved param groups bring back their fused / foreach flags
            tensor_parallel.unfuse_mixed_groups(self.optimizer)

    def load_optimizer_state_dict(self, state):
        """A full torch optimizer state_dict (optimizer.pt of a DDP or single-process run), re-sharded."""
        model = self.unwrap(self.model)
        if self.pipeline is not None:
            from .pipeline import stage_optimizer_state

            state = stage_optimizer_state(self.pipeline.whole_groups, {n for n, _ in model.named_parameters()}, state)
        else:
            state = _by_name(model, self.optimizer, state)
        set_optimizer_state_dict(model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))

    @property
    def has_sharded_state(self) -> bool:
        return True

    def save_sharded(self, directory: str, process_group=None):
        """The optimizer state into dcp/ (torch.distributed.checkpoint). With `process_group` (a background
        save's side channel): copied to host memory now (training may change it right after), written by
        DCP's thread with its collectives on that group; the future is done once the files are fsynced."""
        import torch.distributed.checkpoint as dcp

        # a pipeline's stages hold different parameter groups: saved flattened, one entry per parameter name
        options = StateDictOptions(flatten_optimizer_state_dict=self.pipeline is not None)
        state = {"optimizer": get_optimizer_state_dict(self.unwrap(self.model), self.optimizer, options=options)}
        path = os.path.join(directory, DCP_DIR)
        if process_group is None:
            dcp.save(state, checkpoint_id=path)
            return None
        writer = dcp.FileSystemWriter(path, sync_files=True)  # fsynced before the future is done (the default)
        return dcp.async_save(state, storage_writer=writer, process_group=process_group, async_stager=self._stager())

    def _stager(self):
        """DCP's host copy, synchronous, its buffers kept for the next save (the writer saves one at a
        time, so the previous write is done with them); pinned from a GPU."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._dcp_stager is None:
            self._dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=self.device.type == "cuda",
                                                            use_shared_memory=False, use_async_staging=False,
                                                            use_non_blocking_copy=False))
        return self._dcp_stager


def _post_order(module: torch.nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


@contextlib.contextmanager
def _requires_gradient_sync(model, flag: bool):
    model.set_requires_gradient_sync(flag)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _checkpoint_forward(module: torch.nn.Module) -> None:
    """Recompute `module`'s activations in backward; names in the state dict stay unchanged (unlike a
    wrapper module). FSDP's hooks sit around the call, so recomputation sees gathered parameters."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def _by_name(model, optimizer, state: dict) -> dict:
    """A torch optimizer state_dict keyed by parameter index -> keyed by parameter name, the form
    set_optimizer_state_dict takes. Indices follow the order of the optimizer's param groups, which
    create_optimizer builds the same way for every backend."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in state["param_groups"] for i in g["params"]]
    if len(saved_ids) != len(order):
        raise ValueError(f"optimizer.pt has {len(saved_ids)} parameters, this model {len(order)}")
    to_name = dict(zip(saved_ids, order))
    return {"state": {to_name[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [to_name[i] for i in g["params"]]} for g in state["param_groups"]]}
