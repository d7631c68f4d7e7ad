"""Training kernels and memory savers the train stage uses: weight streaming, activation offload, packing, packed attention."""
