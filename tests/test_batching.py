"""Sequences decode together: concurrent generations, several sessions driven from threads, server requests
and ``generate_batch`` share each decode step (one pass over the weights), and every sequence gets exactly
what it gets alone, whoever leaves early; a failed step fails only the generations in it. A long prompt goes in
a budget of tokens a step while running streams decode a token a step; waiting prompts go in fewest tokens
left first, a long one never passed over for ever, one that shares an earlier one's prefix right behind it.
(That one batched
step equals each row alone, on every architecture, is in the conformance kit: ``batched_decoding_problems``.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import mlxchat
from mlxchat import GenerationError, batching, worker
from mlxchat.batching import DecodeRow, PrefillChunk
from mlxchat.testing import GREEDY
from mlxchat.worker import END, Cancelled

from conftest import fixture_path, hold_worker_until_queued

PROMPTS = ["Hello there", "What is the capital of France?", "Tell me a number", "And of Italy?"]


@pytest.fixture
def steps(monkeypatch) -> list[int]:
    """The number of rows of every decode step the worker runs."""
    sizes: list[int] = []
    real = DecodeRow.run_together.__func__  # type: ignore[attr-defined]

    def counted(cls, rows):
        sizes.append(len(rows))
        return real(cls, rows)

    monkeypatch.setattr(DecodeRow, "run_together", classmethod(counted))
    return sizes


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "lfm2", "gemma4"])
def test_generate_batch_equals_each_prompt_alone_and_decodes_together(name: str, steps: list[int]) -> None:
    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    config = {**GREEDY, "max_tokens": 16}
    alone = [model.generate(p, config) for p in PROMPTS]
    steps.clear()
    together = model.generate_batch(PROMPTS, config)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    # Offline batch work: every prompt is prefilled first, then all four decode in every step until one ends,
    # whatever the machine's load (no reader's pace decides which rows share a step).
    ends = sorted(len(r.tokens) + (r.finish_reason == "stop") for r in alone)
    assert steps[: ends[0] - 1] == [len(PROMPTS)] * (ends[0] - 1)
    assert sorted(steps, reverse=True) == steps
    model.close()


def test_sessions_driven_from_threads_decode_together_and_equal_sessions_alone(steps: list[int],
                                                                               monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("qwen3_5"), dtype="float32")
    config = {**GREEDY, "max_tokens": 20}

    def conversation() -> list[list[int]]:
        session = model.chat_session(system="Be terse.")
        return [session.send(q, config=config).tokens for q in ("Hello there", "And of Italy?")]

    expected = conversation()
    hold_worker_until_queued(model, 4, monkeypatch)  # the four first turns reach the worker together
    steps.clear()
    results: list[list[list[int]]] = []
    threads = [threading.Thread(target=lambda: results.append(conversation())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [expected] * 4
    assert max(steps) > 1  # the sessions' steps ran together
    model.close()


def test_a_failed_step_fails_the_generations_in_it_and_the_model_goes_on(monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    config = {**GREEDY, "max_tokens": 12}
    alone = [model.generate(p, config).tokens for p in PROMPTS[:3]]
    real, calls = batching.batched_last_logits, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(batching, "batched_last_logits", failing)
    with pytest.raises(GenerationError, match="injected failure"):
        model.generate_batch(PROMPTS[:3], config)
    monkeypatch.undo()
    assert [r.tokens for r in model.generate_batch(PROMPTS[:3], config)] == alone
    model.close()


def test_a_stream_left_mid_batch_stops_alone_and_the_others_finish_as_alone(steps: list[int],
                                                                            monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("lfm2"), dtype="float32")
    config = {**GREEDY, "max_tokens": 16}
    alone = [model.generate(p, config).tokens for p in PROMPTS[1:]]
    hold_worker_until_queued(model, len(PROMPTS), monkeypatch)  # the four streams start together
    steps.clear()
    results: dict[int, list[int]] = {}
    left: list[int] = []

    def full(index: int) -> None:
        results[index] = [c.token for c in model.stream(PROMPTS[index], config) if c.token is not None]

    def leaving() -> None:
        for chunk in model.stream(PROMPTS[0], config):
            left.append(chunk.token)
            if len(left) == 3:
                break

    threads = [threading.Thread(target=leaving)] + [threading.Thread(target=full, args=(i,)) for i in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(left) == 3 and [results[i] for i in (1, 2, 3)] == alone
    assert max(steps) > 1
    model.close()


def test_concurrent_server_requests_decode_together(steps: list[int], monkeypatch) -> None:
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from server_support import serving

    model = mlxchat.load_model(fixture_path("qwen3_chat"), dtype="float32")
    with serving("qwen3_chat", model) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def ask(question: str) -> str | None:
            messages = [{"role": "user", "content": question}]
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
            return reply.choices[0].message.content

        alone = [ask(q) for q in PROMPTS]
        hold_worker_until_queued(model, len(PROMPTS), monkeypatch)  # the four requests reach the worker together
        steps.clear()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(ask, PROMPTS))
    assert together == alone
    assert max(steps) > 1
    model.close()


class Inline:
    """Generations on a model's worker whose reader takes every item on the worker itself, as it comes: no
    reader's pace decides which steps a generation joins, so the steps (logged by :func:`logged_steps`) are
    the worker's alone and the same on a loaded machine. ``then`` callbacks start more generations from the
    worker after a generation's ``n``-th token."""

    def __init__(self, model: mlxchat.GenerativeModel):
        self.model = model
        self.tokens: dict[str, list[int]] = {}
        self.caches: dict[str, object] = {}
        self.errors: list[BaseException] = []
        self.running = 0
        self.done = threading.Event()

    def start(self, name: str, prompt: list[int], config: dict, then: dict[int, object] | None = None) -> None:
        """Start a generation (from any thread; from the worker itself inside a ``then`` callback)."""
        if not self.model.worker.on_worker:
            self.model.worker.run(self.start, name, prompt, config, then)
            return
        cache = self.model.make_prompt_cache()
        merged = self.model.defaults.merged(config)
        self.tokens[name], self.caches[name] = [], cache
        job: list = []
        self.running += 1

        def put(item) -> None:
            try:
                item = job[0].received(item)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                self.errors.append(exc)
                return
            if item is END:
                self.running -= 1
                if not self.running:
                    self.done.set()
            elif item.token is not None:
                self.tokens[name].append(item.token)
                if then and len(self.tokens[name]) in then:
                    then[len(self.tokens[name])]()  # type: ignore[operator]

        job.append(self.model.worker.start(
            lambda cancel: self.model.run_generation(prompt, cache, merged, cancel), Cancelled(), put))

    def wait(self) -> None:
        assert self.done.wait(600) and not self.errors, self.errors


