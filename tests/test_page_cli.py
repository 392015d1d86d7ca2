"""``mlxchat serve --tools`` and ``mlxchat chat --web``: the page's tools are checked before anything loads,
``--tools demo`` gives the page the demo's tools that ask (approval, input) where a terminal runs them
automatically, and ``chat --web`` serves the page with them and opens it in a browser once the server
listens."""

from __future__ import annotations

import socket
import threading

import pytest

import mlxchat.cli
import mlxchat.server
from mlxchat.cli import main
from mlxchat.demo.world import DEMO_PAGE_TOOLS, DEMO_TOOLS


def test_serve_checks_its_tools_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "/nowhere", "--tools", "no_such_module:thing"]) == 2
    assert "--tools: cannot load no_such_module:thing" in capsys.readouterr().err


def test_serve_gives_the_page_its_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    given: dict[str, object] = {}
    monkeypatch.setattr(mlxchat.server, "serve", lambda model, **kw: given.update(kw))
    assert main(["serve", "--tools", "demo", "--store", ":memory:"]) == 0
    assert given["tools"] == list(DEMO_PAGE_TOOLS)


def test_the_page_gets_the_demo_tools_that_ask_and_a_terminal_the_ones_that_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    weather, clock = DEMO_PAGE_TOOLS
    assert weather.needs_approval and clock.context_parameter == "context"  # Approve/Deny; an input request
    # The model sees the prompt it was trained on: the same names, descriptions and parameters.
    assert [t.schema for t in DEMO_PAGE_TOOLS] == [t.schema for t in DEMO_TOOLS]
    given: list[object] = []
    monkeypatch.setattr(mlxchat.cli, "_generate", lambda args, config, tools: given.append(tools) or 0)
    assert main(["generate", "--tools", "demo", "hello"]) == 0
    assert given == [list(DEMO_TOOLS)] and not any(t.needs_approval for t in DEMO_TOOLS)


def test_chat_web_serves_the_page_and_opens_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    opened: list[str] = []
    done = threading.Event()
    given: dict[str, object] = {}

    def serve(model: object, *, port: int, settings: object, tools: list[object]) -> None:
        given.update(port=port, settings=settings, tools=tools, max_tokens=model.defaults.max_tokens)  # type: ignore[attr-defined]
        with socket.create_server(("127.0.0.1", port)):
            assert done.wait(60)

    def browse(url: str) -> bool:
        opened.append(url)
        done.set()
        return True

    monkeypatch.setattr(mlxchat.server, "serve", serve)
    monkeypatch.setattr("webbrowser.open", browse)
    assert main(["chat", "--web", "--tools", "demo", "--max-tokens", "33"]) == 0
    assert opened == [f"http://127.0.0.1:{given['port']}/"]
    assert given["max_tokens"] == 33 and given["tools"] == list(DEMO_PAGE_TOOLS)
    assert str(tmp_path) in given["settings"].store  # type: ignore[attr-defined]
    assert main(["chat", "--web", "--system", "Be brief."]) == 2
