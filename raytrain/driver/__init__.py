"""DRIVER side of a Ray run: start or join Ray, build and launch the TorchTrainer, draw rank 0's
progress, forward signals to the workers. The driver never touches torch.distributed state."""
