from raytrain import Trainer, TrainingArguments
from examples.digits import build_datasets, build_model, compute_metrics

train, val = build_datasets()
args = TrainingArguments(output_dir="runs/digits-py", num_train_epochs=3, learning_rate=3e-3,
                         per_device_train_batch_size=32, eval_strategy="epoch", save_strategy="epoch")
trainer = Trainer(build_model(), args, train_dataset=train, eval_dataset=val, compute_metrics=compute_metrics)
trainer.train()
print(trainer.evaluate())              # {'eval_loss': ..., 'eval_accuracy': ..., ...}
trainer.save_model("runs/digits-py/final")
