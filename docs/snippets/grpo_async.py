# from trl.experimental.async_grpo import AsyncGRPOTrainer, AsyncGRPOConfig
from raytrain.trl import AsyncGRPOTrainer, AsyncGRPOConfig
from peft import LoraConfig

from examples.grpo import build_datasets, correct_sum, brevity
from examples.sft import build_model

data = build_datasets(n_train=64, n_eval=8)
args = AsyncGRPOConfig("runs/grpo-async", max_steps=20, per_device_train_batch_size=4, num_generations=4,
                       max_completion_length=8, learning_rate=5e-3, bf16=False, max_staleness=1,
                       rollout={"num_workers": 2, "num_cpus_per_worker": 1})  # raytrain-rollout-0 and -1
trainer = AsyncGRPOTrainer(build_model(), reward_funcs=[correct_sum, brevity], args=args,
                           train_dataset=data["train"], eval_dataset=data["eval"],
                           processing_class=data["processing_class"],
                           peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
trainer.train()
print(trainer.evaluate())  # {'eval_reward': ..., 'eval_rewards/correct_sum/mean': ..., ...}
