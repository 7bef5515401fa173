"""DistributedDataParallel: a full replica per rank, gradients all-reduced (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from .base import Strategy, TorchDistributedMixin


class DDPStrategy(TorchDistributedMixin, Strategy):
    """torch.distributed is already initialised (Ray Train's TorchTrainer or torchrun) when this is built."""

    name = "ddp"
    averages_gradients = True  # DDP divides the summed gradients by world size

    def __init__(self, args):
        super().__init__(args)
        self._init_distributed(args)
        if args.fp16:
            self.scaler = torch.amp.GradScaler(self.device.type)

    def setup(self, model, optimizer_factory, optimizer=None):
        model, self.optimizer = self._place(model, optimizer_factory, optimizer)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs(self.args))
        self.model = torch.compile(wrapped) if self.args.torch_compile else wrapped
        return self.model, self.optimizer

    def unwrap(self, model):
        model = getattr(model, "_orig_mod", model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_sync(self):
        """Skip the gradient all-reduce on accumulation micro-steps; the last one reduces them all."""
        ddp = getattr(self.model, "_orig_mod", self.model)
        return ddp.no_sync()

    def model_state_dict(self, all_ranks: bool = False, trainable_only: bool = False):
        """Every replica holds the same weights: rank 0 copies its own (others only when asked)."""
        if not (self.is_main or all_ranks):
            return None
        return super().model_state_dict(trainable_only=trainable_only)

    def optimizer_state_dict(self):
        return self.optimizer.state_dict() if self.is_main else None


def ddp_kwargs(args) -> dict:
    """HF's ddp_* arguments that are set, as DistributedDataParallel's keywords (unset: torch's defaults)."""
    given = {"find_unused_parameters": args.ddp_find_unused_parameters, "bucket_cap_mb": args.ddp_bucket_cap_mb,
             "broadcast_buffers": args.ddp_broadcast_buffers, "static_graph": args.ddp_static_graph}
    return {k: v for k, v in given.items() if v is not None}
