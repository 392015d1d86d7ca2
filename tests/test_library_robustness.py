"""What a library user passes in cannot crash the process or wedge a session (found by a fuzzing pass over the
public API): token ids are checked before any MLX gather (reply log-probabilities, a multimodal prompt's logits),
a model closed while a reply streams ends the stream with an error instead of leaving its reader waiting, an
asyncio reader whose event loop closed mid-reply leaves the model serving the others, a tool's
result that is no valid text becomes an error result, a transcript whose tool results answer no call is refused,
and generation settings that float32 cannot carry are refused or mean what they say."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

import mlxchat
from mlxchat import GenerationConfig, ImageError, InvalidInputError, ModelClosedError, MultimodalPrompt, tool

from conftest import fixture_path


@pytest.fixture(scope="module")
def model():
    model = mlxchat.load_model()
    yield model
    model.close()


def test_reply_log_probabilities_check_their_tokens_and_positions(model) -> None:
    session = model.chat_session()
    session.send("hello there", config={"max_tokens": 4, "temperature": 0})
    cache = session.cache
    vocab = model.config.vocab_size
    for tokens in ([vocab + 7], [-2], [1.5]):
        with pytest.raises(InvalidInputError):
            model.reply_logprobs(cache, 3, tokens)
    for start in (0, -1, len(cache) + 1, 2.5, True):
        with pytest.raises(InvalidInputError, match="start"):
            model.reply_logprobs(cache, start, [1])
    with pytest.raises(InvalidInputError, match="top"):
        model.reply_logprobs(cache, 3, [1], top=-1)
    assert session.send("and again", config={"max_tokens": 4}).finish_reason  # the session goes on


def test_a_multimodal_prompts_ids_are_checked_before_its_logits(model) -> None:
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        model.logits(MultimodalPrompt((1, 10**9)))
    with pytest.raises(InvalidInputError, match="sequence of integers"):
        model.generate(None)  # type: ignore[arg-type]


def test_closing_the_model_ends_the_streams_open_on_it() -> None:
    """The readers of replies streaming when the model is closed get ModelClosedError (they waited for ever);
    the model, closed, refuses new work with it."""
    model = mlxchat.load_model()
    session = model.chat_session()
    events = iter(session.send_stream("hello there", config={"max_tokens": 200, "temperature": 0}))  # 57 tokens
    next(events)
    tokens = model.stream([1, 2, 3], {"max_tokens": 200, "temperature": 0})  # 5 tokens: paced, 3 made at most
    next(tokens)
    model.close()  # (it waits for no reader)
    with pytest.raises(ModelClosedError):
        list(events)
    with pytest.raises(ModelClosedError):
        list(tokens)
    with pytest.raises(ModelClosedError):
        model.generate([1, 2, 3], {"max_tokens": 2})


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the closed loop's pending read
def test_an_asyncio_reader_whose_event_loop_closed_mid_reply_leaves_the_model_serving_the_others(monkeypatch) -> None:
    """The reply could not hand its next item to the closed loop: that failure ended the model's worker thread,
    and every other generation on the model waited for ever."""
    model = mlxchat.load_model(fixture_path("qwen3"), dtype="float32")
    held, queued = threading.Event(), threading.Event()
    start = model.worker.start

    def counted(*args, **kwargs):
        job = start(*args, **kwargs)
        queued.set()
        return job

    monkeypatch.setattr(model.worker, "start", counted)
    model.worker.submit(held.wait)
    loop = asyncio.new_event_loop()
    reading = loop.create_task(anext(aiter(model.chat_session().astream("Hello", config={"max_tokens": 2}))))
    loop.run_until_complete(asyncio.to_thread(queued.wait))  # the reply is queued behind the held worker
    loop.close()
    held.set()  # the reply hands its items (at most 2 steps in) to a closed loop
    generated: list[mlxchat.GenerationResult] = []
    endless = {"max_tokens": 30, "temperature": 0.0, "logit_bias": {e: -100.0 for e in model.eos_ids}}
    other = threading.Thread(target=lambda: generated.append(model.generate([1, 2, 3], endless)), daemon=True)
    other.start()
    other.join(60.0)
    assert generated, "the model's worker stopped: a generation beside the reply never ended"
    assert not reading.done() and len(generated[0].tokens) == 30
    del reading  # what the closed loop left pending goes here, under this test's warning filter
    gc.collect()
    model.close()


def test_a_tool_result_that_is_no_valid_text_is_an_error_the_model_reads(model) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: Name of the city.
        """
        return "sunny \ud800"

    session = model.chat_session(tools=[get_weather], auto_tools=True)
    session.send("What is the weather in Paris?", config={"max_tokens": 60, "temperature": 0})
    results = [m.content for m in session.messages if m.role == "tool"]
    assert results and all(r.startswith("Error: InvalidInputError") and "\ud800" not in r for r in results)
    assert not session.pending_tool_calls
    assert session.send("thanks", config={"max_tokens": 4}).finish_reason


