"""The Strategy interface: everything that differs between backends, and nothing else.

The loop calls only these methods, so single-process, DDP, FSDP2 and DeepSpeed runs share one loop.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch


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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- set-up
    def setup(self, model: torch.nn.Module, optimizer_factory: Callable[[torch.nn.Module], torch.optim.Optimizer],
              optimizer: torch.optim.Optimizer | None = None):
        """Move/wrap the model, build the optimizer over the final parameters; return both."""
        raise NotImplementedError

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        model = getattr(model, "module", model)
        return getattr(model, "_orig_mod", model)

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
        if not bool(torch.isfinite(grad_norm)):
            return False
        self.optimizer.step()
        return True

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- collectives (identity in one process)
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    # -- state for checkpoints
    def model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full, consolidated weights on CPU (rank 0; other ranks may get None)."""
        return {k: v.detach().cpu() for k, v in self.unwrap(self.model).state_dict().items()}

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.unwrap(self.model).load_state_dict(state)

    def optimizer_state_dict(self) -> dict | None:
        """What goes in optimizer.pt (rank 0); None when the backend saves it sharded instead."""
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def save_sharded(self, directory: str) -> None:
        """Backend-sharded state (DCP, DeepSpeed engine); nothing for replicated backends."""

    def load_sharded(self, directory: str) -> None:
        pass

    @property
    def has_sharded_state(self) -> bool:
        return False

    def teardown(self) -> None:
        pass
