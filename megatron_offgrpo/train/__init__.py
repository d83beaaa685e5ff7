"""The trainer: builders from the config, the megatron step with the fused loss, the loop, checkpoints, metrics."""
