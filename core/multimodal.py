"""Prompts with images, and the prefill that runs them through a vision-language model.

**The prompt.** A chat template writes one marker token per image; the family's processor expands it to
the image's placeholder tokens (Qwen3.5: ``<|image_pad|>`` x n between the template's own
``<|vision_start|>``/``<|vision_end|>``; Gemma 4: ``<|image>`` + ``<|image|>`` x n + ``<image|>``).
:func:`expand_images` does the same on token ids. A :class:`MultimodalPrompt` is those ids plus one
:class:`ImageSpan` per image: where its placeholders start, how many there are, and the preprocessed image
with its digest. Everything a model needs for any slice of the prompt follows from it: the input
embeddings (token embeddings with the image features in place of the placeholders) and, for Qwen3.5,
the 3-D rotary positions.

**The forward.** A vision-language module takes, for a chunk of the prompt, the chunk's token ids plus
the extra inputs its :meth:`~mlxchat.architecture.VisionModule.image_inputs` builds (``embeddings``, and
``positions`` for multimodal RoPE); a chunk without image tokens needs none. Images are encoded whole
(the vision tower attends across the whole image), once per digest, and each chunk takes its rows.

**Cached decoding across images.** With multimodal RoPE the text after an image continues at the image's
largest position + 1, not at its token index. The shift is kept by the attention layers' KV caches
(:attr:`mlxchat.cache.KVCache.shifts`), recorded when a chunk with explicit positions ends, and cut back
with the keys: decoding, a text-only follow-up turn and a cache trimmed to any position all continue at
the right position with plain token ids. A chunk may end inside an image for Qwen3.5 (the text model is
causal; the remaining placeholders come with their positions). Gemma 4 models that attend
bidirectionally among an image's tokens (``use_bidirectional_attention: "vision"``) need every image
inside one chunk (:attr:`~mlxchat.architecture.VisionModule.atomic_images`); :func:`chunk_bounds` never
splits one there.

**Prefill** is the prompt cache's (:meth:`mlxchat.prompt_cache.PromptCache.prefill`): it runs every image
through the model before decoding starts, each chunk with its image inputs. States that cannot be cut back
(DeltaNet, conv, sliding windows) return to a position only through a snapshot taken there; a generation
with images asks for one at every image's first placeholder, so that a changed image costs only what
follows it.

**Identity for reuse.** :meth:`MultimodalPrompt.image_keys` gives ``(start, length, digest)`` per image;
:meth:`mlxchat.prompt_cache.PromptCache.reuse` compares them besides the tokens, so a changed image
stops reuse at its first placeholder and the same pixels sent again reuse everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from .architecture import ModelModule
from .cache import LayerCache
from .errors import ImageError
from .images import ImageProcessor, ProcessedImage, image_url_source

ImageKey = tuple[int, int, str]
"""An image in a prompt: ``(start, length, digest)`` of its placeholder tokens and pixels."""


@dataclass(frozen=True)
class ImageTokens:
    """How a family writes an image in token ids: the chat template writes ``marker`` once per image; the
    processor replaces it with ``begin`` + ``marker`` x n + ``end``."""

    marker: int
    begin: tuple[int, ...] = ()
    end: tuple[int, ...] = ()


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its placeholder tokens are ``ids[start:start + image.tokens]``."""

    start: int
    image: ProcessedImage

    @property
    def length(self) -> int:
        return self.image.tokens

    @property
    def end(self) -> int:
        return self.start + self.image.tokens

    @property
    def key(self) -> ImageKey:
        return (self.start, self.length, self.image.digest)


@dataclass(frozen=True)
class MultimodalPrompt:
    """Token ids with images: ``images`` in order, their placeholder spans inside ``ids``, apart."""

    ids: tuple[int, ...]
    images: tuple[ImageSpan, ...] = ()

    def __post_init__(self) -> None:
        cursor = 0
        for span in self.images:
            if span.start < cursor or span.end > len(self.ids) or span.length < 1:
                raise ImageError(f"image placeholders at [{span.start}, {span.end}) overlap another image or "
                                 f"leave the {len(self.ids)}-token prompt")
            cursor = span.end

    def __len__(self) -> int:
        return len(self.ids)

    def check(self, marker: int) -> None:
        """Raise unless the placeholder token ``marker`` fills exactly the image spans."""
        expected = {i for span in self.images for i in range(span.start, span.end)}
        found = {i for i, t in enumerate(self.ids) if t == marker}
        if found != expected:
            raise ImageError(f"image placeholder tokens at {len(found)} positions for images covering "
                             f"{len(expected)}: the ids and the image spans disagree")

    def image_keys(self) -> list[ImageKey]:
        return [span.key for span in self.images]

    def spans_in(self, start: int, end: int) -> list[ImageSpan]:
        """The images with placeholders in ``[start, end)``."""
        return [span for span in self.images if span.start < end and span.end > start]


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


