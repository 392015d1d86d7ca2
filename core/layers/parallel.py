"""Tensor parallelism: every rank holds a slice of each large weight, runs its part of every layer, and the
partial results meet in one all-reduce (``mx.distributed.all_sum``) at the end of each mixer and feed-forward.

Layers split themselves with a ``shard(group)`` method: attention by heads (a KV head is replicated on the
ranks whose query heads read it when there are fewer KV heads than ranks), MLPs by hidden units, experts
within each expert or by expert (:func:`shard_experts`), DeltaNet by heads, short convolutions by
channels. :meth:`~mlxchat.layers.CausalLM.shard` calls it on every layer that has one (a layer without one
stays whole on every rank, which is always correct) and splits the embedding and the output projection by
vocabulary (:class:`VocabParallelEmbedding`, :class:`VocabParallelHead`).

A column-parallel layer is the layer itself with the output rows of the other ranks cut away
(:func:`slice_outputs`); a row-parallel one (:class:`RowParallelLinear`) keeps its input columns and sums
the ranks' products. Every cut is recorded (:func:`shard_slices`), so loading reads only this rank's slice of
each tensor. Splits may be uneven (3 ranks over 4 heads); a quantized layer is cut across its inputs only
at quantization-group boundaries. MLX's own ``shard_linear`` needs even splits and full weights in memory
first, hence these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import DistributedError
from ..quantized import dequantize_rows, quantized_matmul

Ranges = Sequence[tuple[int, int]]
ExpertSplit = Literal["width", "expert"]
PIPELINE_HINT = "use distributed='pipeline', or fewer ranks"


@dataclass(frozen=True)
class Slice:
    """Which part of a checkpoint tensor a parameter holds: the ``ranges`` along ``axis``, concatenated."""

    axis: int
    ranges: tuple[tuple[int, int], ...]

    def index(self, ndim: int, start: int, stop: int) -> tuple[slice, ...]:
        axis = self.axis % ndim
        return (slice(None),) * axis + (slice(start, stop),)

    def take(self, tensor: mx.array) -> mx.array:
        parts = [tensor[self.index(tensor.ndim, a, b)] for a, b in self.ranges]
        return mx.contiguous(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=self.axis))


def balanced(total: int, parts: int, unit: int = 1, what: str = "features") -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``parts`` contiguous pieces of ``total``, as equal as whole ``unit``s allow
    (the first pieces one unit larger)."""
    units, rest = divmod(total, unit)
    if rest or units < parts:
        raise DistributedError(f"{total} {what} cannot be split over {parts} ranks"
                               + (f" in whole groups of {unit}" if unit > 1 else "") + f"; {PIPELINE_HINT}")
    base, extra = divmod(units, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + (base + (part < extra)) * unit)
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def head_split(heads: int, kv_heads: int, size: int, what: str = "attention heads") -> list[tuple[tuple[int, int],
                                                                                                tuple[int, int]]]:
    """Each rank's query heads and the KV heads they read, ``((q0, q1), (kv0, kv1))``.

    With at least as many KV heads as ranks, the ranks split the KV heads and take the query heads of each
    group; with fewer, the ranks split among the groups and each KV head is replicated on the ranks that
    share its queries (every rank's query heads still read one KV head each, as grouped-query attention does).
    """
    if heads % kv_heads:
        raise DistributedError(f"{heads} {what} do not form groups over {kv_heads} KV heads")
    if heads < size:
        raise DistributedError(f"{heads} {what} cannot be split over {size} ranks; {PIPELINE_HINT}")
    group = heads // kv_heads
    if kv_heads >= size:
        return [((a * group, b * group), (a, b)) for a, b in balanced(kv_heads, size, what=what)]
    split = []
    for kv, (first, stop) in enumerate(balanced(size, kv_heads, what="ranks")):
        for a, b in balanced(group, stop - first, what=what):
            split.append(((kv * group + a, kv * group + b), (kv, kv + 1)))
    return split


def all_reduce(x: mx.array, group: mx.distributed.Group | None) -> mx.array:
    """The sum of every rank's ``x`` (``x`` itself when the layer is not split)."""
    return x if group is None else mx.distributed.all_sum(x, group=group)


def quantization_of(layer: nn.Module) -> tuple[int, int] | None:
    """``(bits, group_size)`` of a quantized layer, ``None`` for a plain one."""
    return (layer.bits, layer.group_size) if "scales" in layer else None


def input_unit(layer: nn.Module) -> int:
    """The granularity at which a layer's inputs may be cut (its quantization group, or 1)."""
    quantization = quantization_of(layer)
    return quantization[1] if quantization else 1


