"""Everything plugin code imports, in one place: the contract (:class:`Architecture`, :class:`ChatQuirks`,
:data:`hookimpl`), configs, the layers blocks are built from, the layer caches and the tool-call parser
bases. A plugin that imports only from here (and ``mlxchat``) keeps working when core's modules move.

A plugin package is a module with ``@hookimpl`` functions, declared under the ``mlxchat.plugins``
entry-point group (see :mod:`mlxchat.hookspecs` for the hooks)::

    from mlxchat.plugin import Architecture, ChatQuirks, hookimpl

    @hookimpl
    def mlxchat_architectures():
        return [Architecture("llama", ("llama",), LlamaConfig, LlamaForCausalLM,
                             ChatQuirks(tool_format="llama3_json", stop_tokens=("<|eot_id|>",)))]

``mlxchat.testing`` then checks it against transformers and the session contract.
"""

from .architecture import Architecture, ChatQuirks, ModelModule
from .cache import KVCache, LayerCache, RaggedRows, RowCaches, SlidingWindowCache, StateCache
from .config import ModelConfig, RopeConfig
from .errors import CheckpointError, ImageError
from .hookspecs import hookimpl
from .images import Gemma4ImageProcessor, ImageProcessor, ProcessedImage, Qwen2VLImageProcessor
from .layers import (
    Attended,
    Attention,
    AxialRoPE,
    CausalLM,
    Decoder,
    GatedDeltaNet,
    MRoPE,
    Projections,
    ProportionalRoPE,
    RMSNorm,
    RMSNormGated,
    RoPE,
    RowParallelLinear,
    ShortConv,
    SparseMoE,
    SwiGLU,
    SwitchGLU,
    SwitchLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    all_reduce,
    attend,
    attend_all,
    attend_over,
    balanced,
    depthwise_weight,
    fetch_attended,
    gate_function,
    gated_delta_chunked,
    gated_delta_step,
    gelu_tanh_gate,
    head_split,
    input_unit,
    shard_experts,
    shard_layers,
    silu_gate,
    slice_inputs,
    slice_outputs,
    softmax_top_k,
    stack_experts,
    window_mask,
)
from .multimodal import ImageTokens, MultimodalPrompt, VisionModule, embed_with_images
from .tools.parsing import (
    CallBlock,
    JsonTagsParser,
    ParsedCall,
    TaggedCallParser,
    ToolCallParser,
    TrailingCallParser,
    guess_name,
)

__all__ = [
    "Architecture",
    "Attended",
    "Attention",
    "AxialRoPE",
    "Gemma4ImageProcessor",
    "ImageError",
    "ImageProcessor",
    "ImageTokens",
    "MRoPE",
    "MultimodalPrompt",
    "ProcessedImage",
    "Qwen2VLImageProcessor",
    "VisionModule",
    "attend_all",
    "embed_with_images",
    "CallBlock",
    "CausalLM",
    "ChatQuirks",
    "CheckpointError",
    "Decoder",
    "GatedDeltaNet",
    "JsonTagsParser",
    "KVCache",
    "LayerCache",
    "ModelConfig",
    "ModelModule",
    "ParsedCall",
    "Projections",
    "ProportionalRoPE",
    "RMSNorm",
    "RMSNormGated",
    "RaggedRows",
    "RoPE",
    "RowCaches",
    "RopeConfig",
    "ShortConv",
    "SlidingWindowCache",
    "SparseMoE",
    "StateCache",
    "SwiGLU",
    "SwitchGLU",
    "SwitchLinear",
    "TaggedCallParser",
    "ToolCallParser",
    "TrailingCallParser",
    "attend",
    "attend_over",
    "depthwise_weight",
    "gate_function",
    "gated_delta_chunked",
    "gated_delta_step",
    "gelu_tanh_gate",
    "guess_name",
    "hookimpl",
    "silu_gate",
    "softmax_top_k",
    "stack_experts",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "all_reduce",
    "balanced",
    "head_split",
    "input_unit",
    "shard_experts",
    "shard_layers",
    "slice_inputs",
    "slice_outputs",
    "fetch_attended",
    "window_mask",
]
