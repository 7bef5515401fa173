"""The layout of a run over its ranks (torchtitan's ParallelDims): pipeline stages, data-parallel
replicas (HSDP's replicate dim), data-parallel shards (FSDP2), sequence (sp, DeepSpeed's Ulysses) or context
(cp, torch's ring attention) groups and tensor-parallel groups, sized from HF's `parallelism_config`
(pp_size, pp_schedule and pp_microbatches are raytrain's extension of it) and built once into a device mesh.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, sp / cp, tp. TP is innermost, so a TP group is
consecutive ranks: the workers of one node (Ray places them PACKed, local ranks in order); a sequence group
next (its all-to-alls run every layer); pp outermost, so a stage's point-to-point sends are the only traffic
between its groups of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend",
          "pp_size", "pp_schedule", "pp_microbatches")
_NAMES = {"sp_backend": ("deepspeed",), "cp_backend": ("torch",)}  # HF's (accelerate's) only backends
#: torch.distributed.pipelining's schedule names (get_schedule_class's) that train and evaluate; the
#: multi-stage ones run two stages per rank, looped (rank r: stages r and r + pp), torchtitan's default.
#: (The V-shaped ZBVZeroBubble and DualPipeV cannot evaluate in torch 2.13: forward-only steps fail.)
SINGLE_STAGE = ("1F1B", "GPipe")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


def normalize(config: Any) -> dict[str, int] | None:
    """HF's parallelism_config as a dict of its sizes: a mapping, or accelerate's ParallelismConfig
    (read by attribute, so accelerate is not imported); None when unset. One-line ValueError when bad."""
    if config is None:
        return None
    if isinstance(config, dict):
        unknown = sorted(set(config) - set(FIELDS))
        if unknown:
            raise ValueError(f"parallelism_config: unknown field(s) {unknown}; valid: {', '.join(FIELDS)}")
        raw = dict(config)
    elif any(hasattr(config, f) for f in FIELDS):
        raw = {f: getattr(config, f) for f in FIELDS if getattr(config, f, None) is not None}
        if (raw.get("sp_size") or 1) > 1:  # accelerate leaves DeepSpeed's SP out of its size check: dp is the rest
            raw.pop("dp_shard_size", None)
    else:
        raise ValueError(f"parallelism_config: a mapping of {', '.join(FIELDS)} or accelerate's "
                         f"ParallelismConfig, got {type(config).__name__}")
    out = {"dp_replicate_size": 1, "dp_shard_size": -1, "tp_size": 1, "cp_size": 1, "cp_backend": "torch",
           "sp_size": 1, "sp_backend": "deepspeed", "pp_size": 1, "pp_schedule": "1F1B", "pp_microbatches": None}
    for key, value in raw.items():
        if value is None:
            continue
        if key == "pp_schedule":
            out[key] = schedule_name(value)
            continue
        if key in _NAMES:
            if value not in _NAMES[key]:
                raise ValueError(f"parallelism_config.{key}: {' or '.join(map(repr, _NAMES[key]))} (HF's only backend), "
                                 f"got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and not (key == "dp_shard_size"
                                                                                         and value == -1)):
            rule = "an integer >= 1 or -1 (the rest of the ranks)" if key == "dp_shard_size" else "an integer >= 1"
            raise ValueError(f"parallelism_config.{key}: {rule}, got {value!r}")
        out[key] = value
    if out["sp_size"] > 1 and out["cp_size"] > 1:
        raise ValueError("parallelism_config: sp_size and cp_size split the same sequence (Ulysses or ring attention); "
                         "set one of them 1")
    # a size that is 1 leaves its settings out (and the mapping stays HF's)
    for size, keys in (("pp_size", ("pp_size", "pp_schedule", "pp_microbatches")), ("sp_size", ("sp_size", "sp_backend")),
                       ("cp_size", ("cp_backend",))):
        if out[size] == 1:
            for key in keys:
                del out[key]
    return out


def schedule_name(value: Any) -> str:
    """A pp_schedule as torch spells it (matched without case, as get_schedule_class does); one-line error."""
    names = SINGLE_STAGE + MULTI_STAGE
    found = next((n for n in names if isinstance(value, str) and n.lower() == value.lower()), None)
    if found is None:
        raise ValueError(f"parallelism_config.pp_schedule: one of {', '.join(names)}, got {value!r}")
    return found


@dataclass(frozen=True)
class ParallelDims:
    """Validated sizes; `pp * dp_replicate * dp_shard * sp * cp * tp == world_size`."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None  # None: one per sample of the per-rank batch (torchtitan's default)
    sp: int = 1
    cp: int = 1

    @classmethod
    def resolve(cls, config: Any, world_size: int) -> ParallelDims:
        """Sizes for `world_size` ranks (dp_shard -1: what the other dims leave); one-line ValueError."""
        c = normalize(config) or normalize({})
        rep, shard, tp, pp = c["dp_replicate_size"], c["dp_shard_size"], c["tp_size"], c.get("pp_size", 1)
        sp, cp = c.get("sp_size", 1), c["cp_size"]
        lead = f"pp_size {pp} x " if pp > 1 else ""
        seq = "".join(f" x {k} {v}" for k, v in (("sp_size", sp), ("cp_size", cp)) if v > 1)
        if shard == -1:
            if world_size % (pp * rep * tp * sp * cp):
                raise ValueError(f"parallelism_config: {lead}dp_replicate_size {rep} x tp_size {tp}{seq} must divide the "
                                 f"world size (scaling.num_workers) {world_size}")
            shard = world_size // (pp * rep * tp * sp * cp)
        if pp * rep * shard * tp * sp * cp != world_size:
            raise ValueError(f"parallelism_config: {lead}dp_replicate_size {rep} x dp_shard_size {shard} x tp_size "
                             f"{tp}{seq} = {pp * rep * shard * tp * sp * cp} must equal the world size "
                             f"(scaling.num_workers) {world_size}")
        for name, size in (("sp_size", sp), ("cp_size", cp)):
            others = [f"{k} {v}" for k, v in (("tp_size", tp), ("pp_size", pp), ("dp_replicate_size", rep)) if v > 1]
            if size > 1 and others:
                raise ValueError(f"parallelism_config.{name}: {size} composes with data parallelism (dp_shard_size) "
                                 f"only, not with {', '.join(others)}; set those 1, or {name} 1")
        return cls(rep, shard, tp, world_size, pp, c.get("pp_schedule", "1F1B"), c.get("pp_microbatches"), sp, cp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.pp_schedule in MULTI_STAGE else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def shards(self) -> int:
        """The ranks FSDP2 shards over: the data-parallel ones and a sequence group's (torchtitan's dp_shard_cp)."""
        return self.dp * self.seq

    @property
    def seq(self) -> int:
        """The ranks that split one sequence (sp or cp; they read the same batch)."""
        return self.sp * self.cp

    def dp_rank(self, rank: int) -> int:
        return (rank // (self.tp * self.seq)) % self.dp

    def seq_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.seq

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp * self.seq * self.tp)

    def stage_ids(self, pp_rank: int) -> tuple[int, ...]:
        """The pipeline stages rank `pp_rank` of the pp dim runs: one; or two, looped (r, r + pp)."""
        return tuple(pp_rank + s * self.pp for s in range(self.stages_per_rank))

    def microbatches(self, per_rank_batch: int) -> int:
        return self.pp_microbatches or per_rank_batch

    def check_batch(self, per_rank_batch: int) -> None:
        """pp_microbatches equal microbatches of the per-rank batch, at least one per stage for 1F1B-like
        schedules (torch's rule); one-line ValueError."""
        if self.pp == 1:
            return
        m = self.microbatches(per_rank_batch)
        if per_rank_batch % m:
            raise ValueError(f"parallelism_config.pp_microbatches: {m} must divide the per-rank batch "
                             f"(per_device_train_batch_size) {per_rank_batch}")
        if m < self.num_stages and self.pp_schedule != "GPipe":
            raise ValueError(f"parallelism_config.pp_microbatches: {self.pp_schedule} needs at least one microbatch "
                             f"per stage ({self.num_stages} stages), got {m}; raise pp_microbatches or "
                             "per_device_train_batch_size")

    def as_dict(self) -> dict[str, Any]:
        """The mesh's sizes as the manifest records them (the pipeline's when there is one)."""
        out: dict[str, Any] = {"dp_replicate_size": self.dp_replicate, "dp_shard_size": self.dp_shard, "tp_size": self.tp}
        if self.pp > 1:
            out = {"pp_size": self.pp, **out, "pp_schedule": self.pp_schedule, "pp_stages": self.num_stages}
        for key, size in (("sp_size", self.sp), ("cp_size", self.cp)):
            if size > 1:
                out[key] = size
        return out

    def check_local(self, local_world_size: int | None) -> None:
        """A TP group within one node: its all-reduces run every layer, too often for the network."""
        if local_world_size and self.tp > 1 and local_world_size % self.tp:
            raise ValueError(f"parallelism_config.tp_size: {self.tp} must divide the workers per node "
                             f"({local_world_size}) so that a TP group stays within one node")

    def build_mesh(self, device_type: str):
        """The device mesh (pp, dp_replicate, dp_shard, cp, tp); a collective, once per run."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))

    def seq_group(self, rank: int):
        """The process group of `rank`'s sequence group (consecutive ranks); every rank calls it."""
        import torch.distributed as dist

        mine = None
        for first in range(0, self.world_size, self.seq):  # every rank creates every group, in the same order
            ranks = list(range(first, first + self.seq))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine

    def dp_group(self, rank: int):
        """The process group of `rank`'s data-parallel peers (same stage, context and TP index); every rank calls it."""
        import torch.distributed as dist

        mine = None
        for p in range(self.pp):  # every rank creates every group, in the same order
            for s in range(self.seq):
                for t in range(self.tp):
                    ranks = [((p * self.dp + d) * self.seq + s) * self.tp + t for d in range(self.dp)]
                    group = dist.new_group(ranks)
                    if rank in ranks:
                        mine = group
        return mine

    def tied_group(self, rank: int):
        """Under PP, `rank`'s peer holding the other end of tied input and output embeddings: the first stage's
        rank and the last stage's with the same data-parallel and TP index. Every rank calls it."""
        import torch.distributed as dist

        mine, stride = None, self.dp * self.tp
        for c in range(stride):  # every rank creates every group, in the same order
            ranks = [c, (self.pp - 1) * stride + c]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine

    def loss_group(self, rank: int):
        """Under PP, the ranks that sum the logged loss: every stage and data-parallel rank of one TP index
        (the last stage's hold it, the others zero); None: the whole world. Every rank calls it."""
        import torch.distributed as dist

        if self.tp == 1:
            return None
        mine = None
        for t in range(self.tp):
            group = dist.new_group([r for r in range(self.world_size) if r % self.tp == t])
            if t == self.tp_rank(rank):
                mine = group
        return mine
