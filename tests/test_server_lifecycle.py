"""One request lifecycle on every generating endpoint (issue 25, items 1 and 2): a store that fails (another
program holding its write lock, a write that fails while generating) or any error an endpoint raises,
streaming or not, gives its queue slot and pooled cache back, so the server serves again once the cause
is gone; a client leaving a stream while the model is busy never stalls the event loop; and each request,
on every route, writes one structured access-log line."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from mlxchat.server import turns  # noqa: E402
from mlxchat.server.store import StoreUnavailableError  # noqa: E402

from conftest import loaded  # noqa: E402
from server_support import DEMO, Served, held_mid_stream, serving  # noqa: E402

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": DEMO, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6,
                             "temperature": 0},
    "/v1/responses": {"model": DEMO, "input": "Hi!", "max_output_tokens": 6, "temperature": 0},
    "/v1/messages": {"model": DEMO, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6,
                     "temperature": 0},
}


def post(served: Served, path: str, stream: bool = False, **extra: Any) -> httpx.Response:
    return httpx.post(served.url + path, json={**BODIES[path], "stream": stream, **extra}, timeout=60)


def at_once(*calls: Any) -> list[Any]:
    """Run the calls on threads at the same time; their results in order."""
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def failed_stream(text: str) -> bool:
    """Whether a stream ended with its endpoint's error event."""
    return any(mark in text for mark in ('data: {"error": {', "event: response.failed", "event: error"))


def every_endpoint_serves(served: Served, times: int) -> None:
    for path in BODIES:
        for index in range(times):
            response = post(served, path, stream=bool(index % 2))
            assert response.status_code == 200 and not failed_stream(response.text), response.text


class Counted:
    """Counts the caches taken from and given back to a server's pool."""

    def __init__(self, served: Served):
        pool = served.state.pool
        self.taken = self.given = 0
        take, give_back = pool.take, pool.give_back

        async def counted_take(messages: Any) -> Any:
            self.taken += 1
            return await take(messages)

        def counted_give_back(messages: Any, cache: Any) -> None:
            self.given += 1
            give_back(messages, cache)

        pool.take, pool.give_back = counted_take, counted_give_back


