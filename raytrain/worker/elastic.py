"""WORKER side: an elastic group's batch at the world size it started with (Ray restarts the whole group
from the latest checkpoint at each resize). The global batch is the largest group's,
per_device_train_batch_size x max workers x gradient_accumulation_steps, at every size: the accumulation
takes up the difference where it divides, else the per-device batch (config.ScalingConfig.batch_at);
args validation refused at start a range where neither does.
"""

from __future__ import annotations

import logging

from ..config.sections import ConfigError

logger = logging.getLogger(__name__)


def fit_batch(args, world_size: int) -> dict | None:
    """Set this world size's per-device batch and accumulation on `args`, from the configured ones (kept on
    args, so a second call gives the same); returns the configured layout, None for a fixed-size group."""
    scaling = args.scaling
    if not scaling.elastic:
        return None
    base = args.__dict__.get("_elastic_base")
    if base is None:
        base = args._elastic_base = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    fit = scaling.batch_at(world_size, *base)
    if fit is None:  # only if a Trainer changed the batch settings after the arguments were validated
        raise ConfigError(f"scaling.num_workers: the global batch of {base[0] * scaling.num_workers * base[1]} "
                          f"cannot be kept at {world_size} workers")
    # Set without revalidation, which would take these derived values for the configured global batch.
    object.__setattr__(args, "per_device_train_batch_size", fit[0])
    object.__setattr__(args, "gradient_accumulation_steps", fit[1])
    return {"world_size": scaling.num_workers, "batch_size": base[0], "gradient_accumulation_steps": base[1]}


def announce(args, world_size: int, before: dict) -> str | None:
    """Log (and return) the one line of a start on another world size than `before`'s: the resumed
    checkpoint's data state, or the configured layout on a fresh start."""
    old = before.get("world_size")
    if old is None or old == world_size:
        return None
    batch, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    old_batch, old_accum = before.get("batch_size", batch), before.get("gradient_accumulation_steps", accum)
    changes = [f"{name} {a} -> {b}" for name, a, b in (("gradient_accumulation_steps", old_accum, accum),
                                                        ("per_device_train_batch_size", old_batch, batch)) if a != b]
    total, old_total = batch * world_size * accum, old_batch * old * old_accum
    kept = f"global batch {total} kept" if total == old_total else f"global batch {old_total} -> {total}"
    line = f"world size {old} -> {world_size}: {', '.join(changes) or 'batch unchanged'} ({kept})"
    logger.warning(line)
    return line