@pytest.fixture
def logged_steps(monkeypatch) -> list[list[tuple[str, object, int]]]:
    """Every step the worker runs, as ``(kind, cache, tokens)`` per item: ``("decode", cache, 1)`` for a decode
    row, ``("prefill", cache, n)`` for a prefill chunk that ran ``n`` prompt tokens."""
    log: list[list[tuple[str, object, int]]] = []
    real = worker.run_step

    def logged(items):
        real(items)
        log.append([("decode", i.cache, 1) if isinstance(i, DecodeRow) else ("prefill", i.prefill.cache, i.ran)
                    for i in items if isinstance(i, DecodeRow | PrefillChunk)])

    monkeypatch.setattr(worker, "run_step", logged)
    return log


def test_a_long_prompt_goes_in_a_budget_a_step_while_a_running_stream_decodes_a_token_a_step(logged_steps) -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32", prefill_step_budget=8)
    short, long = model.encode("Hello there"), [(7 * i) % 300 + 10 for i in range(100)]
    config = {**GREEDY, "max_tokens": 40}
    alone = {name: model.generate(prompt, config).tokens for name, prompt in (("short", short), ("long", long))}
    logged_steps.clear()
    run = Inline(model)
    run.start("short", short, config, then={2: lambda: run.start("long", long, config)})
    run.wait()
    assert run.tokens == alone  # each stream as alone
    a, b = run.caches["short"], run.caches["long"]
    chunks = [(i, n) for i, step in enumerate(logged_steps) for kind, cache, n in step
              if kind == "prefill" and cache is b and n]
    assert len(chunks) == -(-len(long) // 8) and all(n <= 8 for _, n in chunks)  # the budget, a step at a time
    # Every step that prefilled the long prompt also decoded a token of the running stream.
    assert all(("decode", a, 1) in logged_steps[i] for i, _ in chunks)
    assert any({("decode", a, 1), ("decode", b, 1)} <= set(step) for step in logged_steps)  # then both decode
    model.close()


@pytest.mark.parametrize(("name", "ragged"), [("qwen3", True), ("lfm2", True), ("qwen3_5", True), ("gemma4", True),
                                             ("lfm2", False)])
def test_a_step_is_one_pass_over_the_weights_on_a_model_that_runs_ragged(name: str, ragged: bool,
                                                                         logged_steps, monkeypatch) -> None:
    """Decode rows and the prompt chunks of two waiting prompts: one forward pass a step on a model whose
    layers take RaggedRows (every built-in plugin's); on the others (a third-party plugin that does not say
    it does), the rows' pass and one for each prompt chunk."""
    model = mlxchat.load_model(fixture_path(name), dtype="float32", prefill_step_budget=16)
    assert model.module.runs_ragged
    monkeypatch.setattr(model.module, "runs_ragged", ragged)
    prompts = {"short": model.encode("Hello there"), "long": [(7 * i) % 300 + 10 for i in range(60)],
               "next": [(3 * i) % 200 + 12 for i in range(9)]}
    config = {**GREEDY, "max_tokens": 24}
    alone = {n: model.generate(prompt, config).tokens for n, prompt in prompts.items()}
    passes: list[int] = []
    decoder = type(model.module.model)
    forward = decoder.__call__
    monkeypatch.setattr(decoder, "__call__", lambda self, *a, **k: (passes.append(1), forward(self, *a, **k))[1])
    per_step: list[int] = []
    run_step = worker.run_step

    def counted(items):
        passes.clear()
        run_step(items)
        per_step.append(len(passes))

    monkeypatch.setattr(worker, "run_step", counted)
    logged_steps.clear()
    run = Inline(model)
    later = lambda: (run.start("long", prompts["long"], config), run.start("next", prompts["next"], config))  # noqa: E731
    run.start("short", prompts["short"], config, then={2: later})
    run.wait()
    assert run.tokens == alone  # each stream as alone
    mixed = [(count, [kind for kind, _, n in step if n]) for count, step in zip(per_step, logged_steps, strict=True)
             if any(kind == "prefill" and n for kind, _, n in step) and any(kind == "decode" for kind, *_ in step)]
    assert mixed  # the long prompt went in beside the short one's decoding
    for count, kinds in mixed:  # (a hybrid's prompt may also be split where it snapshots its state)
        assert count == 1 if ragged else count >= kinds.count("prefill") + 1
    model.close()


@pytest.mark.parametrize("name", ["lfm2", "qwen3_5"])
def test_a_one_token_prompt_goes_in_beside_the_decode_rows_of_a_hybrid(name: str, logged_steps) -> None:
    """A one-token prompt's chunk is a prompt span, not one of the step's decode rows (which run as one batch of
    their states): its fresh cache holds no state yet."""
    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    prompts = {"a": model.encode("Hello there"), "b": model.encode("Good morning"), "one": [42]}
    config = {**GREEDY, "max_tokens": 8}
    alone = {n: model.generate(prompt, config).tokens for n, prompt in prompts.items()}
    logged_steps.clear()
    run = Inline(model)
    run.start("a", prompts["a"], config)
    run.start("b", prompts["b"], config, then={2: lambda: run.start("one", prompts["one"], config)})
    run.wait()
    assert run.tokens == alone
    assert any(("prefill", run.caches["one"], 1) in step and sum(kind == "decode" for kind, *_ in step) >= 2
               for step in logged_steps)
    model.close()


def test_a_step_that_decodes_nothing_takes_a_whole_prefill_step_on_a_model_that_runs_ragged(logged_steps) -> None:
    """The budget bounds what a step adds beside decoding streams; a prompt alone goes in as fast as one
    prefill (its chunks of the budget run as one pass of ``prefill_step`` tokens)."""
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32", prefill_step_budget=8)
    prompt = [(7 * i) % 300 + 10 for i in range(60)]
    config = {**GREEDY, "max_tokens": 4, "prefill_step": 32}
    with mlxchat.load_model(fixture_path("qwen3"), dtype="float32") as other:
        alone = other.generate(prompt, config).tokens
    logged_steps.clear()
    assert model.generate(prompt, config).tokens == alone
    assert [n for step in logged_steps for kind, _, n in step if kind == "prefill"] == [32, 28]
    model.close()


@pytest.mark.parametrize("idle_prompts", [4, 2])
def test_prompts_arriving_together_go_in_together_each_as_fast_as_alone(logged_steps, monkeypatch,
                                                                        idle_prompts: int) -> None:
    """A step that decodes nothing takes a prefill step of each of IDLE_PROMPTS waiting prompts (the fewest tokens
    left first): a burst starts decoding together."""
    monkeypatch.setattr(batching, "IDLE_PROMPTS", idle_prompts)
    model = mlxchat.load_model(fixture_path("lfm2"), dtype="float32", prefill_step_budget=16)
    prompts = {f"p{j}": [(5 * i + j) % 200 + 10 for i in range(20 + 5 * j)] for j in range(4)}
    config = {**GREEDY, "max_tokens": 6, "prefill_step": 16}
    alone = {name: model.generate(prompt, config).tokens for name, prompt in prompts.items()}
    logged_steps.clear()
    run = Inline(model)
    model.worker.run(lambda: [run.start(name, prompt, config) for name, prompt in reversed(prompts.items())])
    run.wait()
    assert run.tokens == alone
    names = {id(cache): name for name, cache in run.caches.items()}
    first = {names[id(cache)]: n for kind, cache, n in logged_steps[0] if kind == "prefill" and n}
    assert first == {f"p{j}": 16 for j in range(idle_prompts)}  # each its own chunk, the shortest ones
    assert all(n <= 16 for step in logged_steps for kind, _, n in step if kind == "prefill")
    if idle_prompts == 4:  # no prompt is done after the first step: the second takes a chunk of each too
        assert [kind for kind, _, _ in logged_steps[1]] == ["prefill"] * 4
    model.close()


def test_a_prompt_alone_on_an_idle_worker_takes_a_budget_larger_than_its_prefill_step(logged_steps) -> None:
    model = mlxchat.load_model(fixture_path("lfm2"), dtype="float32", prefill_step_budget=64)
    prompt = [(5 * i) % 200 + 10 for i in range(64)]
    model.generate(prompt, {**GREEDY, "max_tokens": 2, "prefill_step": 16})
    assert [n for kind, _, n in logged_steps[0] if kind == "prefill"] == [64]  # what a busy step would give it
    model.close()


def test_generations_sent_from_threads_close_together_start_in_one_step(logged_steps, monkeypatch) -> None:
    monkeypatch.setattr(worker, "GATHER_QUIET", 2.0)  # (2 ms by default: wide here, so no thread is ever late)
    monkeypatch.setattr(worker, "GATHER_AT_MOST", 5.0)
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    prompts = [[(5 * i + j) % 200 + 10 for i in range(12 + j)] for j in range(4)]
    config = {**GREEDY, "max_tokens": 4}
    alone = [model.generate(prompt, config).tokens for prompt in prompts]
    caches = [model.make_prompt_cache() for _ in prompts]
    logged_steps.clear()
    with ThreadPoolExecutor(len(prompts)) as threads:
        futures = []
        for prompt, cache in zip(prompts, caches, strict=True):
            futures.append(threads.submit(model.generate, prompt, config, cache=cache))
            time.sleep(0.01)  # each sent after the worker took the one before
        assert [future.result().tokens for future in futures] == alone
    first = next(step for step in logged_steps if any(kind == "prefill" for kind, _, _ in step))
    assert {id(cache) for kind, cache, _ in first if kind == "prefill"} == {id(cache) for cache in caches}
    started = time.perf_counter()
    model.worker.run(lambda: None)  # a plain job does not wait for others (gathering would hold it 2 s)
    assert time.perf_counter() - started < 1.0
    model.close()


def test_waiting_prompts_go_in_fewest_tokens_left_first_within_the_budget(logged_steps, monkeypatch) -> None:
    monkeypatch.setattr(batching, "IDLE_PROMPTS", 1)  # a step that decodes nothing takes one prefill step in all
    model = mlxchat.load_model(fixture_path("lfm2"), dtype="float32", prefill_step_budget=16)
    first, second = [(5 * i) % 200 + 10 for i in range(40)], [(3 * i) % 200 + 12 for i in range(30)]
    config = {**GREEDY, "max_tokens": 6, "prefill_step": 16}  # a step that decodes nothing takes a prefill step
    alone = {name: model.generate(prompt, config).tokens for name, prompt in (("first", first), ("second", second))}
    logged_steps.clear()
    run = Inline(model)

    def both() -> None:
        run.start("first", first, config)
        run.start("second", second, config)

    model.worker.run(both)  # both wait for the same steps
    run.wait()
    assert run.tokens == alone
    order = [name for step in logged_steps for kind, cache, n in step if kind == "prefill" and n
             for name in run.caches if run.caches[name] is cache]
    assert order == sorted(order, key=["second", "first"].index)  # the first, longer, waits until the second is in
    assert all(sum(n for kind, _, n in step if kind == "prefill") <= 16 for step in logged_steps)
    model.close()


def test_eight_sessions_sending_from_their_own_threads_at_once_decode_together_as_each_alone(
        steps: list[int], monkeypatch) -> None:
    model = mlxchat.load_model(fixture_path("qwen3_5"), dtype="float32")
    config = {**GREEDY, "max_tokens": 12}
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(8)]
    alone = [model.chat_session(system="Be terse.").send(q, config=config).tokens for q in questions]
    sessions = [model.chat_session(system="Be terse.") for _ in questions]
    # "at once": the worker goes on when all eight turns are queued behind its job
    hold_worker_until_queued(model, len(questions), monkeypatch)
    steps.clear()
    with ThreadPoolExecutor(len(sessions)) as threads:
        together = list(threads.map(lambda s, q: s.send(q, config=config).tokens, sessions, questions))
    assert together == alone
    assert steps[0] == len(sessions)  # all eight prompts went in in one step, then all eight rows decoded at once
    assert len(steps) < sum(len(t) for t in alone) - len(sessions)  # fewer passes than tokens: rows shared them
    model.close()


