"""``GET /metrics`` and memory-aware admission (issue 25): the counters add up to what the clients saw,
the page is behind the API key unless left open to loopback scrapers, and a request whose cache could
never fit the server's ``max_kv_gb`` is refused with a 503 that says so, while one that fits waits for
the memory the running ones give back."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import mlxchat  # noqa: E402
from mlxchat.pacing import Load, StepPace  # noqa: E402
from mlxchat.server.admission import Footprint, Hold, KvBudget, Reservation  # noqa: E402

from conftest import FIXTURES, loaded  # noqa: E402
from server_support import DEMO, Served, held_mid_stream, serving  # noqa: E402

HEADERS = {"Authorization": "Bearer k"}


def scrape(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = httpx.get(served.url + "/metrics", headers=HEADERS, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(page.text) for sample in family.samples}


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_the_counters_add_up_to_what_the_clients_saw() -> None:
    with serving("demo", api_key="k") as served:
        assert httpx.get(served.url + "/metrics", timeout=10).status_code == 401
        url = served.url
        chat = {"model": DEMO, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 5, "temperature": 0}
        seen: dict[str, list[int]] = {"chat.completions": [0, 0, 0], "responses": [0, 0, 0], "messages": [0, 0, 0]}
        for stream in (False, True):
            answer = httpx.post(url + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
                **chat, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})})
            usage = (answer.json() if not stream else
                     httpx.Response(200, text=answer.text.split("data: ")[-2]).json())["usage"]
            seen["chat.completions"] = [a + b for a, b in zip(seen["chat.completions"], (
                usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]),
                strict=True)]
        response = httpx.post(url + "/v1/responses", headers=HEADERS, timeout=60, json={
            "model": DEMO, "input": "Hi!", "max_output_tokens": 5, "temperature": 0}).json()["usage"]
        seen["responses"] = [response["input_tokens"], response["input_tokens_details"]["cached_tokens"],
                             response["output_tokens"]]
        message = httpx.post(url + "/v1/messages", headers=HEADERS, timeout=60, json={**chat}).json()["usage"]
        seen["messages"] = [message["input_tokens"] + message["cache_read_input_tokens"],
                            message["cache_read_input_tokens"], message["output_tokens"]]
        refused = httpx.post(url + "/v1/messages", headers=HEADERS, timeout=60, json={**chat, "model": "other"})
        assert refused.status_code == 404
        for _ in range(2):  # refused by the guard, before any route
            assert httpx.post(url + "/v1/messages", timeout=60, json=chat).status_code == 401
        assert httpx.post(url + "/v1/messages", headers={**HEADERS, "content-type": "text/plain"}, timeout=60,
                          content=b"{}").status_code == 415
        samples = scrape(served)
        refused_key = value(samples, "mlxchat_refused_requests_total", status="401", reason="invalid_api_key")
        assert refused_key == 3  # the first scrape without the key too
        assert value(samples, "mlxchat_refused_requests_total", status="415", reason="unsupported_media_type") == 1
        # every token after a reply's first came from a decode step of one row (the requests ran one at a time)
        decoded = sum(generated for _, _, generated in seen.values())
        steps = value(samples, "mlxchat_decode_step_rows_count")
        assert 0 < steps < decoded and value(samples, "mlxchat_decode_step_rows_sum") == steps
        prefilled = value(samples, "mlxchat_prefill_step_tokens_sum")
        assert 0 < prefilled <= sum(prompt - cached for prompt, cached, _ in seen.values())
        assert value(samples, "mlxchat_requests_total", endpoint="chat.completions", status="200") == 2
        assert value(samples, "mlxchat_requests_total", endpoint="responses", status="200") == 1
        assert value(samples, "mlxchat_requests_total", endpoint="messages", status="200") == 1
        assert value(samples, "mlxchat_requests_total", endpoint="messages", status="404") == 1
        for endpoint, (prompt, cached, generated) in seen.items():
            assert value(samples, "mlxchat_prompt_tokens_total", endpoint=endpoint) == prompt
            assert value(samples, "mlxchat_cached_prompt_tokens_total", endpoint=endpoint) == cached
            assert value(samples, "mlxchat_generated_tokens_total", endpoint=endpoint) == generated
            answered = 2 if endpoint == "chat.completions" else 1
            assert value(samples, "mlxchat_time_to_first_token_seconds_count", endpoint=endpoint) == answered
            assert value(samples, "mlxchat_inter_token_latency_seconds_count", endpoint=endpoint) > 0
        assert value(samples, "mlxchat_queue_depth") == 0 and value(samples, "mlxchat_running_generations") == 0
        assert value(samples, "mlxchat_pool_bytes") == served.state.pool.nbytes > 0
        assert value(samples, "mlxchat_kv_reserved_bytes") == 0 and value(samples, "mlxchat_kv_live_bytes") == 0
        assert value(samples, "mlxchat_kv_limit_bytes") == served.state.kv.limit
        pace = served.state.model.step_pace
        assert pace is not None and (pace.known is None) == math.isnan(value(samples, "mlxchat_step_cost_seconds",
                                                                             part="fixed"))
        served.state.model.step_pace = pace = StepPace(2.0)  # a pace that saw only these steps
        for tokens, prompt_keys in itertools.product((1, 4, 64, 512), (0, 5000)):
            pace.observe(Load(tokens, prompt_keys), 0.05 + 0.001 * tokens + 3e-6 * prompt_keys)
        assert pace.cost() == pytest.approx((0.05, 0.001, 3e-6))
        samples = scrape(served)
        parts = ("fixed", "per_token", "per_prompt_key")
        assert [value(samples, "mlxchat_step_cost_seconds", part=part) for part in parts] \
            == pytest.approx([0.05, 0.001, 3e-6])
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["queued"] == 0 and health["kv_limit_bytes"] == served.state.kv.limit


def test_the_running_generations_and_the_bytes_their_caches_hold_are_read_when_scraped() -> None:
    model = loaded("qwen3_chat")
    with serving("qwen3_chat", api_key="k") as served, held_mid_stream(served, model, headers=HEADERS):
        samples = scrape(served)
        (turn,) = served.state.turns
        assert value(samples, "mlxchat_running_generations") == 1 and value(samples, "mlxchat_queue_depth") == 1
        assert value(samples, "mlxchat_kv_live_bytes") == turn.cache.nbytes > 0
        assert value(samples, "mlxchat_kv_reserved_bytes") >= turn.cache.nbytes


def test_metrics_can_be_left_open_to_a_loopback_scraper() -> None:
    with serving("demo", api_key="k", metrics_open=True) as served:
        assert httpx.get(served.url + "/metrics", timeout=10).status_code == 200
        assert httpx.post(served.url + "/v1/chat/completions", timeout=10, json={
            "model": DEMO, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 401


def test_a_request_whose_cache_could_never_fit_is_a_503_and_one_that_fits_waits() -> None:
    model = loaded("qwen3")
    with serving("qwen3", model) as served:
        kv = served.state.kv
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}
        prompt = httpx.post(served.url + "/v1/chat/completions", json={**chat, "max_tokens": 2},
                            timeout=60).json()["usage"]["prompt_tokens"]
        kv.limit = kv.footprint.nbytes(prompt + kv.growth_step)  # room for one request's first hold
        refused = httpx.post(served.url + "/v1/chat/completions", json={**chat, "max_tokens": 3000}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "kv_memory_exceeded"
        assert "--max-kv-gb" in refused.json()["error"]["message"]
        # a request that fits waits while a running one holds the memory, and runs once it is given back
        answers: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answers.append(
            httpx.post(served.url + "/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=60)))
        with held_mid_stream(served, model, max_tokens=kv.growth_step):  # its reservation: the limit
            assert kv.reserved == kv.limit
            waiting.start()
            while kv.waiting == 0 and not answers:
                waiting.join(0.01)
            assert not answers and served.state.queued == 2
        waiting.join(60)  # the stream's client left: its memory went back
        assert answers and answers[0].status_code == 200
        assert kv.reserved == 0 and served.state.queued == 0


def test_a_chat_page_turn_holds_its_memory_and_waits_for_it_like_a_request() -> None:
    """The page's turns are under ``--max-kv-gb`` too: one waits (its state says so) while an API stream holds
    the memory and runs once it is given back; stopped while it waits, its ticket goes and its prompt waits
    first in the queue; one that could never fit is an error naming the limit, its prompt kept."""
    from page_support import until

    model = loaded("qwen3")
    with serving("qwen3", model) as served, httpx.Client(base_url=served.url, timeout=60) as client:
        kv = served.state.kv
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}
        prompt = client.post("/v1/chat/completions", json={**chat, "max_tokens": 2}).json()["usage"]["prompt_tokens"]
        kv.limit = kv.footprint.nbytes(prompt + kv.growth_step)  # one turn at a time (short prompts, short replies)
        conversation = client.post("/api/conversations", json={}).json()["id"]
        page = "/api/conversations/" + conversation
        with held_mid_stream(served, model, max_tokens=kv.growth_step):
            assert kv.reserved == kv.limit
            client.post(page + "/send", json={"text": "Hi"})
            waiting = until(client, conversation, lambda s: s["waiting"])
            assert waiting["status"] == "streaming" and kv.waiting == 1
            client.post(page + "/stop", json={})
            stopped = until(client, conversation, lambda s: s["status"] == "idle")
            assert [p["text"] for p in stopped["queue"]] == ["Hi"] and stopped["messages"] == []
            assert kv.waiting == 0 and kv.reserved == kv.limit
            client.post(page + "/send_queued_now", json={"id": stopped["queue"][0]["id"]})
            until(client, conversation, lambda s: s["waiting"])
        # the stream's client left: its memory went back, and the page's turn ran
        done = until(client, conversation, lambda s: s["status"] == "idle" and len(s["messages"]) == 2)
        assert done["messages"][1]["role"] == "assistant" and not done["queue"]
        assert kv.reserved == 0 and kv.waiting == 0
        kv.limit = 1
        client.post(page + "/send", json={"text": "Again"})
        refused = until(client, conversation, lambda s: s["status"] == "error")
        assert "--max-kv-gb" in refused["error"] and [p["text"] for p in refused["queue"]] == ["Again"]
        assert kv.reserved == 0 and len(refused["messages"]) == 2


def test_a_page_turn_stopped_as_its_memory_comes_gives_it_back() -> None:
    """However a stop falls around the budget's grant (before the turn asks; between the grant and the gate
    keeping it; after it kept it, while the ticket's result, dropped by the cancel, was on its way to the
    controller's thread), the gate lets nothing through and the hold goes back. Let through, the turn holds its
    memory as its cache's growth and counts among the running turns until it is over."""
    from mlxchat.server.admission import ThreadHold

    model = loaded("qwen3")
    kv = KvBudget(model, limit=10**9)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    reserve = kv.reserve

    class StoppedAfterKeeping(ThreadHold):
        async def _reserve(self, reservation: Reservation) -> Hold | None:
            hold = await super()._reserve(reservation)
            self.cancel()  # (the page's stop runs on the loop too)
            return hold

    session = model.chat_session()
    hi = [mlxchat.ChatMessage(role="user", content="Hi")]
    try:
        running: set[Any] = set()
        gate = ThreadHold(kv, loop, model.defaults, running)
        assert gate.enter(session, hi, lambda: None)
        assert running == {gate} and gate.cache is session.cache and session.cache.growth is not None
        assert kv.reserved == kv.footprint.nbytes(len(model.render_prompt([{"role": "user", "content": "Hi"}])[1])
                                                  + kv.growth_step)
        gate.exit()
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)  # the release has run
        assert not running and kv.reserved == 0 and session.cache.growth is None
        for when in ("before", "at the grant", "after keeping"):
            gate = (StoppedAfterKeeping if when == "after keeping" else ThreadHold)(kv, loop, model.defaults)
            if when == "before":
                gate.cancel()

            entering: list[Any] = []

            async def stopped_at_the_grant(reservation: Reservation, gate: ThreadHold = gate,
                                           entering: list[Any] = entering) -> Hold:
                while not entering:
                    await asyncio.sleep(0.001)
                hold = await reserve(reservation)
                gate.cancel()
                entering[0].result(60)  # the controller's thread gives up first (a blocking wait: no await, so
                return hold  # the task's cancel lands once the grant was kept or given back, as in reserve)

            kv.reserve = stopped_at_the_grant if when == "at the grant" else reserve  # type: ignore[method-assign]
            with ThreadPoolExecutor(1) as controller:
                entering.append(controller.submit(gate.enter, session, hi, lambda: None))
                assert not entering[0].result(60), when
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(10)  # the release has run
            assert kv.reserved == 0 and kv.waiting == 0 and session.cache.growth is None, when
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_requests_waiting_for_memory_are_served_in_arrival_order() -> None:
    """A small request that would fit at once waits behind a large one that came first (no overtaking, so a
    large request is never starved), and each is granted as soon as what is given back lets it fit."""
    kv = KvBudget(loaded("qwen3"), limit=0)
    unit = kv.footprint.nbytes(256)  # what 256 tokens hold
    kv.limit = 10 * unit

    async def run() -> list[str]:
        granted: list[str] = []
        holds: dict[str, Hold] = {}

        async def reserve(name: str, units: int) -> None:  # prompts that hold all they may need at once
            holds[name] = await kv.reserve(Reservation(256 * units, 256 * units))
            granted.append(name)

        await reserve("held", 6)
        large = asyncio.ensure_future(reserve("large", 8))
        while kv.waiting < 1:
            await asyncio.sleep(0)
        small = asyncio.ensure_future(reserve("small", 3))  # 6 + 3 fits, but "large" came first
        leaving = asyncio.ensure_future(reserve("leaving", 1))
        while kv.waiting < 3:
            await asyncio.sleep(0)
        leaving.cancel()  # a request whose client left while it waited gives its place up
        await asyncio.gather(leaving, return_exceptions=True)
        assert granted == ["held"] and kv.waiting == 2 and kv.reserved == 6 * unit
        await kv.release(holds["held"])
        await large
        assert granted == ["held", "large"] and not small.done() and kv.reserved == 8 * unit
        await kv.release(holds["large"])
        await small
        await kv.release(holds["small"])
        return granted

    assert asyncio.run(run()) == ["held", "large", "small"]
    assert kv.reserved == 0 and kv.waiting == 0


