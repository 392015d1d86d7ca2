"""What every generating endpoint shares: the model-name check, tool choice turned into a forced reply
prefix, and :class:`Turn`, one request's turn over a pooled prompt cache.

Each endpoint (chat.completions, Responses, Anthropic Messages) only translates: its request into a
conversation of OpenAI-style chat messages, tools and a generation config, and the turn's events into its
own wire format. The cache, the session, ``parallel_tool_calls`` and log-probabilities are handled here
once; the request's life around its turn (admission, disconnects, errors, release) in
:mod:`mlxchat.server.lifecycle`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ContextLengthError, MlxchatError, TemplateError
from ..generation import GenerationConfig, GenerationReport
from ..messages import ChatMessage
from ..model import GenerativeModel
from ..prompt_cache import PromptCache
from ..reply import TextDelta, ThinkingDelta, ToolCallEvent
from ..session import ChatResult, ChatSession, ChatStream, ContextPolicy, Done, StreamEvent
from ..session_state import check_tool_answers
from .admission import Hold
from .errors import ApiError

if TYPE_CHECKING:
    from .state import ServerState

Messages = list[dict[str, Any]]


def check_model(requested: str | None, served: str, kind: str = "invalid_request_error") -> None:
    """A request naming a model is refused (404 ``model_not_found``) unless it names the one served."""
    if requested is not None and requested != served:
        raise ApiError(404, f"the model {requested!r} does not exist here; this server serves {served!r}", kind,
                       code="model_not_found", param="model")


@dataclass(frozen=True)
class ToolChoice:
    """How a reply may use the tools: ``auto`` (the model decides), ``none`` (no tools offered),
    ``required`` (some call), ``function`` (a call of ``name``)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None

    @property
    def library(self) -> Any:
        """The ``tool_choice`` a :class:`~mlxchat.session.ChatSession` takes."""
        return {"type": "function", "function": {"name": self.name}} if self.mode == "function" else self.mode


def tool_setup(model: GenerativeModel, messages: Messages, tools: list[dict[str, Any]] | None, choice: ToolChoice,
               config: GenerationConfig) -> tuple[list[dict[str, Any]] | None, GenerationConfig]:
    """The tools to offer and the config that makes the reply honour ``choice``. A format whose parser gives
    its call grammar is constrained by the session (the turn passes it :attr:`ToolChoice.library`); for the
    others, ``required`` and a named function make the reply open a call in the family's markup
    (:meth:`ToolCallParser.forced_prefix`), after the model's reasoning when the reply may reason
    (``GenerationConfig.reply_prefix_after``)."""
    if not tools and choice.mode in ("required", "function"):
        raise ApiError(400, f"tool_choice {choice.name or choice.mode!r} needs tools", param="tool_choice")
    if not tools or choice.mode == "none":
        return None, config
    names = [tool["function"]["name"] for tool in tools]
    if choice.mode == "function" and choice.name not in names:
        raise ApiError(400, f"tool_choice names the function {choice.name!r}, which is not among the tools offered "
                            f"({', '.join(names)})", param="tool_choice")
    if choice.mode == "auto":
        return tools, config
    parser = model.tool_parser(tools)
    if parser is not None and parser.call_grammar(tools, model.call_markup) is not None:
        return tools, config
    prefix = parser.forced_prefix(choice.name) if parser is not None else None
    if prefix is None:
        what = "call a tool" if parser is None else "call a named function"
        raise ApiError(400, f"this model cannot be made to {what} (its tool-call format does not say how); use "
                            "tool_choice 'auto'" + (" or 'required'" if parser is not None else ""),
                       param="tool_choice")
    forced: dict[str, Any] = {"reply_prefix": prefix}
    markers = model.reasoning_markers
    if markers is not None:
        kwargs = dict(config.chat_template_kwargs)
        if config.enable_thinking is not None:
            kwargs["enable_thinking"] = config.enable_thinking
        try:
            opening = model.generation_prompt([ChatMessage.coerce(m).template_dict() for m in messages],
                                              tools=tools, **kwargs)
        except TemplateError as exc:
            raise ApiError(400, str(exc)) from None
        opener, closer = markers
        if opening.rfind(opener) > opening.rfind(closer):  # the prompt opened the reasoning
            forced["reply_prefix_after"] = ("", closer)
        elif closer not in opening:  # the model may open it itself
            forced["reply_prefix_after"] = (opener, closer)
    return tools, config.model_copy(update=forced)


