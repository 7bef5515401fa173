"""DATA: every input -> batches for one rank (sharded, deterministic, resumable).

Bottom to top: sources (errors, columns, in-memory datasets), stream (block streaming), files
(Parquet / CSV / JSON lines), ray_data (Ray Data), loaders (what the Trainer builds).
"""

from .ray_data import RayData
from .sources import (DataError, DataFileNotFoundError, Files, MapSource, build_source, count_items,
                      default_collate, model_inputs)

__all__ = ["DataError", "DataFileNotFoundError", "Files", "MapSource", "RayData", "build_source",
           "count_items", "default_collate", "model_inputs"]
