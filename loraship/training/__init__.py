"""What the train stage runs: model loading, batches, the step loop, evaluation, checkpoints, the out-of-memory
re-plan loop; and the kernels and memory savers under it (weight streaming, activation offload, packed attention)."""
