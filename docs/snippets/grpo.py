# from trl import GRPOTrainer, GRPOConfig
from raytrain.trl import GRPOTrainer, GRPOConfig
from datasets import Dataset
from peft import LoraConfig

from examples.sft import build_model, build_tokenizer, preferences


def brief(completions, **kwargs):  # TRL's signature: one reward per completion (None: does not apply)
    return [-abs(len(c[0]["content"]) - 4) / 4 for c in completions]


def has_digit(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in c[0]["content"])) for c in completions]


dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in preferences(32)])  # conversational prompts
args = GRPOConfig("runs/grpo", num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                  num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=4, beta=0.04,
                  max_steps=4, save_steps=2, logging_steps=1, report_to="none")
trainer = GRPOTrainer(model=build_model(), reward_funcs=[brief, has_digit], args=args, train_dataset=dataset,
                      processing_class=build_tokenizer(),
                      peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
trainer.train()  # after a SIGKILL: trainer.train(resume_from_checkpoint=True) continues the same run exactly
