"""TRL's SFTTrainer as a mixin over raytrain's Trainer: TRL's own dataset preparation, collator, fused-LM-head loss
and metrics (taken from the installed trl, not rewritten); only what calls transformers' Trainer is glue here."""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin, set_seed
from trl import SFTTrainer as _TRL
from trl.chat_template_utils import (clone_chat_template, get_training_chat_template, has_generation_markers,
                                     is_chat_template_stop_token_trained)
from trl.data_utils import is_conversational
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
from trl.trainer.utils import add_fused_lm_head, create_model_from_path

from .common import TRLMethods, as_config, check_unsupported, from_path_kwargs, setup_peft


class SFTMethods(TRLMethods):
    """TRL 1.16's SFTTrainer arguments and behaviour; `config_class` (the facade's SFTConfig) converts plain args."""

    config_class: type
    _tag_names = ["trl", "sft"]

    def __init__(self, model: Any, args: Any = None, data_collator: Callable | None = None, train_dataset=None,
                 eval_dataset=None, processing_class: Any = None, compute_loss_func: Callable | None = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None, optimizers=(None, None),
                 optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics: Callable | None = None,
                 quantization_config: Any = None, peft_config: Any = None,
                 formatting_func: Callable[[dict], str] | None = None):
        args = as_config(self.config_class, args, model, "SFT")
        check_unsupported(args)
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        set_seed(args.seed)  # as TRL: before the model and PEFT's random adapter weights
        model = self._load_model(model, args, quantization_config)
        if processing_class is None:
            from transformers import AutoProcessor
            processing_class = AutoProcessor.from_pretrained(model.config._name_or_path)
        if isinstance(processing_class, ProcessorMixin):
            raise ValueError("processing_class: vision-language processors are not supported by raytrain.trl; "
                             "pass a tokenizer")
        if not isinstance(processing_class, PreTrainedTokenizerBase):
            raise TypeError("processing_class: expected a PreTrainedTokenizerBase")
        self._tokenizer, self._is_vlm, self._is_vision_dataset = processing_class, False, False
        if args.eos_token is not None:
            if args.eos_token not in processing_class.get_vocab():
                raise ValueError(f"eos_token: {args.eos_token!r} is not in the tokenizer's vocabulary")
            processing_class.eos_token = args.eos_token
            model.config.get_text_config().eos_token_id = processing_class.eos_token_id
            gen = getattr(model, "generation_config", None)
            if gen is not None:  # as TRL: the new eos stops generation too, beside the old ones
                ids = [] if gen.eos_token_id is None else [gen.eos_token_id] if isinstance(gen.eos_token_id, int) \
                    else list(gen.eos_token_id)
                if processing_class.eos_token_id not in ids:
                    gen.eos_token_id = [processing_class.eos_token_id, *ids]
        added_tokens = []
        if args.chat_template_path is not None:
            path = args.chat_template_path
            if path.endswith((".jinja", ".j2")):
                with open(path, encoding="utf-8") as f:
                    processing_class.chat_template = f.read()
            else:
                model, processing_class, added_tokens = clone_chat_template(model, processing_class, path)
        sample = next(iter(train_dataset))
        if "image" in sample or "images" in sample:
            raise ValueError("train_dataset: image columns (vision datasets) are not supported by raytrain.trl")
        model = setup_peft(model, peft_config, args, added_tokens)
        self.padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})
        if self.padding_free and data_collator is not None:
            raise ValueError("data_collator: a custom collator is not supported with padding_free (or bfd packing)")
        if args.assistant_only_loss and not is_conversational(sample):
            raise ValueError("assistant_only_loss: the dataset is not conversational (no 'messages' or "
                             "'prompt'/'completion' lists of turns)")
        use_training_template = args.assistant_only_loss and not has_generation_markers(processing_class.chat_template)
        self.chat_template = get_training_chat_template(processing_class) if use_training_template else None
        if args.assistant_only_loss and not is_chat_template_stop_token_trained(
                processing_class, chat_template=self.chat_template):
            warnings.warn("the chat template leaves the assistant's end-of-turn token out of the loss mask: the "
                          "model may not learn to stop", stacklevel=2)
        self.completion_only_loss = (("prompt" in sample and "completion" in sample)
                                     if args.completion_only_loss is None else args.completion_only_loss)
        if data_collator is None:
            pad_token = args.pad_token or processing_class.pad_token or processing_class.eos_token
            if pad_token not in processing_class.get_vocab():
                raise ValueError(f"pad_token: {pad_token!r} is not in the tokenizer's vocabulary")
            processing_class.pad_token = pad_token
            model.config.get_text_config().pad_token_id = processing_class.pad_token_id
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.pad_token_id = processing_class.pad_token_id
            data_collator = DataCollatorForLanguageModeling(pad_token_id=processing_class.pad_token_id,
                                                            padding_free=self.padding_free,
                                                            pad_to_multiple_of=args.pad_to_multiple_of)
        if self.padding_free and not args.packing and args.max_length is not None:
            raise ValueError("padding_free: without packing max_length is not enforced; enable packing "
                             "(packing_strategy 'bfd') or set max_length=None")
        self._skip_prepare_dataset = bool(args.dataset_kwargs and args.dataset_kwargs.get("skip_prepare_dataset"))
        self._formatting_func = formatting_func
        if not self._skip_prepare_dataset:
            if self.completion_only_loss and formatting_func:
                raise ValueError("formatting_func: not compatible with completion_only_loss=True")
            train_dataset = self._prepare_dataset(train_dataset, processing_class, args, args.packing,
                                                  formatting_func, "train")
            if eval_dataset is not None:
                packing = args.packing if args.eval_packing is None else args.eval_packing
                if isinstance(eval_dataset, dict):
                    eval_dataset = {k: self._prepare_dataset(d, processing_class, args, packing, formatting_func, k)
                                    for k, d in eval_dataset.items()}
                else:
                    eval_dataset = self._prepare_dataset(eval_dataset, processing_class, args, packing,
                                                         formatting_func, "eval")
        if args.label_smoothing_factor > 0:
            raise ValueError("label_smoothing_factor: not supported by raytrain.trl's SFTTrainer (deprecated in TRL "
                             "1.16: it needs the full logits)")
        if args.loss_type not in ("nll", "dft"):
            raise ValueError(f"loss_type: {args.loss_type!r} is not one of 'nll', 'dft'")
        if args.loss_type == "dft" and compute_loss_func is not None:
            raise ValueError("compute_loss_func: not allowed with loss_type='dft'")
        if _peft_on_lm_head(model):
            raise ValueError("peft_config: an adapter on lm_head is not supported (TRL reads lm_head.weight directly)")
        self._signature_columns = ["input_ids", "labels", "seq_lengths"]  # TRL's: packing needs seq_lengths
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
        self._init_aux_loss(model, args)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
        self._tp_size = 1
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    _prepare_dataset = _TRL._prepare_dataset  # TRL's own: no super() inside

    @staticmethod
    def _load_model(model: Any, args: Any, quantization_config: Any) -> torch.nn.Module:
        if not isinstance(model, str):
            return model
        return create_model_from_path(model, **from_path_kwargs(args, quantization_config))

    def _init_aux_loss(self, model: Any, args: Any) -> None:
        """TRL's switch (TRLMethods), which SFT also writes into the model's config."""
        text_config = self._set_aux_loss(model, args)
        if hasattr(text_config, "router_aux_loss_coef"):
            text_config.output_router_logits = self.aux_loss_enabled
            text_config.router_aux_loss_coef = self.router_aux_loss_coef

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's compute_loss: x the process count with num_items_in_batch (as HF's), the MoE router loss averaged
        over the accumulation steps; raytrain's training_step takes it as HF's does."""
        return _TRL.compute_loss(self, model, inputs, return_outputs=return_outputs,
                                 num_items_in_batch=num_items_in_batch)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """As TRL: a dataset passed here is prepared as the init's were."""
        if not self._skip_prepare_dataset and eval_dataset is not None and not isinstance(eval_dataset, str):
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
            prep = self._prepare_dataset
            if isinstance(eval_dataset, dict):
                eval_dataset = {k: prep(d, self.processing_class, self.args, packing, self._formatting_func, k)
                                for k, d in eval_dataset.items()}
            else:
                eval_dataset = prep(eval_dataset, self.processing_class, self.args, packing, self._formatting_func,
                                    "eval")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)


def _peft_on_lm_head(model: Any) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return hasattr(model, "peft_config") and isinstance(model.get_output_embeddings(), BaseTunerLayer)
