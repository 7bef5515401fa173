"""TRL's DPOTrainer as a mixin over raytrain's Trainer: TRL's preference-data preparation, DataCollatorForPreference,
its loss (every loss_type, from the installed trl's _compute_loss) and its rewards/logps metrics; glue only here."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin, set_seed
from trl import DPOTrainer as _TRL
from trl.trainer.dpo_trainer import DataCollatorForPreference
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, disable_dropout_in_model

from .common import TRLMethods, as_config, check_unsupported, from_path_kwargs, setup_peft

_F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


class DPOMethods(TRLMethods):
    """TRL 1.16's DPOTrainer arguments and behaviour; `config_class` (the facade's DPOConfig) converts plain args."""

    config_class: type
    _tag_names = ["trl", "dpo"]

    def __init__(self, model: Any, ref_model: Any = None, args: Any = None, data_collator: Callable | None = None,
                 train_dataset=None, eval_dataset=None, processing_class: Any = None,
                 compute_metrics: Callable | None = None, callbacks: list | None = None, optimizers=(None, None),
                 quantization_config: Any = None, peft_config: Any = None):
        args = as_config(self.config_class, args, model, "DPO")
        check_unsupported(args)
        if args.sync_ref_model:
            raise ValueError("sync_ref_model: not supported by raytrain.trl (the reference model is not "
                             "checkpointed, so a resumed run would not continue the same run)")
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        set_seed(args.seed)  # as TRL: before the model and PEFT's random adapter weights
        model_path = model if isinstance(model, str) else None
        if model_path is not None:
            model = create_model_from_path(model_path, **from_path_kwargs(args, quantization_config))
        elif quantization_config is not None:
            raise ValueError("quantization_config: only for a model given as a path")
        if ref_model is model:
            raise ValueError("ref_model: must not be the model itself; leave it out for a copy of the model")
        if processing_class is None:
            from transformers import AutoProcessor
            processing_class = AutoProcessor.from_pretrained(model.config._name_or_path)
        if isinstance(processing_class, ProcessorMixin) or not isinstance(processing_class, PreTrainedTokenizerBase):
            raise ValueError("processing_class: raytrain.trl's DPOTrainer takes a tokenizer (no vision processors)")
        self._tokenizer, self._is_vlm, self._is_vision_dataset = processing_class, False, False
        sample = next(iter(train_dataset))
        if "image" in sample or "images" in sample:
            raise ValueError("train_dataset: image columns (vision datasets) are not supported by raytrain.trl")
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        if peft_config is None and hasattr(model, "peft_config") and ref_model is None:
            model.add_adapter("ref", model.peft_config["default"])  # as TRL: a frozen copy of the adapter
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        model = setup_peft(model, peft_config, args, [])
        self.padding_free = False  # TRL 1.16 turns padding_free off for DPO (disabled after a refactor)
        if data_collator is None:
            pad_token = args.pad_token or processing_class.pad_token or processing_class.eos_token
            if pad_token not in processing_class.get_vocab():
                raise ValueError(f"pad_token: {pad_token!r} is not in the tokenizer's vocabulary")
            processing_class.pad_token = pad_token
            model.config.get_text_config().pad_token_id = processing_class.pad_token_id
            data_collator = DataCollatorForPreference(pad_token_id=processing_class.pad_token_id,
                                                      max_length=args.max_length,
                                                      truncation_mode=args.truncation_mode,
                                                      pad_to_multiple_of=args.pad_to_multiple_of)
        self._set_loss_fields(args)
        train_dataset = self._prepare_dataset(train_dataset, processing_class, args, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._prepare_dataset(d, processing_class, args, k) for k, d in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._prepare_dataset(eval_dataset, processing_class, args, "eval")
        self._signature_columns = ["prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps",
                                   "ref_rejected_logps"]  # TRL's
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers)
        self._set_aux_loss(model, args)
        if ref_model is None and not hasattr(self.model, "peft_config") and not args.precompute_ref_log_probs:
            path = model_path or getattr(self.model.config, "_name_or_path", "")  # as TRL: reloaded from there
            if not path:
                raise ValueError("ref_model: give one (or a path as model, or peft_config, or "
                                 "precompute_ref_log_probs=True); a model built in memory has no path to reload")
            ref_model = create_model_from_path(path, **{**(args.model_init_kwargs or {}), "dtype": self.model.dtype})
        self.ref_model = ref_model
        if args.disable_dropout:
            disable_dropout_in_model(self.model)
            if self.ref_model is not None:
                disable_dropout_in_model(self.ref_model)
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",)
                                                                         if self.use_weighting else ())
        add_fused_lm_head(self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model,
                          outputs=outputs)
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model)
            self.ref_model.eval().requires_grad_(False)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
        self._tp_size = 1
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)
        if args.precompute_ref_log_probs:
            size = args.precompute_ref_batch_size or args.per_device_train_batch_size
            self.train_dataset = self._precompute_ref_logps(self.train_dataset, size)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self._precompute_ref_logps(d, size) for k, d in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, size)

    _prepare_dataset = _TRL._prepare_dataset  # TRL's own (no super() inside)
    compute_ref_log_probs = _TRL.compute_ref_log_probs
    _compute_loss = _TRL._compute_loss

    def _set_loss_fields(self, args: Any) -> None:
        self.beta = args.beta
        self.precompute_ref_logps = args.precompute_ref_log_probs
        self.loss_types = args.loss_type
        self.loss_weights = args.loss_weights or [1.0] * len(self.loss_types)
        self.ld_alpha, self.label_smoothing, self.use_weighting = args.ld_alpha, args.label_smoothing, args.use_weighting
        self.f_divergence_type, self.f_alpha_divergence_coef = args.f_divergence_type, args.f_alpha_divergence_coef
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_types) <= _F_DIVERGENCE_LOSSES:
            raise ValueError(f"f_divergence_type: {self.f_divergence_type!r} works only with loss_type in "
                             f"{sorted(_F_DIVERGENCE_LOSSES)}, got {self.loss_types}")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_types):
            raise ValueError("use_weighting: not implemented for loss_type 'aot' / 'aot_unpaired' (as TRL)")
        if "exo_pair" in self.loss_types and self.label_smoothing == 0.0:
            raise ValueError("label_smoothing: must be > 0 for loss_type 'exo_pair' (the EXO paper uses 1e-3)")

    def _precompute_ref_logps(self, dataset: Any, batch_size: int) -> Any:
        """TRL's precompute_ref_log_probs: the reference's log-probs of every pair, added as two columns (computed
        once where the trainer is built, so every Ray worker gets the same columns)."""
        from torch.utils.data import DataLoader

        if not hasattr(dataset, "add_column"):
            raise ValueError("precompute_ref_log_probs: needs a map-style datasets.Dataset, not a stream")
        columns = [c for c in dataset.column_names if c in ("prompt_ids", "chosen_ids", "rejected_ids")]
        model = self.ref_model or self.model
        chosen, rejected = [], []
        for batch in DataLoader(dataset.select_columns(columns), batch_size=batch_size,
                                collate_fn=self.data_collator, shuffle=False):
            c, r = self.compute_ref_log_probs(model, batch)
            chosen.append(c.cpu())
            rejected.append(r.cpu())
        return (dataset.add_column("ref_chosen_logps", torch.cat(chosen).tolist())
                .add_column("ref_rejected_logps", torch.cat(rejected).tolist()))

    loss_is_scaled_for_ga = False  # TRL's: a mean over the micro-batch, which training_step divides as HF

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss, a mean over this micro-batch (training_step scales it for the accumulation, as HF's)."""
        self._place_frozen()  # on first use, by the run's backend
        return self._compute_loss(model, inputs, return_outputs)

    def _prediction_labels(self, inputs: dict) -> Any:
        return inputs["input_ids"]  # TRL's: a preference batch has no labels
