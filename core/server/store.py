"""The conversation store behind the Responses API: stored responses, their input and output items, and the
chain ``previous_response_id`` links them into, in one SQLite file (stdlib ``sqlite3``, write-ahead log).

A response is written before its turn runs (status ``in_progress``, with its input items) and finished
after (its output items, final status, usage), or marked ``failed`` with the error; a server that stopped
mid-turn finds such rows at start and marks them failed, so nothing reads as if it were still running.
A restarted server answers ``previous_response_id`` from here: :meth:`ResponseStore.history` gives the
items of the whole chain, from which a session is primed again.

Schema (``PRAGMA user_version`` = 1)::

    responses(id TEXT PRIMARY KEY, previous_id TEXT, created_at REAL, status TEXT, body TEXT)
    items(response_id TEXT REFERENCES responses ON DELETE CASCADE, kind TEXT ('input' | 'output'),
          position INTEGER, item TEXT, PRIMARY KEY (response_id, kind, position))

``body`` is the response object as JSON without its output (which is the ``output`` items). All calls
run on one thread of the store's own, so the event loop awaits them and never blocks on the file.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ..errors import MlxchatError

SCHEMA_VERSION = 1
MEMORY = ":memory:"
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    previous_id TEXT,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX responses_by_previous ON responses (previous_id);
CREATE TABLE items (
    response_id TEXT NOT NULL REFERENCES responses (id) ON DELETE CASCADE,
    kind TEXT NOT NULL CHECK (kind IN ('input', 'output')),
    position INTEGER NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (response_id, kind, position)
);
"""


class StoreError(MlxchatError):
    """The store cannot be opened (a file another program wrote, or a newer mlxchat), or a chain is broken."""


class ChainError(StoreError):
    """A ``previous_response_id`` that cannot be continued; ``missing`` when it (or a response before it) is
    not in the store."""

    def __init__(self, message: str, missing: bool):
        super().__init__(message)
        self.missing = missing


class ResponseStore:
    """Stored responses in one SQLite file (``":memory:"``: kept only while the server runs)."""

    def __init__(self, path: str | Path = MEMORY):
        self.path = str(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxchat-store")
        self._db: sqlite3.Connection | None = None
        self._executor.submit(self._open).result()

    def _open(self) -> None:
        if self.path != MEMORY:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            db = sqlite3.connect(self.path, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and not db.execute("SELECT name FROM sqlite_master").fetchall():
                db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
            elif version != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: not an mlxchat store of schema version {SCHEMA_VERSION} (found "
                                 f"{version}); give another --store path")
            interrupted = db.execute("SELECT id, body FROM responses WHERE status = 'in_progress'").fetchall()
            for response_id, body in interrupted:
                failed = {**json.loads(body), "status": "failed", "error": {
                    "code": "server_error", "message": "the server stopped before this response was finished"}}
                db.execute("UPDATE responses SET status = 'failed', body = ? WHERE id = ?",
                           (json.dumps(failed), response_id))
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open the store ({exc})") from None
        self._db = db

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._db is not None
            return fn(self._db)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._executor.submit(shut).result()
        self._executor.shutdown()

    # -- writing --------------------------------------------------------------------------------------

    async def create(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Record a response about to run (its body without output, and its input items)."""
        body = json.dumps({k: v for k, v in response.items() if k != "output"})

        def write(db: sqlite3.Connection) -> None:
            with db:
                db.execute("INSERT INTO responses (id, previous_id, created_at, status, body) VALUES (?, ?, ?, ?, ?)",
                           (response["id"], response.get("previous_response_id"), response["created_at"],
                            response["status"], body))
                db.executemany("INSERT INTO items (response_id, kind, position, item) VALUES (?, 'input', ?, ?)",
                               [(response["id"], i, json.dumps(item)) for i, item in enumerate(input_items)])

        await self._run(write)

    async def finish(self, response: dict[str, Any]) -> None:
        """Record how a response ended: its status, body and output items."""
        body = json.dumps({k: v for k, v in response.items() if k != "output"})

        def write(db: sqlite3.Connection) -> None:
            with db:
                db.execute("UPDATE responses SET status = ?, body = ? WHERE id = ?",
                           (response["status"], body, response["id"]))
                db.execute("DELETE FROM items WHERE response_id = ? AND kind = 'output'", (response["id"],))
                db.executemany("INSERT INTO items (response_id, kind, position, item) VALUES (?, 'output', ?, ?)",
                               [(response["id"], i, json.dumps(item)) for i, item in enumerate(response["output"])])

        await self._run(write)

    async def delete(self, response_id: str) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            with db:
                return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

        return await self._run(remove)

    # -- reading --------------------------------------------------------------------------------------

    async def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored response object (output included), or ``None``."""

        def read(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute("SELECT body FROM responses WHERE id = ?", (response_id,)).fetchone()
            if row is None:
                return None
            output = db.execute("SELECT item FROM items WHERE response_id = ? AND kind = 'output' ORDER BY position",
                                (response_id,)).fetchall()
            return {**json.loads(row[0]), "output": [json.loads(item) for (item,) in output]}

        return await self._run(read)

    async def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        def read(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            if db.execute("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is None:
                return None
            rows = db.execute("SELECT item FROM items WHERE response_id = ? AND kind = 'input' ORDER BY position",
                              (response_id,)).fetchall()
            return [json.loads(item) for (item,) in rows]

        return await self._run(read)

    async def history(self, response_id: str) -> list[dict[str, Any]]:
        """The items of the conversation up to and including ``response_id``'s output: each response's input
        then output items, from the first response of its chain on. :class:`ChainError` when a response of
        the chain is missing (deleted, never stored) or did not finish."""

        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            chain: list[str] = []
            current: str | None = response_id
            while current is not None:
                row = db.execute("SELECT previous_id, status FROM responses WHERE id = ?", (current,)).fetchone()
                if row is None:
                    where = "" if current == response_id else f" (it continues {current}, which is gone)"
                    raise ChainError(f"previous response {response_id!r} is not in the store{where}", missing=True)
                if row[1] not in ("completed", "incomplete"):
                    raise ChainError(f"previous response {current!r} is {row[1]}; only a completed or incomplete "
                                     "response can be continued", missing=False)
                chain.append(current)
                current = row[0]
            items: list[dict[str, Any]] = []
            for rid in reversed(chain):
                rows = db.execute("SELECT item FROM items WHERE response_id = ? ORDER BY kind = 'output', position",
                                  (rid,)).fetchall()
                items += [json.loads(item) for (item,) in rows]
            return items

        return await self._run(read)
