"""Images and the prompt cache: reuse compares image identity (a changed image restarts reuse at its first
placeholder, the same pixels are reused whatever their source), a cache restored between images continues
exactly, and the rotary shift multimodal RoPE leaves after an image follows the KV cache. Also the model-level
contract around images (capabilities, refusals) and the plumbing (chunking, marker expansion)."""

from __future__ import annotations

import base64

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image, ImageOps

import mlxchat
from mlxchat.cache import KVCache
from mlxchat.config import RopeConfig
from mlxchat.errors import ImageError
from mlxchat.layers import MRoPE, RoPE
from mlxchat.multimodal import ImageTokens, MultimodalPrompt, chunk_bounds, expand_images, split_image_parts
from mlxchat.prompt_cache import PromptCache
from mlxchat.testing import assert_close

from conftest import fixture_path, loaded, reference
from vision_support import VISION, cached_logits, chat, prompt, with_images

GREEDY = {"temperature": 0.0, "max_tokens": 4, "prefill_step": 16}


def _flipped(name: str) -> Image.Image:
    """Image A mirrored: the same size (so the same placeholder tokens), other pixels."""
    return ImageOps.mirror(Image.open(fixture_path(name) / "image_a.png").convert("RGB"))


@pytest.mark.parametrize("name", VISION)
def test_reuse_compares_images_not_just_tokens(name: str) -> None:
    """Same images (from another source) reuse all but the last token; a same-sized other image, whose
    placeholder tokens are identical, stops reuse at its first placeholder."""
    model = loaded(name)
    messages, (image_b, image_a) = chat(name, "two")
    two = model.image_prompt(messages, [image_b, image_a])
    again = model.image_prompt(messages, [image_b.read_bytes(), image_a.read_bytes()])
    changed = model.image_prompt(messages, [image_b, _flipped(name)])
    assert changed.ids == two.ids and changed.image_keys() != two.image_keys()

    def run() -> tuple[int, int]:
        cache = model.make_prompt_cache()
        starts = [s.start for s in two.images]
        cache.prefill(model.module, two, snapshot_at=starts, step=16)
        same = cache.reuse(again.ids, again.image_keys())
        return same, cache.reuse(changed.ids, changed.image_keys())

    same, restart = model.worker.run(run)
    assert (same, restart) == (len(two) - 1, two.images[1].start)


@pytest.mark.parametrize("name", VISION)
def test_changed_image_restarts_reuse_and_the_reply_is_the_stateless_one(name: str) -> None:
    model = loaded(name)
    messages, (image_b, image_a) = chat(name, "two")
    cache = model.make_prompt_cache()
    model.generate(with_images(messages, [image_b, image_a]), GREEDY, cache=cache)
    changed = with_images(messages, [image_b, _flipped(name)])
    reply = model.generate(changed, GREEDY, cache=cache)
    start = model.image_prompt(changed).images[1].start
    assert reply.report.cached_prompt_tokens == start
    assert reply.report.prompt_tokens == len(model.image_prompt(changed))
    assert reply.tokens == model.generate(changed, GREEDY).tokens


@pytest.mark.parametrize("name", VISION)
def test_cache_restored_between_images_continues_exactly(name: str) -> None:
    """Cut back to text between the images: the cache returns to its snapshot before the first image (the
    states cannot be cut back) and a prefill from there matches transformers."""
    model = loaded(name)
    two = prompt(name, "two")
    first, second = two.images

    def restore() -> tuple[int, PromptCache]:
        cache = model.make_prompt_cache()
        cache.prefill(model.module, two, snapshot_at=[first.start, second.start], step=16)
        between = second.start - 1
        return cache.reuse(two.ids[: between + 1], [first.key]), cache

    kept, cache = model.worker.run(restore)
    assert kept == first.start
    logits, _ = cached_logits(model, two, step=7, cache=cache)
    assert_close(logits, reference(name)["two_logits"][kept:])


def test_text_after_an_image_rotates_at_the_shifted_position() -> None:
    """Qwen3.5: the KV cache carries where text continues after an image (largest position + 1)."""
    model = loaded("qwen3_5_vl")
    one = prompt("qwen3_5_vl", "one")
    image = one.images[0]
    _, rows, cols = image.image.grid
    merge = model.module.visual.config.spatial_merge_size

    def run() -> KVCache:
        cache = model.make_prompt_cache()
        cache.prefill(model.module, MultimodalPrompt(one.ids[: image.end + 1], one.images), step=8)
        return next(c for c in cache.layers if isinstance(c, KVCache))

    kv = model.worker.run(run)
    assert kv.position == image.start + max(rows, cols) // merge
    assert kv.offset == image.end


def test_kv_cache_shift_follows_trims() -> None:
    cache = KVCache()
    keys = mx.zeros((1, 1, 10, 4))
    cache.update_and_fetch(keys, keys)
    cache.shift_positions(-6)
    cache.update_and_fetch(keys[:, :, :2], keys[:, :, :2])
    assert (cache.offset, cache.position) == (12, 6)
    cache.trim_to(11)
    assert cache.position == 5
    cache.trim_to(9)
    assert (cache.position, cache.shifts) == (9, [])


