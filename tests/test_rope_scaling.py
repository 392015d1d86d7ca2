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
from mlxchat.testing import assert_close, chunked_logits, full_logits, greedy_tokens, reference

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


WINDOWS = {"linear": 4096, "dynamic": 24, "llama3": 32, "yarn": 32}
"""Where each fixture's scaling starts: max_position_embeddings (linear, dynamic) or
original_max_position_embeddings (llama3, yarn)."""
LIMITS = {"linear": (8192, "linear RoPE: factor 2 x max_position_embeddings 4096"),
          "dynamic": (48, "dynamic RoPE: factor 2 x max_position_embeddings 24"),
          "llama3": (4096, "max_position_embeddings 4096 (llama3 RoPE)"),
          "yarn": (128, "yarn RoPE: factor 4 x original_max_position_embeddings 32")}


@pytest.mark.parametrize("kind", KINDS)
def test_the_context_limit_is_the_scaled_window_as_vllm_derives_it(kind: str) -> None:
    with mlxchat.load_model(fixture_path(f"qwen3_rope_{kind}"), dtype="float32") as model:
        assert (model.context_length, model.context_reason) == LIMITS[kind]
        assert (model.capabilities.context_length, model.capabilities.context_reason) == LIMITS[kind]
    assert mlxchat.checkpoint_context(fixture_path(f"qwen3_rope_{kind}")) == LIMITS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_past_the_original_window_matches_transformers_cached_generation(kind: str) -> None:
    long = dict(np.load(fixture_path(f"qwen3_rope_{kind}") / "long.npz"))
    prompt, greedy = long["prompt"].tolist(), long["greedy"].tolist()
    assert len(prompt) > WINDOWS[kind]
    with mlxchat.load_model(fixture_path(f"qwen3_rope_{kind}"), dtype="float32") as model:
        assert len(prompt) + len(greedy) <= model.context_length
        # generate's schedule: the prompt in one forward, then one token at a time (dynamic NTK depends on it)
        logits = chunked_logits(model, prompt + greedy[:-1], [len(prompt)])[len(prompt) - 1:]
        assert_close(logits, long["logits"])
        assert greedy_tokens(model, prompt, len(greedy), prefill_step=len(prompt)) == greedy
        reply = model.generate(prompt, {"max_tokens": len(greedy), "temperature": 0.0}).tokens
        assert reply == greedy[: len(reply)] and reply


def test_context_length_raises_the_default_up_to_the_limit_and_no_further() -> None:
    folder = fixture_path("qwen3_rope_dynamic")
    with mlxchat.load_model(folder, dtype="float32", context_length=40) as model:
        assert model.context_length == 40
        assert model.context_reason == f"context_length=40 (the model serves {LIMITS['dynamic'][0]}: " \
                                       f"{LIMITS['dynamic'][1]})"
        with pytest.raises(mlxchat.ContextLengthError, match="context holds 40"):
            model.generate(list(range(40)), {"max_tokens": 1})
    with pytest.raises(mlxchat.ContextLengthError, match=r"context_length 49 .* 48 \(dynamic RoPE: factor 2"):
        mlxchat.load_model(folder, context_length=49)


def test_info_names_a_checkpoints_context_limit_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    from mlxchat.cli import main

    assert main(["info", "--model", str(fixture_path("qwen3_rope_yarn"))]) == 0
    assert "128 tokens (yarn RoPE: factor 4 x original_max_position_embeddings 32)" in capsys.readouterr().out
    assert main(["info", "--json", "--model", str(fixture_path("qwen3_rope_yarn"))]) == 0
    assert json.loads(capsys.readouterr().out)["context"]["context_length"] == 128


def test_speculative_decoding_past_a_dynamic_ntk_window_is_refused_clearly() -> None:
    """Verifying drafts in one forward rotates their keys with one dynamic base where plain decoding uses one
    per token (measured: a self-draft diverged from plain greedy 6 tokens after a 30-token prompt)."""
    folder = fixture_path("qwen3_rope_dynamic")
    with mlxchat.load_model(folder, dtype="float32") as model, mlxchat.load_model(folder, dtype="float32") as draft:
        speculative = model.with_draft(draft)
        within = speculative.generate(list(range(5, 15)), {"max_tokens": 10, "temperature": 0.0, "draft_tokens": 3})
        assert within.tokens == model.generate(list(range(5, 15)), {"max_tokens": 10, "temperature": 0.0}).tokens
        with pytest.raises(mlxchat.InvalidInputError, match="dynamic-NTK window \\(24 tokens"):
            speculative.generate(list(range(5, 35)), {"max_tokens": 4, "temperature": 0.0, "draft_tokens": 3})
