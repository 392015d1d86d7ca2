"""A real uvicorn server of a fixture model on a free port, for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import uvicorn

from mlxchat.server import create_app
from mlxchat.server.guard import guarded_protocol

from conftest import loaded


class Served:
    def __init__(self, app: Any, port: int):
        self.app, self.port = app, port
        self.url = f"http://127.0.0.1:{port}"

    @property
    def state(self) -> Any:
        return self.app.state.mlxchat


DEMO = "mlxchat-demo"


def demo_model() -> Any:
    """The demo model shipped in the package, loaded once for the run."""
    from mlxchat.demo import default_model_path
    from mlxchat.testing import load_fixture

    return load_fixture(default_model_path())


@contextmanager
def serving(fixture: str, model: Any = None, **settings: Any) -> Iterator[Served]:
    """Serve ``model`` (by default the shared model of ``fixture``; ``"demo"``: the demo model, under its own
    name) with these server settings (the model is called ``tiny`` unless ``model_name`` says otherwise)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if fixture == "demo":
        model = model or demo_model()
        settings.setdefault("model_name", None)
    app = create_app(model or loaded(fixture), **{"model_name": "tiny", **settings})
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            http=guarded_protocol(settings.get("header_timeout", 10.0)))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:  # (another process may take the port first: uvicorn's thread then ends)
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield Served(app, port)
    finally:
        server.should_exit = True
        thread.join()


class HeldStream:
    """A streaming chat request whose reply has started, while the model's worker is held busy on a job
    that waits for :attr:`release` (see :func:`held_mid_stream`)."""

    def __init__(self, response: Any, release: threading.Event, held: Future[None]):
        self.response, self.release, self.held = response, release, held


@contextmanager
def held_mid_stream(served: Served, model: Any, max_tokens: int = 3000,
                    headers: dict[str, str] | None = None) -> Iterator[HeldStream]:
    """Start a streaming reply of ``model`` (its end-of-reply tokens banned, so it runs ``max_tokens``), then
    hold the worker busy once the first piece has arrived; the block runs while it is held. On the way out
    the worker is let go and the response closed. A valve lets the worker go after 60 s whatever happens, so
    that a blocked event loop fails the test instead of hanging it."""
    import httpx

    entered, release = threading.Event(), threading.Event()
    valve = threading.Timer(60.0, release.set)
    valve.start()

    def busy() -> None:
        entered.set()
        release.wait()

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 1, "stream": True, "logit_bias": {str(e): -100.0 for e in model.eos_ids}}
    client = httpx.Client(timeout=60)
    try:
        with client.stream("POST", served.url + "/v1/chat/completions", json=body, headers=headers) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            held = model.worker.submit(busy)
            assert entered.wait(60), "the worker never took the job that holds it"
            try:
                yield HeldStream(response, release, held)
            finally:
                release.set()
                held.result(60)
    finally:
        valve.cancel()
        release.set()
        client.close()
