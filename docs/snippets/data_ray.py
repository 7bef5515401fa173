import ray

from raytrain import RayData, Trainer, TrainingArguments
from examples.digits import build_model

ds = ray.data.read_parquet("s3://my-bucket/digits/").map_batches(lambda b: b, batch_format="numpy")
args = TrainingArguments(output_dir="runs/ray-data", max_steps=1000, scaling={"num_workers": 2})
# map_batches may change the row count: num_rows (or max_steps, as here) lets it stream beside training
Trainer(build_model(), args, train_dataset=RayData(ds, num_rows=1438, buffer_bytes=64 << 20)).train()
