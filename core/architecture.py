"""What a plugin contributes for one architecture, and what its model module must provide."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from .cache import LayerCache
from .config import ModelConfig


@runtime_checkable
class ModelModule(Protocol):
    """The MLX module of an architecture (hand-written forward)."""

    def __call__(self, tokens: mx.array, cache: list[LayerCache] | None = None) -> mx.array:
        """Logits ``[batch, length, vocab]`` for ``tokens [batch, length]``; ``cache`` is updated in place."""
        ...

    def make_cache(self) -> list[LayerCache]:
        """One fresh, empty cache per layer. It makes no MLX arrays (a cache fills on its first chunk): a
        server makes caches on its event loop's thread while the worker runs other work."""
        ...

    # Optional: ``last_logits(tokens, cache) -> [batch, vocab]``, the last position's logits without the
    # output projection of the others (mlxchat.layers.CausalLM has it); generation uses it when present.
    # Optional: ``runs_ragged = True`` when ``last_logits`` takes mlxchat.cache.RaggedRows caches (several
    # sequences' tokens end to end, the last logits of each): the worker then runs its decode rows and prompt
    # chunks as one pass (mlxchat.batching); otherwise each prompt chunk is a pass of its own.
    # A vision-language module also implements mlxchat.multimodal.VisionModule.
    # Optional, to run split over a process group (load_model(..., distributed=...)): ``shard(group)`` (tensor
    # parallel) and ``pipeline(group)``, which replace parameters by this rank's lazy slices before the weights
    # load, and set ``group``; mlxchat.layers.CausalLM has both (see mlxchat.layers.parallel and .pipeline).

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint tensor names (and layouts) to this module's parameter names."""
        ...


@dataclass(frozen=True)
class ChatQuirks:
    """A family's chat conventions that its chat template alone does not say."""

    tool_format: str | None = None
    """Name of the tool-call format in the parser registry (``None``: the model does not call tools)."""
    reasoning: tuple[str, str] | None = None
    """Markers around reasoning in the model's output (``None``: the family does not reason in its replies)."""
    stop_tokens: tuple[str, ...] = ()
    """Tokens that end a reply besides the checkpoint's EOS ids (when the vocabulary has them)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments always passed to the chat template (e.g. ``preserve_thinking``)."""


@dataclass(frozen=True)
class Architecture:
    """One architecture served by a plugin."""

    name: str
    model_types: tuple[str, ...]
    """``model_type`` strings it serves, top-level and nested (``text_config.model_type``)."""
    config_class: type[ModelConfig]
    model_class: type[Any]
    """Built as ``model_class(config)``; satisfies :class:`ModelModule`."""
    chat: ChatQuirks = field(default_factory=ChatQuirks)
