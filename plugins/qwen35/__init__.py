"""mlxchat plugin for Qwen3.5 (qwen3_5, qwen3_5_moe: hybrid Gated DeltaNet + gated attention) checkpoints (in progress: registers nothing yet)."""
