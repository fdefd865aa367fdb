"""The training loop and what it writes: metrics, run directories, checkpoints of its state."""
