"""Named layers plugins build their blocks from."""

from .attention import Attended, Attention, attend, attend_over, fetch_attended, fused_heads, window_mask
from .decoder import CausalLM, Decoder
from .fused import Projections, fuse_projections
from .gated_delta import GatedDeltaNet, RMSNormGated, gated_delta_chunked, gated_delta_step
from .mlp import SwiGLU, gate_function, gelu_tanh_gate, silu_gate
from .moe import SparseMoE, SwitchGLU, SwitchLinear, softmax_top_k, stack_experts
from .norms import RMSNorm, rms_norm
from .parallel import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    all_reduce,
    balanced,
    head_split,
    input_unit,
    shard_experts,
    shard_layers,
    slice_inputs,
    slice_outputs,
)
from .rope import MRoPE, ProportionalRoPE, RoPE, rotate
from .short_conv import ShortConv, depthwise_weight
from .vision import AxialRoPE, attend_all

__all__ = [
    "Attention",
    "AxialRoPE",
    "CausalLM",
    "Decoder",
    "GatedDeltaNet",
    "MRoPE",
    "Projections",
    "ProportionalRoPE",
    "RMSNorm",
    "RMSNormGated",
    "RoPE",
    "RowParallelLinear",
    "ShortConv",
    "SparseMoE",
    "SwiGLU",
    "SwitchGLU",
    "SwitchLinear",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "all_reduce",
    "Attended",
    "attend",
    "attend_over",
    "attend_all",
    "balanced",
    "depthwise_weight",
    "fuse_projections",
    "gate_function",
    "gated_delta_chunked",
    "gated_delta_step",
    "gelu_tanh_gate",
    "head_split",
    "input_unit",
    "rms_norm",
    "rotate",
    "shard_experts",
    "shard_layers",
    "silu_gate",
    "slice_inputs",
    "slice_outputs",
    "softmax_top_k",
    "stack_experts",
    "fetch_attended",
    "fused_heads",
    "window_mask",
]
