"""Vision-language models against transformers: prompts with one image and with two images of other sizes
(rendered by the real chat templates, expanded like the processors), logits of the whole prompt and of a
cached chunked prefill, and greedy tokens, for Qwen3.5 dense and MoE and Gemma 4 (E2B-like, with
bidirectional attention among an image's tokens, and MoE)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxchat
from mlxchat.testing import assert_close

from conftest import fixture_path, loaded, reference
from vision_support import VISION, cached_logits, chat, prompt, with_images

CHATS = ["one", "two"]


@pytest.mark.parametrize("which", CHATS)
@pytest.mark.parametrize("name", VISION)
def test_prompt_ids_match_the_processor(name: str, which: str) -> None:
    """The chat template's markers expanded to each image's placeholders, as transformers' processor does."""
    assert list(prompt(name, which).ids) == reference(name)[f"{which}_ids"].tolist()


@pytest.mark.parametrize("which", CHATS)
@pytest.mark.parametrize("name", VISION)
def test_logits_with_images_match_transformers(name: str, which: str) -> None:
    assert_close(np.array(loaded(name).logits(prompt(name, which))), reference(name)[f"{which}_logits"])


@pytest.mark.parametrize("name", VISION)
def test_chunked_prefill_and_cached_decoding_match_transformers(name: str) -> None:
    """Chunks of 5 tokens through both images, then one token at a time on the cached positions. Qwen3.5's
    chunks end inside images; Gemma 4's bidirectional images are never split."""
    model = loaded(name)
    two = prompt(name, "two")
    logits, bounds = cached_logits(model, two, step=5)
    assert_close(logits, reference(name)["two_logits"])
    split = any(s.start < b < s.end for _, b in bounds for s in two.images)
    assert split == (not model.module.atomic_images)


@pytest.mark.parametrize("which", CHATS)
@pytest.mark.parametrize("name", VISION)
def test_greedy_tokens_match_transformers(name: str, which: str) -> None:
    model = loaded(name)
    messages, images = chat(name, which)
    expected = reference(name)[f"{which}_greedy"].tolist()
    config = {"temperature": 0.0, "max_tokens": len(expected), "prefill_step": 7}
    result = model.generate(with_images(messages, images), config)
    assert result.tokens == expected[: len(result.tokens)]
    assert len(result.tokens) == len(expected) or expected[len(result.tokens)] in model.eos_ids


def test_mlx_vlm_gemma4_layout_matches_transformers(tmp_path: Path) -> None:
    """mlx-vlm's names for a Gemma 4 conversion (``language_model.model.*``, top-level ``vision_tower.*`` and
    ``embed_vision.*``; checked against a real mlx-vlm 0.7.10 conversion of this fixture) load the same model."""
    folder = tmp_path / "gemma4_vl"
    shutil.copytree(fixture_path("gemma4_vl"), folder)
    renames = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.embed_vision.", "embed_vision."))
    weights = mx.load(str(folder / "model.safetensors"))
    renamed = {}
    for key, value in weights.items():
        for old, new in renames:
            key = key.replace(old, new) if key.startswith(old) else key
        renamed[key] = value
    assert not any(k.startswith("model.") for k in renamed)
    mx.save_safetensors(str(folder / "model.safetensors"), renamed, metadata={"format": "mlx"})
    model = mlxchat.load_model(folder, dtype="float32")
    try:
        messages, images = chat("gemma4_vl", "two")
        assert_close(np.array(model.logits(model.image_prompt(messages, images))), reference("gemma4_vl")["two_logits"])
    finally:
        model.close()
