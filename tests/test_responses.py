"""The Responses API with the official ``openai`` client on the demo model: chains continued by
``previous_response_id`` from the warm cache (cached tokens prove it), a resent item list served the same
way, the official stream events (each validated by the client's own models), function tools round trip,
tool_choice, stored responses (retrieve, input items, delete, store: false, failures), a restart that
continues a chain from the store, evicted caches restored from disk, and clients that leave."""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

import mlxchat  # noqa: E402
from mlxchat.demo.world import DEMO_TOOLS  # noqa: E402

from conftest import fixture_path  # noqa: E402
from server_support import DEMO, Served, serving  # noqa: E402

TOOLS = [{"type": "function", "name": t.name, "description": t.description,
          "parameters": t.schema["function"]["parameters"], "strict": True} for t in DEMO_TOOLS]
GREEDY: dict[str, Any] = {"model": DEMO, "temperature": 0}
RESPONSE = TypeAdapter(Response)
EVENT = TypeAdapter(ResponseStreamEvent)


def client(served: Served) -> Any:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served():
    with serving("demo") as server:
        yield server


def test_a_follow_up_continues_the_warm_session_of_its_previous_response(served) -> None:
    api = client(served)
    first = api.responses.create(input="What is the capital of France?", **GREEDY)
    assert first.output_text == "The capital of France is Paris." and first.status == "completed"
    RESPONSE.validate_python(first.model_dump())
    second = api.responses.create(input="What is 12 plus 30?", previous_response_id=first.id, **GREEDY)
    assert second.output_text == "12 + 30 = 42."
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the same conversation sent whole, without the chain, gets the same reply
    whole = api.responses.create(input=[{"role": "user", "content": "What is the capital of France?"},
                                        *[item.model_dump(exclude_none=True) for item in first.output],
                                        {"role": "user", "content": "What is 12 plus 30?"}], store=False, **GREEDY)
    assert whole.output_text == second.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens


def test_a_resent_item_list_is_served_from_the_warm_cache_by_prefix(served) -> None:
    """As the OpenAI Agents SDK does without previous_response_id: each request carries every item so far."""
    api = client(served)
    items: list[Any] = [{"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                          "text": "What is the capital of Peru?"}]}]
    first = api.responses.create(input=items, store=False, **GREEDY)
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "Thanks!"})
    second = api.responses.create(input=items, store=False, **GREEDY)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_function_tools_round_trip(served) -> None:
    api = client(served)
    asked = api.responses.create(input="What's the weather in Paris?", tools=TOOLS, **GREEDY)
    assert [item.type for item in asked.output] == ["reasoning", "function_call"]
    call = asked.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    answered = api.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        previous_response_id=asked.id, tools=TOOLS, **GREEDY)
    assert "Paris" in answered.output_text and "21" in answered.output_text
    assert answered.usage.input_tokens_details.cached_tokens >= asked.usage.input_tokens


@pytest.mark.parametrize(("choice", "name"), [("required", "get_weather"),
                                              ({"type": "function", "name": "get_time"}, "get_time")])
def test_tool_choice_makes_the_reply_call(served, choice, name) -> None:
    reply = client(served).responses.create(input="What's the weather in Paris?", tools=TOOLS, tool_choice=choice,
                                            **GREEDY)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, {"city": "Paris"})]


def test_parallel_tool_calls_false_keeps_one_call(served) -> None:
    api = client(served)
    question = "What's the weather in Lima and the time in Oslo?"
    both = api.responses.create(input=question, tools=TOOLS, **GREEDY)
    assert len([i for i in both.output if i.type == "function_call"]) == 2
    one = api.responses.create(input=question, tools=TOOLS, parallel_tool_calls=False, **GREEDY)
    assert [i.name for i in one.output if i.type == "function_call"] == ["get_weather"]
    assert one.parallel_tool_calls is False


def stream_events(served: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events as sent, each validated by the official client's event models."""
    events = []
    with httpx.stream("POST", f"{served.url}/v1/responses", json={**body, "stream": True}, timeout=60) as response:
        lines = iter(response.iter_lines())
        for line in lines:
            if line.startswith("event: "):
                data = json.loads(next(lines).removeprefix("data: "))
                assert data["type"] == line.removeprefix("event: ")
                EVENT.validate_python(data)
                events.append(data)
    return events


def test_the_stream_sends_the_official_events_in_order(served) -> None:
    events = stream_events(served, {**GREEDY, "input": "What's the weather in Rome?", "tools": TOOLS})
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events if not e["type"].endswith(".delta")]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert final["output"][0]["content"][0]["text"] == reasoning
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Rome"}
    assert client(served).responses.retrieve(final["id"]).model_dump(exclude_none=True) == \
        Response.model_validate(final).model_dump(exclude_none=True)