def _waiting(model: mlxchat.GenerativeModel, prompt: list[int], waited: int = 0) -> PrefillChunk:
    plan = model.make_prompt_cache().start_prefill(model.module, prompt, step=16, logits=True)
    return PrefillChunk(plan, budget=64, idle=512, waited=waited)


def test_a_long_prompt_waits_behind_shorter_ones_only_a_bounded_number_of_steps() -> None:
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    document, chat = list(range(10, 1010)), list(range(400, 500))
    assert [len(i.prefill.ids) for i in PrefillChunk.in_turn([_waiting(model, document), _waiting(model, chat)])] \
        == [100, 1000]
    # each step it waited counts as a step's budget (64) fewer: after 15 steps 1000 - 15 * 64 < 100
    assert [len(i.prefill.ids) for i in PrefillChunk.in_turn([_waiting(model, document, 14), _waiting(model, chat)])] \
        == [100, 1000]
    assert [len(i.prefill.ids) for i in PrefillChunk.in_turn([_waiting(model, document, 15), _waiting(model, chat)])] \
        == [1000, 100]
    model.close()


def test_a_prompt_whose_next_tokens_an_earlier_one_computes_goes_right_behind_it() -> None:
    """Agents sharing a system prompt: the later one waits behind the one computing it, to copy it from the pool,
    even when its own question is shorter than that one's; a shorter unrelated prompt still goes first."""
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    system = list(range(10, 110))
    first, unrelated, second = _waiting(model, system + [7] * 50), _waiting(model, list(range(200, 260))), \
        _waiting(model, system + [9] * 10)
    assert first.prefill.starts_like(second.prefill.ids, 100) and not first.prefill.starts_like(second.prefill.ids, 101)
    assert not unrelated.prefill.starts_like(system, 1)
    assert PrefillChunk.in_turn([first, unrelated, second]) == [unrelated, first, second]
    assert PrefillChunk.in_turn([second, unrelated, first]) == [unrelated, second, first]
    model.close()


