"""A store write is whole or not at all: one that fails half-way (here: an output item that is not JSON,
after the status was updated) leaves the response as it was, so a crash mid-write cannot leave a
response marked completed without its output."""

from __future__ import annotations

import asyncio

import pytest

from mlxchat.server.store import ResponseStore


def test_a_write_that_fails_half_way_changes_nothing(tmp_path) -> None:
    async def run() -> None:
        store = ResponseStore(tmp_path / "store.sqlite3")
        try:
            body = {"id": "resp_1", "object": "response", "created_at": 0, "status": "in_progress"}
            await store.create(body, [{"type": "message", "role": "user", "content": "hi"}])
            with pytest.raises(TypeError):
                await store.finish({**body, "status": "completed", "output": [{"bad": object()}]})
            kept = await store.get("resp_1")
            assert kept is not None and kept["status"] == "in_progress" and kept["output"] == []
            await store.finish({**body, "status": "completed", "output": [{"type": "message", "content": "ok"}]})
            done = await store.get("resp_1")
            assert done is not None and done["status"] == "completed" and len(done["output"]) == 1
        finally:
            store.close()

    asyncio.run(run())
