"""mlxchat plugin for Gemma 4 text (sliding + global attention, per-layer embeddings) checkpoints (in progress: registers nothing yet)."""
