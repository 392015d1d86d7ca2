"""Training: supervised fine-tuning / pre-training of any plugin architecture on MLX autograd (in progress)."""
