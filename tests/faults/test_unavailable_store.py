"""A store the server cannot write for a while: locked by another program (a backup tool holding SQLite's
exclusive lock) or read-only. Each request that writes the store gets a clear 503 ``store_unavailable``
naming the store and SQLite's reason, stored responses can still be read, requests that store nothing
are served, and once the cause clears the same request is served and continues its chain.

A store that turns read-only under a running server cannot be made so here without root-only tricks (root
ignores file modes; a read-only remount is refused while the store's file is open for writing), so the
read-only case turns SQLite's own read-only switch on the server's connection (``PRAGMA query_only``): every
write then fails as on a read-only file, with ``SQLITE_READONLY`` ("attempt to write a readonly database").
A server started on a store it cannot write stops at start (it cannot take the store's lock file).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from server_support import DEMO, Served, serving  # noqa: E402


@contextmanager
def locked(served: Served, store: Path) -> Iterator[None]:
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # what a backup tool (or a second writer) does
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


@contextmanager
def read_only(served: Served, store: Path) -> Iterator[None]:
    responses = served.state.store

    def switch(on: bool) -> None:  # on the store's own thread, which owns its connection
        responses._executor.submit(lambda: responses._db.execute(f"PRAGMA query_only = {int(on)}")).result()

    switch(True)
    try:
        yield
    finally:
        switch(False)


def respond(served: Served, **body: Any) -> Any:
    return httpx.post(f"{served.url}/v1/responses", timeout=60,
                      json={"model": DEMO, "max_output_tokens": 6, "temperature": 0, **body})


@pytest.mark.parametrize(("cause", "reason"), [(locked, "database is locked"),
                                               (read_only, "attempt to write a readonly database")],
                         ids=["locked", "read-only"])
def test_a_store_that_cannot_be_written_is_a_clear_503_until_it_clears(
        tmp_path: Path, cause: Callable[[Served, Path], Any], reason: str) -> None:
    store = tmp_path / "store.sqlite3"
    with serving("demo", store=str(store)) as served:
        first = respond(served, input="What is the capital of Chile?")
        assert first.status_code == 200
        with cause(served, store):
            refused = respond(served, input="And of Peru?", previous_response_id=first.json()["id"])
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "store_unavailable" and str(store) in error["message"], error
            assert reason in error["message"], error
            assert httpx.get(f"{served.url}/v1/responses/{first.json()['id']}", timeout=60).status_code == 200
            unstored = respond(served, input="Hi!", store=False)
            chat = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
                "model": DEMO, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 6})
            assert unstored.status_code == chat.status_code == 200, (unstored.text, chat.text)
        served_again = respond(served, input="And of Peru?", previous_response_id=first.json()["id"])
        assert served_again.status_code == 200, served_again.text
        assert served_again.json()["previous_response_id"] == first.json()["id"]
    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
