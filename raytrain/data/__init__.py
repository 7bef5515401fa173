"""DATA: every input -> batches for one rank (sharded, deterministic, resumable).

Bottom to top: errors; columns (collation, Arrow -> numpy, schema checks), prefetch, sharding (the
rule and stream layouts); sources (in memory, Files); remap; stream (blocks larger than memory); files
and ray_data (their readers); build (build_source: any input -> a source); loaders (the Trainer's).
"""

from .build import build_source, model_inputs, trainer_datasets
from .columns import count_items, default_collate
from .errors import DataError, DataFileNotFoundError
from .ray_data import RayData
from .sharding import plan_epoch
from .sources import Files, MapSource
from .stream import StreamSource

__all__ = ["DataError", "DataFileNotFoundError", "Files", "MapSource", "RayData", "StreamSource", "build_source",
           "count_items", "default_collate", "model_inputs", "plan_epoch", "trainer_datasets"]
