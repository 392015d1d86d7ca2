"""mlxchat: local chat models on MLX behind stateful chat sessions.

Importing mlxchat first puts OpenBLAS (and the single-row gemv route) under MLX's CPU backend; see
:mod:`mlxchat.runtime`.
"""

from .runtime import configure_blas, package_version

configure_blas()
__version__ = package_version()

from . import configs  # noqa: E402  (a module: mlxchat.configs.list(), .get(name))
from .architecture import Architecture, ChatQuirks, ModelModule  # noqa: E402
from .cache import KVCache, LayerCache, StateCache  # noqa: E402
from .config import ModelConfig, RopeConfig  # noqa: E402
from .controller import ChatController, ChatState, InputRequest, QueuedPrompt, TurnGate  # noqa: E402
from .errors import (  # noqa: E402
    AdapterError,
    CheckpointError,
    ContextLengthError,
    DistributedError,
    GenerationError,
    ImageError,
    InvalidInputError,
    MlxchatError,
    ModelClosedError,
    PluginError,
    RewardError,
    SavedStateError,
    SessionClosedError,
    SessionStateError,
    StreamConsumedError,
    TemplateError,
    TrainingDivergedError,
    UnknownModelTypeError,
    UnsupportedQuantizationError,
)
from .generation import GenerationChunk, GenerationConfig, GenerationReport, GenerationResult  # noqa: E402
from .hookspecs import hookimpl  # noqa: E402
from .images import ImageProcessor, ProcessedImage, load_image  # noqa: E402
from .loading import build_model, checkpoint_context, load_model, load_session  # noqa: E402
from .messages import ChatMessage, FunctionCall, ReplyVersion, ToolCall  # noqa: E402
from .model import Capabilities, GenerativeModel  # noqa: E402
from .multimodal import ImageSpan, MultimodalPrompt, VisionModule  # noqa: E402
from .prefix_cache import PromptCachePool  # noqa: E402
from .prompt_cache import PromptCache  # noqa: E402
from .registry import detect_model_type, registry  # noqa: E402
from .reply import TextDelta, ThinkingDelta, ToolCallEvent  # noqa: E402
from .runtime import runtime_info  # noqa: E402
from .session import (  # noqa: E402
    ChatResult,
    ChatSession,
    ChatStream,
    Done,
    SessionCapableModel,
    SessionState,
    StreamEvent,
    ToolResultEvent,
)
from .tools import Tool, ToolContext, tool  # noqa: E402

__all__ = [
    "Architecture",
    "Capabilities",
    "ChatController",
    "ChatMessage",
    "ChatQuirks",
    "ChatResult",
    "ChatSession",
    "ChatState",
    "ChatStream",
    "AdapterError",
    "CheckpointError",
    "ContextLengthError",
    "DistributedError",
    "Done",
    "FunctionCall",
    "GenerationChunk",
    "GenerationConfig",
    "GenerationError",
    "GenerationReport",
    "GenerationResult",
    "GenerativeModel",
    "ImageError",
    "ImageProcessor",
    "ImageSpan",
    "InputRequest",
    "InvalidInputError",
    "KVCache",
    "LayerCache",
    "MlxchatError",
    "ModelConfig",
    "ModelModule",
    "MultimodalPrompt",
    "PluginError",
    "RewardError",
    "TrainingDivergedError",
    "ProcessedImage",
    "PromptCache",
    "PromptCachePool",
    "QueuedPrompt",
    "ReplyVersion",
    "SavedStateError",
    "RopeConfig",
    "SessionCapableModel",
    "SessionState",
    "ModelClosedError",
    "SessionClosedError",
    "SessionStateError",
    "StateCache",
    "StreamConsumedError",
    "StreamEvent",
    "TemplateError",
    "TextDelta",
    "ThinkingDelta",
    "Tool",
    "ToolCall",
    "ToolCallEvent",
    "ToolContext",
    "ToolResultEvent",
    "TurnGate",
    "UnknownModelTypeError",
    "UnsupportedQuantizationError",
    "VisionModule",
    "__version__",
    "build_model",
    "configs",
    "detect_model_type",
    "hookimpl",
    "load_image",
    "checkpoint_context",
    "load_model",
    "load_session",
    "registry",
    "runtime_info",
    "tool",
]
