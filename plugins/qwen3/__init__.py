"""mlxchat plugin for Qwen3 (dense) and Qwen3-MoE checkpoints."""

from mlxchat.plugin import Architecture, ChatQuirks, hookimpl

from .model import Qwen3Config, Qwen3ForCausalLM

QWEN3 = Architecture(
    name="qwen3",
    model_types=("qwen3", "qwen3_moe"),
    config_class=Qwen3Config,
    model_class=Qwen3ForCausalLM,
    chat=ChatQuirks(tool_format="json_tags", reasoning=("<think>", "</think>"),
                    stop_tokens=("<|im_end|>", "<|endoftext|>")),
)


@hookimpl
def mlxchat_architectures() -> list[Architecture]:
    return [QWEN3]


__all__ = ["QWEN3", "Qwen3Config", "Qwen3ForCausalLM"]
