from raytrain import Trainer, TrainingArguments
from examples.digits import build_datasets, build_model, compute_metrics

train, val = build_datasets()
args = TrainingArguments(output_dir="runs/digits", max_steps=180, eval_strategy="steps", eval_steps=45,
                         save_strategy="steps", save_steps=45, metric_for_best_model="accuracy")
trainer = Trainer(model_init=build_model, args=args, train_dataset=train, eval_dataset=val,
                  compute_metrics=compute_metrics)
best = trainer.hyperparameter_search(
    {"learning_rate": {"loguniform": [1e-4, 1e-2]}, "model.hidden_size": {"choice": [64, 128, 256]}},
    n_trials=16, direction="maximize", metric="accuracy", scheduler="asha", seed=0, name="digits")
print(best.run_id, best.objective, best.hyperparameters, best.checkpoint)
print(best.run_summary)          # the trials table as a DataFrame (also trials.csv)
