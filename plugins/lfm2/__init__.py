"""mlxchat plugin for LFM2 (lfm2, lfm2_moe: short-conv hybrid) checkpoints (in progress: registers nothing yet)."""
