"""Vision-language models against transformers: prompts with one image and with two images of other sizes
(rendered by the real chat templates, expanded like the processors), logits of the whole prompt and of a
cached chunked prefill, and greedy tokens, for Qwen3.5 dense and MoE and Gemma 4 (E2B-like, with
bidirectional attention among an image's tokens, and MoE)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import loaded, reference
from parity import assert_close
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
