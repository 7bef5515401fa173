"""One process on CPU or one GPU."""

from __future__ import annotations

import torch

from .base import Strategy


class SingleProcessStrategy(Strategy):
    name = "single"

    def __init__(self, args):
        super().__init__(args)
        use_cuda = torch.cuda.is_available() and not args.use_cpu and (args.scaling.use_gpu or args.scaling.num_workers == 1)
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        if args.fp16:
            self.scaler = torch.amp.GradScaler(self.device.type)

    def setup(self, model, optimizer_factory, optimizer=None):
        model, self.optimizer = self._place(model, optimizer_factory, optimizer)
        self.model = model
        if self.args.torch_compile:
            options = {k: v for k, v in (("backend", self.args.torch_compile_backend),
                                         ("mode", self.args.torch_compile_mode)) if v}
            self.model = torch.compile(model, **options)
        return self.model, self.optimizer