def expand_images(ids: Sequence[int], images: Sequence[ProcessedImage], tokens: ImageTokens) -> MultimodalPrompt:
    """Replace the ``i``-th marker in ``ids`` by image ``i``'s placeholders, as the processor does."""
    markers = [i for i, t in enumerate(ids) if t == tokens.marker]
    if len(markers) != len(images):
        raise ImageError(f"the prompt has {len(markers)} image markers for {len(images)} images")
    out: list[int] = []
    spans, cursor = [], 0
    for position, image in zip(markers, images, strict=True):
        out += ids[cursor:position]
        out += tokens.begin
        spans.append(ImageSpan(len(out), image))
        out += [tokens.marker] * image.tokens
        out += tokens.end
        cursor = position + 1
    out += ids[cursor:]
    prompt = MultimodalPrompt(tuple(int(t) for t in out), tuple(spans))
    prompt.check(tokens.marker)
    return prompt


def embed_with_images(embed: Callable[[mx.array], mx.array], prompt: MultimodalPrompt, start: int, end: int,
                      features: Mapping[str, mx.array], filler: int) -> mx.array:
    """Input embeddings ``[1, end - start, hidden]`` of a prompt slice: token embeddings, with each image's
    feature rows in place of its placeholders (which are embedded as ``filler``, a token every
    vocabulary holds, and then replaced)."""
    spans = prompt.spans_in(start, end)
    ids = list(prompt.ids[start:end])
    for span in spans:
        for i in range(max(span.start, start), min(span.end, end)):
            ids[i - start] = filler
    h = embed(mx.array(ids)[None])
    pieces, cursor = [], start
    for span in spans:
        a, b = max(span.start, start), min(span.end, end)
        if a > cursor:
            pieces.append(h[:, cursor - start : a - start])
        pieces.append(features[span.image.digest][a - span.start : b - span.start][None].astype(h.dtype))
        cursor = b
    if cursor < end:
        pieces.append(h[:, cursor - start :])
    return mx.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0]


def chunk_bounds(start: int, end: int, step: int, stops: Iterable[int] = (),
                 atomic: Sequence[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """Chunks ``[a, b)`` covering ``[start, end)``: at most ``step`` tokens, split at every stop, and never
    ending inside an ``atomic`` span (a chunk that would ends at the span's start, or, when the span
    starts the chunk, grows to hold all of it). ``end`` itself must not fall inside an atomic span."""
    if any(s < end < e for s, e in atomic):
        raise ImageError(f"position {end} is inside an image that must be prefilled whole")
    stops = sorted(s for s in set(stops) if start < s < end)
    bounds, a = [], start
    while a < end:
        b = min(end, a + step, *(s for s in stops if s > a))
        for s, e in atomic:
            if s < b < e:
                b = s if s > a else e
        bounds.append((a, b))
        a = b
    return bounds


def encode_images(module: VisionModule, spans: Iterable[ImageSpan]) -> dict[str, mx.array]:
    """Features ``[tokens, hidden]`` of each distinct image, evaluated."""
    features: dict[str, mx.array] = {}
    for span in spans:
        if span.image.digest not in features:
            features[span.image.digest] = module.encode_image(span.image)
            mx.eval(features[span.image.digest])
    return features


IMAGE_PART_TYPES = ("image", "image_url")


def carries_image(content: Any) -> bool:
    """Whether a message's content holds an image part."""
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content)


def image_kept(part: Any) -> bool:
    """Whether a content part needs nothing outside it: not an image, or one kept as a ``data:`` URL (as a
    session's history holds its images)."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return True
    image = part.get("image")
    return part.get("type") == "image" and isinstance(image, str) and image[:5].lower() == "data:"


def images_kept(messages: Sequence[Any]) -> bool:
    """Whether every image of ``messages`` is kept in them: a saved or stored transcript must not name a file or
    a URL for us to read (:meth:`~mlxchat.session.ChatSession.prime_history` reads those for a caller's own)."""
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
        if isinstance(content, list) and not all(image_kept(part) for part in content):
            return False
    return True


def split_image_parts(messages: Sequence[Any], images: Sequence[Any] = ()) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages with each image content part reduced to ``{"type": "image"}`` (all a chat template
    needs to write its marker), and the images in order.

    A part holds its image under ``"image"`` (a path, bytes, a ``PIL.Image``, a ``data:`` URL) or as an
    OpenAI ``image_url`` (only ``data:`` URLs: a remote URL is refused here); a part without one takes the
    next of ``images``.
    """
    given = list(images)
    plain, sources = [], []
    for message in messages:
        data = message.model_dump() if hasattr(message, "model_dump") else dict(message)
        content = data.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    sources.append(part_image(part, given))
                    part = {"type": "image"}
                parts.append(part)
            data["content"] = parts
        plain.append(data)
    if given:
        raise ImageError(f"{len(given)} more images than image parts in the messages")
    return plain, sources


def part_image(part: dict[str, Any], given: list[Any]) -> Any:
    """The image an image content part holds (the next of ``given`` for a part without one)."""
    if part.get("image") is not None:
        return part["image"]
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if url is not None:
        return image_url_source(url)
    if not given:
        raise ImageError("an image part has no image (give it under 'image' or 'image_url', or in images=)")
    return given.pop(0)
