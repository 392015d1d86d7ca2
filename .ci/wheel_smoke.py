"""The installed wheel, used as a user would, outside the source tree (.ci/run runs it in a fresh venv):
the demo model generates, a session holds a turn, the server answers its three APIs on loopback,
``mlxchat info`` runs (on Linux every native kernel on), and ``mlxchat.distributed`` imports."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlxchat
import mlxchat.distributed  # noqa: F401 - the wheel once left this package out

GREEDY = {"temperature": 0.0, "max_tokens": 40}
CLI = str(Path(sys.executable).with_name("mlxchat"))  # the wheel's console script, in this venv


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"wheel smoke: {what}")
    print(f"ok: {what}")


def post(port: int, path: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    here = Path(mlxchat.__file__).resolve()
    check("site-packages" in here.parts, f"mlxchat imported from the installed wheel ({here})")

    info = json.loads(subprocess.run([CLI, "info", "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    check(bool(info["plugins"]), "mlxchat info lists the plugins")
    if sys.platform == "linux":
        for kernel in ("blas_route", "quantized_kernels", "fused_kernels"):
            check(info[kernel].startswith("mlxchat native"), f"{kernel} on ({info[kernel]})")

    model = mlxchat.load_model()  # no path: the demo model, package data of the wheel
    check(bool(model.generate("Hello!", {"max_tokens": 8, "temperature": 0.0}).text), "the demo model generates")
    session = model.chat_session(default_config=GREEDY)
    reply = session.send("What is the capital of Japan?")
    check("Tokyo" in reply.text and len(session.messages) == 2, f"a session turn ({reply.text!r})")
    model.close()

    port = free_port()
    server = subprocess.Popen([CLI, "serve", "--port", str(port), "--store", ":memory:"])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit("wheel smoke: the server did not start")
                time.sleep(0.5)
        user = [{"role": "user", "content": "Hello!"}]
        chat = post(port, "/v1/chat/completions", {"model": "mlxchat-demo", "messages": user, "max_tokens": 20})
        check(bool(chat["choices"][0]["message"]["content"]), "POST /v1/chat/completions")  # type: ignore[index]
        response = post(port, "/v1/responses", {"model": "mlxchat-demo", "input": "Hello!", "max_output_tokens": 20})
        check(response["status"] in ("completed", "incomplete") and bool(response["output"]),
              f"POST /v1/responses ({response['status']})")
        message = post(port, "/v1/messages", {"model": "mlxchat-demo", "messages": user, "max_tokens": 20})
        check(message["type"] == "message" and bool(message["content"]), "POST /v1/messages")
        for path in ("/", "/page/app.js", "/page/vendor/purify.min.js"):  # the chat page's files are in the wheel
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as page:
                check(page.status == 200 and len(page.read()) > 0, f"GET {path}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
