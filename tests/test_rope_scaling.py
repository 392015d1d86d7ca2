"""Scaled RoPE: the qwen3_rope_* fixtures (linear, dynamic NTK, llama3, yarn) pass the parity kit in
tests/test_conformance.py; here, that their scaling matters over the reference sequence (the same weights
without it are far off), that an unsupported type is a clear error, and that a model is owned by its
worker: loaded on one thread, it generates on others (scaled RoPE crashed there with "There is no
Stream(cpu, 0) in current thread")."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import mlxchat
from mlxchat.testing import full_logits, reference

from conftest import fixture_path

KINDS = ["linear", "dynamic", "llama3", "yarn"]


@pytest.mark.parametrize("kind", KINDS)
def test_scaling_matters_over_the_reference_sequence(kind: str, tmp_path: Path) -> None:
    folder = shutil.copytree(fixture_path(f"qwen3_rope_{kind}"), tmp_path / kind)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0}
    (folder / "config.json").write_text(json.dumps(config))
    ref = reference(fixture_path(f"qwen3_rope_{kind}"))
    with mlxchat.load_model(folder, dtype="float32") as unscaled:
        assert np.abs(full_logits(unscaled, ref["input_ids"]) - ref["logits"]).max() > 1e-2


def test_longrope_is_a_clear_error(tmp_path: Path) -> None:
    folder = shutil.copytree(fixture_path("qwen3"), tmp_path / "longrope")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0] * 16,
                                 "long_factor": [2.0] * 16, "original_max_position_embeddings": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(mlxchat.CheckpointError, match="'longrope'.*not supported"):
        mlxchat.load_model(folder)


def test_a_model_loaded_on_one_thread_generates_on_others() -> None:
    loaded: dict[str, mlxchat.GenerativeModel] = {}
    loader = threading.Thread(target=lambda: loaded.update(
        model=mlxchat.load_model(fixture_path("qwen3_rope_yarn"), dtype="float32")))
    loader.start()
    loader.join()
    ref = reference(fixture_path("qwen3_rope_yarn"))
    prompt = ref["input_ids"][: int(ref["prompt_len"])].tolist()
    config = {"max_tokens": 6, "temperature": 0.0}
    with loaded["model"] as model:
        here = model.generate(prompt, config).tokens
        elsewhere: list[list[int]] = []
        other = threading.Thread(target=lambda: elsewhere.append(model.generate(prompt, config).tokens))
        other.start()
        other.join()
        assert here == elsewhere[0] == ref["greedy"][: len(here)].tolist()
        session = model.chat_session()
        assert session.send("Hello", config=config).report.generated_tokens > 0


def test_a_model_built_on_one_thread_runs_on_others() -> None:
    raw = json.loads((fixture_path("qwen3_rope_llama3") / "config.json").read_text())
    built: list[mlxchat.GenerativeModel] = []
    builder = threading.Thread(target=lambda: built.append(mlxchat.build_model(raw, seed=3)))
    builder.start()
    builder.join()
    with built[0] as model:
        assert np.isfinite(full_logits(model, [1, 2, 3, 4])).all()
