"""The trainer: LoRA training runs (forward_backward, optim_step), losses, clock-cycle execution and
checkpoints."""
