"""Named layers plugins build their blocks from."""

from .attention import Attention, attend
from .decoder import CausalLM, Decoder
from .mlp import SwiGLU
from .moe import SparseMoE, SwitchGLU, SwitchLinear, softmax_top_k, stack_experts
from .norms import RMSNorm
from .rope import RoPE

__all__ = [
    "Attention",
    "CausalLM",
    "Decoder",
    "RMSNorm",
    "RoPE",
    "SparseMoE",
    "SwiGLU",
    "SwitchGLU",
    "SwitchLinear",
    "attend",
    "softmax_top_k",
    "stack_experts",
]

from .short_conv import ShortConv, depthwise_weight  # noqa: E402

__all__ += ["ShortConv", "depthwise_weight"]

from .gated_delta import GatedDeltaNet, RMSNormGated, gated_delta_chunked, gated_delta_step  # noqa: E402

__all__ += ["GatedDeltaNet", "RMSNormGated", "gated_delta_chunked", "gated_delta_step"]

from .attention import window_mask  # noqa: E402
from .rope import ProportionalRoPE  # noqa: E402

__all__ += ["ProportionalRoPE", "window_mask"]