def test_memory_given_back_while_a_waiting_request_is_being_cancelled_goes_to_the_next() -> None:
    kv = KvBudget(loaded("qwen3"), limit=0)
    kv.limit = kv.footprint.nbytes(512)

    async def run() -> None:
        held = await kv.reserve(Reservation(512, 512))
        leaving = asyncio.ensure_future(kv.reserve(Reservation(512, 512)))
        staying = asyncio.ensure_future(kv.reserve(Reservation(256, 256)))
        while kv.waiting < 2:
            await asyncio.sleep(0)
        leaving.cancel()  # its ticket is cancelled now, its own clean-up runs at the loop's next turn
        await kv.release(held)  # meanwhile: the cancelled ticket is passed over, not granted
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await kv.release(await asyncio.wait_for(staying, 5))

    asyncio.run(run())
    assert kv.reserved == 0 and kv.waiting == 0


def test_a_reply_holds_its_prompt_and_grows_as_it_decodes(monkeypatch) -> None:
    """A request is admitted holding its prompt and the first ``growth_step`` tokens of reply, not its whole
    ``max_tokens``, and grows a step at a time as it asks; where generations cannot wait for each other
    (profiling runs them one at a time) it holds the whole at once."""
    from mlxchat import profiling

    kv = KvBudget(loaded("qwen3"), limit=10**12)
    nbytes = kv.footprint.nbytes
    large = Reservation(300 + 4096, 300)

    async def run() -> None:
        hold = await kv.reserve(large)
        assert hold.tokens == 300 + kv.growth_step and kv.reserved == nbytes(hold.tokens)
        assert hold.allow(hold.tokens) and hold.tokens == 812
        assert hold.allow(813) and hold.tokens == 812 + kv.growth_step and kv.reserved == nbytes(1324)
        assert hold.allow(4396) and hold.need == 0 and kv.reserved == kv.nbytes(large)
        kv.limit = kv.reserved  # past its reservation (an estimate too low) it grows whatever the limit: its
        assert hold.allow(4396 + 300) and not hold.paused  # need was counted as nothing, so it may not wait
        await kv.release(hold)
        assert kv.reserved == 0
        kv.limit = 10**12
        monkeypatch.setattr(profiling, "enabled", True)
        whole = await kv.reserve(large)
        assert whole.tokens == 4396 and whole.need == 0 and kv.reserved == kv.nbytes(large)
        await kv.release(whole)
        monkeypatch.setattr(profiling, "enabled", False)
        small = await kv.reserve(Reservation(2000, 300))
        kv.limit = kv.reserved
        assert not small.allow(900) and small.paused  # it would go past the limit: it waits
        monkeypatch.setattr(profiling, "enabled", True)  # the worker now runs one generation at a time: a
        assert small.allow(900) and not small.paused  # generation waiting could wait for one never started
        await kv.release(small)

    asyncio.run(run())


