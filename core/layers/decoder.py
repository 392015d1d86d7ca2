"""The decoder-only skeleton every plugin fills with its own blocks."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cache import KVCache, LayerCache, RaggedRows
from ..config import ModelConfig
from .parallel import VocabParallelEmbedding, VocabParallelHead, shard_layers
from .pipeline import SkippedLayer, Stage, Unembedded, pipeline_split


class Decoder(nn.Module):
    """Token embedding, a stack of blocks and a final norm (``model.*`` in checkpoints)."""

    def __init__(self, vocab_size: int, hidden_size: int, blocks: Sequence[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens: nn.Module = nn.Embedding(vocab_size, hidden_size)
        self.layers = list(blocks)
        self.norm = norm

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def __call__(self, tokens: mx.array, cache: Sequence[LayerCache | None] | None = None) -> mx.array:
        h = self.embed(tokens)
        for layer, layer_cache in zip(self.layers, cache or [None] * len(self.layers), strict=True):
            h = layer(h, layer_cache)
        return self.norm(h)


class CausalLM(nn.Module):
    """A :class:`Decoder` under ``model`` and the output projection ``lm_head`` (tied to the embedding when
    the checkpoint has none). Subclasses build the decoder; the rest of the contract is here, including
    splitting the model over a process group: :meth:`shard` (tensor parallel) and :meth:`pipeline`."""

    group: mx.distributed.Group | None = None
    """The process group the model is split over (``None``: it runs whole in this process)."""
    stage: Stage | None = None
    """This rank's part of a pipeline (``None``: not pipelined)."""
    vision_parts: tuple[str, ...] = ()
    """Attributes holding a vision tower, dropped when the model is split (split models read text only)."""
    embeds_on_every_rank = False
    """Whether every pipeline rank needs the token embeddings (not only rank 0, which runs the first layer)."""
    runs_ragged = False
    """Whether every layer that holds a cache takes :class:`~mlxchat.cache.RaggedRows` (a subclass whose
    blocks mix tokens through core's :class:`~mlxchat.layers.Attention`, :class:`~mlxchat.layers.GatedDeltaNet`
    and :class:`~mlxchat.layers.ShortConv`, or layers of its own that split ragged rows too, sets it)."""

    def __init__(self, config: ModelConfig, model: Decoder):
        super().__init__()
        self.config = config
        self.model = model
        if not config.tie_word_embeddings:
            self.lm_head: nn.Module = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def project(self, h: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, cache: Sequence[LayerCache | None] | None = None,
                 **inputs: mx.array) -> mx.array:
        """Logits of ``tokens``; ``inputs`` are the extra inputs a vision-language decoder takes (precomputed
        ``embeddings``, ``positions``) for a chunk with image tokens."""
        return self._logits(self.model(tokens, cache, **inputs), cache)

    def last_logits(self, tokens: mx.array, cache: Sequence[LayerCache | None] | None = None,
                    **inputs: mx.array) -> mx.array:
        """Logits ``[batch, vocab]`` of the last position only: the vocabulary-wide projection runs for one
        row, so a prompt chunk and the first sampled token can share one pass over the weights. Over
        :class:`~mlxchat.cache.RaggedRows`, the last position of each sequence: ``[sequences, vocab]``."""
        h = self.model(tokens, cache, **inputs)
        ragged = next((c for c in cache or () if isinstance(c, RaggedRows)), None)
        if ragged is not None:
            return self._logits(h[:, mx.array(ragged.ends) - 1, :], cache)[0]
        return self._logits(h[:, -1:, :], cache)[:, -1, :]

    def _logits(self, h: mx.array, cache: Sequence[LayerCache | None] | None) -> mx.array:
        """The projection of the decoder's output; pipelined, of the last rank's, on rank 0 (the other ranks
        give zeros that wait for the exchange)."""
        if self.stage is None:
            return self.project(h)
        h = self.stage.finish(h)
        holder = next((c for c in cache or () if c is not None), None)
        links = self.stage.take_links()
        if holder is not None:
            holder.held = links
        if self.stage.rank == 0:
            return self.project(h)
        return mx.depends(mx.zeros((*h.shape[:-1], self.config.vocab_size), h.dtype), h)

    # -- splitting over a process group ---------------------------------------------------------------

    def shard(self, group: mx.distributed.Group) -> None:
        """Tensor parallel over ``group``: the embedding and output projection split by vocabulary, and every
        layer with a ``shard(group)`` method split by it (see :mod:`mlxchat.layers.parallel`); the others
        stay whole on every rank. Parameters become lazy slices: load the weights afterwards."""
        self._drop_vision()
        self.model.embed_tokens = VocabParallelEmbedding(self.model.embed_tokens, group)
        if not self.config.tie_word_embeddings:
            self.lm_head = VocabParallelHead(self.lm_head, group)
        for layer in self.model.layers:
            shard_layers(layer, group)
        self.group = group

    def pipeline(self, group: mx.distributed.Group) -> None:
        """Pipeline parallel over ``group``: each rank keeps a contiguous run of layers, balanced by bytes with
        rank 0 also holding the embedding and the output projection (see :mod:`mlxchat.layers.pipeline`);
        the others' layers become :class:`~mlxchat.layers.pipeline.SkippedLayer`. Load the weights afterwards."""
        self._drop_vision()
        layers = self.model.layers
        nbytes = [_nbytes(layer) for layer in layers]
        ends = _nbytes(self) - sum(nbytes)
        spans = pipeline_split(self.pipeline_units(), nbytes, group.size(), ends)
        mine = spans[group.rank()]
        stage = Stage(group, mine.start, mine.stop, layers[mine.start])
        for i in range(len(layers)):
            if i not in mine:
                layers[i] = SkippedLayer(stage, i, layers[i])
        if group.rank() != 0:
            if not self.embeds_on_every_rank:
                self.model.embed_tokens = Unembedded(self.config.hidden_size)
            if not self.config.tie_word_embeddings:
                del self.lm_head
        self.stage, self.group = stage, group

    def pipeline_units(self) -> list[range]:
        """Runs of layers that must stay on one pipeline rank (by default every layer on its own)."""
        return [range(i, i + 1) for i in range(len(self.model.layers))]

    def _drop_vision(self) -> None:
        for name in self.vision_parts:
            if name in self:
                delattr(self, name)

    def make_cache(self) -> list[LayerCache]:
        return [KVCache() for _ in self.model.layers]

    def cast_predicate(self, name: str) -> bool:
        """Whether a floating tensor is cast to the compute dtype on load (override to keep some as stored)."""
        return True

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for v in dict(tree_flatten(module.parameters())).values())
