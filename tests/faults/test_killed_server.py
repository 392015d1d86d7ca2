"""A server killed with SIGKILL mid-stream, mid-prefill (a long prompt, after its response was stored and
before any token) and mid-store-write (inside the transaction that finishes a response), then restarted on
the same store: the store is not corrupted, the response that was running reads as failed (with no output:
a write is whole or not at all), and the chain before it continues. The store's own writes killed at any
moment leave a store that opens, checks whole, and takes new writes. (Slow: real processes.)

The server (long_reply_server.py) holds itself at the moment to kill (after a prefill's first chunk, before
a commit) and says so on stdout, so each kill lands where it is meant to, however loaded the machine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from mlxchat.server.store import ResponseStore

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


@contextmanager
def server(store: Path, pause: str | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A long-reply server on ``store`` (``pause``: where it holds itself; see long_reply_server.py)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, str(HERE / "long_reply_server.py"), str(port), str(store),
                                *([pause] if pause else [])],
                               stdout=subprocess.PIPE if pause else subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"{url}/health", timeout=5)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.3)
        yield process, url
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)


def create(url: str, **body: object) -> dict[str, object]:
    reply = httpx.post(f"{url}/v1/responses", json={"model": "mlxchat-demo", **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def integrity(store: Path) -> str:
    with sqlite3.connect(store) as db:
        return str(db.execute("PRAGMA integrity_check").fetchone()[0])


def paused(process: subprocess.Popen[str], where: str, within: float = 300) -> None:
    """Wait until the server says it holds itself at ``where`` (it never goes on from there); a server that
    has not said so ``within`` seconds (its hook no longer reached: the code it patches changed) is killed
    and the test fails, rather than waiting for good."""
    assert process.stdout is not None
    lines: list[str] = []

    def read() -> None:
        while (line := process.stdout.readline()) and line != f"paused mid-{where}\n":  # type: ignore[union-attr]
            pass
        lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(within)
    if reader.is_alive():
        kill(process)
    assert lines and lines[0], f"the server did not reach the {where} within {within:.0f} s, or ended before it"


def kill(process: subprocess.Popen[str]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def events(stream: httpx.Response) -> Iterator[dict[str, object]]:
    for line in stream.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line[6:])


def restarted_as_failed(store: Path, first: dict[str, object], running: str) -> None:
    """After the kill: the store whole, the running response failed with no output, the chain before it going
    on in a restarted server."""
    assert integrity(store) == "ok"
    with server(store) as (_, url):
        killed = httpx.get(f"{url}/v1/responses/{running}", timeout=30).json()
        assert killed["status"] == "failed" and killed["error"] and killed["output"] == []
        assert httpx.get(f"{url}/v1/responses/{first['id']}", timeout=30).json()["status"] == first["status"]
        follow = create(url, input="And of Peru?", previous_response_id=first["id"], max_output_tokens=8)
        assert follow["status"] == "incomplete" and follow["output"]  # ran to its max_output_tokens
    assert integrity(store) == "ok"


def test_killed_mid_prefill_the_running_response_is_failed_and_the_chain_before_it_goes_on(tmp_path) -> None:
    """A stream's answer starts with its first event, after the prefill: the client of a request killed
    mid-prefill gets no answer at all, and the store holds its response as running."""
    store = tmp_path / "store.sqlite3"
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 60  # 1,620 tokens: 4 chunks of the budget
    with server(store, pause="prefill") as (process, url):
        first = create(url, input="What is the capital of Chile?", max_output_tokens=8)
        answers: list[object] = []

        def ask() -> None:
            try:
                answers.append(httpx.post(f"{url}/v1/responses", timeout=120, json={
                    "model": "mlxchat-demo", "input": long_prompt, "previous_response_id": first["id"],
                    "max_output_tokens": 8, "stream": True}))
            except httpx.HTTPError as exc:
                answers.append(exc)

        asking = threading.Thread(target=ask)
        asking.start()
        paused(process, "prefill")
        kill(process)
        asking.join(timeout=60)
    assert len(answers) == 1 and isinstance(answers[0], httpx.HTTPError)  # the connection ended: no token
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT id, status FROM responses WHERE previous_id = ?", (first["id"],)).fetchall()
    assert [status for _, status in rows] == ["in_progress"]  # stored before its turn ran
    restarted_as_failed(store, first, rows[0][0])


def test_killed_mid_store_write_the_response_is_failed_whole_and_the_chain_before_it_goes_on(tmp_path) -> None:
    store = tmp_path / "store.sqlite3"
    with server(store, pause="store-write") as (process, url):
        first = create(url, input="What is the capital of Chile?", max_output_tokens=8)
        with httpx.stream("POST", f"{url}/v1/responses", timeout=120, json={
                "model": "mlxchat-demo", "input": "And of Bolivia?", "previous_response_id": first["id"],
                "max_output_tokens": 8, "metadata": {"pause": "store-write"}, "stream": True}) as stream:
            created = next(events(stream))
            paused(process, "store-write")  # its reply generated, its output written, not committed
            kill(process)
    assert created["type"] == "response.created"
    restarted_as_failed(store, first, str(created["response"]["id"]))  # type: ignore[index]


def test_killed_mid_stream_the_running_response_is_failed_and_the_chain_before_it_goes_on(tmp_path) -> None:
    store = tmp_path / "store.sqlite3"
    with server(store) as (process, url):
        first = create(url, input="What is the capital of Chile?", max_output_tokens=8)
        running = None
        with httpx.stream("POST", f"{url}/v1/responses", timeout=120, json={
                "model": "mlxchat-demo", "input": "Tell me a story.", "previous_response_id": first["id"],
                "max_output_tokens": 4000, "stream": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    running = running or event.get("response", {}).get("id")
                    if event["type"] == "response.output_text.delta":
                        kill(process)  # mid-stream: 4000 tokens to go
                        break
    assert running is not None
    restarted_as_failed(store, first, running)


WRITER = r"""
import asyncio, sys
from mlxchat.server.store import ResponseStore

async def main():
    store = ResponseStore(sys.argv[1])
    n = 0
    while True:
        body = {"id": f"resp_{n}", "object": "response", "created_at": n, "status": "in_progress",
                "output": [{"type": "message", "content": "y" * 20000}]}
        await store.create(body, [{"type": "message", "role": "user", "content": "hi " * 2000}])
        await store.finish({**body, "status": "completed"})
        n += 1
        if n == 20:
            print("writing", flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("after", [0.0, 0.05, 0.3])
def test_a_store_killed_mid_write_opens_whole(tmp_path, after) -> None:
    store = tmp_path / "store.sqlite3"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(store)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    time.sleep(after)
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)

    async def reopen() -> list[str]:
        reopened = ResponseStore(store)  # marks what was running failed
        try:
            with sqlite3.connect(store) as db:
                statuses = [row[0] for row in db.execute("SELECT DISTINCT status FROM responses")]
            await reopened.create({"id": "resp_new", "object": "response", "created_at": 0,
                                   "status": "in_progress"}, [])
            with sqlite3.connect(store) as db:  # a finished response has its output: its write was whole
                unfinished = db.execute("SELECT COUNT(*) FROM responses WHERE status = 'completed' AND id NOT IN "
                                        "(SELECT response_id FROM items WHERE kind = 'output')").fetchone()[0]
            assert unfinished == 0
            assert (await reopened.get("resp_new")) is not None
            return statuses
        finally:
            reopened.close()

    statuses = asyncio.run(reopen())
    assert integrity(store) == "ok"
    assert set(statuses) <= {"completed", "failed"} and "completed" in statuses
