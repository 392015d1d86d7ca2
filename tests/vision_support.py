"""The vision fixtures' chats, and logits of a prompt with images fed through a cache chunk by chunk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import mlxchat
from mlxchat.multimodal import MultimodalPrompt, chunk_bounds, encode_images

from conftest import fixture_path, loaded

VISION = ["qwen3_5_vl", "qwen3_5_moe_vl", "gemma4_vl", "gemma4_moe_vl"]


def chat(name: str, which: str) -> tuple[list[dict[str, Any]], list[Path]]:
    """The messages of one of a fixture's chats and its image files, in order."""
    spec = json.loads((fixture_path(name) / "chats.json").read_text())[which]
    return spec["messages"], [fixture_path(name) / image for image in spec["images"]]


def with_images(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """The messages with each image part holding its image (as a user would send them)."""
    sources = iter(images)
    return [{**m, "content": [{"type": "image", "image": next(sources)} if p.get("type") == "image" else p
                              for p in m["content"]]} if isinstance(m["content"], list) else m for m in messages]


def prompt(name: str, which: str) -> MultimodalPrompt:
    messages, images = chat(name, which)
    return loaded(name).image_prompt(messages, images)


def cached_logits(model: mlxchat.GenerativeModel, prompt: MultimodalPrompt, step: int,
                  cache: mlxchat.PromptCache | None = None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Logits of ``prompt`` from where ``cache`` stands (fresh if none): chunks of at most ``step`` tokens
    through the last image (each image whole where the model asks), then one plain token at a time, so
    the text after the images runs on the positions the cache carries. Also the chunks."""

    def run() -> tuple[np.ndarray, list[tuple[int, int]]]:
        module = model.module
        layers = cache if cache is not None else model.make_prompt_cache()
        features = encode_images(module, prompt.images)
        atomic = [(s.start, s.end) for s in prompt.images] if module.atomic_images else []
        last = prompt.images[-1].end
        bounds = chunk_bounds(len(layers), last, step, (), atomic) + [(i, i + 1) for i in range(last, len(prompt))]
        out = []
        for a, b in bounds:
            inputs = module.image_inputs(prompt, a, b, features) if prompt.spans_in(a, b) else {}
            logits = module(mx.array(prompt.ids[a:b])[None], layers.layers, **inputs)[0].astype(mx.float32)
            mx.eval(logits)
            layers.feed(prompt.ids[a:b])
            out.append(np.array(logits))
        return np.concatenate(out), bounds

    return model.worker.run(run)