@pytest.mark.parametrize("seed", range(4))
def test_growing_replies_all_reach_their_end_and_never_hold_more_than_the_limit(seed: int) -> None:
    """Requests with large ``max_tokens`` under a tight limit, each growing a token at a time in a random
    order of turns (as the worker's steps ask): the budget never holds more than its limit, never refuses
    every running request at once (a paused one waits for one that can go on, never for ever), runs more of
    them side by side than whole reservations would, and every request reaches its end."""
    import random

    rng = random.Random(seed)
    kv = KvBudget(loaded("qwen3"), limit=0)
    kv.growth_step = 64
    kv.limit = kv.footprint.nbytes(3000)
    reservations = [Reservation(prompt + rng.randrange(100, 2600), prompt)
                    for prompt in (rng.randrange(10, 400) for _ in range(12))]

    async def run() -> tuple[int, int]:
        held: dict[int, int] = {}  # request -> tokens its cache holds
        holds: dict[int, Hold] = {}

        async def admit(index: int) -> None:
            holds[index] = await kv.reserve(reservations[index])
            held[index] = reservations[index].prompt

        waiting = [asyncio.ensure_future(admit(i)) for i in range(len(reservations))]
        most = pauses = 0
        while len(holds) < len(reservations) or held:
            await asyncio.sleep(0)
            running = [i for i in held if holds.get(i) is not None]
            most = max(most, len(running))
            moved = False
            for index in rng.sample(running, len(running)):
                if holds[index].allow(held[index] + 1):
                    held[index] += 1
                    moved = True
                else:
                    pauses += 1
                assert kv.reserved <= kv.limit
                if held[index] == reservations[index].tokens:
                    del held[index]
                    await kv.release(holds[index])
            assert moved or not running, "every running request waits for memory"
        await asyncio.gather(*waiting)
        return most, pauses

    most, pauses = asyncio.run(run())
    whole = max(i for i in range(1, 13) if sum(sorted(kv.nbytes(r) for r in reservations)[:i]) <= kv.limit)
    assert most > whole and pauses > 0
    assert kv.reserved == 0 and kv.waiting == 0 and kv.paused == 0