class Bound:
    """A cache's growth bound (:class:`~mlxchat.prompt_cache.Growth`, what a server's admission gives each
    request): ``tokens`` at most until opened; it notes that a request past it was refused."""

    def __init__(self, tokens: int):
        self.tokens, self.opened, self.refused = tokens, threading.Event(), threading.Event()

    def allow(self, tokens: int) -> bool:
        if tokens <= self.tokens or self.opened.is_set():
            return True
        self.refused.set()
        return False

    def wait(self, seconds: float) -> None:
        self.opened.wait(seconds)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_a_reply_whose_cache_may_not_grow_sits_out_the_steps_and_goes_on_as_alone(name: str) -> None:
    """A generation whose cache's bound refuses to grow waits where it is, its cache kept, while other
    generations run; once let go it ends as it would have alone. Cancelled while it waits, it ends there and
    the session goes on as if the reply had been cut there."""
    model = mlxchat.load_model(fixture_path(name), dtype="float32")
    config = {**GREEDY, "max_tokens": 24, "logit_bias": {e: -100.0 for e in model.eos_ids}}
    expected = model.chat_session().send(PROMPTS[0], config=config)
    prompt = expected.report.prompt_tokens
    other = model.generate(PROMPTS[1], config)

    session = model.chat_session()
    bound = session.cache.growth = Bound(prompt + 10)
    results: list[mlxchat.ChatResult] = []
    sending = threading.Thread(target=lambda: results.append(session.send(PROMPTS[0], config=config)))
    sending.start()
    assert bound.refused.wait(60)
    assert len(session.cache) == prompt + 10 and not results  # it waits, holding what it was let hold
    assert model.generate(PROMPTS[1], config).tokens == other.tokens  # the model goes on meanwhile
    bound.opened.set()
    sending.join(60)
    assert results[0].tokens == expected.tokens and results[0].finish_reason == "length"

    session = model.chat_session()
    bound = session.cache.growth = Bound(prompt + 10)
    stream = session.send_stream(PROMPTS[0], config=config)
    reading = threading.Thread(target=lambda: list(stream))
    reading.start()
    assert bound.refused.wait(60)
    stream.cancel()
    reading.join(60)
    cut = stream.result
    assert cut is not None and cut.finish_reason == "cancelled" and cut.tokens == expected.tokens[: len(cut.tokens)]
    session.cache.growth = None
    follow = session.send(PROMPTS[1], config=config)
    fresh = model.chat_session()
    fresh.prime_history(session.messages[:-1])
    assert fresh.start_from_history(config=config).tokens == follow.tokens
    model.close()
