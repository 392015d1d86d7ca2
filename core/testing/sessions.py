"""The session contract, as a test class a plugin's tests subclass: on the plugin's fixture model, a
cached turn equals a stateless render of the same visible history token for token, and the cache reports
exactly the reuse it could offer, through multi-turn chats, regenerate, rewind, reset, tool results,
cancel and failures; a hybrid model (layer state that cannot be cut back) returns through snapshots and
never silently re-prefills everything.

    from mlxchat.testing import SessionContract

    class TestLlamaSessions(SessionContract):
        fixture = Path(__file__).parent / "fixtures" / "llama"

Random-weight fixtures neither call tools nor end their turns, so replies run to ``max_tokens``; greedy
decoding with a repetition penalty keeps them varied.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ..messages import ChatMessage
from ..model import GenerativeModel
from ..prompt_cache import common_prefix_length
from ..reply import TextDelta
from ..session import ChatResult, ChatSession
from .fixtures import load_fixture

GREEDY: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0, "repetition_penalty": 1.3}
"""Greedy, short, and with a repetition penalty so that random-weight models do not repeat one token."""
QUESTIONS = ("Hello there", "What is the capital of France?", "And of Italy?", "Thanks, and Spain?",
             "Tell me a number")
SYSTEM = "You are terse."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def template_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {"enable_thinking": config["enable_thinking"]} if "enable_thinking" in config else {}


def prompt_ids(model: GenerativeModel, messages: Sequence[ChatMessage], config: dict[str, Any],
               tools: list[Any] | None = None) -> list[int]:
    """The prompt a stateless run renders for ``messages``."""
    history = [m.template_dict() for m in messages]
    return model.apply_chat_template(history, tools=tools, **template_kwargs(config))  # type: ignore[return-value]


def stateless_tokens(model: GenerativeModel, messages: Sequence[ChatMessage], config: dict[str, Any],
                     tools: list[Any] | None = None) -> list[int]:
    """Greedy reply tokens of a fresh render of ``messages`` on a fresh cache."""
    run = {k: v for k, v in config.items() if k != "enable_thinking"}
    return model.generate(prompt_ids(model, messages, config, tools), run).tokens


def expected_reuse(session: ChatSession, prompt: Sequence[int]) -> int:
    """How many prompt tokens the session's cache can honestly serve, computed from its state."""
    cache = session.cache
    limit = min(common_prefix_length(cache.tokens, prompt), len(prompt) - 1)
    if all(layer.can_trim_to(limit) for layer in cache.layers):
        return limit
    return max([p for p in cache.snapshot_positions if p <= limit], default=0)


def assert_matches_stateless(model: GenerativeModel, session: ChatSession, result: ChatResult,
                             config: dict[str, Any], tools: list[Any] | None = None) -> None:
    """The reply equals a stateless run over the visible history before it, token for token."""
    assert result.tokens == stateless_tokens(model, session.messages[:-1], config, tools), (
        "the cached turn's reply differs from a stateless run over the same history")


def send_checked(model: GenerativeModel, session: ChatSession, text: str, config: dict[str, Any] = GREEDY,
                 tools: list[Any] | None = None) -> ChatResult:
    """``session.send(text)``, checking that it reused exactly what its cache could offer and replied as a
    stateless run would."""
    history = [*session.messages, ChatMessage(role="user", content=text)]
    expected = expected_reuse(session, prompt_ids(model, history, config, tools))
    result = session.send(text, config=config)
    assert result.report.cached_prompt_tokens == expected, (
        f"the turn reused {result.report.cached_prompt_tokens} prompt tokens; its cache held {expected}")
    assert_matches_stateless(model, session, result, config, tools)
    return result


