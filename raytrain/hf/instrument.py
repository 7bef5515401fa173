"""What HF's Trainer does to the model when training starts, by transformers' own code: Liger's kernels
(use_liger_kernel; refused in one line where they cannot run) and debug="underflow_overflow" (transformers'
DebugUnderflowOverflow: forward hooks that report the first inf / nan and stop the run)."""

from __future__ import annotations

import importlib.util
from typing import Any


def check_liger(args: Any) -> None:
    """use_liger_kernel: refused before any work where Liger's Triton kernels cannot run (HF's Trainer would fail in
    train(), or its kernels need a GPU)."""
    if not args.use_liger_kernel:
        return
    if importlib.util.find_spec("liger_kernel") is None:
        raise ValueError("use_liger_kernel: liger-kernel is not installed (pip install liger-kernel; its Triton "
                         "kernels need a GPU); leave it false")
    import torch

    if args.use_cpu or not (torch.cuda.is_available() or args.scaling.use_gpu):
        raise ValueError("use_liger_kernel: Liger's Triton kernels need a GPU (none here, and scaling.use_gpu is "
                         "false); leave it false")


def apply_liger(model: Any, args: Any) -> None:
    """HF's train(): transformers' apply_liger_kernel patches the model with liger_kernel_config's kernels."""
    if args.use_liger_kernel:
        check_liger(args)
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, args.liger_kernel_config)


def watch_underflow_overflow(model: Any, debug: list) -> None:
    """HF's train() with debug underflow_overflow: transformers' DebugUnderflowOverflow on the model (its hooks
    stay, as HF leaves them)."""
    if any(getattr(d, "value", d) == "underflow_overflow" for d in debug or []):
        from transformers.debug_utils import DebugUnderflowOverflow

        DebugUnderflowOverflow(model)
