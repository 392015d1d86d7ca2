"""A real uvicorn server of a fixture model on a free port, for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
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
    while not server.started:
        time.sleep(0.02)
    try:
        yield Served(app, port)
    finally:
        server.should_exit = True
        thread.join()
