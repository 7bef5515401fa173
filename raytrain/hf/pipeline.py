"""The Trainer's steps under pipeline parallelism (pp_size > 1), a mixin of trainer.Trainer: the batch goes
through the rank's stages (strategies/pipeline.py) and the loss is computed on the last stage from each
microbatch's logits, with HF's meaning: the sum over the label tokens divided by the items of the whole
update step (all microbatches, accumulation steps and data-parallel ranks), so the logged loss and the
gradients are one process's. The model's own loss_function, compute_loss_func or the label smoother
compute it, as compute_loss would."""

from __future__ import annotations

from typing import Any

import torch

from . import objects as hf
from ..strategies.base import unwrap_model

_LABELS = ("labels", "shift_labels")


class _Outputs(dict):
    """The last stage's outputs for compute_loss_func: a ModelOutput's key and attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class PipelineMethods:
    """training_step / prediction_step's pipelined path; the Trainer provides args, model, label_smoother,
    compute_loss_func, count_loss_items and get_strategy."""

    def _pipeline_training_step(self, model, inputs: dict, num_items_in_batch=None,
                                own_compute_loss: bool = False) -> torch.Tensor:
        strategy = self.get_strategy()
        if own_compute_loss:
            raise ValueError(f"parallelism_config.pp_size: {type(self).__name__} overrides compute_loss, which "
                             "pipeline stages cannot run (the loss is computed on the last stage from its logits); "
                             "pass compute_loss_func instead, or pp_size 1")
        if inputs.get("labels") is None:
            raise ValueError("parallelism_config.pp_size: training under pipeline parallelism needs the batch's "
                             "labels (the last stage computes the loss from them)")
        if not model.training:
            model.train()
        across = self.args.average_tokens_across_devices  # else each rank's loss over its own items, as HF
        if num_items_in_batch is None:
            count = self.count_loss_items(inputs)
            num_items_in_batch = strategy.all_reduce(count) if across else count
        scale = strategy.gradient_scale if across else 1  # the reduce-scatter averages
        loss = self._pipeline_loss(num_items_in_batch, scale)
        with strategy.autocast():
            losses, _ = strategy.pipeline.run(inputs, self._main_input(), inputs["labels"], loss, train=True)
        if not losses:
            return torch.zeros((), device=strategy.device)
        return torch.stack(losses).sum().detach()  # HF's value: the step's share x the data-parallel ranks

    def _pipeline_prediction_step(self, model, inputs: dict, prediction_loss_only: bool):
        """(loss, logits, labels) on the last stage (the loss the batch's mean over its items), (None, None,
        None) on the others: evaluation gathers the last stage's."""
        strategy = self.get_strategy()
        labels = inputs.get("labels")
        loss = self._pipeline_loss(self.count_loss_items(inputs), 1) if labels is not None else None
        with torch.no_grad(), strategy.autocast():
            losses, logits = strategy.pipeline.run(inputs, self._main_input(), labels, loss, train=False)
        if not strategy.pipeline.has_last:
            return None, None, None
        total = torch.stack(losses).sum().detach() if losses else None
        return total, None if prediction_loss_only else logits, labels

    def _check_pipeline(self) -> None:
        """pp_size > 1: the model splits into the layout's stages; a one-line ValueError before any worker starts."""
        config = self.args.parallelism_config or {}
        if config.get("pp_size", 1) > 1:
            from ..strategies.mesh import ParallelDims
            from ..strategies.pipeline import check

            check(self.model, ParallelDims.resolve(config, self.args.scaling.num_workers))

    def _main_input(self) -> str:
        return getattr(unwrap_model(self.model), "main_input_name", "input_ids")

    def _pipeline_loss(self, num_items: Any, scale: int):
        """The loss of one microbatch's logits: its share of the step's (sum over its items / num_items) x `scale`
        (the data-parallel ranks whose gradients are averaged)."""
        inner = unwrap_model(self.model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        config = getattr(inner, "config", None)

        def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if self.compute_loss_func is not None:
                value = self.compute_loss_func(_Outputs(logits=logits), labels, num_items_in_batch=num_items)
            elif self.label_smoother is not None:
                value = self.label_smoother({"logits": logits}, labels, shift_labels=hf.is_causal_lm(inner),
                                            num_items_in_batch=num_items)
            else:
                value = inner.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size,
                                            num_items_in_batch=num_items)
            return value * scale if scale != 1 else value

        return loss

