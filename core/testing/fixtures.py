"""Fixture folders: tiny checkpoints with their oracle's outputs, found by walking a folder, and the
models loaded from them (one per folder for the whole test run).

A fixture folder holds a checkpoint (``config.json``, weights, tokenizer, chat template), the
``reference.npz`` its builder stored and a ``fixture.json`` saying what made it. A fixture built as a
variant of another (the same architecture with another RoPE scaling, a quantized copy, another layout)
names it under ``variant_of``: the parity checks run on every fixture, the session contract on those
that are no variant.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..architecture import Architecture
from ..checkpoint import read_json
from ..loading import load_model
from ..model import GenerativeModel
from ..registry import registry

_loaded: dict[Path, GenerativeModel] = {}


def load_fixture(folder: str | os.PathLike[str]) -> GenerativeModel:
    """The float32 model of a fixture folder, loaded once per process and shared (close them all with
    :func:`close_fixtures`; the ``mlxchat`` pytest plugin does at the end of the run)."""
    path = Path(folder).resolve()
    if path not in _loaded:
        _loaded[path] = load_model(path, dtype="float32")
    return _loaded[path]


def loaded_folders() -> set[Path]:
    """The folders whose models :func:`load_fixture` holds."""
    return set(_loaded)


def close_fixtures(keep: Collection[Path] = ()) -> None:
    """Stop the workers of the models :func:`load_fixture` loaded (except those of ``keep``)."""
    for folder in [f for f in _loaded if f not in keep]:
        _loaded.pop(folder).close()


def fixture_info(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``fixture.json`` says about a fixture (empty when it has none)."""
    return read_json(Path(folder) / "fixture.json", required=False)


def fixture_folders(root: str | os.PathLike[str], *, variants: bool = True, kind: str = "text") -> list[Path]:
    """The fixture folders directly under ``root`` (those holding a ``config.json`` and a
    ``reference.npz``) of one ``kind`` (``fixture.json``'s, "text" unless it says otherwise: a "vision"
    fixture's reference holds prompts with images), sorted by name; without the variants when
    ``variants=False``."""
    found = sorted(p for p in Path(root).iterdir() if (p / "config.json").is_file() and (p / "reference.npz").is_file())
    return [p for p in found if (variants or not fixture_info(p).get("variant_of"))
            and fixture_info(p).get("kind", "text") == kind]


def architecture_of(folder: str | os.PathLike[str]) -> Architecture:
    """The registered architecture that serves a fixture (its config.json's ``model_type``)."""
    return registry().architecture_for_config(json.loads((Path(folder) / "config.json").read_text()))