def _cut(module: nn.Module, name: str, piece: Slice) -> None:
    """Replace parameter ``name`` by its ``piece`` (lazily: nothing is read) and record the cut."""
    slices: dict[str, Slice] = module.__dict__.setdefault("_shard_slices", {})
    if name in slices:
        raise ValueError(f"{name} is already a slice")
    setattr(module, name, piece.take(module[name]))
    slices[name] = piece


def slice_outputs(layer: nn.Module, ranges: Ranges, axis: int = 0,
                  names: Sequence[str] = ("weight", "scales", "biases", "bias")) -> None:
    """Keep only the output features in ``ranges`` (``axis`` 0 of a linear, conv or embedding; 1 of stacked
    experts) of the parameters ``names`` it has: a column-parallel layer, whose outputs need no
    communication."""
    piece = Slice(axis, tuple(ranges))
    for name in names:
        if name in layer:
            _cut(layer, name, piece)


def slice_inputs(layer: nn.Module, ranges: Ranges) -> None:
    """Keep only the input features in ``ranges`` (the last axis); a quantized layer keeps the packed words and
    the scales of those inputs, which must start and end on its group boundaries."""
    quantization = quantization_of(layer)
    if quantization is None:
        _cut(layer, "weight", Slice(-1, tuple(ranges)))
        return
    bits, size = quantization
    if any(a % size or b % size for a, b in ranges):
        raise DistributedError(f"a layer quantized in groups of {size} inputs cannot be split at inputs "
                               f"{list(ranges)}; {PIPELINE_HINT}")
    _cut(layer, "weight", Slice(-1, tuple((a * bits // 32, b * bits // 32) for a, b in ranges)))
    groups = Slice(-1, tuple((a // size, b // size) for a, b in ranges))
    for name in ("scales", "biases"):
        if name in layer:
            _cut(layer, name, groups)


def shard_slices(root: nn.Module) -> dict[str, Slice]:
    """Every cut parameter under ``root``, by its path, and the slice of the checkpoint tensor it holds."""
    out = {}
    for path, module in root.named_modules():
        for name, piece in module.__dict__.get("_shard_slices", {}).items():
            out[f"{path}.{name}" if path else name] = piece
    return out


def shard_layers(module: nn.Module, group: mx.distributed.Group) -> None:
    """Split ``module`` if it knows how (a ``shard(group)`` method), else each of its children the same way."""
    shard: Callable[[mx.distributed.Group], None] | None = getattr(module, "shard", None)
    if callable(shard):
        shard(group)
        return
    children = dict(tree_flatten(module.children(), is_leaf=lambda value: isinstance(value, nn.Module)))
    for child in children.values():
        shard_layers(child, group)


class _Projection(nn.Module):
    """The parameters of a (possibly quantized) linear map taken over from ``layer``, under the same names."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name in ("weight", "scales", "biases", "bias"):
            if name in layer:
                setattr(self, name, layer[name])
        quantization = quantization_of(layer)
        self.quantized = quantization is not None
        if quantization is not None:
            self.bits, self.group_size, self.mode = layer.bits, layer.group_size, layer.mode

    def product(self, x: mx.array) -> mx.array:
        """``x @ weight.T`` without the bias."""
        if self.quantized:
            return quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size,
                                    self.bits, self.mode)
        return x @ self["weight"].T


class RowParallelLinear(_Projection):
    """A linear layer holding this rank's input columns of its weight (``parts``: each rank's ``[start, stop)``):
    each rank multiplies its slice of the inputs and the partial products are summed across ``group`` before
    the bias. With ``reduce=False`` the caller sums (one all-reduce for several partial results).

    A quantized layer is cut only at its group boundaries; every rank checks every rank's cut, so that they
    all fail alike."""

    def __init__(self, layer: nn.Module, parts: Ranges, group: mx.distributed.Group, *, reduce: bool = True):
        super().__init__(layer)
        unit = input_unit(layer)
        cuts = [b for _, b in parts[:-1] if b % unit]
        if cuts:
            raise DistributedError(f"a layer quantized in groups of {unit} inputs cannot be split at input "
                                   f"{cuts[0]}; {PIPELINE_HINT}")
        slice_inputs(self, [parts[group.rank()]])
        self.group = group if reduce else None

    def __call__(self, x: mx.array) -> mx.array:
        y = all_reduce(self.product(x), self.group)
        return y + self["bias"] if "bias" in self else y


def gather_vocab(local: mx.array, sizes: Sequence[int], group: mx.distributed.Group) -> mx.array:
    """Every rank's ``[..., sizes[rank]]`` logits side by side: ``[..., sum(sizes)]`` on every rank."""
    width = max(sizes)
    rows = local.reshape(-1, local.shape[-1])
    if rows.shape[-1] < width:
        rows = mx.pad(rows, [(0, 0), (0, width - rows.shape[-1])])
    every = mx.distributed.all_gather(rows[None], group=group)  # [ranks, rows, width]
    if len(set(sizes)) == 1:
        joined = every.transpose(1, 0, 2).reshape(rows.shape[0], -1)
    else:
        joined = mx.concatenate([every[r, :, :n] for r, n in enumerate(sizes)], axis=-1)
    return joined.reshape(*local.shape[:-1], sum(sizes))


class _VocabRows(_Projection):
    """The rows (vocabulary entries) ``[start, start + count)`` of an embedding table or output projection."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group):
        super().__init__(layer)
        ranges = balanced(self["weight"].shape[0], group.size(), what="vocabulary entries")
        self.start, stop = ranges[group.rank()]
        self.count = stop - self.start
        self.sizes = [b - a for a, b in ranges]
        self.group = group
        slice_outputs(self, [(self.start, stop)])

    def logits(self, x: mx.array) -> mx.array:
        """``x`` against every row of the vocabulary, on every rank."""
        local = self.product(x)
        if "bias" in self:
            local = local + self["bias"]
        return gather_vocab(local, self.sizes, self.group)


class VocabParallelEmbedding(_VocabRows):
    """An embedding table split by vocabulary: each rank looks up the tokens it holds (zeros for the others)
    and the lookups are summed; used as the tied output projection, the ranks' logits are gathered."""

    def __call__(self, tokens: mx.array) -> mx.array:
        local = tokens - self.start
        held = (local >= 0) & (local < self.count)
        index = mx.where(held, local, 0)
        if self.quantized:
            rows = dequantize_rows(self["weight"], self["scales"], self.get("biases"), index, self.group_size,
                                   self.bits, self.mode)
        else:
            rows = self["weight"][index]
        return mx.distributed.all_sum(mx.where(held[..., None], rows, 0), group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.logits(x)


class VocabParallelHead(_VocabRows):
    """An output projection split by vocabulary; the ranks' logits are gathered."""

    def __call__(self, x: mx.array) -> mx.array:
        return self.logits(x)


def shard_experts(experts: nn.Module, group: mx.distributed.Group, split: ExpertSplit | None = None) -> None:
    """Split a :class:`~mlxchat.layers.SwitchGLU`: ``"width"`` gives every rank a slice of every expert's hidden
    units, ``"expert"`` whole experts to each rank (a token's experts held elsewhere contribute zeros). Either
    way its output is this rank's part of the sum, for the caller to all-reduce once.

    By default the width, which measured faster here (2 ranks, 32 experts of 2048x768, top-8: 18 ms a decode
    step against 58, 1.0 s a 64-token chunk against 1.8; the expert split still runs k experts a token on
    every rank); by expert when the hidden units cannot be cut into whole quantization groups per rank."""
    rank, size = group.rank(), group.size()
    width = experts.gate_proj["weight"].shape[1]
    unit = input_unit(experts.down_proj)
    if split is None:
        split = "width" if width % unit == 0 and width // unit >= size else "expert"
    if split == "expert":
        count = experts.gate_proj["weight"].shape[0]
        first, stop = balanced(count, size, what="experts")[rank]
        for projection in (experts.gate_proj, experts.up_proj, experts.down_proj):
            slice_outputs(projection, [(first, stop)], axis=0)
        experts.expert_range = range(first, stop)
        return
    ranges = [balanced(width, size, unit, what="expert hidden units")[rank]]
    slice_outputs(experts.gate_proj, ranges, axis=1)
    slice_outputs(experts.up_proj, ranges, axis=1)
    slice_inputs(experts.down_proj, ranges)


def from_rank_zero(sampler: Callable[[mx.array], mx.array],
                   group: mx.distributed.Group) -> Callable[[mx.array], mx.array]:
    """A sampler whose token is rank 0's on every rank (the others evaluate their logits, which may hold
    collectives, but draw nothing): greedy, seeded and unseeded sampling then agree on every rank."""
    first = group.rank() == 0

    def sample(logits: mx.array) -> mx.array:
        if first:
            token = sampler(logits).astype(mx.uint32)
        else:
            token = mx.depends(mx.zeros(logits.shape[:-1], mx.uint32), logits)
        return mx.distributed.all_sum(token, group=group)

    return sample
