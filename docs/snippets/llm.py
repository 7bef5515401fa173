import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

# from transformers import Trainer, TrainingArguments      # before
from raytrain import Trainer, TrainingArguments            # after
from examples.lora import build_datasets

data = build_datasets(block_size=64)                       # packed byte-level blocks and their tokenizer
tokenizer = data["processing_class"]


def base_model():                                          # stands for from_pretrained("your/base-model")
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=172,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        initializer_range=0.1))


model = get_peft_model(base_model(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
args = TrainingArguments(output_dir="runs/lora-py", max_steps=40, per_device_train_batch_size=16,
                         learning_rate=2e-2, lr_scheduler_type="cosine", warmup_steps=2, gradient_checkpointing=True,
                         eval_strategy="steps", eval_steps=20, save_steps=20, save_total_limit=2,
                         load_best_model_at_end=True, metric_for_best_model="eval_loss", save_merged_model=True)
trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["eval"],
                  processing_class=tokenizer)
trainer.train()
trainer.save_model("runs/lora-py/final")                   # the adapter, the tokenizer, and merged/

adapter = PeftModel.from_pretrained(base_model(), "runs/lora-py/final")
merged = AutoModelForCausalLM.from_pretrained("runs/lora-py/final/merged")
tokenizer = AutoTokenizer.from_pretrained("runs/lora-py/final/merged")
print(trainer.evaluate()["eval_loss"], type(adapter).__name__, type(merged).__name__)
