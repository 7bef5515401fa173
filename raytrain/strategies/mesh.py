"""The layout of a run over its ranks (torchtitan's ParallelDims): data-parallel replicas (HSDP's
replicate dim), data-parallel shards (FSDP2) and tensor-parallel groups, sized from HF's
`parallelism_config` and built once into a device mesh.

Mesh dims, outermost first: dp_replicate, dp_shard, tp. TP is innermost, so a TP group is consecutive
ranks: the workers of one node (Ray places them PACKed, local ranks in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FIELDS = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")


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
    else:
        raise ValueError(f"parallelism_config: a mapping of {', '.join(FIELDS)} or accelerate's "
                         f"ParallelismConfig, got {type(config).__name__}")
    out = {"dp_replicate_size": 1, "dp_shard_size": -1, "tp_size": 1, "cp_size": 1, "sp_size": 1}
    for key, value in raw.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and not (key == "dp_shard_size"
                                                                                         and value == -1)):
            rule = "an integer >= 1 or -1 (the rest of the ranks)" if key == "dp_shard_size" else "an integer >= 1"
            raise ValueError(f"parallelism_config.{key}: {rule}, got {value!r}")
        out[key] = value
    if out["cp_size"] > 1:
        raise ValueError(f"parallelism_config.cp_size: context parallelism needs CUDA (ring attention over "
                         f"NCCL); set cp_size 1, got {out['cp_size']}")
    if out.pop("sp_size") > 1:
        raise ValueError("parallelism_config.sp_size: sequence parallelism (accelerate's, DeepSpeed Ulysses) is not "
                         "supported; set sp_size 1 (tp_plan's sequence_parallel style splits norms along TP)")
    return out


@dataclass(frozen=True)
class ParallelDims:
    """Validated sizes; `dp_replicate * dp_shard * tp == world_size`."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def resolve(cls, config: Any, world_size: int) -> ParallelDims:
        """Sizes for `world_size` ranks (dp_shard -1: what the other dims leave); one-line ValueError."""
        c = normalize(config) or {"dp_replicate_size": 1, "dp_shard_size": -1, "tp_size": 1, "cp_size": 1}
        rep, shard, tp = c["dp_replicate_size"], c["dp_shard_size"], c["tp_size"]
        if shard == -1:
            if world_size % (rep * tp):
                raise ValueError(f"parallelism_config: dp_replicate_size {rep} x tp_size {tp} must divide the "
                                 f"world size (scaling.num_workers) {world_size}")
            shard = world_size // (rep * tp)
        if rep * shard * tp != world_size:
            raise ValueError(f"parallelism_config: dp_replicate_size {rep} x dp_shard_size {shard} x tp_size {tp} "
                             f"= {rep * shard * tp} must equal the world size (scaling.num_workers) {world_size}")
        return cls(rep, shard, tp, world_size)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def as_dict(self) -> dict[str, int]:
        return {"dp_replicate_size": self.dp_replicate, "dp_shard_size": self.dp_shard, "tp_size": self.tp}

    def check_local(self, local_world_size: int | None) -> None:
        """A TP group within one node: its all-reduces run every layer, too often for the network."""
        if local_world_size and self.tp > 1 and local_world_size % self.tp:
            raise ValueError(f"parallelism_config.tp_size: {self.tp} must divide the workers per node "
                             f"({local_world_size}) so that a TP group stays within one node")

    def build_mesh(self, device_type: str):
        """The device mesh (dp_replicate, dp_shard, tp); a collective, once per run."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    def dp_group(self, rank: int):
        """The process group of `rank`'s data-parallel peers (same TP index); every rank calls it."""
        import torch.distributed as dist

        mine = None
        for t in range(self.tp):  # every rank creates every group, in the same order
            group = dist.new_group([d * self.tp + t for d in range(self.dp)])
            if t == self.tp_rank(rank):
                mine = group
        return mine
