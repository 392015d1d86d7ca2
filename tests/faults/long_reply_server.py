"""A server on the demo model whose replies never end by themselves (end-of-turn tokens banned, so each
runs to its max_output_tokens): a stream is reliably still running when the test kills the process.

python long_reply_server.py PORT STORE [PAUSE]

PAUSE holds the server, for good, at the moment a test kills it, and prints a line on stdout when there:
``prefill`` after the first chunk of a prompt longer than one chunk ("paused mid-prefill": the response is
stored as running and no token exists yet); ``store-write`` inside the store's transaction that finishes a
response whose metadata has ``"pause": "store-write"``, its statements run and not committed ("paused
mid-store-write").
"""

import sys
import threading
from contextlib import contextmanager

import mlxchat
from mlxchat import batching
from mlxchat.demo import default_model_path
from mlxchat.server import serve, store


def hold(where: str) -> None:
    print(f"paused mid-{where}", flush=True)
    threading.Event().wait()


def pause_prefill() -> None:
    run_together = batching.StepItem.run_together.__func__  # type: ignore[attr-defined]

    def paused(cls, items):  # type: ignore[no-untyped-def]
        run_together(cls, items)
        if any(isinstance(item, batching.PrefillChunk) and not item.prefill.done for item in items):
            hold("prefill")

    batching.StepItem.run_together = classmethod(paused)  # type: ignore[method-assign, assignment]


def pause_store_write() -> None:
    finish, transaction, marked = store.ResponseStore.finish, store._transaction, threading.Event()

    async def marking(self, response):  # type: ignore[no-untyped-def]
        if (response.get("metadata") or {}).get("pause") == "store-write":
            marked.set()  # the store's thread runs this finish's write next (one request at a time here)
        await finish(self, response)

    @contextmanager
    def paused(db):  # type: ignore[no-untyped-def]
        with transaction(db):
            yield
            if marked.is_set():
                hold("store-write")

    store.ResponseStore.finish = marking  # type: ignore[method-assign]
    store._transaction = paused


if len(sys.argv) > 3:
    {"prefill": pause_prefill, "store-write": pause_store_write}[sys.argv[3]]()
model = mlxchat.load_model(default_model_path())
model.defaults = model.defaults.merged({"temperature": 0.0, "logit_bias": {e: -100.0 for e in model.eos_ids}})
serve(model, port=int(sys.argv[1]), store=sys.argv[2], model_name=None)
