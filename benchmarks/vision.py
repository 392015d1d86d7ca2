"""The image rows: one 448x448 picture and a short question, per vision-language checkpoint.

Each engine runs in its own process (the worker's ``vision`` job) on the same PNG file and the same
question, greedy. After a warm-up generation with the image (first-call allocations, the tower included)
it measures:

- ``encode_s``: the vision tower alone (patch embedding to the projection into the text model's width)
  on the already preprocessed image. mlxchat: the model's ``encode_image``, called on the model's worker
  thread as a prefill calls it; mlx-vlm: its tower and projector, called as its ``get_input_embeddings``
  calls them. The library's own generation path is not touched.
- ``ttft_s``: from handing the engine the chat message and the image file to the first token: rendering,
  reading and preprocessing the image, the tower and the prefill of the whole prompt; ``prefill_tps`` is
  the prompt's tokens (image placeholders included) over that time.
- ``decode_tps``: the tokens after the first over the time they took (stops early at EOS, as the text rows).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

from .engines import Engine
from .texts import IMAGE_QUESTION

SIDE = 448


def picture(path: Path) -> Path:
    """Writes the benchmark's picture: a colour gradient with noise, the same bytes every run."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, SIDE, dtype=np.float32)
    across, down = np.meshgrid(ramp, ramp)
    base = np.stack([across, down, 255 - across], axis=-1)
    noise = np.random.default_rng(0).normal(0, 24, base.shape)
    pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


class ImageEngine(Protocol):
    """An engine with a vision-language checkpoint, set up with the picture and the question."""

    @property
    def engine(self) -> Engine: ...

    def tokens(self) -> tuple[int, int]:
        """(prompt tokens, of which image placeholders) as the engine builds the prompt."""
        ...

    def encode(self) -> float:
        """Seconds the tower takes on the preprocessed picture (evaluated)."""
        ...

    def stream(self, max_tokens: int) -> Iterator[int]:
        """Greedy token ids for the question about the picture, from the chat message and the file."""
        ...


class MlxchatImages:
    def __init__(self, folder: Path, image: Path):
        from .engines import Mlxchat

        self.engine = Mlxchat(folder)
        self.model = self.engine.model
        content = [{"type": "image", "image": str(image)}, {"type": "text", "text": IMAGE_QUESTION}]
        self.messages = [{"role": "user", "content": content}]

    def tokens(self) -> tuple[int, int]:
        prompt = self.model.image_prompt(self.messages)
        return len(prompt), sum(span.length for span in prompt.images)

    def encode(self) -> float:
        from mlxchat.multimodal import encode_images

        prompt = self.model.image_prompt(self.messages)

        def run() -> float:
            begin = time.perf_counter()
            encode_images(self.model.module, prompt.images)  # evaluates the features
            return time.perf_counter() - begin

        return float(self.model.worker.run(run))

    def stream(self, max_tokens: int) -> Iterator[int]:
        from mlxchat import GenerationConfig

        config = GenerationConfig(max_tokens=max_tokens, temperature=0.0)
        for chunk in self.model.stream(self.messages, config):
            if chunk.token is not None:
                yield chunk.token


class MlxVlmImages:
    def __init__(self, folder: Path, image: Path, *, blas_path: str | None, dtype: str | None):
        from .engines import MlxVlm

        self.engine = MlxVlm(folder, blas_path=blas_path, dtype=dtype)  # first: it preloads the BLAS for MLX
        from mlx_vlm.prompt_utils import apply_chat_template

        self.model, self.processor = self.engine.model, cast(Any, self.engine.processor)
        self.prompt = str(apply_chat_template(self.processor, self.model.config, IMAGE_QUESTION, num_images=1))
        self.image = str(image)

    def _inputs(self) -> dict[str, Any]:
        """The processor's output for the prompt and the picture, as mlx-vlm's generation prepares it."""
        from mlx_vlm.utils import prepare_inputs

        config = self.model.config
        return dict(prepare_inputs(self.processor, images=[self.image], prompts=self.prompt,
                                   image_token_index=getattr(config, "image_token_index", None)))

    def tokens(self) -> tuple[int, int]:
        config = self.model.config
        marker = getattr(config, "image_token_id", None) or config.image_token_index
        ids = self._inputs()["input_ids"][0].tolist()
        return len(ids), ids.count(marker)

    def encode(self) -> float:
        import mlx.core as mx

        inputs = self._inputs()
        pixels = inputs["pixel_values"]
        begin = time.perf_counter()
        if hasattr(self.model, "encode_image"):  # Gemma 4: vision_tower, then embed_vision
            features = self.model.encode_image(pixels, inputs.get("image_position_ids"))
        else:  # Qwen3.5: the tower ends in its merger
            tower = self.model.vision_tower
            features, _ = tower(pixels.astype(tower.patch_embed.proj.weight.dtype), inputs["image_grid_thw"])
        mx.eval(features)
        return time.perf_counter() - begin

    def stream(self, max_tokens: int) -> Iterator[int]:
        from mlx_vlm import stream_generate

        results = stream_generate(self.model, self.processor, self.prompt, image=[self.image],
                                  max_tokens=max_tokens, temperature=0.0)
        for result in results:
            if result.finish_reason is None and result.token is not None:  # the last result repeats a token
                yield int(result.token)


def open_images(name: str, folder: Path, image: Path, *, blas_path: str | None,
                dtype: str | None) -> ImageEngine:
    if name == "mlxchat":
        return MlxchatImages(folder, image)
    if name == "mlx-vlm":
        return MlxVlmImages(folder, image, blas_path=blas_path, dtype=dtype)
    raise ValueError(f"unknown image engine {name!r}; known: mlxchat, mlx-vlm")


def measure(images: ImageEngine, decode: int) -> dict[str, Any]:
    """One image row's run: tokens, the tower's time, then a generation timed token by token."""
    list(images.stream(2))  # warm-up
    prompt_tokens, image_tokens = images.tokens()
    encode_s = images.encode()
    images.engine.reset_peak()
    arrivals, tokens = [], []
    begin = time.perf_counter()
    for token in images.stream(decode):
        arrivals.append(time.perf_counter())
        tokens.append(token)
    ttft = arrivals[0] - begin
    span = arrivals[-1] - arrivals[0]
    return {
        "image": f"{SIDE}x{SIDE}",
        "prompt_tokens": prompt_tokens,
        "image_tokens": image_tokens,
        "encode_s": encode_s,
        "ttft_s": ttft,
        "prefill_tps": prompt_tokens / ttft,
        "generated": len(tokens),
        "decode_tps": (len(tokens) - 1) / span if span > 0 else None,
        "tokens": tokens,
        "peak_bytes": images.engine.peak_bytes(),
    }
