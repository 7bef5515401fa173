# from transformers import Trainer, TrainingArguments      # before
from raytrain import Trainer, TrainingArguments            # after