def test_replies_too_long_to_hold_together_run_side_by_side_and_one_waits_to_grow(monkeypatch) -> None:
    """Behind the server: two requests whose whole ``max_tokens`` could not be held together are admitted
    together, each holding its prompt and a growth step; once one reply has grown, the other waits to grow
    (its cache kept) until the first has ended, then goes on. Both replies equal each alone, and the budget
    never held more than its limit."""
    import mlxchat

    from conftest import fixture_path, hold_worker_until_queued

    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    questions = ["Hello there", "Tell me a number"]

    def ask(question: str) -> Any:
        return httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 400,
            "temperature": 0, "logit_bias": {str(e): -100.0 for e in model.eos_ids}}).json()

    with serving("qwen3", model) as served:
        kv = served.state.kv
        alone = [ask(q) for q in questions]
        assert max(a["usage"]["prompt_tokens"] for a in alone) + 400 <= 512
        kv.growth_step = 64
        kv.limit = kv.footprint.nbytes(512) + kv.footprint.nbytes(256)  # one whole reply and another's start
        refused: list[int] = []
        reserved: list[int] = []
        grow = kv.grow

        def watched(hold: Hold, tokens: int) -> bool:
            granted = grow(hold, tokens)
            refused.extend([tokens] * (not granted))
            reserved.append(kv.reserved)
            return granted

        monkeypatch.setattr(kv, "grow", watched)
        hold_worker_until_queued(model, len(questions), monkeypatch)  # both admitted before either grows
        with ThreadPoolExecutor(len(questions)) as threads:
            together = list(threads.map(ask, questions))
        assert [a["choices"][0]["message"]["content"] for a in together] == \
            [a["choices"][0]["message"]["content"] for a in alone]
        assert [a["usage"]["completion_tokens"] for a in together] == [400, 400]
        assert refused and max(reserved) <= kv.limit
        assert kv.reserved == 0 and kv.paused == 0 and served.state.held()["paused_for_memory"] == 0
    model.close()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "gemma4", "lfm2"])
