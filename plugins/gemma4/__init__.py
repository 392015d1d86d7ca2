"""mlxchat plugin for Gemma 4 checkpoints, served as text models (the multimodal towers are skipped)."""

from mlxchat.plugin import Architecture, ChatQuirks, ToolCallParser, hookimpl

from .model import Gemma4Config, Gemma4ForCausalLM
from .tool_calls import Gemma4ToolParser

GEMMA4 = Architecture(
    name="gemma4",
    model_types=("gemma4", "gemma4_text"),
    config_class=Gemma4Config,
    model_class=Gemma4ForCausalLM,
    chat=ChatQuirks(
        tool_format="gemma4",
        # The thought channel's label belongs to the marker, so reasoning text starts after it; a prompt
        # that ends inside the channel (thinking on, after tool results) ends with exactly this marker.
        reasoning=("<|channel>thought\n", "<channel|>"),
        # A reply ends its turn, or stops after its tool calls to wait for the results.
        stop_tokens=("<turn|>", "<|tool_response>"),
    ),
)


@hookimpl
def mlxchat_architectures() -> list[Architecture]:
    return [GEMMA4]


@hookimpl
def mlxchat_tool_parsers() -> dict[str, type[ToolCallParser]]:
    return {"gemma4": Gemma4ToolParser}


__all__ = ["GEMMA4", "Gemma4Config", "Gemma4ForCausalLM", "Gemma4ToolParser"]