@asynccontextmanager
async def watching(request: Any, on_gone: Callable[[], None]) -> AsyncIterator[None]:
    """Call ``on_gone`` if the client disconnects while the block runs (a streaming response watches its
    client itself once it has started)."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, on_gone))
    try:
        yield
    finally:
        watcher.cancel()


async def _watch_disconnect(request: Any, on_gone: Callable[[], None]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    on_gone()


def text_length(messages: Sequence[dict[str, Any]]) -> int:
    """Characters of the text in ``messages`` (string contents and text parts)."""
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


class Turn:
    """One request's turn: admitted to the model's queue (429 when full), served with the pooled cache whose
    conversation shares the most with ``messages``, run by a session primed with them, and stopped at the
    next token when cancelled. :meth:`next` gives the events as the client sees them: with ``max_calls``
    the reply is cut after that many calls (the model stops at the next token). :meth:`finish` (called by
    the request's :class:`~mlxchat.server.lifecycle.Lifecycle`, whatever happened) gives the slot and the
    cache back, remembering the conversation the cache now holds.
    """

    def __init__(self, state: ServerState, messages: Messages, *, tools: list[dict[str, Any]] | None,
                 config: GenerationConfig, max_calls: int | None = None, context_policy: ContextPolicy = "error",
                 tool_choice: Any = None):
        self.state, self.messages, self.tools, self.config = state, messages, tools, config
        self.tool_choice = tool_choice if tools else None
        """The library's ``tool_choice`` (constrained calls; ``None`` once ``tool_setup`` took the tools away)."""
        self.max_calls, self.context_policy = max_calls, context_policy
        self.session: ChatSession | None = None
        self.cache: PromptCache | None = None
        self.result: ChatResult | None = None
        """The finished reply as the client saw it (cut after ``max_calls`` calls)."""
        self._stream: ChatStream | None = None
        self._events: AsyncIterator[StreamEvent] | None = None
        self._raw: ChatResult | None = None
        self._admitted = self._finished = False
        self._hold: Hold | None = None
        self.reports: list[GenerationReport] = []
        """The reports of the replies done (one per choice)."""
        self.first_token_seconds: float | None = None
        """From admission to the first event of the first reply."""
        self.token_gaps: list[float] = []
        """Seconds between the events of a reply after its first."""
        self._clock = 0.0

    def admit(self) -> None:
        """Take a place in the model's queue (429 when it is full)."""
        if not self._admitted:
            self.state.admit()
            self._admitted, self._clock = True, time.monotonic()

    async def start(self) -> None:
        """Take the turn's cache and start it (admitted first, and its cache's growth reserved: see
        :mod:`mlxchat.server.admission`); a request the session refuses is a 400."""
        check_tool_answers(self.messages)
        self.admit()
        strict = self.context_policy == "error"
        if strict:
            self._check_length()
        kv = self.state.kv
        self._hold = await kv.reserve(await kv.estimate(self.messages, self.tools, self.config, fits=strict))
        self.cache = await self.state.pool.take(self.messages)
        self.cache.growth = self._hold  # its generations wait while the memory to grow is held by others
        try:
            self.session = self.state.model.chat_session(tools=self.tools, cache=self.cache,
                                                         context_policy=self.context_policy,
                                                         prefix_cache=self.state.pool.prefixes)
            await asyncio.to_thread(self.session.prime_history, self.messages)  # images are read: not on the loop
            self._begin(self.session.start_from_history_stream(config=self.config, tool_choice=self.tool_choice))
            self.state.turns.add(self)
        except (MlxchatError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None

    def _check_length(self) -> None:
        """Refuse a prompt of more characters than the context could hold as tokens before any is tokenized (a
        token covers at most the longest one's characters; twice that for a normalizer that joins characters)."""
        model = self.state.model
        most = model.context_length * self.state.longest_token * 2
        if text_length(self.messages) > most:
            raise ContextLengthError(f"the prompt has more than {most} characters, more than this model's context "
                                     f"of {model.context_length} tokens can hold; shorten the conversation")

    def again(self, config: GenerationConfig) -> None:
        """Reply to the same conversation once more (the next choice of ``n``): only its last prompt token is
        prefilled again."""
        assert self.session is not None
        self._begin(self.session.regenerate_stream(config=config, tool_choice=self.tool_choice))

    def _begin(self, stream: ChatStream) -> None:
        self._stream, self._events = stream, aiter(stream)
        self._kept: list[StreamEvent] = []
        self._calls, self._cut, self._over = 0, False, False
        self.result = self._raw = None

    @property
    def over(self) -> bool:
        """Whether the reply has ended (its ``Done`` was given)."""
        return self._over

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()

    async def next(self) -> StreamEvent | None:
        """The next event the client sees (the last is :class:`Done`), ``None`` once the turn is over.
        Errors of the model are :class:`MlxchatError`\\ s."""
        assert self._events is not None
        while not self._over:
            event = await anext(self._events)
            now = time.monotonic()
            if self.first_token_seconds is None:
                self.first_token_seconds = now - self._clock
            elif self._kept or isinstance(event, Done):
                self.token_gaps.append(now - self._clock)
            self._clock = now
            if isinstance(event, Done):
                self._over = True
                await anext(self._events, None)  # the stream ends: the session is idle again
                self._raw, self.result = event.result, self._seen(event.result)
                self.reports.append(event.result.report)
                return Done(result=self.result)
            if self._cut:
                continue
            if isinstance(event, ToolCallEvent) and event.call.status == "ok":
                self._calls += 1
                if self.max_calls is not None and self._calls >= self.max_calls:
                    self.cancel()
                    self._cut = True
            self._kept.append(event)
            return event
        return None

    @property
    def shown(self) -> str:
        """The reply's text as a client is shown it: the raw text of each malformed call block where the model
        wrote it, once (the calls of a block share it)."""
        return "".join(e.text if isinstance(e, TextDelta) else e.call.raw for e in self._kept
                       if isinstance(e, TextDelta) or isinstance(e, ToolCallEvent) and e.call.status == "invalid"
                       and e.opens_block)

    async def collect(self) -> ChatResult:
        """Run the turn to its end."""
        while await self.next() is not None:
            pass
        assert self.result is not None
        return self.result

    def _seen(self, result: ChatResult) -> ChatResult:
        if not self._cut:
            return result
        calls = [e.call for e in self._kept if isinstance(e, ToolCallEvent)]
        thinking = "".join(e.text for e in self._kept if isinstance(e, ThinkingDelta))
        report = result.report.model_copy(update={"finish_reason": "tool_calls"})
        return result.model_copy(update={
            "text": "".join(e.text for e in self._kept if isinstance(e, TextDelta)), "tool_calls": calls,
            "thinking": thinking if result.thinking is not None else None, "finish_reason": "tool_calls",
            "report": report})

    async def logprobs(self, top: int) -> list[dict[str, Any]]:
        """OpenAI ``logprobs.content`` entries of the last reply's tokens (see
        :meth:`GenerativeModel.reply_logprobs`)."""
        model, raw, session = self.state.model, self._raw, self.session
        assert raw is not None and session is not None
        scored = await model.worker.arun(model.reply_logprobs, session.cache, raw.report.prompt_tokens, raw.tokens,
                                         top)

        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = model.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in best]}
                for token, (logprob, best) in zip(raw.tokens, scored, strict=True)]

    async def finish(self, messages: Messages | None = None) -> None:
        """End the turn (stopping the model if it still runs) and give the cache back, remembering
        ``messages`` as the conversation it holds (by default the request's)."""
        if self._finished:
            return
        self._finished = True
        try:
            if self._events is not None and not self._over:
                close = getattr(self._events, "aclose", None)
                if close is not None:  # even when the response task is being cancelled (the client left)
                    await asyncio.shield(close())
        finally:
            self.state.turns.discard(self)
            if self._admitted:
                self.state.release()
            await self.state.kv.release(self._hold)
            if self.cache is not None:
                self.cache.growth = None
                self.state.pool.give_back(messages or self.messages, self.cache)


def seeded(config: GenerationConfig, index: int) -> GenerationConfig:
    """The config of choice ``index`` of ``n``: a set seed moves on by the index, so choices differ."""
    if config.seed is None or not index:
        return config
    return config.model_copy(update={"seed": (config.seed + index) % 2**64})
