import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain import Files, Trainer, TrainingArguments
from examples.digits import build_datasets, build_model

train, _ = build_datasets()                               # write the digits as two Parquet files
table = pa.table({"pixels": list(train["pixels"]), "labels": train["labels"]})
pq.write_table(table.slice(0, 700), "digits-0.parquet")
pq.write_table(table.slice(700), "digits-1.parquet")


def to_float32(batch):                                    # numpy in, numpy out, one row per row
    return {"pixels": np.stack(batch["pixels"]).astype(np.float32), "labels": batch["labels"]}


args = TrainingArguments(output_dir="runs/files", max_steps=30, per_device_train_batch_size=32)
data = Files("digits-*.parquet", preprocess=to_float32)  # in memory: it is small; stream=True streams it
Trainer(build_model(), args, train_dataset=data).train()
