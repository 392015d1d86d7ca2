"""mlxchat plugin for Qwen3.5 (dense) and Qwen3.5-MoE checkpoints: hybrid Gated DeltaNet + gated
attention, and the XML tool-call format (``qwen3_xml``) that Qwen3.5, Qwen3.6 and Qwen3-Coder share."""

from mlxchat.plugin import Architecture, ChatQuirks, hookimpl

from .model import Qwen35Config, Qwen35ForCausalLM
from .tool_parser import XmlToolCallParser

QWEN35 = Architecture(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
    config_class=Qwen35Config,
    model_class=Qwen35ForCausalLM,
    chat=ChatQuirks(tool_format="qwen3_xml", reasoning=("<think>", "</think>"),
                    stop_tokens=("<|im_end|>", "<|endoftext|>")),
)


@hookimpl
def mlxchat_architectures() -> list[Architecture]:
    return [QWEN35]


@hookimpl
def mlxchat_tool_parsers() -> dict[str, type[XmlToolCallParser]]:
    return {"qwen3_xml": XmlToolCallParser}


__all__ = ["QWEN35", "Qwen35Config", "Qwen35ForCausalLM", "XmlToolCallParser"]
