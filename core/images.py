"""Images in: reading them from the sources a chat accepts, and preprocessing them exactly as the
transformers image processors of the vision families do (Pillow and NumPy only; no torch).

Sources: a file path, encoded ``bytes``, a ``PIL.Image``, or a ``data:`` URL. Remote ``http(s)`` URLs
are never fetched here: :func:`image_url_source` refuses them unless the caller explicitly allows them
(and then fetches them itself). Every image is turned upright by its EXIF orientation and made RGB with
transparency composited on white, as transformers' ``load_image`` and ``convert_to_rgb`` do.

Two processor families cover the supported models, each matching its transformers PIL processor to the
bit on the same image (resampling is Pillow's in both):

- :class:`Qwen2VLImageProcessor` (Qwen2-VL ... Qwen3.5): ``smart_resize`` to a multiple of
  ``patch * merge`` within ``[min_pixels, max_pixels]``, normalise, then patches of
  ``temporal x patch x patch`` pixels in spatial-merge-block order (a still image is repeated over the
  temporal patch). One placeholder token per ``merge x merge`` patches.
- :class:`Gemma4ImageProcessor`: the largest aspect-preserving size with at most
  ``max_soft_tokens * k^2`` patches and sides a multiple of ``k * patch`` (``k`` the pooling kernel);
  pixels in ``[0, 1]``, raster-order patches. One placeholder token per ``k x k`` patches.

A :class:`ProcessedImage` carries the pixel values, the patch grid and a digest of both: two images
are the same to a model exactly when their digests are equal, whatever file they came from.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image, ImageOps
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import CheckpointError, ImageError

ImageSource = str | bytes | os.PathLike[str] | Image.Image
"""A path, encoded bytes, a ``PIL.Image`` or a ``data:`` URL."""

MAX_ASPECT_RATIO = 200
MAX_PIXELS = 50_000_000
"""The most pixels an image may have (a 48-megapixel photo fits), checked from its header before it is decoded:
a 43-byte GIF can declare a 9,400 x 9,400 screen that takes seconds and gigabytes to decode."""
MAX_FILE_BYTES = 64 * 2**20
"""The largest image file read from a path."""
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
"""The formats read (Pillow's other decoders, DDS, PSD, EPS and the like, are not exposed to inputs)."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_url_source(url: object, *, allow_remote: bool = False) -> bytes | str:
    """What an OpenAI-style ``image_url`` names: the bytes of a ``data:`` URL, or (only when
    ``allow_remote``) an ``http(s)`` URL for the caller to fetch. Anything else is refused, so a request
    can never make the server read a local file."""
    if not isinstance(url, str):
        raise ImageError(f"an image URL is a string, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(url)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise ImageError("remote image URLs are not allowed here; send the image as a data: URL "
                             "(or enable remote images explicitly)")
        return url
    raise ImageError(f"unsupported image URL scheme {scheme or '(none)'!r}: use a data: URL")


def as_data_url(source: ImageSource) -> str:
    """The image as a ``data:`` URL, so that a message holding it is self-contained (a file that changes
    later does not change the conversation) and serialisable: encoded bytes and files keep their bytes, a
    ``PIL.Image`` is written as PNG (lossless)."""
    if isinstance(source, str) and source[:5].lower() == "data:":
        _data_url_bytes(source)  # checked here, not when the turn runs
        return source
    if isinstance(source, Image.Image):
        buffer = io.BytesIO()
        try:
            _rgb(source).save(buffer, format="PNG")  # (CMYK, 16-bit or float modes have no PNG form of their own)
        except ImageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a closed or half-read image: any of Pillow's errors
            raise ImageError(f"cannot write the image ({type(exc).__name__}: {exc})") from None
        data, kind = buffer.getvalue(), "png"
    else:
        if isinstance(source, bytes | bytearray):
            data = bytes(source)
        elif isinstance(source, str | os.PathLike):
            data = _file_bytes(Path(source))
        else:
            raise ImageError(f"an image is a path, bytes, a PIL.Image or a data: URL, got {type(source).__name__}")
        kind = (_open(io.BytesIO(data), "the image").format or "png").lower()
    return f"data:image/{kind};base64,{base64.b64encode(data).decode('ascii')}"


def _file_bytes(path: Path) -> bytes:
    """An image file's bytes: a regular file (not a FIFO or a device) of at most :data:`MAX_FILE_BYTES`."""
    try:
        if not path.is_file():
            raise ImageError(f"{path}: no such image file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ImageError(f"{path}: more than {MAX_FILE_BYTES // 2**20} MB; not read as an image")
        return path.read_bytes()
    except OSError as exc:
        raise ImageError(f"{path}: cannot read the image file ({exc})") from exc


def load_image(source: ImageSource) -> Image.Image:
    """An RGB ``PIL.Image`` from a path, encoded bytes, a ``PIL.Image`` or a ``data:`` URL, upright by its
    EXIF orientation, transparency composited on white."""
    if isinstance(source, Image.Image):
        image = source
    elif isinstance(source, bytes | bytearray):
        image = _open(io.BytesIO(bytes(source)), "image bytes")
    elif isinstance(source, str) and source[:5].lower() == "data:":
        image = _open(io.BytesIO(_data_url_bytes(source)), "data: URL")
    elif isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https"):
        raise ImageError(f"remote image URLs are not fetched ({source[:60]}); download the image first")
    elif isinstance(source, str | os.PathLike):
        image = _open(io.BytesIO(_file_bytes(Path(source))), str(source))
    else:
        raise ImageError(f"an image is a path, bytes, a PIL.Image or a data: URL, got {type(source).__name__}")
    return _rgb(image)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("malformed data: URL (no comma)")
    params = header[5:].split(";")
    media = params[0].strip().lower()
    if media and not media.startswith("image/"):
        raise ImageError(f"a data: URL for an image has an image/* media type, got {media!r}")
    if "base64" in (p.strip().lower() for p in params[1:]):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"data: URL is not valid base64 ({exc})") from exc
    return urllib.parse.unquote_to_bytes(payload)


def _open(file: Any, name: str) -> Image.Image:
    """The image decoded, its size checked from its header first (see :data:`MAX_PIXELS`); whatever Pillow's
    decoders raise on a damaged file (OSError, SyntaxError, struct.error, NotImplementedError, RuntimeError, ...)
    is an :class:`ImageError`."""
    try:
        image = Image.open(file, formats=FORMATS)
        _check_size(image.width, image.height, name)
        image.load()
    except (ImageError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - see above
        message = re.sub(r"<[^>]* at 0x[0-9a-fA-F]+>", "it", str(exc))  # (no object addresses to clients)
        raise ImageError(f"{name}: not a readable image ({type(exc).__name__}: {message})") from None
    return image


def _check_size(width: int, height: int, name: str) -> None:
    if width < 1 or height < 1:
        raise ImageError(f"{name}: an image of {width} x {height} pixels shows nothing")
    if width * height > MAX_PIXELS:
        raise ImageError(f"{name}: {width} x {height} pixels is more than the {MAX_PIXELS:,} an image may have")


def _rgb(image: Image.Image) -> Image.Image:
    _check_size(image.width, image.height, "the image")
    try:
        try:
            image = ImageOps.exif_transpose(image)
        except Exception:  # noqa: BLE001 - a damaged EXIF block (read lazily, any of Pillow's errors): not turned
            pass
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            image = image.convert("RGBA")
            background = Image.new("RGBA", image.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, image).convert("RGB")
        return image.convert("RGB")
    except (ImageError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - a closed or half-read image, a mode Pillow cannot convert
        raise ImageError(f"cannot convert the image to RGB ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """An image as a model's vision tower reads it."""

    pixels: np.ndarray
    """Float32 ``[patches, patch_values]``, in the order the processor emits them."""
    grid: tuple[int, int, int]
    """``(t, h, w)``: temporal patches, patch rows, patch columns."""
    tokens: int
    """Placeholder tokens the image takes in the prompt."""
    digest: str = field(init=False)
    """SHA-256 of the grid and the pixel values: the image's identity for cache reuse."""

    def __post_init__(self) -> None:
        pixels = np.ascontiguousarray(self.pixels, dtype="<f4")
        object.__setattr__(self, "pixels", pixels)
        head = "x".join(map(str, self.grid)).encode() + b":"
        object.__setattr__(self, "digest", hashlib.sha256(head + pixels.tobytes()).hexdigest())

    def __repr__(self) -> str:
        return f"ProcessedImage(grid={self.grid}, tokens={self.tokens}, digest={self.digest[:12]})"


class ImageProcessor(Protocol):
    """Turns a loaded image into what one family's vision tower reads."""

    def __call__(self, image: ImageSource) -> ProcessedImage: ...

    def count_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens an image of this size takes (without processing it)."""
        ...


class _Settings(BaseModel):
    """The common keys of a ``preprocessor_config.json`` (unknown keys are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    do_resize: bool = True
    resample: int = Field(int(Image.Resampling.BICUBIC), ge=0, le=5)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    patch_size: int = Field(16, ge=1)

    @classmethod
    def parse(cls, raw: dict[str, Any], defaults: dict[str, Any]) -> Any:
        """Settings from a ``preprocessor_config.json`` dict, ``defaults`` filling what it leaves out."""
        given = {k: v for k, v in cls._dialect(raw).items() if v is not None}
        try:
            return cls.model_validate({**defaults, **given})
        except ValidationError as exc:
            raise CheckpointError(f"preprocessor_config.json does not describe a {cls.__name__}: {exc}") from exc

    @classmethod
    def _dialect(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """``raw`` with older spellings of keys mapped to the fields."""
        return raw

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=Image.Resampling(self.resample))

    def _values(self, image: Image.Image) -> np.ndarray:
        """Channel-first float32 values, rescaled and normalised as transformers does (float64 rescale,
        float32 normalisation)."""
        values = np.moveaxis(np.asarray(image), -1, 0)
        if self.do_rescale:
            values = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            values = values.astype(np.float32) if not np.issubdtype(values.dtype, np.floating) else values
            mean = np.array(self.image_mean, dtype=values.dtype)
            std = np.array(self.image_std, dtype=values.dtype)
            values = ((values.T - mean) / std).T
        return np.asarray(values, dtype=np.float32)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Sides that are multiples of ``factor``, close to the original aspect ratio, with an area within
    ``[min_pixels, max_pixels]`` (Qwen2-VL's rule, Python's rounding included)."""
    _check_size(width, height, "the image")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f} is above "
                         f"{MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar <= 0 or w_bar <= 0:
        raise ImageError(f"a {height}x{width} image resizes to nothing (min_pixels {min_pixels})")
    return h_bar, w_bar


class Qwen2VLImageProcessor(_Settings):
    """transformers' ``Qwen2VLImageProcessorPil`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), with its
    defaults (a checkpoint's ``preprocessor_config.json`` overrides them)."""

    patch_size: int = Field(14, ge=1)
    temporal_patch_size: int = Field(2, ge=1)
    merge_size: int = Field(2, ge=1)
    min_pixels: int = Field(56 * 56, ge=1)
    max_pixels: int = Field(28 * 28 * 1280, ge=1)

    @classmethod
    def _dialect(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """``size: {shortest_edge, longest_edge}`` is the newer spelling of ``min_pixels`` / ``max_pixels``
        (as in transformers, explicit ``min_pixels`` / ``max_pixels`` win)."""
        size = raw.get("size")
        if not isinstance(size, dict):
            return raw
        return {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge"), **raw}

    @classmethod
    def from_config(cls, raw: dict[str, Any], **defaults: Any) -> Qwen2VLImageProcessor:
        """From a ``preprocessor_config.json`` dict; ``defaults`` fill what it leaves out."""
        return cls.parse(raw, defaults)  # type: ignore[no-any-return]

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def count_tokens(self, height: int, width: int) -> int:
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def __call__(self, source: ImageSource) -> ProcessedImage:
        image = load_image(source)
        height, width = self.target_size(image.height, image.width)
        if height % self.factor or width % self.factor:
            raise ImageError(f"a {height}x{width} image does not split into {self.factor}-pixel merge blocks")
        values = self._values(self._resize(image, height, width))
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        blocks = values.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        pixels = frames.reshape(grid_h * grid_w, 3 * t * p * p)
        return ProcessedImage(pixels, (1, grid_h, grid_w), grid_h * grid_w // m**2)


GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)


class Gemma4ImageProcessor(_Settings):
    """transformers' ``Gemma4ImageProcessorPil``: variable resolution under a soft-token budget."""

    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    max_soft_tokens: int = 280
    pooling_kernel_size: int = Field(3, ge=1)

    @model_validator(mode="after")
    def _budget(self) -> Gemma4ImageProcessor:
        if self.max_soft_tokens not in GEMMA4_SOFT_TOKENS:
            raise ValueError(f"max_soft_tokens must be one of {GEMMA4_SOFT_TOKENS}, got {self.max_soft_tokens}")
        return self

    @classmethod
    def from_config(cls, raw: dict[str, Any], **defaults: Any) -> Gemma4ImageProcessor:
        return cls.parse(raw, defaults)  # type: ignore[no-any-return]

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """The largest size that keeps the aspect ratio, has at most ``max_soft_tokens * k^2`` patches and
        sides that are multiples of ``k * patch`` (transformers' rule, edge cases included)."""
        _check_size(width, height, "the image")
        if not self.do_resize:
            return height, width
        k, p = self.pooling_kernel_size, self.patch_size
        max_patches = self.max_soft_tokens * k * k
        target_px = max_patches * p * p
        factor = math.sqrt(target_px / (height * width))
        side = k * p
        target_h = int(math.floor(factor * height / side)) * side
        target_w = int(math.floor(factor * width / side)) * side
        if target_h == 0 and target_w == 0:
            raise ImageError(f"a {height}x{width} image resizes to nothing")
        longest = (max_patches // k**2) * side
        if target_h == 0:
            target_h, target_w = side, min(int(math.floor(width / height)) * side, longest)
        elif target_w == 0:
            target_w, target_h = side, min(int(math.floor(height / width)) * side, longest)
        if target_h * target_w > target_px:
            raise ImageError(f"a {height}x{width} image does not fit in {max_patches} patches of {p} pixels")
        return target_h, target_w

    def count_tokens(self, height: int, width: int) -> int:
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.pooling_kernel_size**2

    def __call__(self, source: ImageSource) -> ProcessedImage:
        image = load_image(source)
        height, width = self.target_size(image.height, image.width)
        if (height, width) != (image.height, image.width):
            image = self._resize(image, height, width)
        values = self._values(image)
        p, k = self.patch_size, self.pooling_kernel_size
        rows, cols = height // p, width // p
        if rows % k or cols % k:
            raise ImageError(f"a {height}x{width} image does not pool into {k}x{k} patch blocks")
        pixels = values[:, : rows * p, : cols * p].reshape(3, rows, p, cols, p).transpose(1, 3, 2, 4, 0)
        return ProcessedImage(pixels.reshape(rows * cols, p * p * 3), (1, rows, cols), rows * cols // k**2)
