"""The conversation store behind the Responses API: stored responses, their input and output items, and the
chain ``previous_response_id`` links them into, in one SQLite file (stdlib ``sqlite3``, write-ahead log).

A response is written before its turn runs (status ``in_progress``, with its input items) and finished
after (its output items, final status, usage), or marked ``failed`` with the error; a server that stopped
mid-turn finds such rows at start and marks them failed, so nothing reads as if it were still running.
A restarted server answers ``previous_response_id`` from here: :meth:`ResponseStore.history` gives the
items of the whole chain, from which a session is primed again.

One server per store file: a file store is locked (``<store>.lock``, an advisory ``flock`` naming its
holder) while it is open, so a second server on it stops at start with an error that names the first,
before it could fail the first's running responses or remove its spilled caches. Responses are kept for
``max_age`` seconds and at most ``max_rows`` of them (the oldest go first); a response past either bound
is answered as missing, as a deleted one is, and so is every response that continues it.

Schema (``PRAGMA user_version`` = 1)::

    responses(id TEXT PRIMARY KEY, previous_id TEXT, created_at REAL, status TEXT, body TEXT)
    items(response_id TEXT REFERENCES responses ON DELETE CASCADE, kind TEXT ('input' | 'output'),
          position INTEGER, item TEXT, PRIMARY KEY (response_id, kind, position))

``body`` is the response object as JSON without its output (which is the ``output`` items). The chat
page's conversations (:mod:`.conversations`) live beside them, one row each, their messages as the
session lists them (ids, reply versions and reports included)::

    conversations(id TEXT PRIMARY KEY, created_at REAL, updated_at REAL, title TEXT, messages TEXT)

(created when missing, so a store of the same schema version written before the page gains the table).
All calls run on one thread of the store's own, so the event loop awaits them and never blocks on the file.
"""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import json
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

from ..errors import MlxchatError

