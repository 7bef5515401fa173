"""One process on CPU or one GPU."""

from __future__ import annotations

import torch

from .base import Strategy


class SingleProcessStrategy(Strategy):
    name = "single"

    def __init__(self, args):
        super().__init__(args)
        use_cuda = torch.cuda.is_available() and (args.scaling.use_gpu or args.scaling.num_workers == 1)
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if args.fp16:
            self.scaler = torch.amp.GradScaler(self.device.type)

    def setup(self, model, optimizer_factory, optimizer=None):
        model = model.to(self.device)
        if self.args.gradient_checkpointing:
            _enable_gradient_checkpointing(model)
        self.model = model
        self.optimizer = optimizer if optimizer is not None else optimizer_factory(model)
        if self.args.torch_compile:
            self.model = torch.compile(model)
        return self.model, self.optimizer


def _enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError("gradient_checkpointing: the model has no gradient_checkpointing_enable() "
                         "method; add one or set gradient_checkpointing: false")
    enable()
