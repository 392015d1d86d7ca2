"""ChatSession: one conversation over a model, served from the session's own cache.

Every turn renders the whole conversation through the checkpoint's chat template, tokenizes it, and lets
the session's :class:`~mlxchat.prompt_cache.PromptCache` cut back to the longest prefix it already
holds, so only the rest is prefilled. The model therefore always sees exactly what a stateless run
would show it (templates that drop earlier reasoning, edited history, regenerate and rewind all stay
right), and a turn costs what changed. Caches that cannot be cut back take snapshots just before the last
prompt token, where the next turn's render will part from this prompt, and at the end of the reply.

Around the turn the session keeps what changes what history *is*, each costing only the tokens that
changed: message ids and times, reply versions (a regenerate keeps the old reply), checkpoints (back to a
message by id), and tools it calls by itself (``auto_tools``), pausing for the user's approval where a
tool asks for it.

A session owns no weights: a turn is planned (rendered, tokenized, its images preprocessed) on the reader's
side, then runs on the model's worker thread, whose steps serve every session decoding at that moment in
one pass and feed waiting prompts a budget of tokens a step (:mod:`mlxchat.batching`).
Tools run on the reader's side (the thread iterating the stream, or the event loop), never on the worker.

This module is the facade; the rooms behind it: :mod:`~mlxchat.session_state` (what a session is, to
export and import), :mod:`~mlxchat.history` (the edits to it), :mod:`~mlxchat.turn_plan` (a reply's
prompt and snapshots), :mod:`~mlxchat.turn_steps` (what a turn does next with tool calls),
:mod:`~mlxchat.session_turns` (one turn at a time, run and committed) and :mod:`~mlxchat.chat_stream`
(the reader's side of a turn).
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, TypeVar, Unpack, cast

from .chat_stream import ChatStream, TurnOptions
from .constraints import reply_shape
from .errors import ImageError, InvalidInputError, SessionStateError
from .generation import GenerationConfig, GenerationReport
from .history import History
from .images import ImageSource, as_data_url
from .limits import check_depth, check_strings, check_text
from .messages import ChatMessage, ToolCall
from .multimodal import carries_image, image_kept, part_image
from .persistence import restore_session, save_session
from .prefix_cache import PromptCachePool
from .prompt_cache import PromptCache
from .session_state import Decision, SessionState
from .session_turns import SessionTurns
from .session_types import (
    DEFAULT_MAX_TOOL_ROUNDS,
    ChatResult,
    ContextPolicy,
    Done,
    SessionCapableModel,
    StreamEvent,
    ToolResultEvent,
    TurnFinish,
)
from .tools.context import Ask
from .tools.schema import ToolSpec, tool_functions, tool_schemas
from .turn_plan import TurnPlan
from .turn_steps import check_can_respond

__all__ = ["DEFAULT_MAX_TOOL_ROUNDS", "ChatResult", "ChatSession", "ChatStream", "ConfigArg", "ContextPolicy", "Done",
           "SessionCapableModel", "SessionState", "StreamEvent", "ToolResultEvent", "TurnFinish", "TurnOverrides",
           "TurnPlan"]

ConfigArg = GenerationConfig | dict[str, Any] | None
F = TypeVar("F", bound=Callable[..., Any])


def _change(method: F) -> F:
    """A change made to a session outside a turn (an edit, a save), run under
    :meth:`~mlxchat.session_turns.SessionTurns.exclusive`: refused in a turn, and no turn or other change
    starts while it runs."""

    @functools.wraps(method)
    def change(self: ChatSession, *args: Any, **kwargs: Any) -> Any:
        with self._turns.exclusive():
            return method(self, *args, **kwargs)

    return cast(F, change)


def _check_system(system: Any) -> str | None:
    """A system prompt as given; one that is no valid text is an :class:`InvalidInputError` before it reaches the
    conversation (pydantic's own error, a ValidationError, is none of the library's)."""
    if system is not None and not isinstance(system, str):
        raise InvalidInputError(f"the system prompt must be a string, got {type(system).__name__}")
    return system if system is None else check_text(system, "the system prompt")


class TurnOverrides(TypedDict, total=False):
    """What one call may change for its turn, as keywords of :meth:`ChatSession.send` and the other turn
    methods (one definition, so their signatures cannot drift apart).

    ``config``: generation settings over the session's defaults. ``tools``: the tools offered instead of the
    session's. ``auto_tools`` / ``max_tool_rounds``: the session's automatic tool calling, for this turn.
    ``response_format`` (a format dict as OpenAI's, a bare JSON Schema, or a pydantic model) and
    ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name":
    ...}}``) constrain the replies (:func:`mlxchat.constraints.reply_shape`); a schema that does not compile
    is an error when the stream is made, before the turn starts.
    """

    config: ConfigArg
    tools: Sequence[Any] | None
    auto_tools: bool | None
    max_tool_rounds: int | None
    response_format: Any
    tool_choice: Any


class ChatSession:
    """A conversation over one model. See the module docstring for how turns reuse the cache."""

    def __init__(
        self,
        model: SessionCapableModel,
        *,
        system: str | None = None,
        default_config: ConfigArg = None,
        tools: Sequence[Any] | None = None,
        cache: PromptCache | None = None,
        context_policy: ContextPolicy = "error",
        auto_tools: bool = False,
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        new_id: Callable[[], str] | None = None,
        clock: Callable[[], float] | None = None,
        input_handler: Ask | None = None,
        kv_bits: int | None | Literal["model"] = "model",
        kv_group_size: int | None = None,
        prefix_cache: PromptCachePool | None = None,
    ):
        """``cache``: a prompt cache of this model to start from (say, one a server keeps between requests
        that carry the whole conversation); the session takes it over.

        ``context_policy`` says what a turn does when the conversation outgrows the model's context:
        ``"error"`` raises :class:`ContextLengthError` (and the turn is not added); ``"truncate_oldest"``
        leaves the oldest whole turns out of the prompt (the system prompt stays; :attr:`messages` keeps
        them all) until the prompt leaves room for ``max_tokens``, or a quarter of the context if that is
        less. Either way a reply is cut at the end of the context (``finish_reason="length"``).

        ``auto_tools``: when the model calls tools that have a Python function (``@tool``), run them,
        record each result as a tool message and reply again, until a reply makes no calls or
        ``max_tool_rounds`` rounds have run (``finish_reason="max_tool_rounds"``); a tool marked
        ``needs_approval`` stops the turn first (``finish_reason="approval_required"``, see
        :meth:`respond_to_approval`). Each send/respond can override both.

        ``new_id`` and ``clock`` make message ids and times (by default random ids and ``time.time``);
        ``input_handler`` answers a tool's :meth:`~mlxchat.tools.ToolContext.request_input`.

        ``kv_bits`` / ``kv_group_size``: this session's KV format when it makes its cache (by default the
        model's, ``load_model(kv_bits=...)``; ``None`` float, 16 float16, 2-8 bits group-wise quantized); a ``cache``
        given keeps its own.

        ``prefix_cache`` (by default the model's ``prefix_cache``, if it has one): a pool this session shares
        its cache's prefixes through; a turn whose prompt starts like another session's (a long system prompt)
        copies that prefix instead of prefilling it (:mod:`mlxchat.prefix_cache`).
        """
        if context_policy not in ("error", "truncate_oldest"):
            raise InvalidInputError(f"context_policy must be 'error' or 'truncate_oldest', got {context_policy!r}")
        if max_tool_rounds < 0:
            raise InvalidInputError(f"max_tool_rounds must be at least 0, got {max_tool_rounds}")
        _check_system(system)
        self._model = model
        self._functions = tool_functions(tools or [])
        state = SessionState(default_config=model.defaults.merged(default_config), system=system,
                             tools=self._offer(tools) or [], context_policy=context_policy, auto_tools=auto_tools,
                             max_tool_rounds=max_tool_rounds)
        self._history = History(state, new_id or (lambda: f"msg_{uuid.uuid4().hex[:24]}"), clock or time.time)
        if system:
            self._history.add(ChatMessage(role="system", content=system))
        self._turns = SessionTurns(
            model, self._history,
            cache if cache is not None else model.make_prompt_cache(kv_bits=kv_bits, kv_group_size=kv_group_size),
            prefix_cache if prefix_cache is not None else getattr(model, "prefix_cache", None), input_handler)

    # -- state ----------------------------------------------------------------------------------------

    @property
    def model(self) -> SessionCapableModel:
        return self._model

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation so far (a copy), the system turn first when there is one."""
        return [m.model_copy(deep=True) for m in self._history.messages]

    @property
    def report(self) -> GenerationReport | None:
        """The last reply's report; ``None`` before the first reply and after :meth:`reset`."""
        return self._history.state.report

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls the last reply made, ids filled in (invalid ones included, with their raw text)."""
        return [c.model_copy(deep=True) for c in self._history.state.tool_calls]

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        """The last reply's calls that no tool result answers yet."""
        return [c.model_copy(deep=True) for c in self._history.pending_calls()]

    @property
    def pending_approvals(self) -> list[ToolCall]:
        """Pending calls to tools marked ``needs_approval`` that wait for :meth:`respond_to_approval`."""
        return [c.model_copy(deep=True) for c in self._history.pending_calls()
                if (tool := self._functions.get(c.name)) is not None and tool.needs_approval
                and c.id not in self._history.state.decisions]

    @property
    def turns(self) -> int:
        """How many user turns the conversation has."""
        return sum(m.role == "user" for m in self._history.messages)

    @property
    def has_images(self) -> bool:
        """Whether any message carries an image."""
        return any(carries_image(m.content) for m in self._history.messages)

    @property
    def tools(self) -> list[ToolSpec]:
        return list(self._history.state.tools)

    @property
    def truncated_messages(self) -> int:
        """How many of the oldest messages (after the system prompt) the context policy leaves out of the
        prompt; 0 unless ``context_policy="truncate_oldest"`` had to drop turns."""
        return self._history.state.hidden

    @property
    def cache(self) -> PromptCache:
        self._turns.check_open()
        assert self._turns.cache is not None
        return self._turns.cache

    @property
    def input_handler(self) -> Ask | None:
        """Answers a tool's :meth:`~mlxchat.tools.ToolContext.request_input` (settable)."""
        return self._turns.input_handler

    @input_handler.setter
    def input_handler(self, handler: Ask | None) -> None:
        self._turns.input_handler = handler

    # -- turns ----------------------------------------------------------------------------------------

    def send(self, content: str, *, images: Sequence[ImageSource] = (), **turn: Unpack[TurnOverrides]) -> ChatResult:
        """Append a user turn and reply to it (blocking)."""
        return self.send_stream(content, images=images, **turn).collect()

    def send_stream(self, content: str, *, images: Sequence[ImageSource] = (),
                    **turn: Unpack[TurnOverrides]) -> ChatStream:
        """:meth:`send`, streamed: the user turn is appended when the stream is first iterated.

        ``images`` (paths, encoded bytes, ``PIL.Image`` objects or ``data:`` URLs) go before the text in
        the user message, each as a ``{"type": "image", "image": <data: URL>}`` content part (so the
        conversation holds them whole); the model's processor reads them now, so a bad image is an error
        here. Empty content without images, content that is not valid Unicode, or images for a model that
        reads none are an :class:`InvalidInputError` (and nothing is added)."""
        self._turns.check_open()
        if not isinstance(content, str):
            raise InvalidInputError(f"send() takes the message as a string, got {type(content).__name__}")
        if not check_text(content, "the message").strip() and not images:
            raise InvalidInputError("nothing to send: the message is empty")
        message = ChatMessage(role="user", content=self._with_images(content, images) if images else content)
        self._history.check_no_pending_calls()

        def prepare() -> None:
            self._history.check_no_pending_calls()
            self._history.add(message)

        return ChatStream(self._turns, prepare, self._options(**turn))

    def respond(self, **turn: Unpack[TurnOverrides]) -> ChatResult:
        """Reply to the conversation as it stands: it ends with a user turn or a tool result, or (with
        automatic tool calls) with a reply whose calls the session can now answer itself (after
        :meth:`respond_to_approval`)."""
        return self.respond_stream(**turn).collect()

    def respond_stream(self, **turn: Unpack[TurnOverrides]) -> ChatStream:
        self._turns.check_open()
        options = self._options(**turn)

        def prepare() -> None:
            check_can_respond(self._history, options.functions, options.auto_tools)

        prepare()
        return ChatStream(self._turns, prepare, options)

    @_change
    def add_tool_result(self, call_id: str, content: Any, name: str = "") -> None:
        """Answer the call ``call_id`` of the last reply (non-string content is sent as JSON)."""
        pending = {c.id: c for c in self._history.pending_calls()}
        if call_id not in pending:
            raise SessionStateError(
                f"no unanswered tool call with id {call_id!r} (unanswered: {', '.join(pending) or 'none'})"
            )
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        self._history.answer(pending[call_id], text, name)

    def send_tool_result(self, call_id: str, content: Any, name: str = "", *, config: ConfigArg = None,
                         tools: Sequence[Any] | None = None) -> ChatResult:
        """:meth:`add_tool_result`, then :meth:`respond`."""
        self.add_tool_result(call_id, content, name)
        return self.respond(config=config, tools=tools)

    def send_tool_result_stream(self, call_id: str, content: Any, name: str = "", *, config: ConfigArg = None,
                                tools: Sequence[Any] | None = None) -> ChatStream:
        self.add_tool_result(call_id, content, name)
        return self.respond_stream(config=config, tools=tools)

    @_change
    def respond_to_approval(self, call_id: str, approved: bool, reason: str | None = None,
                            arguments: dict[str, Any] | None = None) -> None:
        """Decide a call waiting for approval (:attr:`pending_approvals`). Approved, the tool runs when the
        turn continues, with ``arguments`` if given (which the history then records as the call's);
        denied, the model sees ``reason`` (or a plain "denied") as the tool's result. Once every waiting
        call is decided, :meth:`respond` continues the turn."""
        waiting = {c.id: c for c in self.pending_approvals}
        if call_id not in waiting:
            raise SessionStateError(f"no call {call_id!r} waits for approval (waiting: {', '.join(waiting) or 'none'})")
        if arguments is not None:
            if not approved:
                raise InvalidInputError("arguments edit an approved call; a denied call takes a reason")
            if not isinstance(arguments, dict):
                raise InvalidInputError(f"arguments must be a dict, got {type(arguments).__name__}")
            check_strings(check_depth(arguments, what="the arguments"), "the arguments")
        if reason is not None:
            check_text(reason, "the reason")
        self._history.decide(call_id, Decision(approved=approved, reason=reason, arguments=arguments))

    def regenerate(self, **turn: Unpack[TurnOverrides]) -> ChatResult:
        """Reply again to the conversation before the last reply; the old reply is kept as another version
        of the same message (see :meth:`select_version`)."""
        return self.regenerate_stream(**turn).collect()

    def regenerate_stream(self, **turn: Unpack[TurnOverrides]) -> ChatStream:
        self._check_ready()
        self._history.check_ends_with_reply()
        return ChatStream(self._turns, self._history.pop_reply, self._options(**turn))

    @_change
    def select_version(self, message_id: str, index: int) -> None:
        """Show reply version ``index`` of the assistant message ``message_id`` (0 is its first reply). When
        that message is not the last one, the messages after it are dropped (they answered another
        version); the last message switches in place. The next turn reuses the cache as far as the
        conversation still agrees with it."""
        self._history.select_version(message_id, index)

    @_change
    def restore_checkpoint(self, message_id: str) -> None:
        """Keep the conversation up to and including message ``message_id``; drop what came after. The next
        turn reuses the cache up to there (through snapshots where layers cannot be cut back)."""
        self._history.keep_through(message_id)

    @_change
    def rewind(self, keep: int) -> None:
        """Keep only the first ``keep`` messages (as :attr:`messages` lists them) and drop the rest: the
        positional form of :meth:`restore_checkpoint`."""
        self._history.rewind(keep)

    @_change
    def set_system(self, system: str | None) -> None:
        """Replace the system prompt (``None`` removes it); the rest of the conversation stays."""
        self._history.set_system(_check_system(system))

    @_change
    def reset(self, keep_system: bool = True) -> None:
        """Forget the conversation, the last report and its calls (the cache stays for prefix reuse)."""
        self._history.reset(keep_system)

    def close(self) -> None:
        """End the session and free its cache; the model stays open. Later calls raise."""
        self._turns.close()

    def export_state(self) -> SessionState:
        """A copy of everything this session is besides its model and cache (see :class:`SessionState`): what
        :meth:`save` writes beside the cache, or what :meth:`import_state` gives another session."""
        with self._turns.exclusive(open_required=False):
            return self._history.state.model_copy(deep=True)

    @_change
    def import_state(self, state: SessionState) -> None:
        """Make this session's conversation and settings those of ``state`` (a copy is taken). The cache stays:
        the next turn reuses as much of it as still agrees with the new conversation. Functions for automatic
        tool calls stay this session's (a state holds tools as schemas only)."""
        state = state.model_copy(deep=True)
        state.tools = self._offer(state.tools) or []
        self._history.take_over(state)

    @_change
    def save(self, path: str | os.PathLike[str]) -> None:
        """Save the conversation and its prompt cache (snapshots included) to one file; :meth:`load` resumes
        it with nothing to prefill again (see :mod:`mlxchat.persistence`)."""
        save_session(self, path)

    @classmethod
    def load(cls, model: SessionCapableModel, path: str | os.PathLike[str], **options: Any) -> ChatSession:
        """The session saved at ``path``, resumed over ``model`` (the model it was saved with: another one is a
        :class:`~mlxchat.errors.SavedStateError`); ``options`` replace saved settings (``tools``, ...)."""
        return restore_session(cls, model, path, **options)

    @_change
    def prime_history(self, messages: Sequence[ChatMessage | dict[str, Any]]) -> None:
        """Load a stored transcript into a session that has not spoken yet (no inference runs).

        The session's system prompt is put first unless the transcript has its own. Messages keep their
        ids, times and reply versions; those without get new ones. Follow with :meth:`start_from_history`
        when the transcript ends with a user turn or tool result.
        """
        if isinstance(messages, str | bytes):
            raise InvalidInputError("a transcript is a list of messages (dicts or ChatMessages)")
        messages = list(messages)
        if not all(isinstance(m, ChatMessage | dict) for m in messages):
            raise InvalidInputError("a transcript is a list of messages (dicts or ChatMessages)")
        self._history.prime([self._images_stored(m) for m in messages])

    def start_from_history(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                           response_format: Any = None, tool_choice: Any = None) -> ChatResult:
        """Reply to a primed transcript (a cold start: the whole history is prefilled once)."""
        return self.respond(config=config, tools=tools, response_format=response_format, tool_choice=tool_choice)

    def start_from_history_stream(self, *, config: ConfigArg = None, tools: Sequence[Any] | None = None,
                                  response_format: Any = None, tool_choice: Any = None) -> ChatStream:
        return self.respond_stream(config=config, tools=tools, response_format=response_format,
                                   tool_choice=tool_choice)

    # -- asyncio --------------------------------------------------------------------------------------

    async def asend(self, content: str, *, images: Sequence[ImageSource] = (),
                    **turn: Unpack[TurnOverrides]) -> ChatResult:
        return await self.send_stream(content, images=images, **turn).acollect()

    def astream(self, content: str, *, images: Sequence[ImageSource] = (),
                **turn: Unpack[TurnOverrides]) -> ChatStream:
        """:meth:`send_stream` for ``async for`` (the same stream object supports both)."""
        return self.send_stream(content, images=images, **turn)

    async def arespond(self, **turn: Unpack[TurnOverrides]) -> ChatResult:
        return await self.respond_stream(**turn).acollect()

    async def aregenerate(self, **turn: Unpack[TurnOverrides]) -> ChatResult:
        return await self.regenerate_stream(**turn).acollect()

    async def asend_tool_result(self, call_id: str, content: Any, name: str = "", *, config: ConfigArg = None,
                                tools: Sequence[Any] | None = None) -> ChatResult:
        self.add_tool_result(call_id, content, name)
        return await self.arespond(config=config, tools=tools)

    async def astart_from_history(self, *, config: ConfigArg = None,
                                  tools: Sequence[Any] | None = None) -> ChatResult:
        return await self.arespond(config=config, tools=tools)

    # -- helpers --------------------------------------------------------------------------------------

    def _options(self, config: ConfigArg = None, tools: Sequence[Any] | None = None, auto_tools: bool | None = None,
                 max_tool_rounds: int | None = None, response_format: Any = None,
                 tool_choice: Any = None, **unknown: Any) -> TurnOptions:
        """A turn's options: the session's settings with the call's overrides (see :class:`TurnOverrides`)."""
        if unknown:
            raise TypeError(f"a turn takes no keyword {', '.join(map(repr, unknown))}: it takes "
                            f"{', '.join(TurnOverrides.__annotations__)} (generation settings such as temperature "
                            "go in config={...})")
        state = self._history.state
        rounds = state.max_tool_rounds if max_tool_rounds is None else max_tool_rounds
        if rounds < 0:
            raise InvalidInputError(f"max_tool_rounds must be at least 0, got {rounds}")
        override = GenerationConfig.coerce(config)
        offered = self._offered(tools)
        fmt = response_format if response_format is not None else state.default_config.merged(override).response_format
        shape = reply_shape(self._model.tool_parser, offered, self._model.call_markup, fmt, tool_choice)
        if shape.first is not None or shape.later is not None:
            self._model.token_table  # noqa: B018 - built here, once per model, not on the worker other turns share
        return TurnOptions(config=override, tools=[] if shape.mode == "none" else offered,
                           functions=self._functions if tools is None else tool_functions(tools),
                           auto_tools=state.auto_tools if auto_tools is None else auto_tools, max_tool_rounds=rounds,
                           shape=shape)

    def _with_images(self, text: str, images: Sequence[ImageSource]) -> list[dict[str, Any]]:
        if isinstance(images, str | bytes | os.PathLike) or not isinstance(images, Sequence):
            raise ImageError(f"images is a list of images, got {type(images).__name__} (wrap one image in a list)")
        parts = [self._image_part(image) for image in images]
        for part in parts:
            self._turns.planner.processed(part["image"])  # read here: a bad image fails the call, not the turn
        return parts + ([{"type": "text", "text": text}] if text else [])

    def _image_part(self, image: ImageSource) -> dict[str, Any]:
        """An image as the history keeps it: a checked ``data:`` URL."""
        if not self._model.supports_images:
            raise ImageError(f"{self._model!r} reads no images (its checkpoint has no vision tower)")
        return {"type": "image", "image": as_data_url(image)}

    def _images_stored(self, message: ChatMessage | dict[str, Any]) -> ChatMessage | dict[str, Any]:
        """A transcript's message with its image parts as the history keeps them, whatever form they came in
        (a path, a ``PIL.Image``, bytes, an OpenAI ``image_url``); read when a turn renders them."""
        content = message.content if isinstance(message, ChatMessage) else message.get("content")
        if not isinstance(content, list) or all(image_kept(p) for p in content):
            return message
        data = message.model_dump() if isinstance(message, ChatMessage) else dict(message)
        data["content"] = [p if image_kept(p) else self._image_part(part_image(p, [])) for p in content]
        return data

    def _offer(self, tools: Sequence[Any] | None) -> list[ToolSpec] | None:
        if tools is None:
            return None
        schemas = tool_schemas(tools)
        if schemas and not self._model.supports_tools:
            raise InvalidInputError(f"{self._model!r} takes no tools (its chat template or plugin has no tool format)")
        return schemas

    def _offered(self, tools: Sequence[Any] | None) -> list[ToolSpec]:
        offered = self._offer(tools)
        return self._history.state.tools if offered is None else offered

    def _check_ready(self) -> None:
        """Refuse a change to a closed session, or to one in a turn."""
        self._turns.check_open()
        self._turns.check_idle()
