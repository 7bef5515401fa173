from raytrain import EarlyStoppingCallback, Trainer, TrainingArguments
from examples.digits import build_datasets, build_model, compute_metrics

train, val = build_datasets()
model = build_model(hidden_size=64)
args = TrainingArguments(output_dir="runs/x", num_train_epochs=4, per_device_train_batch_size=32,
                         learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=0.05,
                         eval_strategy="epoch", save_strategy="epoch", save_total_limit=2,
                         load_best_model_at_end=True, metric_for_best_model="accuracy")
trainer = Trainer(model, args, train_dataset=train, eval_dataset=val, compute_metrics=compute_metrics,
                  callbacks=[EarlyStoppingCallback(early_stopping_patience=3)])
trainer.train()                              # or train(resume_from_checkpoint=True)
metrics = trainer.evaluate()                 # {'eval_loss': ..., 'eval_accuracy': ..., 'epoch': ...}
prediction = trainer.predict(val)            # predictions, label_ids, metrics (test_*)
trainer.save_model("runs/x/final")           # runs/x/final/model.safetensors
