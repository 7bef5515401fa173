"""What a run is told: TrainingArguments (HF's fields) and their validation, the CLI config's sections."""
