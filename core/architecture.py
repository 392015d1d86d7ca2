"""What a plugin contributes for one architecture, and what its model module must provide."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx

from .cache import LayerCache
from .config import ModelConfig

if TYPE_CHECKING:
    from .images import ImageProcessor, ProcessedImage
    from .multimodal import ImageTokens, MultimodalPrompt


@runtime_checkable
class ModelModule(Protocol):
    """The MLX module of an architecture (hand-written forward)."""

    def __call__(self, tokens: mx.array, cache: list[LayerCache] | None = None) -> mx.array:
        """Logits ``[batch, length, vocab]`` for ``tokens [batch, length]``; ``cache`` is updated in place."""
        ...

    def make_cache(self) -> list[LayerCache]:
        """One fresh cache per layer."""
        ...

    # Optional: ``last_logits(tokens, cache) -> [batch, vocab]``, the last position's logits without the
    # output projection of the others (mlxchat.layers.CausalLM has it); generation uses it when present.
    # A vision-language module also implements VisionModule below.

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint tensor names (and layouts) to this module's parameter names."""
        ...


@runtime_checkable
class VisionModule(ModelModule, Protocol):
    """What a vision-language :class:`ModelModule` adds to read images (see :mod:`mlxchat.multimodal`)."""

    def __call__(self, tokens: mx.array, cache: list[LayerCache] | None = None, **inputs: mx.array) -> mx.array:
        """As :meth:`ModelModule.__call__`; a chunk with image tokens also takes the ``inputs`` that
        :meth:`image_inputs` builds for it."""
        ...

    supports_images: bool
    """Whether the checkpoint has the vision tower (a converted text-only copy loads without one)."""
    image_tokens: ImageTokens
    atomic_images: bool
    """Whether an image's placeholders must be prefilled in one chunk (bidirectional attention among them)."""

    def image_processor(self, settings: dict[str, Any]) -> ImageProcessor:
        """The preprocessing this tower expects, from the checkpoint's ``preprocessor_config.json``."""
        ...

    def encode_image(self, image: ProcessedImage) -> mx.array:
        """The image's features ``[image.tokens, hidden_size]`` in the text model's embedding space."""
        ...

    def image_inputs(self, prompt: MultimodalPrompt, start: int, end: int,
                     features: dict[str, mx.array]) -> dict[str, mx.array]:
        """Extra forward inputs for ``prompt.ids[start:end]`` (``features`` by image digest)."""
        ...


@dataclass(frozen=True)
class ChatQuirks:
    """A family's chat conventions that its chat template alone does not say."""

    tool_format: str | None = None
    """Name of the tool-call format in the parser registry (``None``: the model does not call tools)."""
    reasoning: tuple[str, str] | None = ("<think>", "</think>")
    """Markers around reasoning in the model's output."""
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
