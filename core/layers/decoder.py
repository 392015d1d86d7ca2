"""The decoder-only skeleton every plugin fills with its own blocks."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache, LayerCache
from ..config import ModelConfig


class Decoder(nn.Module):
    """Token embedding, a stack of blocks and a final norm (``model.*`` in checkpoints)."""

    def __init__(self, vocab_size: int, hidden_size: int, blocks: Sequence[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
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
    the checkpoint has none). Subclasses build the decoder; the rest of the contract is here."""

    def __init__(self, config: ModelConfig, model: Decoder):
        super().__init__()
        self.config = config
        self.model = model
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def project(self, h: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, cache: Sequence[LayerCache | None] | None = None,
                 **inputs: mx.array) -> mx.array:
        """Logits of ``tokens``; ``inputs`` are the extra inputs a vision-language decoder takes (precomputed
        ``embeddings``, ``positions``) for a chunk with image tokens."""
        return self.project(self.model(tokens, cache, **inputs))

    def last_logits(self, tokens: mx.array, cache: Sequence[LayerCache | None] | None = None,
                    **inputs: mx.array) -> mx.array:
        """Logits ``[batch, vocab]`` of the last position only: the vocabulary-wide projection runs for one
        row, so a prompt chunk and the first sampled token can share one pass over the weights."""
        return self.project(self.model(tokens, cache, **inputs)[:, -1:, :])[:, -1, :]

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
