"""The embedded demo model: a small Qwen3-architecture chat model trained by the project itself, shipped
in the package so that mlxchat works offline out of the box.

It knows a small world (capitals, two-digit arithmetic, metric conversions, greetings) and calls the
demo tools ``get_weather(city)`` and ``get_time(city)`` (:data:`mlxchat.demo.world.DEMO_TOOLS`; the chat
page runs them as :data:`~mlxchat.demo.world.DEMO_PAGE_TOOLS`, which ask the user first). Rebuild it with
``python -m mlxchat.demo.build``; measure it with ``python -m mlxchat.demo.evaluate``.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError

MODEL_DIR = Path(__file__).resolve().parent / "model"


def default_model_path() -> Path:
    """The shipped demo checkpoint folder (used when no model is given)."""
    if not (MODEL_DIR / "config.json").exists():
        raise CheckpointError(
            f"{MODEL_DIR}: the demo model is missing; build it with `python -m mlxchat.demo.build`"
        )
    return MODEL_DIR


__all__ = ["MODEL_DIR", "default_model_path"]
