"""Image loading and preprocessing: the processors give transformers' pixel values on the fixtures' images,
every source gives the same image, and what must not be read is refused."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mlxchat.errors import CheckpointError, ImageError
from mlxchat.images import Gemma4ImageProcessor, Qwen2VLImageProcessor, as_data_url, image_url_source, load_image

from conftest import fixture_path, loaded, reference

PROCESSED = [(name, image) for name in ("qwen3_5_vl", "gemma4_vl") for image in ("image_a", "image_b")]


@pytest.mark.parametrize(("name", "image"), PROCESSED)
def test_pixels_match_the_transformers_processor(name: str, image: str) -> None:
    """Resize (Pillow bicubic), alpha on white, rescale, normalisation and patch order as transformers."""
    ref = reference(name)
    processed = loaded(name).process_image(fixture_path(name) / f"{image}.png")
    assert processed.grid == tuple(ref[f"{image}_grid"])
    assert processed.pixels.shape == ref[f"{image}_pixels"].shape
    assert float(np.abs(processed.pixels - ref[f"{image}_pixels"]).max()) <= 1e-5


@pytest.mark.parametrize("name", ["qwen3_5_vl", "gemma4_vl"])
def test_placeholder_counts_match_the_processor(name: str) -> None:
    model, ref = loaded(name), reference(name)
    marker = model.module.image_tokens.marker
    chats = json.loads((fixture_path(name) / "chats.json").read_text())
    for chat, spec in chats.items():
        counts = [model.process_image(fixture_path(name) / image).tokens for image in spec["images"]]
        assert sum(counts) == int((ref[f"{chat}_ids"] == marker).sum())
        sizes = [Image.open(fixture_path(name) / image).size for image in spec["images"]]
        assert counts == [model.image_processor.count_tokens(h, w) for w, h in sizes]


def test_gemma4_patches_are_in_raster_order() -> None:
    ref = reference("gemma4_vl")
    _, rows, cols = ref["image_b_grid"]
    xs, ys = np.meshgrid(np.arange(cols), np.arange(rows))
    assert (ref["image_b_positions"] == np.stack([xs.ravel(), ys.ravel()], axis=-1)).all()


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_every_source_gives_the_same_image(tmp_path: Path) -> None:
    processor = Qwen2VLImageProcessor.from_config({"patch_size": 4, "min_pixels": 256, "max_pixels": 2304})
    path = fixture_path("qwen3_5_vl") / "image_b.png"
    data = path.read_bytes()
    copy = tmp_path / "renamed.png"
    copy.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = [path, str(path), copy, data, Image.open(path), url]
    digests = {processor(source).digest for source in sources}
    assert len(digests) == 1


def test_digest_follows_the_pixels() -> None:
    processor = Gemma4ImageProcessor.from_config({"patch_size": 4, "max_soft_tokens": 70})
    image = load_image(fixture_path("gemma4_vl") / "image_a.png")
    changed = image.copy()
    changed.putpixel((0, 0), tuple(255 - v for v in image.getpixel((0, 0))))  # type: ignore[arg-type, union-attr]
    assert processor(image).digest != processor(changed).digest
    assert processor(_png(image)).digest == processor(image).digest


def test_transparency_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    assert load_image(clear).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_turns_the_image_upright() -> None:
    image = Image.new("RGB", (20, 10), (200, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: the upright image is 10 wide, 20 high
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif)
    assert load_image(buffer.getvalue()).size == (10, 20)


def test_remote_and_file_urls_are_refused() -> None:
    with pytest.raises(ImageError, match="remote image URLs are not allowed"):
        image_url_source("https://example.com/cat.png")
    assert image_url_source("https://example.com/cat.png", allow_remote=True) == "https://example.com/cat.png"
    for url in ("file:///etc/passwd", "/etc/passwd", "ftp://host/x.png"):
        with pytest.raises(ImageError, match="data: URL"):
            image_url_source(url)
    with pytest.raises(ImageError, match="not fetched"):
        load_image("http://example.com/cat.png")
    png = _png(Image.new("RGB", (4, 4)))
    assert image_url_source("data:image/png;base64," + base64.b64encode(png).decode()) == png


@pytest.mark.parametrize(("source", "message"), [
    (b"not an image", "not a readable image"),
    ("data:text/plain;base64,aGk=", "image/\\* media type"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png;base64", "no comma"),
    ("/no/such/image.png", "no such image file"),
    (3.5, "an image is a path"),
])
def test_unreadable_images_raise_image_error(source: object, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        load_image(source)  # type: ignore[arg-type]


def test_extreme_aspect_ratio_is_refused() -> None:
    processor = Qwen2VLImageProcessor()
    with pytest.raises(ImageError, match="aspect ratio"):
        processor(Image.new("RGB", (1000, 4)))


def test_processor_settings_are_validated() -> None:
    with pytest.raises(CheckpointError, match="max_soft_tokens"):
        Gemma4ImageProcessor.from_config({"max_soft_tokens": 100})
    with pytest.raises(CheckpointError, match="patch_size"):
        Qwen2VLImageProcessor.from_config({"patch_size": 0})


def test_qwen_size_spelling_and_explicit_pixels() -> None:
    """``size: {shortest_edge, longest_edge}`` sets the pixel range; explicit min/max_pixels win."""
    sized = Qwen2VLImageProcessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 200}}, max_pixels=9)
    assert (sized.min_pixels, sized.max_pixels) == (100, 200)
    both = Qwen2VLImageProcessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 200}, "max_pixels": 300})
    assert both.max_pixels == 300


def _png_with_chunk(kind: bytes, data: bytes) -> bytes:
    png = _png(Image.new("RGB", (8, 8), (10, 20, 30)))
    chunk = struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return png[:33] + chunk + png[33:]  # after IHDR


def _gif_declaring(width: int, height: int) -> bytes:
    """A 1 x 1 GIF whose logical screen is ``width`` x ``height`` (tens of bytes that decode to gigabytes)."""
    screen = b"GIF89a" + struct.pack("<HH", width, height) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
    image = b"\x2c" + struct.pack("<HHHH", 0, 0, 1, 1) + b"\x00" + b"\x02\x02\x44\x01\x00"
    return screen + image + b"\x3b"


def test_hostile_or_unusual_images_are_image_errors_or_read(tmp_path: Path) -> None:
    """Each of these escaped as a raw exception (a 500 behind the server) or cost seconds and gigabytes: a
    damaged EXIF block, a decoder outside the formats read (DDS), a screen declared past MAX_PIXELS, an image of
    no pixels, a device or FIFO as a path; a CMYK image from Pillow is read as any other."""
    for data in (_png_with_chunk(b"eXIf", b"garbage-garbage"), _png_with_chunk(b"eXIf", b"II*\x00\x08\x00\x00")):
        assert load_image(data).size == (8, 8)  # its orientation unreadable: taken as it is
    dds = io.BytesIO()
    Image.new("RGBA", (16, 16)).save(dds, "DDS")
    for bad, message in ((dds.getvalue(), "not a readable image"), (_gif_declaring(9400, 9400), "more than the"),
                         (Image.new("RGB", (0, 0)), "shows nothing"), ("/dev/zero", "no such image file")):
        with pytest.raises(ImageError, match=message):
            load_image(bad)
        with pytest.raises(ImageError, match=message):
            as_data_url(bad)
    with pytest.raises(ImageError, match="shows nothing"):
        Qwen2VLImageProcessor.from_config({}).count_tokens(0, 10)
    cmyk = Image.new("CMYK", (8, 8), (0, 50, 100, 0))
    assert load_image(as_data_url(cmyk)).size == (8, 8)
    with pytest.raises(ImageError, match="not a readable image") as caught:
        load_image(b"not an image at all")
    assert " at 0x" not in str(caught.value)  # no object addresses for a client to read
