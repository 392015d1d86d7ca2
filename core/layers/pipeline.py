"""Pipeline parallelism: each rank runs a contiguous run of the decoder's layers and hands the hidden state to
the next rank (``mx.distributed.send``/``recv``, always to the right neighbour of the ring); the last rank's
final hidden state is then shared with every rank, and rank 0, which also holds the embedding and the
output projection, turns it into logits.

The decoder's own loop is unchanged: a layer this rank does not run is replaced by a :class:`SkippedLayer`,
which passes the hidden state on, receives it from the previous rank just before this rank's first layer
and sends it on just after its last. Its layer cache stays in the list and is advanced without data
(:meth:`~mlxchat.cache.LayerCache.advance`), so every rank's prompt cache answers reuse and snapshot
questions exactly as one process would, and takes the same decisions. What a rank sends is handed to its
first layer cache to evaluate (``held``): a prefill chunk's logits are never evaluated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache import LayerCache
from ..errors import DistributedError


class Stage:
    """This rank's layers ``[first, stop)`` of the pipeline, and the arrays it sent during the last forward."""

    def __init__(self, group: mx.distributed.Group, first: int, stop: int, layer: nn.Module):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.first, self.stop = first, stop
        self._layer = layer  # one of this rank's layers: the hidden state has the dtype of its norms
        self._links: list[mx.array] = []

    @property
    def dtype(self) -> mx.Dtype:
        parameters = dict(tree_flatten(self._layer.parameters())).values()
        floating = (v.dtype for v in parameters if mx.issubdtype(v.dtype, mx.floating))
        return next(floating, mx.float32)

    def receive(self, like: mx.array) -> mx.array:
        """The hidden state of the previous rank's last layer (``like``'s shape)."""
        return mx.distributed.recv(like.shape, self.dtype, self.rank - 1, group=self.group)

    def send(self, h: mx.array) -> mx.array:
        """Hand ``h`` to the next rank; the result is ``h`` (computations on it come after the send)."""
        sent = mx.distributed.send(h, self.rank + 1, group=self.group)
        self._links.append(sent)
        return sent

    def finish(self, h: mx.array) -> mx.array:
        """The last rank's ``h`` on every rank (the others' ``h`` only orders the exchange after their sends)."""
        last = self.rank == self.size - 1
        final = mx.distributed.all_sum(mx.where(mx.array(last), h, 0), group=self.group)
        self._links.append(final)
        return final

    def take_links(self) -> tuple[mx.array, ...]:
        links, self._links = tuple(self._links), []
        return links


class SkippedLayer(nn.Module):
    """A layer another rank runs: the hidden state passes through (received here when the next layer is this
    rank's first, sent on when the previous one was its last) and the layer's cache advances without data. It
    keeps the replaced layer's flags (``is_linear``, ...), which a model's ``make_cache`` reads."""

    def __init__(self, stage: Stage, index: int, layer: nn.Module):
        super().__init__()
        for name, value in vars(layer).items():
            if not name.startswith("_") and isinstance(value, bool | int | float | str):
                setattr(self, name, value)
        self.stage = stage
        self.receives = index == stage.first - 1
        self.sends = index == stage.stop

    def __call__(self, h: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        for value in (*args, *kwargs.values()):
            if isinstance(value, LayerCache):
                value.advance(h.shape[1])
        if self.receives:
            return self.stage.receive(h)
        if self.sends:
            return self.stage.send(h)
        return h


class Unembedded(nn.Module):
    """Stands in for the embedding on ranks after the first: only the shape of its output is used (the first
    layer of the rank receives the real hidden state)."""

    def __init__(self, dims: int):
        super().__init__()
        self.dims = dims

    def __call__(self, tokens: mx.array) -> mx.array:
        return mx.zeros((*tokens.shape, self.dims))


def pipeline_split(units: Sequence[Sequence[int]], nbytes: Sequence[int], size: int, first_extra: int) -> list[range]:
    """Each rank's layers: ``units`` (runs of layers that must stay on one rank) cut into ``size`` contiguous
    parts so that the largest part's bytes (rank 0's plus ``first_extra``, the embedding and output
    projection) is as small as it can be."""
    if len(units) < size:
        raise DistributedError(f"{len(units)} layers (or groups of layers that must stay together) cannot be "
                               f"split over {size} ranks; use fewer ranks")
    weights = [sum(nbytes[i] for i in unit) for unit in units]
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[r][j]: the smallest largest load when the first j units go to ranks 0..r-1.
    best = [[inf] * (n + 1) for _ in range(size + 1)]
    cut = [[0] * (n + 1) for _ in range(size + 1)]
    best[0][0] = 0
    for r in range(1, size + 1):
        for j in range(r, n - (size - r) + 1):
            for i in range(r - 1, j):
                load = prefix[j] - prefix[i] + (first_extra if r == 1 else 0)
                value = max(best[r - 1][i], load)
                if value < best[r][j]:
                    best[r][j], cut[r][j] = value, i
    bounds = [n]
    for r in range(size, 0, -1):
        bounds.append(cut[r][bounds[-1]])
    bounds.reverse()
    return [range(units[bounds[r]][0], units[bounds[r + 1] - 1][-1] + 1) for r in range(size)]