def test_the_measured_footprint_bounds_what_a_conversation_holds(name: str) -> None:
    model = loaded(name)
    footprint = Footprint(model)
    session = model.chat_session()
    result = session.send("Hello there, how are you today?", config={"max_tokens": 20, "temperature": 0.0})
    tokens = result.report.prompt_tokens + result.report.generated_tokens
    held = session.cache.nbytes
    assert held <= footprint.nbytes(tokens)
    if name == "qwen3":  # full attention only: the estimate is what it holds
        assert footprint.nbytes(tokens) == held


def test_the_footprint_is_measured_in_the_kv_format_the_models_caches_are_made_in() -> None:
    """A server over a model that keeps 8-bit keys and values reserves what those hold, not float32's."""
    float_kv = Footprint(loaded("qwen3"))
    with mlxchat.load_model(FIXTURES / "qwen3", dtype="float32", kv_bits=8, kv_group_size=32) as model:
        footprint = Footprint(model)
        session = model.chat_session()
        result = session.send("Hello there, how are you today?", config={"max_tokens": 20, "temperature": 0.0})
        tokens = result.report.prompt_tokens + result.report.generated_tokens
        assert session.cache.nbytes <= footprint.nbytes(tokens)
        assert footprint.nbytes(4096) < 0.35 * float_kv.nbytes(4096)  # 8-bit in groups of 32: 0.31x, and a tail


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_mtp"])
def test_a_reply_that_decodes_speculatively_reserves_its_drafters_state(name: str) -> None:
    """With a draft model (here the model itself) or an MTP head, what a speculative turn holds (its cache and
    the drafter's state beside it) is within the footprint with the drafter's state, which a reservation of a
    request that sets ``draft_tokens`` counts (and one that does not, not)."""
    model = loaded(name)
    speculative = model.with_draft(model if name == "qwen3" else "mtp", 3)
    footprint = Footprint(speculative)
    assert footprint.draft_layers and not Footprint(loaded("qwen3")).draft_layers
    session = speculative.chat_session()
    result = session.send("Hello there, how are you today?", config={"max_tokens": 20, "temperature": 0.0})
    assert result.report.draft_tokens > 0
    tokens = result.report.prompt_tokens + result.report.generated_tokens
    held = session.cache.nbytes
    assert footprint.nbytes(tokens) < footprint.nbytes(tokens, drafted=True)
    assert held <= footprint.nbytes(tokens, drafted=True)
    if name == "qwen3":  # full attention only: without the draft's cache the estimate is the target's alone
        assert footprint.nbytes(tokens) < held
    budget = KvBudget(speculative, 10**12)
    messages = [{"role": "user", "content": "Hello"}]
    for draft_tokens in (0, 3):
        config = speculative.defaults.merged({"draft_tokens": draft_tokens})
        reservation = asyncio.run(budget.estimate(messages, None, config))
        assert reservation.drafted == bool(draft_tokens)
        assert budget.nbytes(reservation) == footprint.nbytes(reservation.tokens, drafted=bool(draft_tokens))


