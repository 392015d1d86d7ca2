"""The chat page's conversation API against a real server on the demo model: the page and its CSP, the
guard's rules, every action mapped onto ChatController (with the demo's page tools: the weather waits for
approval, the time asks which city), the events, and conversations kept in the store across a restart.
After a regenerate or a checkpoint restore the next turn's cached tokens cover everything before the change.
The page's tools run for page conversations only, never for the OpenAI or Anthropic endpoints."""

from __future__ import annotations

import base64
import http.client
import io
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from PIL import Image

from mlxchat import tool
from mlxchat.demo.world import DEMO_PAGE_TOOLS, clock_report, weather_report

from conftest import fixture_path, loaded
from page_support import State, idle, long_replies, page_model, prompt, report, shared_prefix, until
from server_support import Served, serving


@pytest.fixture(scope="module")
def model():
    model = page_model()
    yield model
    model.close()


@pytest.fixture(scope="module")
def served(model, tmp_path_factory) -> Iterator[Served]:
    store = str(tmp_path_factory.mktemp("page") / "s.sqlite3")
    with serving("demo", model=model, tools=DEMO_PAGE_TOOLS, store=store) as s:
        yield s


@pytest.fixture
def client(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def new(client: httpx.Client) -> str:
    response = client.post("/api/conversations", json={})
    assert response.status_code == 201
    return str(response.json()["id"])


def act(client: httpx.Client, conversation: str, action: str, **body: object) -> State:
    response = client.post(f"/api/conversations/{conversation}/{action}", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_the_page_is_served_with_a_strict_content_security_policy(client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert 'aria-label="Message"' in page.text and "<script>" not in page.text  # no inline script
    for asset in ("/page/app.js", "/page/style.css", "/page/vendor/marked.umd.js", "/page/vendor/purify.min.js",
                  "/page/vendor/marked.LICENSE", "/page/vendor/dompurify.LICENSE"):
        response = client.get(asset)
        assert response.status_code == 200 and response.headers["x-content-type-options"] == "nosniff", asset
    assert "DOMPurify 3.5.0" in client.get("/page/vendor/purify.min.js").text
    assert client.get("/page/../conversations.py").status_code == 404


def test_the_api_keeps_the_servers_rules(model) -> None:
    with serving("demo", model=model, api_key="sesame", allowed_hosts=["127.0.0.1"]) as s, \
            httpx.Client(base_url=s.url) as client:
        assert client.get("/").status_code == 200 and client.get("/page/app.js").status_code == 200
        assert client.get("/api/conversations").status_code == 401
        assert client.post("/api/conversations", json={}).status_code == 401
        key = {"Authorization": "Bearer sesame"}
        created = client.post("/api/conversations", json={}, headers=key)
        assert created.status_code == 201
        events = client.get(f"/api/conversations/{created.json()['id']}/events", headers={})
        assert events.status_code == 401
        assert client.get("/api/conversations", headers={**key, "Host": "evil.example"}).status_code == 400
        assert client.get("/", headers={"Host": "evil.example"}).status_code == 400
        for sneaky in ("/page/../api/conversations", "/page/%2e%2e/api/conversations", "/page//../api/conversations"):
            raw = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            raw.request("GET", sneaky)  # sent as written (httpx would resolve the dots itself)
            assert raw.getresponse().status == 404, sneaky
            raw.close()
        plain = client.post(f"/api/conversations/{created.json()['id']}/send", content=b'{"text": "hi"}',
                            headers={**key, "Content-Type": "text/plain"})
        assert plain.status_code == 415


def test_bad_actions_are_4xx_json(client) -> None:
    conversation = new(client)
    assert client.post(f"/api/conversations/{conversation}/explode", json={}).status_code == 404
    assert client.get("/api/conversations/0123456789abcdef0123456789abcdef").status_code == 404
    assert client.post("/api/conversations/not-an-id/stop", json={}).status_code == 404
    for action, body in [("send", {"text": "   "}), ("send", {"text": "hi", "colour": "red"}),
                         ("send", {"text": 3}), ("select_version", {"message_id": "m", "index": -1}),
                         ("restore_checkpoint", {"message_id": "nope"}), ("remove_queued", {"id": "nope"}),
                         ("approval", {"call_id": "nope", "approved": True}),
                         ("input", {"request_id": "nope", "text": "x"}),
                         ("send", {"text": "look", "images": ["/etc/passwd"]})]:
        response = client.post(f"/api/conversations/{conversation}/{action}", json=body)
        assert 400 <= response.status_code < 500, (action, body, response.text)
        assert response.json()["error"]["message"]
    assert client.get(f"/api/conversations/{conversation}").json()["messages"] == []


def test_images_need_a_model_that_reads_them(client) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    response = client.post(f"/api/conversations/{new(client)}/send", json={"text": "what is it?", "images": [url]})
    assert response.status_code == 400 and "reads no images" in response.json()["error"]["message"]


def test_an_image_goes_with_the_message_on_a_model_that_reads_images() -> None:
    image = next((fixture_path("qwen3_5_vl")).glob("*.png"))
    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    with serving("qwen3_5_vl", loaded("qwen3_5_vl"), max_queue=4) as s, \
            httpx.Client(base_url=s.url, timeout=60) as client:
        assert client.get("/api/conversations").json()["supports_images"] is True
        with long_replies(s.state.model, tokens=4):  # a conversation's session takes the defaults it starts with
            conversation = new(client)
            act(client, conversation, "send", text="What is in it?", images=[url])
            done = until(client, conversation, idle)
    user = done["messages"][0]
    assert [p["type"] for p in user["content"]] == ["image", "text"] and user["content"][0]["image"] == url
    assert report(done["messages"][1])["prompt_tokens"] > 0


def test_an_error_stays_until_dismissed(client, model) -> None:
    conversation = new(client)
    act(client, conversation, "send", text="word " * (model.context_length + 10))
    failed = until(client, conversation, lambda s: s["status"] == "error")
    assert "context" in failed["error"]
    dismissed = act(client, conversation, "dismiss_error")
    assert dismissed["status"] == "idle" and dismissed["error"] is None


def test_a_turn_streams_and_regenerate_reuses_the_whole_prompt(client) -> None:
    conversation = new(client)
    assert act(client, conversation, "send", text="What is the capital of France?")["status"] == "streaming"
    done = until(client, conversation, idle)
    user, reply = done["messages"]
    assert (user["role"], reply["role"]) == ("user", "assistant") and "Paris" in reply["content"]
    first = report(reply)
    assert first["generated_tokens"] > 0 and first["prompt_tokens"] > 0
    act(client, conversation, "regenerate")
    done = until(client, conversation, lambda s: idle(s) and len(s["messages"][-1].get("versions", [])) == 2)
    reply = done["messages"][-1]
    assert reply["selected_version"] == 1
    # Everything before the reply came from the cache (the last prompt token is fed again for its logits).
    assert report(reply)["cached_prompt_tokens"] == report(reply)["prompt_tokens"] - 1 == first["prompt_tokens"] - 1
    chosen = act(client, conversation, "select_version", message_id=reply["id"], index=0)
    assert chosen["messages"][-1]["selected_version"] == 0


def test_after_a_checkpoint_restore_the_next_turn_reuses_everything_before_it(client, model) -> None:
    conversation = new(client)
    act(client, conversation, "send", text="What is the capital of Italy?")
    first = until(client, conversation, idle)["messages"]
    act(client, conversation, "send", text="What is the capital of Spain?")
    old = until(client, conversation, lambda s: idle(s) and len(s["messages"]) == 4)["messages"]
    restored = act(client, conversation, "restore_checkpoint", message_id=first[1]["id"])
    assert [m["id"] for m in restored["messages"]] == [m["id"] for m in first]
    act(client, conversation, "send", text="What is the capital of Norway?")
    done = until(client, conversation, lambda s: idle(s) and len(s["messages"]) == 4)["messages"]
    assert "Oslo" in done[-1]["content"] and done[:2] == first
    # Everything the new prompt shares with the one before the restore came from the cache.
    before, after = prompt(model, old[:3], DEMO_PAGE_TOOLS), prompt(model, done[:3], DEMO_PAGE_TOOLS)
    shared = shared_prefix(before, after)
    assert shared > len(prompt(model, first[:1], DEMO_PAGE_TOOLS))  # past the first turn's prompt, into its reply
    assert report(done[-1])["cached_prompt_tokens"] == shared
    assert report(done[-1])["prompt_tokens"] == len(after)


def test_approve_deny_with_a_reason_and_approve_edited_arguments(client) -> None:
    conversation = new(client)
    act(client, conversation, "send", text="What's the weather in London?")
    waiting = until(client, conversation, lambda s: s["status"] == "awaiting_approval")
    (call,) = waiting["pending_approvals"]
    assert call["function"]["name"] == "get_weather"
    act(client, conversation, "approval", call_id=call["id"], approved=False, reason="not today")
    done = until(client, conversation, idle)
    tool = next(m for m in done["messages"] if m["role"] == "tool")
    assert tool["content"] == "not today"

    act(client, conversation, "send", text="What's the weather in Berlin?")
    (call,) = until(client, conversation, lambda s: s["status"] == "awaiting_approval")["pending_approvals"]
    act(client, conversation, "approval", call_id=call["id"], approved=True, arguments={"city": "Rome"})
    done = until(client, conversation, idle)
    tool = [m for m in done["messages"] if m["role"] == "tool"][-1]
    assert json.loads(tool["content"])["city"] == "Rome"
    edited = [m for m in done["messages"] if m.get("tool_calls")][-1]["tool_calls"][0]
    assert json.loads(edited["function"]["arguments"]) == {"city": "Rome"}

    act(client, conversation, "send", text="What's the weather in Paris?")
    (call,) = until(client, conversation, lambda s: s["status"] == "awaiting_approval")["pending_approvals"]
    act(client, conversation, "approval", call_id=call["id"], approved=True)
    done = until(client, conversation, idle)
    assert json.loads([m for m in done["messages"] if m["role"] == "tool"][-1]["content"])["city"] == "Paris"


def test_an_input_request_is_answered_and_a_stop_cancels_it(client) -> None:
    conversation = new(client)
    act(client, conversation, "send", text="What time is it in Paris?")
    (request,) = until(client, conversation, lambda s: s["status"] == "awaiting_input")["input_requests"]
    assert request["prompt"].startswith("Which Paris?") and request["name"] == "get_time"
    act(client, conversation, "input", request_id=request["id"], text="Paris, Texas")
    done = until(client, conversation, idle)
    result = json.loads([m for m in done["messages"] if m["role"] == "tool"][-1]["content"])
    assert result == clock_report("Paris, Texas") and result["time"] in done["messages"][-1]["content"]

    act(client, conversation, "send", text="What time is it in Tokyo?")
    (request,) = until(client, conversation, lambda s: s["status"] == "awaiting_input")["input_requests"]
    act(client, conversation, "input", request_id=request["id"], text="  ")  # no answer: the city as asked
    done = until(client, conversation, lambda s: idle(s) and len(s["messages"]) == 8)
    assert json.loads([m for m in done["messages"] if m["role"] == "tool"][-1]["content"]) == clock_report("Tokyo")

    act(client, conversation, "send", text="What time is it in Oslo?")
    until(client, conversation, lambda s: s["status"] == "awaiting_input")
    act(client, conversation, "stop")
    stopped = until(client, conversation, lambda s: s["status"] in ("idle", "error") and not s["input_requests"])
    if stopped["status"] == "error":
        assert act(client, conversation, "dismiss_error")["status"] == "idle"


def test_a_question_left_unanswered_ends_at_the_input_timeout(model, tmp_path) -> None:
    """``--input-timeout``: a tool's question nobody answers ends with an error for the tool, and the turn (which
    holds its memory while it waits) goes on to its reply."""
    with serving("demo", model=model, tools=DEMO_PAGE_TOOLS, store=str(tmp_path / "s.sqlite3"),
                 input_timeout=0.3) as served, httpx.Client(base_url=served.url, timeout=60) as client:
        conversation = new(client)
        act(client, conversation, "send", text="What time is it in Paris?")
        done = until(client, conversation, lambda s: idle(s) and s["messages"][-1]["role"] == "assistant")
        (result,) = [m for m in done["messages"] if m["role"] == "tool"]
        assert "no answer to" in result["content"] and "within 0.3 s" in result["content"]


def test_the_queue_while_a_reply_streams_and_stop_keeps_the_text(client, model) -> None:
    with long_replies(model):  # a conversation's session takes the model's defaults when it starts
        conversation = new(client)
        act(client, conversation, "send", text="Tell me a long story.")
        streaming = until(client, conversation, lambda s: len((s["streaming_message"] or {}).get("content") or "") > 5)
        assert streaming["messages"][-1]["content"] == "Tell me a long story."  # shown while the reply streams
        act(client, conversation, "send", text="second")
        queued = act(client, conversation, "send", text="third")["queue"]
        assert [p["text"] for p in queued] == ["second", "third"]
        assert [p["text"] for p in act(client, conversation, "remove_queued", id=queued[0]["id"])["queue"]] == ["third"]
        act(client, conversation, "stop")
        stopped = until(client, conversation, lambda s: s["status"] == "idle")
    assert [p["text"] for p in stopped["queue"]] == ["third"]  # paused by the stop
    kept = stopped["messages"][-1]
    assert kept["role"] == "assistant" and kept["content"] and report(kept)["finish_reason"] == "cancelled"
    act(client, conversation, "send_queued_now", id=stopped["queue"][0]["id"])
    until(client, conversation, lambda s: len((s["streaming_message"] or {}).get("content") or "") > 5)
    act(client, conversation, "stop")  # (the session keeps the long replies' defaults: thousands of tokens)
    done = until(client, conversation, lambda s: idle(s) and len(s["messages"]) == 4)
    assert done["messages"][2]["content"] == "third"


def test_conversations_are_listed_and_survive_a_restart(model, tmp_path) -> None:
    store = str(tmp_path / "store.sqlite3")
    with serving("demo", model=model, store=store) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        conversation = new(client)
        act(client, conversation, "send", text="What is the capital of Germany?")
        before = until(client, conversation, idle)["messages"]
        listed = client.get("/api/conversations").json()["data"]
        assert listed[0]["id"] == conversation and listed[0]["title"] == "What is the capital of Germany?"
    with serving("demo", model=model, store=store) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        again = client.get(f"/api/conversations/{conversation}").json()
        assert again["messages"] == before
        act(client, conversation, "send", text="What is the capital of France?")
        reply = until(client, conversation, lambda st: idle(st) and len(st["messages"]) == 4)["messages"][-1]
        assert "Paris" in reply["content"]
        assert report(reply)["cached_prompt_tokens"] == 0  # a new session, primed from the store: one prefill
        assert client.delete(f"/api/conversations/{conversation}").status_code == 200
        assert client.get(f"/api/conversations/{conversation}").status_code == 404


def test_a_call_waiting_for_approval_waits_across_a_restart(model, tmp_path) -> None:
    store = str(tmp_path / "store.sqlite3")
    with serving("demo", model=model, store=store, tools=DEMO_PAGE_TOOLS) as s, \
            httpx.Client(base_url=s.url, timeout=60) as client:
        conversation = new(client)
        act(client, conversation, "send", text="What's the weather in London?")
        (call,) = until(client, conversation, lambda st: st["status"] == "awaiting_approval")["pending_approvals"]
    with serving("demo", model=model, store=store, tools=DEMO_PAGE_TOOLS) as s, \
            httpx.Client(base_url=s.url, timeout=60) as client:
        again = client.get(f"/api/conversations/{conversation}").json()
        assert again["status"] == "awaiting_approval" and again["pending_approvals"] == [call]
        act(client, conversation, "approval", call_id=call["id"], approved=True)
        done = until(client, conversation, idle)
        assert json.loads([m for m in done["messages"] if m["role"] == "tool"][-1]["content"])["city"] == "London"


def poll(client: httpx.Client, conversation: str, check: Callable[[State], bool]) -> State:
    """The conversation's state once it passes ``check``, read without holding an event stream open."""
    for _ in range(2400):
        state = dict(client.get(f"/api/conversations/{conversation}").json())
        if check(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"never got there; the last state: {state}")


def test_idle_conversations_beyond_the_cache_limit_are_closed_and_primed_again(model) -> None:
    with serving("demo", model=model, caches=1) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        first, second = new(client), new(client)
        act(client, first, "send", text="What is the capital of France?")
        poll(client, first, idle)
        act(client, first, "send", text="What is the capital of Spain?")
        warm = report(poll(client, first, lambda st: idle(st) and len(st["messages"]) == 4)["messages"][-1])
        assert warm["cached_prompt_tokens"] > 0  # live: its cache served the first turn
        act(client, second, "send", text="What is the capital of Italy?")  # the first one is closed now
        poll(client, second, idle)
        act(client, first, "send", text="What is the capital of Norway?")  # primed again from the store
        cold = poll(client, first, lambda st: idle(st) and len(st["messages"]) == 6)["messages"]
        assert report(cold[-1])["cached_prompt_tokens"] == 0 and "Oslo" in cold[-1]["content"]


def held(client: httpx.Client, check: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """What ``/health`` says the server holds, once it passes ``check`` (a turn's cache is bounded just after it
    ends, on the server's loop)."""
    for _ in range(400):
        health = dict(client.get("/health").json())
        if check(health):
            return health
        time.sleep(0.05)
    raise AssertionError(f"never got there; the server holds {health}")


def test_idle_conversations_caches_are_bounded_with_the_pools_by_max_cache_gb(model) -> None:
    """The least recently used idle cache goes first, a conversation's or the API pool's; a conversation whose cache
    went stays open and prefills its history again. (Replies of 40 tokens: every cache here holds as many.)"""
    def turn(client: httpx.Client, conversation: str, text: str, messages: int = 2) -> State:
        act(client, conversation, "send", text=text)
        return poll(client, conversation, lambda st: idle(st) and len(st["messages"]) == messages)

    with long_replies(model, tokens=40):
        with serving("demo", model=model) as s, httpx.Client(base_url=s.url, timeout=60) as client:
            turn(client, new(client), "Question one")
            one = held(client, lambda h: h["page_cache_bytes"] > 0)["page_cache_bytes"]  # a conversation's cache
        with serving("demo", model=model, max_cache_gb=1.5 * one / 1e9) as s, \
                httpx.Client(base_url=s.url, timeout=60) as client:
            first, second = new(client), new(client)
            turn(client, first, "Question one")
            turn(client, second, "Question two")  # the first one's cache goes
            held(client, lambda h: h["page_cache_bytes"] == one and h["pool_caches"] == 0)
            chat = {"model": "mlxchat-demo", "messages": [{"role": "user", "content": "Question six"}],
                    "max_tokens": 40}
            assert client.post("/v1/chat/completions", json=chat).status_code == 200  # the second one's goes
            held(client, lambda h: h["page_cache_bytes"] == 0 and h["pool_caches"] == 1)
            for conversation in (first, second):
                again = turn(client, conversation, "And again", messages=4)["messages"]
                assert report(again[-1])["cached_prompt_tokens"] == 0


RAN: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: Name of the city.
    """
    RAN.append(city)
    return json.dumps(weather_report(city))


def test_the_openai_and_anthropic_endpoints_never_run_the_pages_tools(model) -> None:
    RAN.clear()
    schema = get_weather.schema["function"]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    with serving("demo", model=model, tools=[get_weather]) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        # The client offers the tool: the call comes back to it, to run itself.
        chat = client.post("/v1/chat/completions", json={"model": name, "messages": ask, "temperature": 0,
                                                          "tools": [get_weather.schema]}).json()
        assert chat["choices"][0]["finish_reason"] == "tool_calls"
        assert chat["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        responses = client.post("/v1/responses", json={"model": name, "input": ask, "temperature": 0,
                                                       "tools": [{"type": "function", **schema}]}).json()
        assert [i["name"] for i in responses["output"] if i["type"] == "function_call"] == ["get_weather"]
        messages = client.post("/v1/messages", json={
            "model": name, "messages": ask, "max_tokens": 200, "temperature": 0,
            "tools": [{"name": schema["name"], "description": schema["description"],
                       "input_schema": schema["parameters"]}]}).json()
        assert messages["stop_reason"] == "tool_use"
        # The client offers none: the page's tools are not in the prompt either.
        plain = client.post("/v1/chat/completions", json={"model": name, "messages": ask, "temperature": 0}).json()
        assert not plain["choices"][0]["message"].get("tool_calls")
        assert plain["usage"]["prompt_tokens"] == len(model.render_prompt(ask)[1])
    assert RAN == []
