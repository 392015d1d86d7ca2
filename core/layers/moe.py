"""Mixture of experts with gathered matmuls: every token runs only its top-k experts, with no Python loop.

Expert weights are stacked ``[experts, out, in]`` under ``switch_mlp.{gate,up,down}_proj`` (the layout
MLX checkpoints ship; plugins' ``sanitize`` stacks per-expert or splits fused checkpoint tensors into it).
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import mlx.nn as nn

from ..errors import CheckpointError
from ..quantized import gather_matmul, gather_quantized_matmul, gathers_rows
from .mlp import SwiGLU, gate_function
from .parallel import ExpertSplit, all_reduce, shard_experts

# Below this many (token, expert) pairs, sorting tokens by expert for MLX's kernels costs more than it saves.
_SORT_THRESHOLD = 64


class SwitchLinear(nn.Module):
    """One linear layer per expert; each row of ``x`` goes through the experts named in ``indices``."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        bound = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-bound, bound, (num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return gather_matmul(x, self.weight, indices, sorted_indices)

    def gathers_rows(self, x: mx.array) -> bool:
        """Whether the product orders ``x``'s rows by expert itself (see :func:`mlxchat.quantized.gathers_rows`)."""
        return gathers_rows(x, self.weight)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: object) -> nn.Module:
        return QuantizedSwitchLinear.from_weight(self.weight, group_size, bits, mode)


class QuantizedSwitchLinear(nn.Module):
    """:class:`SwitchLinear` with quantized expert weights (``weight``/``scales``/``biases``); the products go
    through :func:`mlxchat.quantized.gather_quantized_matmul`."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
                 mode: str):
        super().__init__()
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.freeze()

    @classmethod
    def from_weight(cls, weight: mx.array, group_size: int, bits: int, mode: str) -> QuantizedSwitchLinear:
        quantized, scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        return cls(quantized, scales, biases[0] if biases else None, group_size, bits, mode)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return gather_quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), indices,
                                       self.group_size, self.bits, self.mode, sorted_indices)

    def gathers_rows(self, x: mx.array) -> bool:
        """Whether the product orders ``x``'s rows by expert itself (see :func:`mlxchat.quantized.gathers_rows`)."""
        return gathers_rows(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                            self.mode)


class SwitchGLU(nn.Module):
    """Gated experts (SiLU by default, see :class:`SwiGLU`): ``x [..., D]`` and ``indices [..., k]`` give
    ``[..., k, D]``.

    Split by expert (:func:`~mlxchat.layers.parallel.shard_experts`), a rank holds the experts of
    ``expert_range`` only and gives zeros for the others."""

    expert_range: range | None = None

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, activation: str = "silu"):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden_size, intermediate_size, num_experts)
        self.up_proj = SwitchLinear(hidden_size, intermediate_size, num_experts)
        self.down_proj = SwitchLinear(intermediate_size, hidden_size, num_experts)
        self._gate = gate_function(activation)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        held = None
        if self.expert_range is not None:
            local = indices - self.expert_range.start
            held = (local >= 0) & (local < len(self.expert_range))
            indices = mx.where(held, local, 0)
        out = self._experts(x, indices)
        return out if held is None else mx.where(held[..., None], out, 0)

    def _experts(self, x: mx.array, indices: mx.array) -> mx.array:
        top_k, shape = indices.shape[-1], indices.shape
        x = mx.expand_dims(x, (-2, -3))
        sort = indices.size >= _SORT_THRESHOLD and not self.gate_proj.gathers_rows(x)
        if sort:
            # Group rows by expert so that each expert's weights are read once per chunk (MLX's kernels; the
            # native CPU kernels group them themselves).
            flat = indices.flatten()
            order = mx.argsort(flat)
            inverse = mx.argsort(order)
            x = x.flatten(0, -3)[order // top_k]
            indices = flat[order]
        hidden = self._gate(self.gate_proj(x, indices, sort), self.up_proj(x, indices, sort))
        out = self.down_proj(hidden, indices, sort)
        if sort:
            out = out[inverse].reshape(*shape, 1, out.shape[-1])
        return out.squeeze(-2)


def softmax_top_k(logits: mx.array, top_k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Softmax over all experts, keep the ``top_k`` largest, optionally renormalise them to sum to 1."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    indices = mx.stop_gradient(mx.argpartition(-probs, kth=top_k - 1, axis=-1)[..., :top_k])  # no gradient: ranks
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(logits.dtype), indices


class SparseMoE(nn.Module):
    """Router ``gate`` + experts ``switch_mlp``, and an optional sigmoid-gated ``shared_expert``."""

    group: mx.distributed.Group | None = None

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        shared_intermediate_size: int | None = None,
        activation: str = "silu",
    ):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.switch_mlp = SwitchGLU(hidden_size, intermediate_size, num_experts, activation)
        self.has_shared = shared_intermediate_size is not None
        if shared_intermediate_size is not None:
            self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size, activation=activation)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Per-token expert weights and indices, ``[..., top_k]`` each."""
        return softmax_top_k(self.gate(x), self.top_k, self.norm_topk_prob)

    def __call__(self, x: mx.array) -> mx.array:
        weights, indices = self.route(x)
        y = (self.switch_mlp(x, indices) * weights[..., None]).sum(axis=-2)
        if self.has_shared:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(y, self.group)

    def shard(self, group: mx.distributed.Group, experts: ExpertSplit | None = None) -> None:
        """Tensor parallel: the router stays whole, the experts (and the shared expert) split; the ranks' parts
        of the output meet in one all-reduce."""
        shard_experts(self.switch_mlp, group, experts)
        if self.has_shared:
            self.shared_expert.shard(group, reduce=False)
        self.group = group


_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(weight|scales|biases)$")

FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Fused expert tensors ``<p>.experts.<name> [E, out, in]`` and the :class:`SwitchGLU` projections they hold
along ``out``, in order: transformers' layout (the one peft's ``target_parameters`` adapt)."""


def stack_experts(weights: dict[str, mx.array], names: dict[str, str] | None = None) -> dict[str, mx.array]:
    """Bring expert tensors into the ``switch_mlp`` layout, from either checkpoint layout:

    - per expert: ``<p>.experts.<e>.<proj>.weight`` stacked into ``<p>.switch_mlp.<proj>.weight``;
    - fused (:data:`FUSED_EXPERTS`): ``<p>.experts.gate_up_proj [E, 2I, H]`` split into gate and up,
      ``<p>.experts.down_proj``.

    ``names`` renames checkpoint projections to ``gate_proj``/``up_proj``/``down_proj`` (e.g. ``w1``).
    """
    names = names or {}
    out: dict[str, mx.array] = {}
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    for key, value in weights.items():
        match = _PER_EXPERT.match(key)
        prefix, _, fused = key.rpartition(".experts.")
        if match:
            prefix, expert, proj, kind = match.groups()
            groups.setdefault((prefix, names.get(proj, proj), kind), {})[int(expert)] = value
        elif prefix and fused in FUSED_EXPERTS:
            projections = FUSED_EXPERTS[fused]
            parts = mx.split(value, len(projections), axis=-2) if len(projections) > 1 else [value]
            for proj, part in zip(projections, parts, strict=True):
                out[f"{prefix}.switch_mlp.{proj}.weight"] = part
        else:
            out[key] = value
    for (prefix, proj, kind), experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise CheckpointError(f"{prefix}.experts: tensors for experts {missing} are missing ({proj}.{kind})")
        out[f"{prefix}.switch_mlp.{proj}.{kind}"] = mx.stack([experts[e] for e in range(len(experts))])
    return out