SYSTEM = " ".join(f"Rule {i}: answer briefly and name your sources." for i in range(30))


def test_the_footprint_of_a_copy_counts_the_prefix_it_reads_apart() -> None:
    """A conversation that copied a long system prompt from another holds what the footprint says it adds
    past that prefix, and the prefix, read where it lies, holds what the footprint says it does."""
    from mlxchat import PromptCachePool
    from mlxchat.cache import KVCache, distinct_nbytes

    model = loaded("qwen3")
    footprint, pool = Footprint(model), PromptCachePool()
    config = {"max_tokens": 8, "temperature": 0.0}
    first = model.chat_session(system=SYSTEM, prefix_cache=pool)
    first.send("Hi", config=config)
    second = model.chat_session(system=SYSTEM, prefix_cache=pool)
    report = second.send("Hello there", config=config).report
    shared, tokens = pool.copied_tokens, report.prompt_tokens + report.generated_tokens
    assert shared >= KVCache.share_from
    added = distinct_nbytes([first.cache.held(), second.cache.held()]) - distinct_nbytes([first.cache.held()])
    assert added == footprint.nbytes(tokens, shared) < footprint.nbytes(tokens)
    prefixes = {id(layer.shared): layer.shared for layer in second.cache.layers}
    assert sum(p.keys.nbytes + p.values.nbytes for p in prefixes.values()) == footprint.prefix_nbytes(shared)
    assert footprint.nbytes(tokens, shared=KVCache.share_from - 1) == footprint.nbytes(tokens)  # copied, not read


