"""Generating and scoring one prompt group: the small interface between an asynchronous GRPO trainer and whatever
produces its rollouts (transformers' generate() here; a vLLM or SGLang engine could stand in its place). An engine
holds a policy (set_weights), and turns a GroupRequest into a ScoredGroup: the group's completions, the behaviour
policy's log-probabilities of their tokens, each reward function's rewards and the group-normalised advantages.
Everything random in it is drawn from the request's seed, so a group comes out the same wherever it is generated."""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch


@dataclass(frozen=True)
class GroupRequest:
    """One prompt group to generate: `group` is its position in the run, `version` the policy that generates it."""

    group: int
    step: int
    prompt_index: int
    version: int
    seed: int
    row: dict  # the dataset's row: `prompt` and the other columns the reward functions read


@dataclass
class ScoredGroup:
    """A generated and scored group: per completion its token ids (up to and including the first EOS), the
    behaviour policy's log-probabilities of those tokens, each reward function's reward (NaN: not scored), the
    advantage; where and when it was generated (wall-clock seconds, for staleness and overlap figures)."""

    group: int
    step: int
    prompt_index: int
    version: int
    prompt: Any
    prompt_ids: list[int]
    completions: list[Any]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[list[float]]  # [function][completion]
    advantages: list[float]
    truncated: list[bool]
    worker: str = ""
    started: float = 0.0
    finished: float = 0.0
    extra: dict = field(default_factory=dict)

    def reward(self, i: int) -> float:
        """Completion i's reward: the sum over functions that scored it; NaN when none did (TRL's rule)."""
        values = [r[i] for r in self.rewards if not math.isnan(r[i])]
        return sum(values) if values else math.nan


class RolloutEngine(Protocol):
    """What a rollout worker runs: a policy that can be replaced, and groups generated and scored together."""

    def set_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None: ...

    def rollout(self, requests: list[GroupRequest]) -> list[ScoredGroup]: ...


@dataclass(frozen=True)
class Sampling:
    """The generation settings (AsyncGRPOConfig's names)."""

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict | None = None
    threads: int = 1