SCHEMA_VERSION = 1
MEMORY = ":memory:"
LOCK_WAIT = 1.0
"""Seconds a read or write waits for another program's lock on the file before its request gets 503."""
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
_CONVERSATIONS = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    title TEXT NOT NULL,
    messages TEXT NOT NULL
);
"""


class StoreError(MlxchatError):
    """The store cannot be opened (a file another program wrote, or a newer mlxchat), or a chain is broken."""


class StoreUnavailableError(StoreError):
    """The store cannot be read or written now (another program holds its lock, or it is read-only)."""


class ChainError(StoreError):
    """A ``previous_response_id`` that cannot be continued; ``missing`` when it (or a response before it) is
    not in the store."""

    def __init__(self, message: str, missing: bool):
        super().__init__(message)
        self.missing = missing


def _read(text: str, what: str, kind: type = dict) -> Any:
    """A JSON object (or ``kind``) read back from the store: one damaged there (edited by hand, another program's)
    is a :class:`StoreError` naming it, not whatever parsing it would raise further on."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, kind):
        raise StoreError(f"{what} in the store is damaged (not a JSON {'object' if kind is dict else 'array'})")
    return value


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write, whole or not at all (the connection autocommits each statement, and ``with db:`` does
    not open a transaction then): a server killed mid-write leaves the store as before it."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class ResponseStore:
    """Stored responses in one SQLite file (``":memory:"``: kept only while the server runs)."""

    def __init__(self, path: str | Path = MEMORY, *, max_age: float | None = None, max_rows: int | None = None):
        self.path = str(path)
        self.max_age, self.max_rows = max_age, max_rows
        self._held: IO[str] | None = None if self.path == MEMORY else _hold(Path(self.path))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxchat-store")
        self._db: sqlite3.Connection | None = None
        try:
            self._executor.submit(self._open).result()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        if self.path != MEMORY:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=LOCK_WAIT)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and not db.execute("SELECT name FROM sqlite_master").fetchall():
                db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
            elif version != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: not an mlxchat store of schema version {SCHEMA_VERSION} (found "
                                 f"{version}); give another --store path")
            db.executescript(_CONVERSATIONS)
            interrupted = db.execute("SELECT id, body FROM responses WHERE status = 'in_progress'").fetchall()
            for response_id, body in interrupted:
                try:
                    was = _read(body, f"response {response_id!r}")
                except StoreError:  # damaged: it fails with what can still be said of it
                    was = {"id": response_id, "object": "response"}
                failed = {**was, "status": "failed", "error": {
                    "code": "server_error", "message": "the server stopped before this response was finished"}}
                db.execute("UPDATE responses SET status = 'failed', body = ? WHERE id = ?",
                           (json.dumps(failed), response_id))
            self._prune(db)
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: cannot open the store ({exc})") from None
        self._db = db

    def _cutoff(self) -> float:
        """Responses created before this time have expired."""
        return time.time() - self.max_age if self.max_age is not None else float("-inf")

    def _prune(self, db: sqlite3.Connection) -> None:
        """Remove the responses past the bounds (their items go with them)."""
        with _transaction(db):
            if self.max_age is not None:
                db.execute("DELETE FROM responses WHERE created_at < ?", (self._cutoff(),))
            if self.max_rows is not None:
                db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created_at DESC, "
                           "rowid DESC LIMIT -1 OFFSET ?)", (self.max_rows,))

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._db is not None
            try:
                return fn(self._db)
            except sqlite3.OperationalError as exc:  # locked, busy, read-only, disk full
                raise StoreUnavailableError(f"the response store {self.path} cannot be used now ({exc}); "
                                            "requests that store responses fail until it can") from None

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        self._executor.submit(shut).result()
        self._executor.shutdown()
        if self._held is not None:
            self._held.close()  # the lock goes with the file handle
            self._held = None

    # -- writing --------------------------------------------------------------------------------------

    async def create(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Record a response about to run (its body without output, and its input items)."""
        body = json.dumps({k: v for k, v in response.items() if k != "output"})

        def write(db: sqlite3.Connection) -> None:
            with _transaction(db):
                db.execute("INSERT INTO responses (id, previous_id, created_at, status, body) VALUES (?, ?, ?, ?, ?)",
                           (response["id"], response.get("previous_response_id"), response["created_at"],
                            response["status"], body))
                db.executemany("INSERT INTO items (response_id, kind, position, item) VALUES (?, 'input', ?, ?)",
                               [(response["id"], i, json.dumps(item)) for i, item in enumerate(input_items)])
            self._prune(db)

        await self._run(write)

    async def finish(self, response: dict[str, Any]) -> None:
        """Record how a response ended: its status, body and output items."""
        body = json.dumps({k: v for k, v in response.items() if k != "output"})

        def write(db: sqlite3.Connection) -> None:
            with _transaction(db):
                db.execute("UPDATE responses SET status = ?, body = ? WHERE id = ?",
                           (response["status"], body, response["id"]))
                db.execute("DELETE FROM items WHERE response_id = ? AND kind = 'output'", (response["id"],))
                db.executemany("INSERT INTO items (response_id, kind, position, item) VALUES (?, 'output', ?, ?)",
                               [(response["id"], i, json.dumps(item)) for i, item in enumerate(response["output"])])

        await self._run(write)

    async def delete(self, response_id: str) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            with _transaction(db):
                return db.execute("DELETE FROM responses WHERE id = ? AND created_at >= ?",
                                  (response_id, self._cutoff())).rowcount > 0

        return await self._run(remove)

    # -- reading --------------------------------------------------------------------------------------

    async def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored response object (output included), or ``None``."""

        def read(db: sqlite3.Connection) -> dict[str, Any] | None:
            row = db.execute("SELECT body FROM responses WHERE id = ? AND created_at >= ?",
                             (response_id, self._cutoff())).fetchone()
            if row is None:
                return None
            output = db.execute("SELECT item FROM items WHERE response_id = ? AND kind = 'output' ORDER BY position",
                                (response_id,)).fetchall()
            what = f"response {response_id!r}"
            return {**_read(row[0], what), "output": [_read(item, f"an output item of {what}") for (item,) in output]}

        return await self._run(read)

    async def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        def read(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            if db.execute("SELECT 1 FROM responses WHERE id = ? AND created_at >= ?",
                          (response_id, self._cutoff())).fetchone() is None:
                return None
            rows = db.execute("SELECT item FROM items WHERE response_id = ? AND kind = 'input' ORDER BY position",
                              (response_id,)).fetchall()
            return [_read(item, f"an input item of response {response_id!r}") for (item,) in rows]

        return await self._run(read)

    async def history(self, response_id: str) -> list[dict[str, Any]]:
        """The items of the conversation up to and including ``response_id``'s output: each response's input
        then output items, from the first response of its chain on. :class:`ChainError` when a response of
        the chain is missing (deleted, expired, never stored) or did not finish."""

        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            chain: list[str] = []
            seen: set[str] = set()
            current: str | None = response_id
            while current is not None:
                if current in seen:  # a row edited by hand: the chain would never end
                    raise StoreError(f"the chain of response {response_id!r} loops back to {current!r} (the store is "
                                     "damaged)")
                row = db.execute("SELECT previous_id, status FROM responses WHERE id = ? AND created_at >= ?",
                                 (current, self._cutoff())).fetchone()
                if row is None:
                    where = "" if current == response_id else f" (it continues {current}, which is gone)"
                    where += " (responses are kept within the server's --store-max-age and --store-max-rows)"
                    raise ChainError(f"previous response {response_id!r} is not in the store{where}", missing=True)
                if row[1] not in ("completed", "incomplete"):
                    raise ChainError(f"previous response {current!r} is {row[1]}; only a completed or incomplete "
                                     "response can be continued", missing=False)
                chain.append(current)
                seen.add(current)
                current = row[0]
            items: list[dict[str, Any]] = []
            for rid in reversed(chain):
                rows = db.execute("SELECT item FROM items WHERE response_id = ? ORDER BY kind = 'output', position",
                                  (rid,)).fetchall()
                items += [_read(item, f"an item of response {rid!r}") for (item,) in rows]
            return items

        return await self._run(read)

    # -- the page's conversations -----------------------------------------------------------------------

    async def save_conversation(self, conversation_id: str, title: str, messages: list[dict[str, Any]],
                                now: float) -> None:
        """Write a conversation's messages (creating its row the first time)."""

        def write(db: sqlite3.Connection) -> None:
            with _transaction(db):
                db.execute("INSERT INTO conversations (id, created_at, updated_at, title, messages) "
                           "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at, "
                           "title = excluded.title, messages = excluded.messages",
                           (conversation_id, now, now, title, json.dumps(messages)))

        await self._run(write)

    async def conversation(self, conversation_id: str) -> list[dict[str, Any]] | None:
        """A conversation's messages, or ``None`` when it is not stored."""

        def read(db: sqlite3.Connection) -> list[dict[str, Any]] | None:
            row = db.execute("SELECT messages FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
            if row is None:
                return None
            messages = _read(row[0], f"conversation {conversation_id!r}", list)
            if not all(isinstance(message, dict) for message in messages):
                raise StoreError(f"conversation {conversation_id!r} in the store is damaged (a message is no object)")
            return messages

        return await self._run(read)

    async def conversations(self, limit: int) -> list[dict[str, Any]]:
        """The latest ``limit`` conversations (id, title, created_at, updated_at), most recent first."""

        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = db.execute("SELECT id, title, created_at, updated_at FROM conversations "
                              "ORDER BY updated_at DESC LIMIT ?", (limit,)).fetchall()
            return [{"id": i, "title": t, "created_at": c, "updated_at": u} for i, t, c, u in rows]

        return await self._run(read)

    async def delete_conversation(self, conversation_id: str) -> bool:
        def remove(db: sqlite3.Connection) -> bool:
            with _transaction(db):
                return db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,)).rowcount > 0

        return await self._run(remove)

def _hold(path: Path) -> IO[str]:
    """Lock the store at ``path`` for this process (``<store>.lock``, which names the holder), or raise
    :class:`StoreError` naming the server that holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    held = open(path.with_name(path.name + ".lock"), "a+", encoding="utf-8")  # noqa: SIM115 - held while open
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held.seek(0)
        holder = held.read().strip() or "another program"
        held.close()
        raise StoreError(f"{path}: this store is in use by {holder}; one server per store: stop that one, or give "
                         "this one another --store") from None
    held.seek(0)
    held.truncate()
    since = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    held.write(f"the mlxchat server of process {os.getpid()} on {socket.gethostname()} (since {since})")
    held.flush()
    return held
