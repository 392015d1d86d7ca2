"""mlxchat plugin for LiquidAI's LFM2 / LFM2.5 (dense) and LFM2-MoE checkpoints, and their Pythonic
tool-call format."""

from mlxchat.plugin import Architecture, ChatQuirks, ToolCallParser, hookimpl

from .model import Lfm2Config, Lfm2ForCausalLM
from .tool_calls import PythonicCallsParser

LFM2 = Architecture(
    name="lfm2",
    model_types=("lfm2", "lfm2_moe"),
    config_class=Lfm2Config,
    model_class=Lfm2ForCausalLM,
    chat=ChatQuirks(tool_format="pythonic", reasoning=("<think>", "</think>"), stop_tokens=("<|im_end|>",)),
)


@hookimpl
def mlxchat_architectures() -> list[Architecture]:
    return [LFM2]


@hookimpl
def mlxchat_tool_parsers() -> dict[str, type[ToolCallParser]]:
    return {"pythonic": PythonicCallsParser}


__all__ = ["LFM2", "Lfm2Config", "Lfm2ForCausalLM", "PythonicCallsParser"]