def test_a_streamed_reply_equals_the_one_not_streamed(served) -> None:
    api = client(served)
    with api.responses.stream(input="Hi!", **GREEDY) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == api.responses.create(input="Hi!", store=False, **GREEDY).output_text


def test_max_output_tokens_makes_the_response_incomplete(served) -> None:
    events = stream_events(served, {**GREEDY, "input": "What is 23 plus 19?", "max_output_tokens": 5})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["usage"]["output_tokens"] == 5


def test_stored_responses_can_be_retrieved_listed_and_deleted(served) -> None:
    api = client(served)
    first = api.responses.create(input=[{"role": "user", "content": "Hello!"}], instructions="Be brief.",
                                 metadata={"topic": "greeting"}, **GREEDY)
    stored = api.responses.retrieve(first.id)
    assert stored.output_text == first.output_text and stored.metadata == {"topic": "greeting"}
    assert stored.instructions == "Be brief."
    items = api.responses.input_items.list(first.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello!")]
    assert items.data[0].id.startswith("msg_")
    api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(input="And?", previous_response_id=first.id, **GREEDY)


def test_input_items_page_in_either_order(served) -> None:
    api = client(served)
    sent = [{"role": "user", "content": f"Number {i}"} for i in range(5)]
    reply = api.responses.create(input=sent, max_output_tokens=2, **GREEDY)
    texts = [i.content[0].text for i in api.responses.input_items.list(reply.id, order="asc", limit=2).data]
    assert texts == ["Number 0", "Number 1"]
    newest = api.responses.input_items.list(reply.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["Number 4", "Number 3"] and newest.has_more
    rest = api.responses.input_items.list(reply.id, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["Number 2", "Number 1", "Number 0"] and not rest.has_more


def test_store_false_keeps_nothing(served) -> None:
    api = client(served)
    reply = api.responses.create(input="Hi!", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(reply.id)


def test_requests_are_written_before_they_run_and_failures_marked(tmp_path) -> None:
    store = tmp_path / "store.sqlite3"
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    with serving("qwen3_5", store=str(store)) as served:  # its template raises when no user asked anything
        with pytest.raises(openai.BadRequestError, match="No user query"):
            client(served).responses.create(model="tiny", input=[
                call, {"type": "function_call_output", "call_id": "c1", "output": "{}"}])
    with sqlite3.connect(store) as db:
        (status, body), = db.execute("SELECT status, body FROM responses").fetchall()
        items = db.execute("SELECT kind, item FROM items").fetchall()
    assert status == "failed" and "No user query" in json.loads(body)["error"]["message"]
    assert [(kind, json.loads(item)["type"]) for kind, item in items] == [
        ("input", "function_call"), ("input", "function_call_output")]


def test_a_restarted_server_continues_a_chain_from_its_store(tmp_path) -> None:
    """Three responses, a restart on the same store, a fourth: the same reply as a server never stopped gives
    (greedy), the chain re-primed from the store in one prefill."""
    questions = ["What is the capital of Japan?", "What is 15 plus 27?", "What's the weather in Oslo?",
                 "Thanks! And what time is it in Oslo?"]

    def chain(api: Any, start: str | None, asked: list[str]) -> tuple[str | None, Any]:
        previous, reply = start, None
        for question in asked:
            reply = api.responses.create(input=question, previous_response_id=previous, **GREEDY)
            previous = reply.id
        return previous, reply

    with serving("demo") as uninterrupted:
        _, expected = chain(client(uninterrupted), None, questions)
    store = str(tmp_path / "store.sqlite3")
    with serving("demo", store=store) as first_run:
        last, _ = chain(client(first_run), None, questions[:3])
    with serving("demo", store=store) as second_run:
        _, continued = chain(client(second_run), last, questions[3:])
    assert continued.output_text == expected.output_text and continued.output_text
    assert continued.usage.input_tokens == expected.usage.input_tokens
    assert continued.usage.input_tokens_details.cached_tokens == 0  # cold: primed from the stored chain
    assert expected.usage.input_tokens_details.cached_tokens > 0


def test_an_evicted_warm_session_is_restored_from_disk(tmp_path) -> None:
    with serving("demo", store=str(tmp_path / "store.sqlite3"), caches=1) as served:
        api = client(served)
        first = api.responses.create(input="What is the capital of Chile?", **GREEDY)
        api.responses.create(input="What is 40 plus 12?", **GREEDY)  # takes the only slot: the first spills
        (spilled,) = served.state.pool._spilled
        spilled.written.result(timeout=30)  # written by the model's worker, after the reply was sent
        # Its conversation is remembered by digests, not messages (whose images would stay in memory as long as
        # the file stays on disk: the soak's vision server grew 5% in 20 minutes).
        assert all(isinstance(digest, bytes) and len(digest) == 16 for digest in spilled.messages)
        assert [p.name for p in (tmp_path / "store.sqlite3.spill").iterdir()] == [spilled.path.name]
        follow = api.responses.create(input="And of Peru?", previous_response_id=first.id, **GREEDY)
        assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        assert served.state.pool.spilled == 1  # the second one spilled in its turn


def test_concurrent_chains_do_not_cross_talk(served) -> None:
    starts = ["What is the capital of Italy?", "What is 31 plus 11?", "What's the weather in Lima?", "Hello!"]
    alone = []
    for question in starts:
        first = client(served).responses.create(input=question, tools=TOOLS, **GREEDY)
        alone.append(client(served).responses.create(input="Thanks!", previous_response_id=first.id, tools=TOOLS,
                                                     **GREEDY).output_text)
    together: dict[int, str] = {}

    def run(index: int) -> None:
        api = client(served)
        first = api.responses.create(input=starts[index], tools=TOOLS, **GREEDY)
        together[index] = api.responses.create(input="Thanks!", previous_response_id=first.id, tools=TOOLS,
                                               **GREEDY).output_text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(starts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [together[i] for i in range(len(starts))] == alone


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_frees_its_slot_and_the_response_is_kept_as_cancelled(stream, tmp_path) -> None:
    with mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32") as model:
        model.defaults = model.defaults.merged({"logit_bias": {e: -100.0 for e in model.eos_ids}})  # never ends
        store = tmp_path / "store.sqlite3"
        with serving("qwen3_chat", model=model, store=str(store), caches=1) as served:
            data = json.dumps({"input": "Hello!", "stream": stream, "max_output_tokens": 3500}).encode()
            with socket.create_connection(("127.0.0.1", served.port)) as sock:
                sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                             b"\r\n" + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                time.sleep(0.4)
            left = time.monotonic()
            while served.state.queued and time.monotonic() - left < 30:
                time.sleep(0.01)
            assert served.state.queued == 0 and time.monotonic() - left < 5
            cache, = served.state.pool.caches
            assert len(cache) < 1500  # the reply stopped well short of its 3500 tokens
            time.sleep(0.2)  # the store's last write
        with sqlite3.connect(store) as db:
            assert db.execute("SELECT status FROM responses").fetchall() == [("cancelled",)]


def test_the_store_reopens_at_its_schema_and_refuses_another(tmp_path) -> None:
    import asyncio

    from mlxchat.server.store import ResponseStore, StoreError

    path = tmp_path / "store.sqlite3"
    store = ResponseStore(path)
    body = {"id": "resp_1", "created_at": 1, "status": "in_progress", "output": []}
    asyncio.run(store.create(body, [{"type": "message", "role": "user", "content": "hi"}]))
    store.close()  # as if the server stopped mid-turn
    reopened = ResponseStore(path)
    stored = asyncio.run(reopened.get("resp_1"))
    assert stored is not None and stored["status"] == "failed" and "stopped" in stored["error"]["message"]
    reopened.close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 7")
    with pytest.raises(StoreError, match="schema version 1"):
        ResponseStore(path)
    other = tmp_path / "other.sqlite3"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (x)")
    with pytest.raises(StoreError):
        ResponseStore(other)


def test_items_as_clients_replay_them_become_chat_messages() -> None:
    from mlxchat.server.responses import ResponsesRequest, stored_input, to_messages

    request = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Tool."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]})
    items = stored_input(request)
    assert [item["id"][:3] for item in items] == ["msg", "msg", "rs_", "msg", "fc_", "fco", "msg", "msg"]
    assert items[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert to_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Tool.", "tool_calls": [{
            "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
