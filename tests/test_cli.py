"""The command line: generate streams and reports, chat keeps a session with its commands, info tells the
runtime."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest

import mlxchat
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


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mlxchat {mlxchat.__version__}"


@pytest.mark.parametrize(("args", "option"), [(["--max-tokens", "-5"], "--max-tokens"),
                                              (["--temperature", "-1"], "--temperature"),
                                              (["--context-length", "1"], "--context-length"),
                                              (["--prefill-step-budget", "0"], "--prefill-step-budget"),
                                              (["--max-decode-slowdown", "0.5"], "--max-decode-slowdown"),
                                              (["--tools", "no_such_module:f"], "--tools"),
                                              (["--tools", "nonsense"], "--tools"),
                                              (["--tools", "os:sep"], "--tools"),
                                              (["--tools", ".relative:f"], "--tools")])
def test_bad_arguments_are_one_line_before_any_model_loads(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           args: list[str], option: str) -> None:
    # The model path does not exist: had it been loaded first, the error would be about the path.
    assert main(["generate", "--model", str(tmp_path / "nowhere"), *args, "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlxchat: {option}") and "\n" not in err and "Traceback" not in err


def test_serve_without_the_server_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", "--model", "/nowhere"]) == 2
    assert "pip install 'mlxchat[server]'" in capsys.readouterr().err


def test_serve_options_are_checked_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nowhere", "--caches", "0"]) == 2
    assert capsys.readouterr().err.startswith("mlxchat: --caches:")
    for option, value in (("--port", "70000"), ("--max-spill-gb", "inf"), ("--header-timeout", "nan")):
        assert main(["serve", "--model", "/nowhere", option, value]) == 2
        assert capsys.readouterr().err.startswith(f"mlxchat: {option}")


def test_ctrl_c_in_generate_exits_130_quietly(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mlxchat.ChatSession, "send_stream", interrupted)
    assert main(["generate", "--model", MODEL, "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_demo_tools_run_automatically_with_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--tools", "demo", "--temperature", "0", "What's the weather in London?"]) == 0
    out, err = capsys.readouterr()
    assert "[tool call call_1: get_weather" in err and "[tool result call_1:" in err
    assert "London" in out and "<tool_call>" not in out


def test_tools_from_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    spec = "mlxchat.demo.world:get_weather,mlxchat.demo.world:get_time"
    assert main(["generate", "--tools", spec, "--temperature", "0", "What time is it in Paris?"]) == 0
    assert "get_time" in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "in_out", "in_err"), [("hide", False, False), ("show", False, True),
                                                         ("stream", True, False)])
def test_thinking_modes(capsys: pytest.CaptureFixture[str], mode: str, in_out: bool, in_err: bool) -> None:
    assert main(["generate", "--thinking", mode, "--temperature", "0", "What is 12 plus 5?"]) == 0
    out, err = capsys.readouterr()
    assert ("units:" in out) is in_out and ("units:" in err) is in_err
    assert ("<think>" in out) is in_out  # marked when not on a terminal
    assert "17" in out


def test_piped_chat_prints_no_prompts_and_names_unknown_commands(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("/frobnicate\nHello\n"))
    assert main(["chat", "--temperature", "0"]) == 0  # the demo model greets back
    out, err = capsys.readouterr()
    assert out.startswith("Hello") and ">" not in out and "unknown command /frobnicate" in err


def test_chat_goes_on_after_a_save_it_cannot_write_or_a_system_prompt_that_is_no_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/save {tmp_path}\n/system \udcff\nHello\n"))
    assert main(["chat", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"mlxchat: /save: cannot write {tmp_path} (Is a directory)" in err
    assert "mlxchat: the system prompt holds a lone surrogate" in err
    assert "generated" in err and "Traceback" not in err


def test_generate_and_chat_show_the_model_images(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    vision = str(fixture_path("qwen3_5_vl"))
    image = str(fixture_path("qwen3_5_vl") / "image_a.png")
    assert main(["generate", "--model", vision, "--image", image, "--max-tokens", "3", "--temperature", "0",
                 "What is it?"]) == 0
    err = capsys.readouterr().err
    with_image = int(err.split("[")[-1].split(" prompt tokens")[0])
    assert main(["generate", "--model", vision, "--max-tokens", "3", "--temperature", "0", "What is it?"]) == 0
    without = int(capsys.readouterr().err.split("[")[-1].split(" prompt tokens")[0])
    assert with_image > without + 10  # the image's placeholders
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {image}\nWhat is it?\n/image /nowhere.png\n"))
    assert main(["chat", "--model", vision, "--max-tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "image_a.png goes with your next message" in err and "needs the path of an image file" in err
    assert main(["generate", "--model", MODEL, "--image", image, "hi"]) == 1  # a text model
    assert "reads no images" in capsys.readouterr().err


def test_generate_json_schema_constrains_the_reply(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["city", "n"], "additionalProperties": False}
    path = tmp_path / "reply.json"
    path.write_text(json.dumps(schema))
    assert main(["generate", "--json-schema", str(path), "--thinking", "hide", "--seed", "1", "Weather?"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["city"] in ("Paris", "Rome") and 0 <= reply["n"] <= 9


def test_generate_json_schema_errors_before_loading(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "properties": {"a": {"type": "nothing"}}}')
    assert main(["generate", "--json-schema", str(bad), "x"]) == 2
    assert "$.properties.a" in capsys.readouterr().err
    assert main(["generate", "--json-schema", str(tmp_path / "missing.json"), "x"]) == 2
    bad.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["generate", "--json-schema", str(bad), "x"]) == 2
    assert "cannot read a JSON Schema" in capsys.readouterr().err
    assert main(["generate", "--json", "--thinking", "hide", "--max-tokens", "8", "x"]) == 0
    assert capsys.readouterr().out.startswith("{")


def test_int8_activations_flag_switches_the_quantized_products(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import mlxchat.quantized as mq

    monkeypatch.setattr(mq, "_int8", False)  # restored after the test: the setting is the process's
    assert main(["generate", "--model", MODEL, "--int8-activations", "--max-tokens", "2", "Hi"]) == 0
    assert mq._int8
    native = mq._native()[0]
    assert mq.int8_activations() == bool(native is not None and native.int8_kernel())