def test_a_transcript_whose_tool_results_answer_no_call_is_refused(model) -> None:
    calls = [{"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}]
    for tail in ([{"role": "tool", "tool_call_id": "zz", "content": "x"}],
                 [{"role": "tool", "tool_call_id": "c1", "content": "x"}, {"role": "tool", "tool_call_id": "c1",
                                                                            "content": "y"}]):
        session = model.chat_session()
        with pytest.raises(InvalidInputError, match="answers no tool call"):
            session.prime_history([{"role": "user", "content": "weather?"},
                                   {"role": "assistant", "tool_calls": calls}, *tail])
    with pytest.raises(InvalidInputError, match="answers no tool call"):
        model.chat_session().prime_history([{"role": "user", "content": "hi"},
                                            {"role": "tool", "tool_call_id": "c9", "content": "x"}])


def test_settings_float32_cannot_carry_are_refused_or_greedy() -> None:
    assert GenerationConfig(temperature=1e-308).temperature == 0.0  # divides no logits: greedy
    with pytest.raises(ValueError, match="temperature"):
        GenerationConfig(temperature=1e308)
    with pytest.raises(ValueError, match="reply_prefix"):
        GenerationConfig(reply_prefix="\ud800")


def test_positions_and_versions_out_of_range_are_invalid_input(model) -> None:
    session = model.chat_session()
    session.send("hello there", config={"max_tokens": 4})
    reply = session.messages[-1]
    for keep in (-1, 99, 1.5, "1"):
        with pytest.raises(InvalidInputError, match="keep"):
            session.rewind(keep)  # type: ignore[arg-type]
    for index in (5, -1, "0"):
        with pytest.raises(InvalidInputError, match="no reply version"):
            session.select_version(reply.id, index)  # type: ignore[arg-type]
    assert session.send("again", config={"max_tokens": 4}).finish_reason


def test_bad_generation_settings_are_the_librarys_errors(model) -> None:
    session = model.chat_session()
    for config in ({"temperature": -1}, {"max_tokens": 0}, {"temperature": float("nan")}, {"no_such": 1}, [], "x"):
        with pytest.raises(InvalidInputError, match="generation settings"):
            session.send("hi", config=config)  # type: ignore[arg-type]
    assert session.messages == [] and session.send("hi", config={"max_tokens": 2}).finish_reason


def test_a_draft_length_out_of_range_is_refused_at_load() -> None:
    with pytest.raises(InvalidInputError, match="draft_tokens"):
        mlxchat.load_model(draft="mtp", draft_tokens=-1)


def test_a_config_that_builds_no_model_is_a_checkpoint_error(tmp_path) -> None:
    import json
    import shutil

    from mlxchat.demo import default_model_path

    folder = tmp_path / "model"
    shutil.copytree(default_model_path(), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(mlxchat.CheckpointError, match="cannot be built"):
        mlxchat.load_model(folder)


def test_one_image_not_in_a_list_is_refused_rather_than_read_a_character_at_a_time(model) -> None:
    session = model.chat_session()
    with pytest.raises(ImageError, match="wrap one image in a list"):
        session.send("hi", images="data:image/png;base64,AAAA")  # type: ignore[arg-type]
    assert not session.messages


def test_a_text_the_tokenizer_gives_up_on_is_invalid_input_and_the_session_goes_on(model) -> None:
    # The tokenizer's regex engine gives up on ten million spaces, and pyo3 raised that as a PanicException (a
    # BaseException, past every `except Exception`).
    session = model.chat_session()
    with pytest.raises(InvalidInputError, match="tokenizer cannot split"):
        session.send("a" + " " * 10_000_000 + "b", config={"max_tokens": 4})
    assert session.messages == []
    assert session.send("hello there", config={"max_tokens": 4}).finish_reason
