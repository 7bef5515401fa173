"""What TRL's trainers share on raytrain: the args conversion, a model's from-path arguments, PEFT set-up, refusals
of what does not run here, and TRL's metric logging (its `_metrics` averaged into each log, kept across a resume)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from ...callbacks.base import ExportableState

def as_config(config_class: type, args: Any, model: Any, suffix: str) -> Any:
    """TRL's rule: no args -> `<model name>-SFT`; a plain TrainingArguments -> the config with its values."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_class(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")
    if isinstance(args, config_class):
        return args
    if type(args).__module__.startswith("trl"):
        raise TypeError(f"args: {type(args).__name__} is trl's; use raytrain.trl's {config_class.__name__}")
    return config_class.from_dict(args.to_dict())


def from_path_kwargs(args: Any, quantization_config: Any) -> dict:
    """TRL's keyword arguments for a model loaded from its path: model_init_kwargs, the quantization config,
    trust_remote_code."""
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def check_unsupported(args: Any) -> None:
    """One line for each TRL field whose feature raytrain does not run."""
    if args.activation_offloading:
        raise ValueError("activation_offloading: not supported by raytrain.trl (TRL's offloading needs CUDA "
                         "streams); use gradient_checkpointing")
    if (args.gradient_checkpointing_kwargs or {}).get("selective"):
        raise ValueError("gradient_checkpointing_kwargs.selective: TRL's selective checkpointing is not supported "
                         "by raytrain.trl")
    if args.model_init_kwargs is not None and "device_map" in args.model_init_kwargs:
        raise ValueError("model_init_kwargs.device_map: not supported; raytrain places the model on each worker")


def check_prompt_datasets(datasets: dict[str, Any], trainer: str, indexed_by: str) -> None:
    """Each dataset (each of a dict's) map-style, with a prompt column and no images, or one line naming it."""
    for name, data in datasets.items():
        for part in (data.values() if isinstance(data, dict) else [data]):
            if part is None:
                continue
            if not (hasattr(part, "__getitem__") and hasattr(part, "__len__")):
                raise TypeError(f"{name}: a map-style datasets.Dataset is needed ({indexed_by}), got "
                                f"{type(part).__name__}")
            columns = set(getattr(part, "column_names", None) or part[0])
            if "prompt" not in columns:
                raise ValueError(f"{name}: no 'prompt' column (it has {sorted(columns)})")
            if {"image", "images"} & columns:
                raise ValueError(f"{name}: image columns (vision datasets) are not supported by {trainer}")


def setup_peft(model: Any, peft_config: Any, args: Any, added_tokens: list[int]) -> Any:
    """TRL's PEFT set-up: get_peft_model with peft_config (new chat tokens trainable), input grads when checkpointing."""
    if peft_config is not None:
        try:
            from peft import PeftConfig, get_peft_model
        except ImportError:
            raise ImportError("peft_config: the peft package is missing: pip install 'raytrain[trl]'") from None
        if not isinstance(peft_config, PeftConfig):
            raise TypeError(f"peft_config: expected a peft.PeftConfig (e.g. LoraConfig), got "
                            f"{type(peft_config).__name__}")
        if hasattr(model, "peft_config"):
            raise ValueError("peft_config: the model is already a PeftModel; pass its merged base model instead")
        if added_tokens:
            indices = peft_config.trainable_token_indices or {}
            indices.setdefault("embed_tokens", []).extend(added_tokens)
            peft_config.trainable_token_indices = indices
            if "lm_head" not in (peft_config.modules_to_save or []):
                peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]
        model = get_peft_model(model, peft_config)
    if hasattr(model, "peft_config") and args.gradient_checkpointing:
        model.enable_input_require_grads()  # as TRL: transformers' Trainer misses it (transformers#42489)
    return model


class TRLMetricsState(TrainerCallback, ExportableState):
    """Holds TRL's num_tokens counter, so that trainer_state.json carries it and a resumed run (in-process or a
    restarted Ray worker group) logs on from it; the trainer reads and writes it as `_total_train_tokens`."""

    def __init__(self):
        self.total_train_tokens = 0

    def state(self) -> dict:
        return {"args": {}, "attributes": {"total_train_tokens": int(self.total_train_tokens)}}


class TRLMethods:
    """TRL's `log` (its metrics averaged, eval_-prefixed in evaluation), its prediction_step, and the
    tensor-parallel size (1 here)."""

    def __init__(self, *args: Any, callbacks: list | None = None, **kwargs: Any):
        super().__init__(*args, callbacks=[*(callbacks or []), TRLMetricsState()], **kwargs)

    @property
    def _total_train_tokens(self) -> int:
        return self._trl_state().total_train_tokens

    @_total_train_tokens.setter
    def _total_train_tokens(self, value: int) -> None:
        self._trl_state().total_train_tokens = value

    def _trl_state(self) -> TRLMetricsState:
        # looked up each time: a resume may rebuild the callbacks (restore_callback_states_from_checkpoint)
        return next(cb for cb in self.callback_handler.callbacks if isinstance(cb, TRLMetricsState))

    def get_tp_size(self) -> int:
        return 1

    def _place_frozen(self) -> None:
        """The reference and reward models placed as TRL prepares them, once for the run's backend: sharded like
        the policy under FSDP2 and ZeRO-3 (Strategy.place_frozen), else whole beside it."""
        strategy = self.get_strategy()
        if getattr(self, "_frozen_placed", None) == id(strategy):
            return
        if getattr(self, "ref_model", None) is not None:
            self.ref_model = strategy.place_frozen(self.ref_model)
        if hasattr(self, "reward_funcs"):
            self.reward_funcs = [strategy.place_frozen(f) if isinstance(f, torch.nn.Module) else f
                                 for f in self.reward_funcs]
        self._frozen_placed = id(strategy)  # picklable, unlike the strategy

    def _set_aux_loss(self, model: Any, args: Any) -> Any:
        """TRL's MoE router auxiliary loss switch (off for models without router logits); the text config."""
        text_config = model.config.get_text_config()
        coef = args.router_aux_loss_coef
        self.router_aux_loss_coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
        if coef and not hasattr(text_config, "output_router_logits"):
            raise ValueError(f"router_aux_loss_coef: {type(model).__name__} returns no router logits")
        self.aux_loss_enabled = hasattr(text_config, "output_router_logits") and self.router_aux_loss_coef != 0.0
        return text_config

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {key: sum(val) / len(val) for key, val in self._metrics[mode].items() if val}
        if mode == "eval":
            metrics = {f"eval_{key}": val for key, val in metrics.items()}
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """TRL's: the loss from compute_loss, and the outputs' logits only when predictions are wanted."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.get_strategy().autocast():
            if prediction_loss_only:
                return self.compute_loss(model, inputs).detach(), None, None
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        return loss.detach(), outputs.logits, self._prediction_labels(inputs)

    def _prediction_labels(self, inputs: dict) -> Any:
        return inputs.get("labels")
