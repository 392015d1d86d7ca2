"""The response store a server keeps (issue 25, items 5 and 6): one server per store file (a second one
stops with an error naming the first, before touching its spilled caches or running responses), stored
responses kept within an age and a count (older ones answered 404 like deleted ones, and the chains that
continue them too), and every file a save replaces reaching the disk before the rename."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from mlxchat import persistence  # noqa: E402
from mlxchat.server.store import ResponseStore, StoreError  # noqa: E402

from conftest import loaded  # noqa: E402
from server_support import DEMO, serving  # noqa: E402


def body(response_id: str, created_at: float, previous: str | None = None) -> dict[str, Any]:
    return {"id": response_id, "created_at": created_at, "status": "completed", "previous_response_id": previous,
            "output": []}


def test_a_second_server_on_the_same_store_stops_naming_the_first(tmp_path: Path) -> None:
    store = tmp_path / "store.sqlite3"
    with serving("demo", store=str(store)) as first:
        answer = httpx.post(first.url + "/v1/responses", json={"model": DEMO, "input": "Hi!", "max_output_tokens": 4},
                            timeout=60)
        assert answer.status_code == 200
        spill = first.state.pool.spill_dir
        assert spill == tmp_path / "store.sqlite3.spill"
        (spill / "earlier.cache").write_bytes(b"kept")  # the first server's: a second must not remove it
        with pytest.raises(StoreError, match=f"in use by the mlxchat server of process {os.getpid()}"):
            with serving("demo", store=str(store)):
                pass
        assert (spill / "earlier.cache").exists()
        again = httpx.get(f"{first.url}/v1/responses/{answer.json()['id']}", timeout=10)
        assert again.status_code == 200 and again.json()["status"] == answer.json()["status"]
    with serving("demo", store=str(store)) as later:  # once the first has closed, the store is free
        assert httpx.get(f"{later.url}/v1/responses/{answer.json()['id']}", timeout=10).status_code == 200


def test_responses_past_the_age_or_count_are_gone_with_the_chains_that_continue_them(tmp_path: Path) -> None:
    async def run() -> None:
        now = time.time()
        store = ResponseStore(tmp_path / "store.sqlite3", max_age=3600, max_rows=3)
        try:
            await store.create(body("old", now - 7200), [])
            await store.create(body("next", now, previous="old"), [])
            assert await store.get("old") is None and await store.input_items("old") is None
            with pytest.raises(StoreError, match="it continues old, which is gone") as gone:
                await store.history("next")
            assert getattr(gone.value, "missing", False)
            for index in range(4):
                await store.create(body(f"r{index}", now + index), [{"type": "message"}])
            assert await store.get("next") is None  # the oldest of five went
            assert [await store.get(f"r{i}") is not None for i in range(4)] == [False, True, True, True]
            assert not await store.delete("old")
        finally:
            store.close()

    asyncio.run(run())


def test_rows_damaged_in_the_store_are_store_errors_naming_them(tmp_path: Path) -> None:
    """A store edited by hand (or by another program): a chain that loops back, a body or an item that is no JSON
    object, a conversation that is no list of messages. Each is a StoreError naming the row (a loop hung the
    store's one thread, and every request after it, for good); an interrupted response whose body is damaged is
    still marked failed when the store opens."""
    path = tmp_path / "store.sqlite3"

    async def damage() -> None:
        now = time.time()
        store = ResponseStore(path)
        try:
            await store.create(body("a", now, previous="b"), [])
            await store.create(body("b", now, previous="a"), [])
            await store.create(body("list", now), [{"type": "message"}])
            await store.create({**body("running", now), "status": "in_progress"}, [])
            await store.save_conversation("c1", "t", [], now)
            await store.save_conversation("c2", "t", [], now)
        finally:
            store.close()

    asyncio.run(damage())
    with sqlite3.connect(path) as db:
        db.execute("UPDATE responses SET body = '[1, 2]' WHERE id = 'list'")
        db.execute("UPDATE items SET item = 'not json' WHERE response_id = 'list'")
        db.execute("UPDATE responses SET body = '{' WHERE id = 'running'")
        db.execute("UPDATE conversations SET messages = '{\"role\": \"user\"}' WHERE id = 'c1'")
        db.execute("UPDATE conversations SET messages = '[1, 2]' WHERE id = 'c2'")

    async def read() -> None:
        store = ResponseStore(path)  # the damaged in_progress body does not stop it opening
        try:
            with pytest.raises(StoreError, match="'a' loops back to 'a'"):
                await store.history("a")
            assert (await store.get("b"))["id"] == "b"  # the store goes on
            with pytest.raises(StoreError, match="response 'list' in the store is damaged"):
                await store.get("list")
            with pytest.raises(StoreError, match="an input item of response 'list' in the store is damaged"):
                await store.input_items("list")
            assert (await store.get("running"))["status"] == "failed"
            with pytest.raises(StoreError, match="conversation 'c1' in the store is damaged"):
                await store.conversation("c1")
            with pytest.raises(StoreError, match="a message is no object"):
                await store.conversation("c2")
        finally:
            store.close()

    asyncio.run(read())


def test_the_server_answers_an_expired_previous_response_as_missing(tmp_path: Path) -> None:
    with serving("demo", store=str(tmp_path / "store.sqlite3"), store_max_age_days=1) as served:
        first = httpx.post(served.url + "/v1/responses", json={"model": DEMO, "input": "Hi!", "max_output_tokens": 4},
                           timeout=60).json()
        served.state.store.max_age = -1.0  # everything stored has expired
        follow = httpx.post(served.url + "/v1/responses", json={"model": DEMO, "input": "More", "max_output_tokens": 4,
                                                                 "previous_response_id": first["id"]}, timeout=60)
        assert follow.status_code == 404 and follow.json()["error"]["code"] == "previous_response_not_found"
        assert httpx.get(f"{served.url}/v1/responses/{first['id']}", timeout=10).status_code == 404


def test_a_saved_cache_reaches_the_disk_before_it_replaces_the_file(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded("qwen3")
    session = model.chat_session()
    session.send("Hi", config={"max_tokens": 2, "temperature": 0.0})
    target = tmp_path / "cache.safetensors"
    target.write_bytes(b"the previous save")
    calls: list[str] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        calls.append("fsync")
        fsync(fd)

    def recorded_replace(source: Any, destination: Any) -> None:
        calls.append("replace")
        replace(source, destination)

    monkeypatch.setattr(persistence.os, "fsync", recorded_fsync)
    monkeypatch.setattr(persistence.os, "replace", recorded_replace)
    persistence.save_prompt_cache(model, session.cache, target)
    assert calls[:2] == ["fsync", "replace"]
    cache, _ = persistence.load_prompt_cache(model, target)
    assert len(cache) == len(session.cache)
