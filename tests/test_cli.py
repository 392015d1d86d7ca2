"""The command line: generate streams and reports, chat keeps a session with its commands, info tells the
runtime."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from mlxchat.cli import main
from mlxchat.tokenizer import Tokenizer

from conftest import fixture_path

MODEL = str(fixture_path("qwen3"))


def test_generate_streams_a_reply_and_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", MODEL, "--max-tokens", "5", "--temperature", "0", "Hello"]) == 0
    out, err = capsys.readouterr()
    assert "5 generated" in err and "prompt tokens" in err and "length" in err
    assert out.endswith("\n")


def test_generate_raw_skips_the_chat_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", MODEL, "--raw", "--max-tokens", "3", "--temperature", "0", "Hi"]) == 0
    raw = len(Tokenizer.from_folder(fixture_path("qwen3")).encode("Hi"))
    assert f"[{raw} prompt tokens" in capsys.readouterr().err


def test_info_reports_blas_and_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["blas"] and "qwen3" in info["plugins"]
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "BLAS" in out and "plugin qwen3" in out


def test_chat_keeps_a_session_and_runs_its_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    transcript = tmp_path / "t.json"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"Hello\nAnd again\n/save {transcript}\n/system Be brief\n"
                                                 f"/reset\nOnce more\n/quit\n"))
    assert main(["chat", "--model", MODEL, "--max-tokens", "4", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("generated") == 3
    saved = json.loads(transcript.read_text())
    assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]
    assert "system prompt set" in err and "conversation cleared" in err


def test_errors_are_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "x"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("mlxchat: ")


def test_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "chat" in out and "info" in out and "examples:" in out
