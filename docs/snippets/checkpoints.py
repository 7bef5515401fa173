from raytrain import Trainer, TrainingArguments, get_last_checkpoint
from examples.digits import build_datasets, build_model

train, val = build_datasets()
args = TrainingArguments(output_dir="runs/ckpt", max_steps=40, save_strategy="steps", save_steps=20,
                         save_total_limit=2, per_device_train_batch_size=32)
Trainer(build_model(), args, train_dataset=train).train()
print(get_last_checkpoint("runs/ckpt"))                  # runs/ckpt/checkpoint-40

args.max_steps = 60                                       # go on for 20 more steps
trainer = Trainer(build_model(), args, train_dataset=train)
trainer.train(resume_from_checkpoint=True)                # the newest valid checkpoint in output_dir
trainer.train(resume_from_checkpoint="runs/ckpt/checkpoint-40")   # or a given one
