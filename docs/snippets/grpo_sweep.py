from raytrain.trl import GRPOTrainer, GRPOConfig

from examples.grpo import brevity, build_datasets, correct_sum
from examples.sft import build_lora_model

data = build_datasets()
args = GRPOConfig("runs/grpo-sweep", num_generations=4, max_completion_length=8, per_device_train_batch_size=4,
                  per_device_eval_batch_size=8, max_steps=20, learning_rate=5e-3, eval_strategy="steps",
                  eval_steps=10, save_steps=10, bf16=False)
trainer = GRPOTrainer(model_init=build_lora_model, reward_funcs=[correct_sum, brevity], args=args,
                      train_dataset=data["train"], eval_dataset=data["eval"], processing_class=data["processing_class"])
best = trainer.hyperparameter_search(  # one model_init() per trial; the objective: eval_reward, maximized
    {"beta": {"choice": [0.0, 0.04]}, "learning_rate": {"loguniform": [1e-3, 1e-2]},
     "num_generations": {"choice": [2, 4]}},
    n_trials=8, name="grpo")  # a YAML-form space: Ray Tune + Optuna
print(best.run_id, best.objective, best.hyperparameters)
