"""An mlxchat plugin for Llama 3.x and Mistral checkpoints, written as a third-party package would be:
it imports only ``mlxchat.plugin``, registers through the ``mlxchat.plugins`` entry point (see its
pyproject.toml) and is tested with ``mlxchat.testing``."""

from mlxchat.plugin import Architecture, ChatQuirks, ToolCallParser, hookimpl

from .model import LlamaConfig, LlamaForCausalLM
from .tool_calls import Llama31JsonParser

LLAMA = Architecture(
    name="llama",
    model_types=("llama",),
    config_class=LlamaConfig,
    model_class=LlamaForCausalLM,
    # Llama 3 ends a turn with <|eot_id|>, a reply that waits for a tool result with <|eom_id|>; no reasoning.
    chat=ChatQuirks(tool_format="llama3_json", stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")),
)
# Mistral's own tool-call format ([TOOL_CALLS] ...) is not read here: its replies are text.
MISTRAL = Architecture(name="mistral", model_types=("mistral",), config_class=LlamaConfig,
                       model_class=LlamaForCausalLM)


@hookimpl
def mlxchat_architectures() -> list[Architecture]:
    return [LLAMA, MISTRAL]


@hookimpl
def mlxchat_tool_parsers() -> dict[str, type[ToolCallParser]]:
    return {"llama3_json": Llama31JsonParser}


__all__ = ["LLAMA", "MISTRAL", "Llama31JsonParser", "LlamaConfig", "LlamaForCausalLM"]