def test_a_store_locked_by_another_program_is_a_503_and_leaks_nothing(tmp_path: Path) -> None:
    store = tmp_path / "store.sqlite3"
    with serving("demo", store=str(store), max_queue=2) as served:
        assert post(served, "/v1/responses").status_code == 200
        holder = sqlite3.connect(store, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # what a backup tool (or a second writer) does
        try:
            refused = at_once(*[lambda: post(served, "/v1/responses") for _ in range(3)])
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        for response in refused:
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "store_unavailable"
            assert str(store) in response.json()["error"]["message"]
        assert served.state.queued == 0
        every_endpoint_serves(served, 3)  # more requests than the queue holds: no slot was kept


def test_a_store_write_failing_while_generating_leaks_no_slot_or_cache(tmp_path: Path) -> None:
    with serving("demo", store=str(tmp_path / "store.sqlite3"), max_queue=2) as served:
        counted = Counted(served)
        store = served.state.store
        finish = store.finish

        async def failing(response: dict[str, Any]) -> None:
            raise StoreUnavailableError("the response store is locked (injected)")

        store.finish = failing
        try:
            plain, streamed = at_once(lambda: post(served, "/v1/responses"),
                                      lambda: post(served, "/v1/responses", stream=True))
        finally:
            store.finish = finish
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "store_unavailable"
        assert streamed.status_code == 200 and "event: response.failed" in streamed.text
        assert served.state.queued == 0 and counted.taken == counted.given == 2
        every_endpoint_serves(served, 3)
        assert served.state.queued == 0 and counted.taken == counted.given


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(BODIES))
def test_any_error_an_endpoint_raises_gives_the_slot_and_cache_back(path: str, stream: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with serving("demo", max_queue=1) as served:
        counted = Counted(served)
        real_next = turns.Turn.next
        calls = 0

        async def breaking_next(self: turns.Turn) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # a bug after the first event
                raise RuntimeError("injected")
            return await real_next(self)

        monkeypatch.setattr(turns.Turn, "next", breaking_next)
        broken = post(served, path, stream=stream)
        monkeypatch.setattr(turns.Turn, "next", real_next)
        if stream:
            assert broken.status_code == 200 and failed_stream(broken.text)
            assert "internal server error" in broken.text
        else:
            assert broken.status_code == 500 and "internal server error" in broken.text
        assert served.state.queued == 0 and counted.taken == counted.given == 1
        for _ in range(2):
            assert post(served, path, stream=stream).status_code == 200


def test_a_client_leaving_a_stream_while_the_model_is_busy_never_stalls_the_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves mid-stream while the worker is held on a job the test controls: the server starts
    ending the request (the turn's finish) and answers ``/health`` while the worker is still held; once it
    is let go, the request's slot comes back and the server serves again."""
    model = loaded("qwen3_chat")
    finishing = threading.Event()
    finish = turns.Turn.finish

    async def noted_finish(self: turns.Turn, messages: Any = None) -> None:
        finishing.set()
        await finish(self, messages)

    monkeypatch.setattr(turns.Turn, "finish", noted_finish)
    with serving("qwen3_chat", caches=1) as served:
        with held_mid_stream(served, model) as stream:
            stream.response.close()  # the client leaves
            assert finishing.wait(60), "the server never saw the client leave"
            health = httpx.get(served.url + "/health", timeout=60)
            answered_while_held = not stream.release.is_set()
            assert health.status_code == 200 and health.json()["queued"] == 1, health.text
        assert answered_while_held, "/health answered only once the worker was let go: the event loop was blocked"
        deadline = time.monotonic() + 60
        while served.state.queued and time.monotonic() < deadline:  # the turn winds up once the worker is free
            time.sleep(0.01)
        assert served.state.queued == 0
        answer = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert answer.status_code == 200 and served.state.running == 0


def test_each_request_on_every_route_writes_one_structured_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    # The server stops (each request's line written) before the log level is put back.
    with caplog.at_level(logging.INFO, logger="mlxchat.server.access"), serving("demo") as served:
        ok = post(served, "/v1/chat/completions")
        refused = post(served, "/v1/messages", model="another")
        streamed = post(served, "/v1/responses", stream=True, store=False)
        health = httpx.get(served.url + "/health", timeout=60)
        missing = httpx.get(served.url + "/v1/responses/resp_none", timeout=60)
        not_json = httpx.post(served.url + "/v1/chat/completions", content=b"{}", timeout=60,
                              headers={"content-type": "text/plain"})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "mlxchat.server.access"]
    # A line is written once its answer is sent: a stream's can come after the next request's.
    by = {(line["method"], line["path"], line["status"]): line for line in lines}
    assert len(lines) == len(by) and set(by) == {
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/messages", 404), ("POST", "/v1/responses", 200),
        ("GET", "/health", 200), ("GET", "/v1/responses/resp_none", 404), ("POST", "/v1/chat/completions", 415)}
    assert health.status_code == 200 and missing.status_code == 404 and not_json.status_code == 415
    ok_line, refused_line = by["POST", "/v1/chat/completions", 200], by["POST", "/v1/messages", 404]
    streamed_line, not_json_line = by["POST", "/v1/responses", 200], by["POST", "/v1/chat/completions", 415]
    assert [ok_line.get("endpoint"), refused_line.get("endpoint"), streamed_line.get("endpoint")] == [
        "chat.completions", "messages", "responses"]
    assert all("endpoint" not in by[key] for key in by if key[1] in ("/health", "/v1/responses/resp_none")
               or key[2] == 415)
    assert all(line["seconds"] >= 0 and line["client"].startswith("127.0.0.1:") for line in lines)
    usage = ok.json()["usage"]
    assert ok_line["prompt_tokens"] == usage["prompt_tokens"]
    assert ok_line["generated_tokens"] == usage["completion_tokens"]
    assert refused_line["error"] == "model_not_found" and refused.status_code == 404
    assert streamed_line["stream"] is True and streamed_line["generated_tokens"] > 0 and streamed.status_code == 200
    assert not_json_line["error"] == "unsupported_media_type"
