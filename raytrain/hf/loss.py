"""HF 5.23's loss, as a mixin of trainer.Trainer: compute_loss returns what HF's returns (num_items_in_batch passed
to every forward HF passes it to, `model_accepts_loss_kwargs`; the process count factor where HF applies it; a MoE
model's router loss as its forward adds it), training_step scales and backpropagates it as HF does. One difference,
on purpose: a loss that is a mean over its micro-batch (a model that takes no loss keywords) is weighted by the
micro-batch's share of the step's loss items, where HF divides it by the accumulation steps; so accumulated
micro-batches and ranks equal one large batch exactly."""

from __future__ import annotations

import torch

from . import objects as hf
from ..strategies.base import unwrap_model


def clear_device_cache() -> None:
    """HF's (accelerate's clear_device_cache, without its garbage collection)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class LossMethods:
    """The Trainer provides args, model, accelerator, label_smoother, compute_loss_func, get_strategy and
    SequenceMethods' _sequence_step and _label_shift."""

    #: HF's: whether compute_loss's value is already scaled for gradient accumulation (None: HF's rule).
    loss_is_scaled_for_ga: bool | None = None

    #: HF's: the micro-batches of the step being trained (the loop sets it; fewer in an epoch's last step).
    current_gradient_accumulation_steps: int = 1
    #: HF's: the model's own accepts_loss_kwargs, else whether its forward takes **kwargs (then it gets
    #: num_items_in_batch); Trainer.__init__ sets it, a script may change it (HF's tests turn it off).
    model_accepts_loss_kwargs: bool = False

    # ------------------------------------------------------------ HF's decisions
    def loss_needs_num_items(self) -> bool:
        """HF counts num_items_in_batch for every step (one micro-batch on one rank too) when compute_loss passes
        it on: to a model taking loss keywords, or to compute_loss_func."""
        return self.compute_loss_func is not None or self.model_accepts_loss_kwargs

    def get_tp_size(self) -> int:
        """HF's: ranks that see the same batch (tensor parallelism): the model's, accelerate's or the mesh's."""
        tp = getattr(unwrap_model(self.model), "_tp_size", None)
        if tp is None:
            pc = getattr(self.accelerator, "parallelism_config", None)
            tp = pc.tp_size if pc is not None else (self.args.parallelism_config or {}).get("tp_size", 1)
        return int(tp)

    def _loss_scale(self, num_items_in_batch) -> int:
        """HF's factor: with num_items_in_batch counted over every rank, the loss is scaled by the processes that
        DDP's gradient mean divides by (accelerator.num_processes // tp size)."""
        if num_items_in_batch is None or not self.args.average_tokens_across_devices or not (
                self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return 1
        return self.accelerator.num_processes // self.get_tp_size()

    def _scaled_for_ga(self, num_items_in_batch) -> bool:
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    # ------------------------------------------------------------ HF's overridable maths
    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """HF's compute_loss: the model's loss (num_items_in_batch passed when it takes loss keywords; a MoE model
        adds router_aux_loss_coef x its router loss itself), compute_loss_func's, or label smoothing's, x HF's
        process count factor."""
        labels = None
        if (self.label_smoother is not None or self.compute_loss_func is not None) and "labels" in inputs:
            labels = inputs["labels"]
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if self.compute_loss_func is not None:
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif labels is not None:
            loss = self.label_smoother(outputs, labels, shift_labels=self._label_shift(model, inputs),
                                       num_items_in_batch=num_items_in_batch)
        else:
            loss = hf.loss_of(outputs)
        scale = self._loss_scale(num_items_in_batch)
        if scale != 1:
            loss = loss * scale
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Forward and backward for one micro-batch, as HF's: compute_loss (given num_items_in_batch where HF
        counts it), then a mean loss scaled for accumulation (above); returns the detached loss, no host sync."""
        strategy = self._strategy
        if strategy.pipeline is not None:  # pp_size > 1: through this rank's stages (hf/pipeline.py)
            return self._pipeline_training_step(model, inputs, num_items_in_batch,
                                                type(self).compute_loss is not LossMethods.compute_loss)
        if not model.training:  # model.train() walks every module: only after an evaluation
            model.train()
        optimizer = self.optimizer
        if hasattr(optimizer, "train"):  # schedule-free: the weights it trains, not those it evaluates (as HF)
            optimizer.train()
        given = num_items_in_batch if self.loss_needs_num_items() else None  # HF passes what it counts
        with self._sequence_step(model, inputs):  # sp_size / cp_size: the sequence split (hf/sequence.py)
            with strategy.autocast():
                loss = self.compute_loss(model, inputs, num_items_in_batch=given)
            if self.args.torch_empty_cache_steps is not None and \
                    self.state.global_step % self.args.torch_empty_cache_steps == 0:
                clear_device_cache()
            if not self._scaled_for_ga(given):
                loss = self._mean_share(loss, inputs, num_items_in_batch)
            if hasattr(optimizer, "fused_backward"):  # LOMO updates the weights in its backward, at the current rate
                from ..optim.optimizers import get_lr

                optimizer.fused_backward(loss, get_lr(optimizer))
            else:
                strategy.backward(loss)
        return loss.detach()

    def _mean_share(self, loss: torch.Tensor, inputs: dict, num_items_in_batch) -> torch.Tensor:
        """A micro-batch's mean loss as its share of the step's (x the ranks DDP's mean divides by, when the count
        is over every rank); HF's loss / accumulation steps where the items cannot be counted."""
        count = self.count_loss_items(inputs) if num_items_in_batch is not None else None
        if count is None:
            steps = self.current_gradient_accumulation_steps
            return loss / steps if steps != 1 else loss
        ranks = self._strategy.gradient_scale if self.args.average_tokens_across_devices else 1  # sp: its ranks too
        return loss * (count * ranks / num_items_in_batch)

    def count_loss_items(self, inputs: dict):
        """The loss items of a batch as HF counts them (a tensor): shift_labels, else labels (over labels[..., 1:]
        where the model's loss shifts them), other than -100; None without labels."""
        labels = inputs.get("shift_labels")
        if labels is None:
            labels = inputs.get("labels")
            if not isinstance(labels, torch.Tensor):
                return None
            if labels.dim() > 1 and self._shifts_labels():
                labels = labels[..., 1:]
        return labels.ne(-100).sum()

    def _shifts_labels(self) -> bool:
        if "_loss_shifts" not in self.__dict__:  # asked every micro-batch
            self.__dict__["_loss_shifts"] = hf.loss_shifts_labels(self.model)
        return self.__dict__["_loss_shifts"]

    def _eval_num_items(self, inputs: dict):
        """num_items_in_batch for one evaluation batch, where HF counts one (gathered over the ranks there): this
        rank's items x HF's factor, so that compute_loss returns the batch's mean over its own items."""
        if "labels" not in inputs or not self.loss_needs_num_items():
            return None
        count = self.count_loss_items(inputs)
        return count * self._loss_scale(count) if count is not None else None
