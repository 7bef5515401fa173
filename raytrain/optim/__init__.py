"""Optimizers (HF's parameter groups, torch's names) and every learning-rate schedule."""
