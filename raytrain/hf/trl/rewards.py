"""TRL 1.16's reward sources for GRPO and RLOO: reward functions with TRL's signature (prompts, completions,
completion_ids, the dataset's other columns, trainer_state, log_extra / log_metric; None for a completion it does
not score; async ones run together on a daemon event loop), sequence-classification reward models with their
tokenizers, reward_weights. TRL's _calculate_rewards is rewritten here: it reaches transformers' Trainer through
super() and gathers with accelerate; here a reward function that raises or returns the wrong thing is named in one
line before the step's update, and the rewards are gathered across ranks with torch.distributed."""

from __future__ import annotations

import asyncio
import atexit
import logging
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel
from trl.data_utils import apply_chat_template, is_conversational
from trl.trainer.utils import (get_callable_name, get_config_model_id, is_async_callable, shutdown_event_loop_in_daemon,
                               start_event_loop_in_daemon)

logger = logging.getLogger(__name__)


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than one reward (a number or None) per completion."""


class RewardMethods:
    """TRL's reward set-up and _calculate_rewards, for the rollout mixin (rollout.py)."""

    def _setup_rewards(self, reward_funcs: Any, reward_processing_classes: Any, args: Any) -> None:
        """TRL's: model ids loaded as sequence classifiers (num_labels=1), names, weights, tokenizers."""
        if reward_funcs is None:
            reward_funcs = []
        elif not isinstance(reward_funcs, list):
            reward_funcs = [reward_funcs]
        if not reward_funcs:
            raise ValueError("reward_funcs: give at least one reward function or reward model")
        reward_funcs, names, revisions = list(reward_funcs), [], [None] * len(reward_funcs)
        for i, func in enumerate(reward_funcs):
            if isinstance(func, str):
                kwargs = {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}
                revisions[i] = kwargs.get("revision")
                reward_funcs[i] = AutoModelForSequenceClassification.from_pretrained(func, num_labels=1, **kwargs)
            if isinstance(reward_funcs[i], nn.Module):
                names.append(get_config_model_id(reward_funcs[i].config).split("/")[-1])
            elif callable(reward_funcs[i]):
                names.append(get_callable_name(reward_funcs[i]))
            else:
                raise TypeError(f"reward_funcs[{i}]: expected a function, a model id or a sequence-classification "
                                f"model, got {type(func).__name__}")
        self.reward_funcs, self.reward_func_names = reward_funcs, names
        if args.reward_weights is not None:
            if len(args.reward_weights) != len(reward_funcs):
                raise ValueError(f"reward_weights: {len(args.reward_weights)} weights for {len(reward_funcs)} reward "
                                 "functions; give one weight per reward function")
            self.reward_weights = torch.tensor(args.reward_weights, dtype=torch.float32)
        else:
            self.reward_weights = torch.ones(len(reward_funcs), dtype=torch.float32)
        if reward_processing_classes is None:
            reward_processing_classes = [None] * len(reward_funcs)
        elif not isinstance(reward_processing_classes, list):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != len(reward_funcs):
            raise ValueError(f"reward_processing_classes: {len(reward_processing_classes)} for "
                             f"{len(reward_funcs)} reward functions; give one per reward function")
        classes = list(reward_processing_classes)
        for i, (cls, func) in enumerate(zip(classes, reward_funcs)):
            if isinstance(func, PreTrainedModel):
                if cls is None:
                    cls = AutoTokenizer.from_pretrained(get_config_model_id(func.config), revision=revisions[i],
                                                        trust_remote_code=args.trust_remote_code)
                if cls.pad_token_id is None:
                    cls.pad_token = cls.eos_token
                # the reward is read at the last token that is not padding
                func.config.get_text_config().pad_token_id = cls.pad_token_id
                classes[i] = cls
        self.reward_processing_classes = classes
        self._has_async_funcs = any(is_async_callable(f) for f in reward_funcs)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_async_runtime", None)  # a thread and its event loop: started again where rewards are computed
        return state

    def _async_loop(self) -> asyncio.AbstractEventLoop:
        """TRL's daemon event loop for async reward functions, started on first use in this process."""
        runtime = self.__dict__.get("_async_runtime")
        if runtime is None:
            thread, loop, ready = start_event_loop_in_daemon(name=f"{type(self).__name__}-AsyncLoop")
            ready.wait()
            atexit.register(shutdown_event_loop_in_daemon, thread, loop)
            runtime = self.__dict__["_async_runtime"] = (thread, loop)
        return runtime[1]

    def _calculate_rewards(self, inputs: list[dict], prompts: list, completions: list,
                           completion_ids_list: list) -> torch.Tensor:
        """(completions of all ranks, reward functions): TRL's rewards, None as NaN, gathered across ranks."""
        device = self.accelerator.device
        rewards = torch.zeros(len(prompts), len(self.reward_funcs), device=device)
        keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")]
        kwargs = {k: [x[k] for x in inputs] for k in keys}
        kwargs.update(trainer_state=self.state, log_extra=self._log_completion_extra, log_metric=self._log_metric)
        pending = []
        for i, (func, cls, name) in enumerate(zip(self.reward_funcs, self.reward_processing_classes,
                                                  self.reward_func_names)):
            if isinstance(func, nn.Module):
                rewards[:, i] = self._model_rewards(func, cls, prompts, completions)
            elif is_async_callable(func):
                pending.append((i, func, name))
            else:
                try:
                    out = func(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **kwargs)
                except Exception as e:
                    raise self._raised(name, e) from e
                rewards[:, i] = self._checked(name, out, len(prompts), device)
        if pending:
            async def run(func):
                return await func(prompts=prompts, completions=completions, completion_ids=completion_ids_list,
                                  **kwargs)

            async def run_all():
                return await asyncio.gather(*(run(func) for _, func, _ in pending), return_exceptions=True)

            outs = asyncio.run_coroutine_threadsafe(run_all(), self._async_loop()).result()
            for (i, _, name), out in zip(pending, outs):
                if isinstance(out, BaseException):
                    raise self._raised(name, out) from out
                rewards[:, i] = self._checked(name, out, len(prompts), device)
        unscored = torch.isnan(rewards).all(dim=1)
        if unscored.any():
            row = int(unscored.nonzero()[0][0])
            logger.warning("every reward function returned None for completion %d (prompt %r, completion %r): it is "
                           "left out of the advantages", row, prompts[row], completions[row])
        return self.accelerator.gather(rewards)  # the groups are normalised over every rank's completions

    def _model_rewards(self, model: nn.Module, tokenizer: Any, prompts: list, completions: list) -> torch.Tensor:
        """A reward model's score of each prompt + completion (its chat template for conversations)."""
        if next(model.parameters()).device != self.accelerator.device:
            model.to(self.accelerator.device)
        if is_conversational({"prompt": prompts[0]}):
            texts = [apply_chat_template({"messages": p + c}, tokenizer, **self.chat_template_kwargs)["text"]
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        batch = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        batch = self._to_device(batch)
        with torch.inference_mode(), self.accelerator.autocast():
            return model(**batch).logits[:, 0].float()

    def _raised(self, name: str, error: BaseException) -> RewardFunctionError:
        what = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return RewardFunctionError(f"reward function {name!r} raised {type(error).__name__}"
                                   f"{': ' + what if what else ''} (step {self.state.global_step + 1}); the step's "
                                   "update was not made")

    def _checked(self, name: str, out: Any, n: int, device: torch.device) -> torch.Tensor:
        """TRL's conversion (None -> NaN), with one line naming the function and what it returned otherwise."""
        step = f"(step {self.state.global_step + 1}); the step's update was not made"
        try:
            values = list(out)
        except TypeError:
            raise RewardFunctionError(f"reward function {name!r} returned {type(out).__name__} {_short(out)}, not a "
                                      f"list of {n} rewards (one per completion) {step}") from None
        if len(values) != n:
            raise RewardFunctionError(f"reward function {name!r} returned {len(values)} rewards for {n} completions; "
                                      f"return one per completion (None where it does not apply) {step}")
        for j, v in enumerate(values):
            if v is not None and not isinstance(v, (int, float)) and not (
                    isinstance(v, torch.Tensor) and v.numel() == 1) and not hasattr(v, "__float__"):
                raise RewardFunctionError(f"reward function {name!r} returned {type(v).__name__} {_short(v)} for "
                                          f"completion {j}; a reward is a number or None {step}")
        return torch.tensor([torch.nan if v is None else float(v) for v in values], dtype=torch.float32, device=device)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