class SessionContract:
    """Session tests every architecture must pass. Subclass it (as ``Test...``) and set ``fixture`` to a
    fixture folder, or override the ``fixture_folder`` fixture (e.g. to parametrize over several)."""

    fixture: ClassVar[str | os.PathLike[str] | None] = None

    @pytest.fixture
    def fixture_folder(self) -> Path:
        if self.fixture is None:
            pytest.fail(f"{type(self).__name__} names no fixture folder: set its `fixture` attribute")
        return Path(self.fixture)

    @pytest.fixture
    def model(self, fixture_folder: Path) -> GenerativeModel:
        return load_fixture(fixture_folder)

    @pytest.mark.parametrize("thinking", [True, False])
    def test_multi_turn_equals_stateless_and_reuses_the_previous_turns(self, model: GenerativeModel,
                                                                        thinking: bool) -> None:
        config = {**GREEDY, "enable_thinking": thinking}
        session = model.chat_session(system=SYSTEM)
        previous_reply_start = 0
        for question in QUESTIONS:
            result = send_checked(model, session, question, config)
            # at least the conversation up to where the previous reply started is served from the cache
            assert result.report.cached_prompt_tokens >= previous_reply_start
            history = [m.template_dict() for m in session.messages[:-1]]
            previous_reply_start = len(model.apply_chat_template(history, add_generation_prompt=False,
                                                                 enable_thinking=thinking))
        assert len(session.messages) == 1 + 2 * len(QUESTIONS)

    @pytest.mark.parametrize("thinking", [True, False])
    def test_each_turn_reuses_up_to_where_its_render_parts_from_the_last_prompt(self, model: GenerativeModel,
                                                                                thinking: bool) -> None:
        """What mlx-lm's server keeps (the shared start of the generation prompt, say) a session keeps too,
        even where layers cannot be cut back: it snapshots where the next render will part from the prompt."""
        config = {**GREEDY, "enable_thinking": thinking}
        session = model.chat_session(system=SYSTEM)
        previous: list[int] = []
        for question in QUESTIONS[:4]:
            prompt = prompt_ids(model, [*session.messages, ChatMessage(role="user", content=question)], config)
            result = session.send(question, config=config)
            if previous:
                parted = min(common_prefix_length(previous, prompt), len(previous))
                assert result.report.cached_prompt_tokens >= parted, (
                    f"the turn reused {result.report.cached_prompt_tokens} prompt tokens; the last prompt and "
                    f"this one agree on {parted}")
            previous = prompt

    def test_regenerate_prefills_only_the_last_prompt_token(self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        send_checked(model, session, QUESTIONS[0])
        first = send_checked(model, session, QUESTIONS[1])
        result = session.regenerate(config=GREEDY)
        assert result.report.cached_prompt_tokens == first.report.prompt_tokens - 1
        assert result.report.prefilled_tokens == 1
        assert result.tokens == first.tokens  # greedy: the same reply again
        assert_matches_stateless(model, session, result, GREEDY)

    def test_rewind_to_an_earlier_turn_reuses_up_to_that_turn(self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        for question in QUESTIONS[:3]:
            send_checked(model, session, question)
        session.rewind(3)  # system, first question, first reply
        result = send_checked(model, session, "Something else entirely")
        assert result.report.cached_prompt_tokens > 0

    def test_restore_checkpoint_then_a_turn_equals_a_fresh_session_and_reuses_the_cache(
            self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        for question in QUESTIONS[:3]:
            send_checked(model, session, question)
        kept = session.messages[2]  # the first reply
        assert kept.id is not None
        session.restore_checkpoint(kept.id)
        assert [m.id for m in session.messages] == [m.id for m in session.messages[:3]]
        result = send_checked(model, session, "Something else entirely")  # reuse == what the cache held
        assert result.report.cached_prompt_tokens > 0
        fresh = model.chat_session()
        fresh.prime_history(session.messages[:-2])
        again = fresh.send("Something else entirely", config=GREEDY)
        assert again.tokens == result.tokens

    def test_versions_survive_round_trips_and_switching_back_reuses_the_cache(self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        send_checked(model, session, QUESTIONS[0])
        send_checked(model, session, QUESTIONS[1])
        before = session.messages[-1]
        assert before.id is not None
        other = session.regenerate(config={**GREEDY, "temperature": 1.0, "seed": 7})
        message = session.messages[-1]
        assert message.id == before.id and message.selected_version == 1
        assert [v.content for v in message.versions or []] == [before.content, message.content]
        assert (message.versions or [])[1].report == other.report
        copy = model.chat_session()
        copy.prime_history([m.model_dump() for m in session.messages])
        assert copy.messages == session.messages  # ids, times and versions come back from plain dicts
        session.select_version(before.id, 0)
        assert session.messages[-1].content == before.content
        asked = prompt_ids(model, session.messages[:-1], GREEDY)
        result = send_checked(model, session, QUESTIONS[2])  # reuse == what the cache held
        now = prompt_ids(model, session.messages[:-1], GREEDY)
        # switching back costs only what differs from the turn both versions answered (snapshots there)
        assert result.report.cached_prompt_tokens >= min(common_prefix_length(asked, now), len(asked) - 1)

    def test_hybrid_state_returns_through_snapshots(self, model: GenerativeModel) -> None:
        """Layer state that cannot be cut back (conv, recurrent, sliding window) comes back from snapshots
        taken at turn boundaries: a later turn, a regenerate and a rewind all reuse the cache."""
        session = model.chat_session(system=SYSTEM)
        if not session.cache.needs_snapshots:
            pytest.skip("every layer cache of this architecture can be cut back: no snapshots needed")
        send_checked(model, session, QUESTIONS[0])
        assert session.cache.snapshot_positions, "no snapshot was taken during a turn"
        assert send_checked(model, session, QUESTIONS[1]).report.cached_prompt_tokens > 0
        assert session.regenerate(config=GREEDY).report.prefilled_tokens < len(session.cache.tokens)
        send_checked(model, session, QUESTIONS[2])
        session.rewind(3)
        assert send_checked(model, session, "Something else entirely").report.cached_prompt_tokens > 0

    def test_tool_result_continuation_from_a_primed_transcript(self, model: GenerativeModel) -> None:
        if not model.supports_tools:
            pytest.skip("the chat template takes no tools, or the family has no tool-call format")
        session = model.chat_session(system=SYSTEM, tools=TOOLS)
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": {"city": "Paris"}}}
        session.prime_history([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ])
        session.add_tool_result("call_1", "sunny")
        first = session.start_from_history(config=GREEDY)
        assert first.report.cached_prompt_tokens == 0
        assert_matches_stateless(model, session, first, GREEDY, TOOLS)
        second = send_checked(model, session, "And tomorrow?", GREEDY, TOOLS)
        assert second.report.cached_prompt_tokens > 0

    def test_cancel_mid_stream_keeps_what_streamed_and_stays_consistent(self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        send_checked(model, session, QUESTIONS[0])
        stream = session.send_stream(QUESTIONS[1], config={**GREEDY, "max_tokens": 30})
        seen = []
        for event in stream:
            seen.append(event)
            if len(seen) == 3:
                break
        last = session.messages[-1]
        assert last.role == "assistant"
        assert session.report is not None and session.report.finish_reason == "cancelled"
        assert (last.content or "") == "".join(e.text for e in seen if isinstance(e, TextDelta))
        send_checked(model, session, QUESTIONS[2])

    def test_failure_keeps_the_user_turn_and_retry_equals_stateless(self, model: GenerativeModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
        from ..errors import MlxchatError

        session = model.chat_session(system=SYSTEM)
        send_checked(model, session, QUESTIONS[0])
        target = type(getattr(model.module, "model", model.module))  # the decoder, which every path calls
        original = target.__call__
        calls = {"n": 0}

        def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected failure")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(target, "__call__", failing)
        with pytest.raises(MlxchatError, match="injected failure"):
            session.send(QUESTIONS[1], config=GREEDY)
        monkeypatch.undo()
        assert session.messages[-1].role == "user" and session.messages[-1].content == QUESTIONS[1]
        result = session.respond(config=GREEDY)
        assert_matches_stateless(model, session, result, GREEDY)

    def test_reset_then_send_equals_stateless(self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        send_checked(model, session, QUESTIONS[0])
        send_checked(model, session, QUESTIONS[1])
        session.reset()
        assert [m.role for m in session.messages] == ["system"] and session.report is None
        result = send_checked(model, session, QUESTIONS[2])
        assert result.report.cached_prompt_tokens > 0  # the system prompt is served from the cache

    def test_prime_and_start_from_history_then_continue(self, model: GenerativeModel) -> None:
        session = model.chat_session(system=SYSTEM)
        session.prime_history([
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello. What do you need?"},
            {"role": "user", "content": "A fact"},
        ])
        result = session.start_from_history(config=GREEDY)
        assert result.report.cached_prompt_tokens == 0
        assert_matches_stateless(model, session, result, GREEDY)
        send_checked(model, session, "Another one")

    def test_a_saved_session_resumes_as_if_never_interrupted(self, model: GenerativeModel, tmp_path: Path) -> None:
        """``save()`` then ``ChatSession.load()``: the resumed session holds the same transcript, tokens and
        snapshots, and its next turn reuses exactly what the uninterrupted session's does and replies the
        same, token for token."""
        session = model.chat_session(system=SYSTEM)
        for question in QUESTIONS[:2]:
            send_checked(model, session, question)
        session.save(tmp_path / "chat.session")
        resumed = ChatSession.load(model, tmp_path / "chat.session")
        assert resumed.messages == session.messages and resumed.report == session.report
        assert resumed.cache.tokens == session.cache.tokens
        assert resumed.cache.snapshot_positions == session.cache.snapshot_positions
        again = send_checked(model, resumed, QUESTIONS[2])
        uninterrupted = send_checked(model, session, QUESTIONS[2])
        assert again.tokens == uninterrupted.tokens
        assert again.report.cached_prompt_tokens == uninterrupted.report.cached_prompt_tokens > 0

    def test_two_interleaved_sessions_keep_their_own_reuse(self, model: GenerativeModel) -> None:
        first = model.chat_session(system=SYSTEM)
        second = model.chat_session(system="You are verbose and kind.")
        for question in QUESTIONS[:3]:
            a = send_checked(model, first, question)
            b = send_checked(model, second, question)
            if len(first.messages) > 3:
                assert a.report.cached_prompt_tokens > 0 and b.report.cached_prompt_tokens > 0
