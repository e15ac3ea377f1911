"""Training, checkpoints, distributed data parallelism, evaluation."""