class TransformersEngine:
    """A model sampled with transformers' generate(), on `threads` torch threads (the same on every worker, so
    that the arithmetic, hence the completions, do not depend on which worker generates a group)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, reward_funcs: list[Callable], reward_names: list[str],
                 sampling: Sampling, eos_token_ids: list[int], max_steps: int = 0):
        self.model = model.eval()
        self.tokenizer, self.sampling = tokenizer, sampling
        self.reward_funcs, self.reward_names = reward_funcs, reward_names
        self.eos_token_ids, self.max_steps = list(eos_token_ids), max_steps
        self.version: int | None = None

    def set_weights(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """The policy of `version`: its trainable weights (the others never change) loaded by name."""
        missing = set(weights) - set(self.model.state_dict())
        if missing:
            raise KeyError(f"weights for unknown parameters: {sorted(missing)[:3]}")
        self.model.load_state_dict(weights, strict=False)
        self.version = version

    def rollout(self, requests: list[GroupRequest]) -> list[ScoredGroup]:
        """The groups generated together (one generate() call: the schedule fixes which groups go together, so
        the arithmetic does too), each sampled from its own seed, then scored group by group."""
        started = time.time()
        with _threads(self.sampling.threads):
            prompts = [self._prompt_ids(r.row["prompt"]) for r in requests]
            sampled = self._sample(prompts, [r.seed for r in requests])
        out, g = [], self.sampling.num_generations
        for i, (request, prompt_ids) in enumerate(zip(requests, prompts)):
            completion_ids, logprobs, truncated = (part[i * g:(i + 1) * g] for part in sampled)
            completions = self._decode(request.row["prompt"], completion_ids)
            rewards = self._rewards(request, completions, completion_ids)
            out.append(ScoredGroup(group=request.group, step=request.step, prompt_index=request.prompt_index,
                                   version=request.version, prompt=request.row["prompt"], prompt_ids=prompt_ids,
                                   completions=completions, completion_ids=completion_ids, logprobs=logprobs,
                                   rewards=rewards, advantages=advantages(rewards), truncated=truncated,
                                   started=started, finished=time.time()))
        return out

    def _prompt_ids(self, prompt: Any) -> list[int]:
        """TRL's tokenization: a conversation through the chat template (generation prompt added), text as it is."""
        if _conversational(prompt):
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, **(self.sampling.chat_template_kwargs or {}))
            ids = out["input_ids"]
            return list(ids[0] if ids and isinstance(ids[0], list) else ids)
        return list(self.tokenizer(text=prompt)["input_ids"])

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], seeds: list[int]):
        """num_generations completions of each prompt, left-padded into one batch; each group's tokens drawn by
        GroupSampler from its own generator (HF's warpers first); the behaviour log-probabilities from the logits
        they were sampled from, at the sampling temperature. (completion ids, log-probs, truncated) per row."""
        s, g = self.sampling, self.sampling.num_generations
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(g)])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(g)])
        device = next(self.model.parameters()).device
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                  logits_processor=[GroupSampler(seeds, g, s)], repetition_penalty=s.repetition_penalty,
                                  max_new_tokens=s.max_completion_length, eos_token_id=self.eos_token_ids,
                                  pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
                                  temperature=None, top_k=None, top_p=None)
        tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [rows, T, vocab], before any processor
        logps = torch.log_softmax(logits / s.temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        completion_ids, logprobs, truncated = [], [], []
        for row, lp in zip(tokens.tolist(), logps.tolist()):
            end = next((i for i, t in enumerate(row) if t in self.eos_token_ids), None)
            keep = len(row) if end is None else end + 1
            completion_ids.append(row[:keep])
            logprobs.append(lp[:keep])
            truncated.append(end is None)
        return completion_ids, logprobs, truncated

    def _decode(self, prompt: Any, completion_ids: list[list[int]]) -> list[Any]:
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        if _conversational(prompt):
            return [[{"role": "assistant", "content": t}] for t in texts]
        return texts

    def _rewards(self, request: GroupRequest, completions: list, completion_ids: list) -> list[list[float]]:
        """Each function called once for the group with TRL's keywords: prompts, completions, completion_ids, the
        row's other columns (repeated per completion), trainer_state (the step's, before its update)."""
        from ...callbacks.state import TrainerState

        n = len(completions)
        columns = {k: [v] * n for k, v in request.row.items() if k != "prompt"}
        state = TrainerState(global_step=request.step - 1, max_steps=self.max_steps)
        kwargs = dict(prompts=[request.row["prompt"]] * n, completions=completions, completion_ids=completion_ids,
                      trainer_state=state, **columns)
        out = []
        for func, name in zip(self.reward_funcs, self.reward_names):
            try:
                values = func(**kwargs)
                if inspect.isawaitable(values):
                    values = asyncio.run(_awaited(values))
            except Exception as e:
                what = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise RewardError(f"reward function {name!r} raised {type(e).__name__}{': ' + what if what else ''} "
                                  f"(group {request.group}, prompt {request.prompt_index})") from e
            out.append(_checked(name, values, n))
        return out


class GroupSampler:
    """A logits processor that samples each group's next tokens from the group's own torch generator (seeded by
    its seed), after HF's temperature / top-k / top-p / min-p warpers, and leaves only that token: greedy decoding
    then takes it. So a group's completions depend on its seed, not on torch's global RNG."""

    def __init__(self, seeds: list[int], rows_per_group: int, sampling: Sampling):
        from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                  TopPLogitsWarper)

        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.rows = rows_per_group
        warpers = LogitsProcessorList()
        if sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        if sampling.min_p is not None:
            warpers.append(MinPLogitsWarper(sampling.min_p))
        self.warpers = warpers

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores).float(), dim=-1).cpu()
        chosen = torch.cat([torch.multinomial(probs[i * self.rows:(i + 1) * self.rows], 1, generator=gen)
                            for i, gen in enumerate(self.generators)]).to(scores.device)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


class RewardError(ValueError):
    """A reward function raised, or returned something other than one reward per completion."""


async def _awaited(value):
    return await value


def advantages(rewards: list[list[float]]) -> list[float]:
    """TRL's AsyncGRPO advantages: the summed rewards normalised within the group ((r - mean) / (std + 1e-8),
    population std), over the completions some function scored; 0 for a completion none did."""
    n = len(rewards[0]) if rewards else 0
    totals = []
    for i in range(n):
        values = [r[i] for r in rewards if not math.isnan(r[i])]
        totals.append(sum(values) if values else math.nan)
    scored = torch.tensor([t for t in totals if not math.isnan(t)], dtype=torch.float64)
    if scored.numel() == 0:
        return [0.0] * n
    mean, std = scored.mean(), scored.std(unbiased=False)
    return [0.0 if math.isnan(t) else float((t - mean) / (std + 1e-8)) for t in totals]


def _checked(name: str, values: Any, n: int) -> list[float]:
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"reward function {name!r} returned {type(values).__name__}, not a list of {n} rewards "
                          "(one per completion)") from None
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} rewards for {n} completions; return one "
                          "per completion (None where it does not apply)")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
            continue
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name!r} returned {type(v).__name__} {v!r:.60}; a reward is a "
                              "number or None") from None
    return out


def _conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


class _threads:
    """torch's intra-op threads set to n for the block (the arithmetic of a matmul can depend on it)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.before != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)
        return False
