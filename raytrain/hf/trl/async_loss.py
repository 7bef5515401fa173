"""TRL's AsyncGRPO loss and metrics on raytrain's step (a mixin of the async trainer): a micro-batch of rollout samples
(TRL's RolloutSample fields: input_ids, completion_mask, old_log_probs aligned with input_ids, advantage) right-padded
into shift_labels, the PPO-clipped ratio to the behaviour policy per completion token, normalised by the
micro-batch's completion tokens on every rank, and the step's sample metrics."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def plain(sample: Any) -> dict:
    """A sample (TRL's RolloutSample or the dict its queue dataset yields; lists or arrays) as numpy arrays."""
    get = sample.get if isinstance(sample, dict) else lambda k: getattr(sample, k)
    return {"input_ids": np.asarray(get("input_ids"), dtype=np.int64),
            "completion_mask": np.asarray(get("completion_mask"), dtype=np.int64),
            "old_log_probs": np.asarray(get("old_log_probs"), dtype=np.float32),
            "advantage": float(get("advantage")), "group_id": int(get("group_id"))}


class AsyncLossMethods:
    """The micro-batch, the loss and the metrics; the trainer sets epsilon_low / epsilon_high / aux-loss settings."""

    loss_is_scaled_for_ga = True  # TRL's: compute_loss divides by the accumulation steps itself

    def _pack(self, mine: list[dict], micro: list[dict]) -> dict:
        """This rank's samples `mine` (of the micro-batch `micro`, every rank's), right-padded: shift_labels (the next
        token where it is a completion token, else -100), the behaviour log-probs and advantages at those positions,
        the micro-batch's completion tokens on all ranks."""
        b, length = len(mine), max(len(s["input_ids"]) for s in mine)
        pad = self.processing_class.pad_token_id
        ids = torch.full((b, length), pad, dtype=torch.long)
        attention = torch.zeros((b, length), dtype=torch.long)
        labels = torch.full((b, length), -100, dtype=torch.long)
        old = torch.zeros((b, length), dtype=torch.float32)
        for i, s in enumerate(mine):
            n = len(s["input_ids"])
            row, mask = torch.from_numpy(s["input_ids"]), torch.from_numpy(s["completion_mask"]).bool()
            ids[i, :n], attention[i, :n] = row, 1
            target = mask[1:]
            labels[i, :n - 1] = torch.where(target, row[1:], -100)
            old[i, :n - 1] = torch.from_numpy(s["old_log_probs"][1:]) * target
        batch = {"input_ids": ids, "attention_mask": attention, "shift_labels": labels, "old_log_probs": old,
                 "advantages": torch.tensor([s["advantage"] for s in mine], dtype=torch.float32),
                 "global_n_tokens": torch.tensor(float(sum(int(s["completion_mask"].sum()) for s in micro)))}
        return self._prepare_inputs(batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's AsyncGRPO loss: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) per completion token, r the ratio
        to the behaviour policy; this rank's share of the micro-batch's token mean (all ranks' tokens), over the
        accumulation steps; MoE's auxiliary loss weighted as TRL does."""
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    shift_labels=inputs["shift_labels"], fused_lm_head=True, **router)
        mask = inputs["shift_labels"] != -100
        log_probs, entropy = out.log_probs[mask], out.entropy[mask]
        old = inputs["old_log_probs"][mask]
        adv = inputs["advantages"].unsqueeze(1).expand_as(mask)[mask]
        log_ratio = log_probs - old
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        ga, strategy = self.args.gradient_accumulation_steps, self.get_strategy()
        # TRL's: over the tokens per rank (the ranks' mean of gradients is then the token mean), over accumulation
        loss = per_token.sum() / (inputs["global_n_tokens"] / strategy.dp_size).clamp(min=1.0) / ga
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * out.aux_loss / ga
        self._loss_metrics(coef_1, log_ratio, entropy, adv, strategy)
        return (loss, out) if return_outputs else loss

    @torch.no_grad()
    def _loss_metrics(self, coef_1, log_ratio, entropy, adv, strategy) -> None:
        """TRL's ratio, kl, entropy and clip ratios over every rank's tokens (one sum and one max all-reduce)."""
        low = (coef_1 < 1 - self.epsilon_low) & (adv < 0)
        high = (coef_1 > 1 + self.epsilon_high) & (adv > 0)
        sums = torch.stack([coef_1.sum(), ((coef_1 - 1) - log_ratio).sum(), entropy.sum(), low.float().sum(),
                            high.float().sum(), (low | high).float().sum(), torch.tensor(float(coef_1.numel()))])
        extremes = torch.stack([-(low.float().mean() if low.numel() else torch.tensor(math.nan)),
                                high.float().mean() if high.numel() else torch.tensor(math.nan)])
        if strategy.world_size > 1:
            sums, extremes = strategy.all_reduce(sums), strategy.all_reduce(extremes, op="max")
        count = max(float(sums[6]), 1.0)
        m = self._metrics["train"]
        for i, key in enumerate(("ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                                 "clip_ratio/region_mean")):
            m[key].append(float(sums[i]) / count)
        m["clip_ratio/low_min"].append(-float(extremes[0]))
        m["clip_ratio/high_max"].append(float(extremes[1]))

    def _record_step(self, samples: list, version: int) -> None:
        """A scheduled step's sample metrics (TRL's names; rewards as GRPO logs them), once per step on every rank."""
        m = self._metrics["train"]
        stale = [version - s.model_version for s in samples]
        m["sample/staleness_mean"].append(sum(stale) / len(stale))
        m["sample/staleness_max"].append(float(max(stale)))
        m["sample/dropped_stale_total"].append(0.0)  # the schedule generates nothing that is not trained on
        for key in dict.fromkeys(k for s in samples for k in s.metrics):
            values = [s.metrics[key] for s in samples if key in s.metrics and not math.isnan(s.metrics[key])]
            mean = sum(values) / len(values) if values else math.nan
            if key.startswith("rewards/"):
                m[f"{key}/mean"].append(mean)
                m[f"{key}/std"].append(torch.tensor(values).std().item() if len(values) > 1 else math.nan)
            else:
                m[key].append(mean)
        lengths = [int(np.asarray(s.completion_mask).sum()) for s in samples]
        m["batch/forwarded_tokens_per_step"].append(float(sum(len(s.input_ids) for s in samples)))
        m["batch/trained_tokens_per_step"].append(float(sum(lengths)))
        m["completions/mean_length"].append(sum(lengths) / len(lengths))
        m["completions/min_length"].append(float(min(lengths)))
        m["completions/max_length"].append(float(max(lengths)))
        clipped = [n >= self.args.max_completion_length and int(s.input_ids[-1]) not in self.eos_token_ids
                   for n, s in zip(lengths, samples)]
        m["completions/clipped_ratio"].append(sum(clipped) / len(clipped))
        self._trained_groups.update(s.group_id for s in samples)

    def _record_micro(self, metrics: list[dict]) -> None:
        """A TRL rollout worker's micro-batch: each sample metric's mean over the samples that carry it (TRL's
        collator), NaN left out."""
        m = self._metrics["train"]
        for key in dict.fromkeys(k for item in metrics for k in item):
            values = [item[key] for item in metrics if key in item and not math.isnan(item[key])]
            m[key].append(sum(values) / len(values) if values else math.nan)