def test_requests_that_will_read_one_cached_system_prompt_reserve_it_once() -> None:
    """Behind the server: once a conversation has prefilled a long system prompt, new conversations starting
    with it reserve what they add past it and the prompt once among them, so all are admitted together
    under a limit that four whole reservations would overrun; giving them back frees everything."""
    import mlxchat

    from conftest import fixture_path

    model = mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32")

    def chat(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    questions = ["What is the capital of France?", "Tell me a number", "And of Italy?", "Hello there"]
    with serving("qwen3_chat", model) as served:
        kv = served.state.kv
        config = mlxchat.GenerationConfig(max_tokens=4, temperature=0.0)
        cold = asyncio.run(kv.estimate(chat("Hi"), None, config))
        assert cold.prefix is None and cold.shared == 0 and kv.nbytes(cold) == kv.footprint.nbytes(cold.tokens)
        assert cold.prompt == len(model.render_prompt(chat("Hi"))[1]) == cold.tokens - 4  # the prompt and the reply
        answer = httpx.post(served.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": chat("Hi"), "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200
        reservations = [asyncio.run(kv.estimate(chat(q), None, config)) for q in questions]
        assert len({r.prefix for r in reservations}) == 1 and reservations[0].prefix is not None
        own = [kv.footprint.nbytes(r.tokens, r.shared) for r in reservations]
        assert all(o < kv.footprint.nbytes(r.tokens) for o, r in zip(own, reservations, strict=True))
        kv.limit = sum(own) + kv.footprint.prefix_nbytes(reservations[0].shared)
        assert kv.limit < sum(kv.footprint.nbytes(r.tokens) for r in reservations)

        async def hold_all() -> tuple[int, int]:
            holds = [await asyncio.wait_for(kv.reserve(r), 5) for r in reservations]  # each granted at once
            held = kv.reserved
            for hold in holds:
                await kv.release(hold)
            return held, kv.reserved

        assert asyncio.run(hold_all()) == (kv.limit, 0)
        # the same requests through the server, all at once, under that limit
        with ThreadPoolExecutor(4) as threads:
            answers = list(threads.map(lambda q: httpx.post(served.url + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": chat(q), "max_tokens": 4, "temperature": 0}), questions))
        assert [a.status_code for a in answers] == [200] * 4
        assert min(a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers) > 0
        assert kv.reserved == 0 and kv.waiting == 0 and served.state.queued == 0
    model.close()
