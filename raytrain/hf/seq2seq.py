"""HF's Seq2SeqTrainer methods, mixed into raytrain's Trainer as raytrain.Seq2SeqTrainer. With predict_with_generate, evaluate() and
predict() run the model's generate() (args' generation_max_length / generation_num_beams, or **gen_kwargs)
and hand compute_metrics the generated token ids, padded as HF pads them."""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..strategies.base import unwrap_model

if TYPE_CHECKING:
    from ..callbacks.state import PredictionOutput

class Seq2SeqMethods:
    """transformers' Seq2SeqTrainer over a Trainer: the same arguments as Trainer; args is best a Seq2SeqTrainingArguments
    (a plain TrainingArguments means no generation, as in HF)."""

    def __init__(self, model: torch.nn.Module | None = None, args: Any = None,
                 data_collator: Callable | None = None, train_dataset=None, eval_dataset=None,
                 processing_class: Any = None, model_init: Callable | None = None,
                 compute_loss_func: Callable | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers=(None, None),
                 optimizer_cls_and_kwargs: tuple[type, dict] | None = None,
                 preprocess_logits_for_metrics: Callable | None = None):
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, model_init,
                         compute_loss_func, compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics)
        self._apply_generation_config()

    def _apply_generation_config(self) -> None:
        # As HF: args.generation_config > the model's generation_config > generate()'s defaults.
        if getattr(self.args, "generation_config", None) is not None:
            self.model.generation_config = self.load_generation_config(self.args.generation_config)

    @staticmethod
    def load_generation_config(gen_config_arg: Any):
        """A GenerationConfig from a GenerationConfig (copied), a mapping of its fields, a file or directory
        written by save_pretrained, or a model id; strictly validated, as HF's load_generation_config."""
        from transformers import GenerationConfig

        if isinstance(gen_config_arg, GenerationConfig):
            config = copy.deepcopy(gen_config_arg)
        elif isinstance(gen_config_arg, dict):
            config = GenerationConfig.from_dict(dict(gen_config_arg))
        else:
            path, name = os.fspath(gen_config_arg), None
            if os.path.isfile(path):
                path, name = os.path.dirname(path) or ".", os.path.basename(path)
            config = GenerationConfig.from_pretrained(path, name)
        try:
            config.validate(strict=True)  # as HF: save_pretrained at the end would fail on these
        except ValueError as e:
            raise ValueError(f"generation_config: {' '.join(str(e).split())}") from None
        return config

    def hp_search_setup(self, *args: Any, **kwargs: Any) -> None:
        super().hp_search_setup(*args, **kwargs)
        self._apply_generation_config()  # the trial's model gets the arguments' generation config too

    def _set_gen_kwargs(self, gen_kwargs: dict) -> None:
        # As HF: the arguments' generation_max_length / generation_num_beams unless given to the call.
        gen_kwargs = dict(gen_kwargs)
        max_length = getattr(self.args, "generation_max_length", None)
        num_beams = getattr(self.args, "generation_num_beams", None)
        if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None and max_length is not None:
            gen_kwargs["max_length"] = max_length
        if gen_kwargs.get("num_beams") is None and num_beams is not None:
            gen_kwargs["num_beams"] = num_beams
        self._gen_kwargs = gen_kwargs

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval",
                 **gen_kwargs: Any) -> dict[str, float]:
        """Trainer.evaluate; with predict_with_generate, `gen_kwargs` (max_length, max_new_tokens, num_beams,
        any of generate()'s) go to generate()."""
        self._set_gen_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                **gen_kwargs: Any) -> PredictionOutput:
        """Trainer.predict; with predict_with_generate the predictions are generated token ids."""
        self._set_gen_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None,
                        **gen_kwargs: Any):
        """(loss, generated tokens, labels) with predict_with_generate, both padded to the generation config's
        max_length with the pad id, as HF; Trainer's prediction_step otherwise."""
        if not getattr(self.args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only=prediction_loss_only,
                                           ignore_keys=ignore_keys)
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)
        if not gen_kwargs:
            gen_kwargs = dict(getattr(self, "_gen_kwargs", {}))
        for key in ("num_beams", "max_length"):
            if key in gen_kwargs and gen_kwargs[key] is None:
                gen_kwargs.pop(key)
        generator = unwrap_model(model)
        if not callable(getattr(generator, "generate", None)):
            raise TypeError(f"predict_with_generate needs a model with generate() (a transformers generation "
                            f"model), got {type(generator).__name__}")
        strategy = self.get_strategy()
        # Every rank runs the same number of forward passes when parameters are sharded (HF's default).
        sharded = strategy.name == "fsdp" or (strategy.name == "deepspeed" and getattr(strategy, "stage", 0) == 3)
        gen_kwargs.setdefault("synced_gpus", sharded)
        generation_inputs = inputs
        if "labels" in inputs and "decoder_input_ids" in inputs and \
                inputs["labels"].shape == inputs["decoder_input_ids"].shape:
            # decoder_input_ids made from the labels: generate from the start instead of continuing them.
            generation_inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
        with torch.no_grad(), strategy.autocast():
            generated = generator.generate(**generation_inputs, **gen_kwargs)
        gen_config = generator.generation_config
        if gen_config._from_model_config:  # HF's: the config is not rebuilt from the model's every batch
            gen_config._from_model_config = False
        gen_config.update(**gen_config._get_default_generation_params(), defaults_only=True)
        generated = self._pad_to_generation_length(generated, gen_config)
        loss = None
        if has_labels:
            loss, _, _ = super().prediction_step(model, inputs, prediction_loss_only=True, ignore_keys=ignore_keys)
        if self.args.prediction_loss_only:
            return loss, None, None
        labels = self._pad_to_generation_length(inputs["labels"], gen_config) if has_labels else None
        return loss, generated, labels

    def _pad_to_generation_length(self, tensor: torch.Tensor, gen_config) -> torch.Tensor:
        """Shorter than the generation config's max_length (or max_new_tokens + 1): padded to it, as HF."""
        if tensor.shape[-1] < gen_config.max_length:
            return self._pad_tensors_to_max_len(tensor, gen_config.max_length)
        if gen_config.max_new_tokens is not None and tensor.shape[-1] < gen_config.max_new_tokens + 1:
            return self._pad_tensors_to_max_len(tensor, gen_config.max_new_tokens + 1)
        return tensor

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        """Right-padded with the tokenizer's pad id (its eos id if it has none), else the model config's."""
        tok = self.processing_class
        if tok is not None and hasattr(tok, "pad_token_id"):
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        elif getattr(getattr(self.model, "config", None), "pad_token_id", None) is not None:
            pad = self.model.config.pad_token_id
        else:
            raise ValueError("predict_with_generate: set pad_token_id in the model's config (or pass a tokenizer "
                             "as processing_class) to pad the generated tokens")
        padded = torch.full((tensor.shape[0], max_length), pad, dtype=tensor.dtype, device=tensor.device)
        padded[:, : tensor.shape[-1]] = tensor
        return padded

