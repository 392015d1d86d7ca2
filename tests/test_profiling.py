"""The profiler: off it hands back the plain objects (no timing on the hot path); on, every reply is recorded
with its phases, prefill chunks and decode steps (split into build, eval, sample, detokenize, parse), written
as JSON after each reply and summarised by ``mlxchat profile``; the environment switch turns it on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import mlxchat
from mlxchat import profiling
from mlxchat.cli import main

from conftest import FIXTURES, loaded

STEP_KEYS = {"tokens", "build", "eval", "sample"}
REPLY_KEYS = {"prompt_tokens", "cached_prompt_tokens", "generated_tokens", "ttft_s", "prefill_tps", "decode_tps",
              "peak_memory_gb", "finish_reason", "draft_tokens", "accepted_draft_tokens", "seconds", "phases",
              "prefill_chunks", "decode_steps"}


@pytest.fixture
def profiled(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "profile.json"
    profiling.enable(path)
    try:
        yield path
    finally:
        profiling.disable()


def test_disabled_the_profiler_hands_back_the_plain_objects() -> None:
    assert not profiling.enabled
    assert profiling.timed("parse", len) is len
    assert profiling.current() is None and profiling.begin() is None
    with profiling.span("tokenize"):
        pass
    loaded("qwen3").generate([1, 2, 3], {"max_tokens": 2})
    assert profiling.report()["replies"] == []


def test_a_session_turn_is_recorded_phase_by_phase(profiled: Path) -> None:
    model = mlxchat.load_model()  # the demo model: a real template, tokenizer and parser
    try:
        session = model.chat_session()
        session.send("What is the capital of France?", config={"max_tokens": 12, "temperature": 0.0})
        session.send("And of Italy?", config={"max_tokens": 12, "temperature": 0.0, "prefill_step": 8})
    finally:
        model.close()
    report = json.loads(profiled.read_text())
    assert report["mlxchat_profile"] == 1 and len(report["replies"]) == 2
    first, second = report["replies"]
    assert REPLY_KEYS <= set(first)
    assert first["phases"]["template_render"] > 0 and first["phases"]["tokenize"] > 0
    assert first["decode_steps"][0]["prompt"] == first["prompt_tokens"] - first["cached_prompt_tokens"]
    for step in first["decode_steps"]:
        assert STEP_KEYS <= set(step) and "detokenize" in step and "parse" in step
    assert len(first["decode_steps"]) == first["generated_tokens"]
    assert second["cached_prompt_tokens"] > 0 and second["prefill_chunks"]  # chunks of 8, the rest in step 1
    assert all(b - a <= 8 and seconds > 0 for a, b, seconds in second["prefill_chunks"])
    assert second["ttft_s"] > 0 and second["peak_memory_gb"] > 0


def test_speculative_rounds_are_recorded_with_their_drafting(profiled: Path) -> None:
    model = loaded("qwen3")
    result = model.with_draft(model, 3).generate([5, 6, 7, 8], {"max_tokens": 10, "temperature": 0.0})
    reply = profiling.disable()["replies"][0]
    assert reply["draft_tokens"] == result.report.draft_tokens > 0
    rounds = reply["decode_steps"][1:]
    assert all("draft" in step for step in rounds) and sum(s["tokens"] for s in reply["decode_steps"]) >= 10


def test_mlxchat_profile_prints_a_summary(profiled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded("qwen3").generate([1, 2, 3, 4], {"max_tokens": 6})
    assert main(["profile", str(profiled)]) == 0
    out = capsys.readouterr().out
    assert "1 replies" in out and "decode:" in out and "eval" in out and len(out.splitlines()) < 30


def test_mlxchat_profile_refuses_a_file_that_is_no_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"replies": 3}')
    assert main(["profile", str(bad)]) == 1
    assert "not an mlxchat profile report" in capsys.readouterr().err


def test_the_environment_switch_profiles_a_process(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    script = (f"import mlxchat; m = mlxchat.load_model({str(FIXTURES / 'qwen3')!r}); "
              "m.generate([1, 2, 3], {'max_tokens': 3}); m.close()")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "MLXCHAT_PROFILE": str(path)})
    report = profiling.load(path)
    assert len(report["replies"]) == 1 and report["replies"][0]["generated_tokens"] == 3


def test_a_profiled_constrained_reply_follows_its_schema(profiled: Path) -> None:
    """The profiled decode path (one step at a time) applies a constraint's mask too."""
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["x"]}
    result = loaded("qwen3").generate("Hi", {"temperature": 1.0, "seed": 5, "max_tokens": 100, "response_format": {
        "type": "json_schema", "json_schema": {"name": "point", "schema": point}}})
    assert result.finish_reason == "stop" and 0 <= json.loads(result.text)["x"] <= 99
    assert profiling.report()["replies"][-1]["decode_steps"]  # it ran the profiled path