def test_mrope_runs_text_exactly_as_plain_rope() -> None:
    rope = RopeConfig(rope_theta=100.0)
    plain, multimodal = RoPE(8, rope), MRoPE(8, rope, (2, 1, 1), 4096)
    x = mx.random.normal((1, 2, 5, 32), key=mx.random.key(0))
    assert mx.array_equal(plain(x, 7), multimodal(x, 7)).item()
    explicit = multimodal(x, mx.broadcast_to(mx.arange(7, 12)[None], (3, 5)))
    assert_close(np.array(explicit), np.array(plain(x, 7)), 1e-5)


def test_chunks_respect_step_stops_and_whole_images() -> None:
    assert chunk_bounds(0, 10, 4, stops=[6]) == [(0, 4), (4, 6), (6, 10)]
    # An image at [3, 9) that must stay whole: a chunk stops before it, the next holds all of it.
    assert chunk_bounds(0, 12, 4, atomic=[(3, 9)]) == [(0, 3), (3, 9), (9, 12)]
    assert chunk_bounds(0, 12, 4, stops=[5], atomic=[(3, 9)]) == [(0, 3), (3, 9), (9, 12)]
    with pytest.raises(ImageError, match="inside an image"):
        chunk_bounds(0, 5, 4, atomic=[(3, 9)])


def test_prompt_cache_reuse_stops_at_the_first_different_image() -> None:
    cache = PromptCache(lambda: [KVCache()])
    cache.layers[0].offset = 20
    cache.feed(list(range(20)), images=[(2, 4, "a"), (10, 4, "b")])
    ids = list(range(20)) + [99]
    assert cache.reuse(ids, [(2, 4, "a"), (10, 4, "b")]) == 20
    assert cache.reuse(ids, [(2, 4, "a"), (10, 4, "c")]) == 10
    assert cache.images == [(2, 4, "a")]
    assert cache.reuse(ids, []) == 2


def test_markers_expand_to_placeholders() -> None:
    image = loaded("gemma4_vl").process_image(fixture_path("gemma4_vl") / "image_a.png")
    tokens = ImageTokens(marker=7, begin=(5,), end=(6,))
    expanded = expand_images([1, 7, 2], [image], tokens)
    assert expanded.ids == (1, 5, *[7] * image.tokens, 6, 2)
    assert expanded.images[0].start == 2
    with pytest.raises(ImageError, match="2 image markers for 1 images"):
        expand_images([7, 7], [image], tokens)


def test_image_parts_take_their_images_in_order() -> None:
    png = (fixture_path("qwen3_5_vl") / "image_a.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": url}}, {"type": "image"}]}]
    plain, sources = split_image_parts(messages, ["given"])
    assert sources == ["a.png", png, "given"]
    assert plain[0]["content"][2] == {"type": "image"}
    with pytest.raises(ImageError, match="more images"):
        split_image_parts(messages, ["given", "extra"])
    with pytest.raises(ImageError, match="remote image URLs"):
        split_image_parts([{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/y.png"}]}])


def test_capabilities_describe_the_model() -> None:
    vision = loaded("qwen3_5_vl").capabilities
    assert (vision.supports_images, vision.supports_tools, vision.supports_reasoning) == (True, True, True)
    assert vision.context_length == 4096
    assert vision.default_generation == loaded("qwen3_5_vl").defaults
    assert loaded("gemma4_vl").capabilities.supports_reasoning
    assert not loaded("gemma4").capabilities.supports_images
    assert isinstance(vision, mlxchat.Capabilities)


@pytest.mark.parametrize("name", ["qwen3_5_mlx", "gemma4"])
def test_text_only_models_refuse_images(name: str) -> None:
    """mlx-lm's copy of a Qwen3.5 checkpoint has no tower: it loads as the text model it was."""
    model = loaded(name)
    image = fixture_path("qwen3_5_vl") / "image_a.png"
    assert not model.capabilities.supports_images
    with pytest.raises(ImageError, match="reads no images"):
        model.generate("describe", images=[image])
    with pytest.raises(ImageError, match="reads no images"):
        model.logits([1, 2, 3], images=[image])


def test_a_prompt_must_go_on_after_its_last_image() -> None:
    model = loaded("qwen3_5_vl")
    image = fixture_path("qwen3_5_vl") / "image_a.png"
    with pytest.raises(ImageError, match="go on after its last image"):
        model.generate([5, model.module.image_tokens.marker], images=[image])


def test_mlx_vlm_quantized_layout_loads_with_its_tower() -> None:
    """mlx-vlm's 4-bit conversion: the text model quantized (logits as mlx-vlm's), the tower in float
    (the same weights as the released checkpoint's, read from mlx-vlm's channels-last patch embedding)."""
    from mlx.utils import tree_flatten

    model, ref = loaded("qwen3_5_vl_vlm_q4"), reference("qwen3_5_vl_vlm_q4")
    assert model.capabilities.supports_images
    assert_close(np.array(model.logits(ref["input_ids"].tolist())), ref["logits"])
    ours = dict(tree_flatten(model.module.visual.parameters()))
    released = dict(tree_flatten(loaded("qwen3_5_vl").module.visual.parameters()))
    assert ours.keys() == released.keys()
    assert all(mx.array_equal(ours[k], released[k]).item() for k in ours)


def test_a_prompt_whose_ids_and_images_disagree_is_refused() -> None:
    model = loaded("qwen3_5_vl")
    one = prompt("qwen3_5_vl", "one")
    stray = mlxchat.MultimodalPrompt(one.ids + (model.module.image_tokens.marker, 5), one.images)
    with pytest.raises(ImageError, match="disagree"):
        model.logits(stray)
