from dataclasses import dataclass, field

from raytrain import TrainingArguments


@dataclass
class MyArgs(TrainingArguments):                 # a dataclass, as HF's: subclass it, parse it
    model_name: str = field(default="mlp", metadata={"help": "which model to build"})


args = MyArgs("runs/hf", num_train_epochs=2, learning_rate=1e-3)
print(args.model_name, args.learning_rate, args.output_dir)

# The same script on two Ray Train workers: one more argument (or `--scaling num_workers=2` on
# the command line of a script that parses its arguments with HfArgumentParser).
args = MyArgs("runs/hf", num_train_epochs=2, scaling={"num_workers": 2})
