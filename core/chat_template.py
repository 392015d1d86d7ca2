"""Chat templates rendered exactly as transformers' ``apply_chat_template`` renders them, and tokenized so
that message content stays data.

Rendering: a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, HF's ``tojson``
(Python's default spacing, non-ASCII kept), ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag and loop controls; messages with ``None`` values dropped and reasoning copied
under ``reasoning_content``/``thinking``/``reasoning``.

Tokenizing: control-token text inside user, system and tool content (and tool schemas) is wrapped in
private-use markers before rendering; the rendered text is then split on the markers and the marked
pieces are encoded as plain text. A user typing ``<|im_end|>`` gets the characters, never the token.
Only the template's own markup produces control tokens. The marker characters themselves, wherever they
occur in messages, are wrapped the same way, so that they reach the model as typed. A marked string
answers a template's ``startswith``/``endswith``/``in`` tests as the unmarked text would, so the template
takes the branches transformers takes (Qwen3 tells tool responses in user turns apart that way).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import profiling
from .checkpoint import read_json
from .errors import CheckpointError, TemplateError
from .tokenizer import Tokenizer

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Roles whose content comes from outside the model: their control-token text is data.
DATA_ROLES = ("system", "user", "tool", "developer")

_MARK_START, _MARK_END = "\ue000", "\ue001"
_PROBE_NAME = "mlxchat_probe_function"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE_NAME, "description": "Probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


class _Marked(str):
    """A string with markers around its data; the template's tests see the text as it was sent."""

    plain: str

    def __new__(cls, marked: str, plain: str) -> _Marked:
        value = super().__new__(cls, marked)
        value.plain = plain
        return value

    def startswith(self, prefix: Any, *args: Any) -> bool:
        return self.plain.startswith(prefix, *args)

    def endswith(self, suffix: Any, *args: Any) -> bool:
        return self.plain.endswith(suffix, *args)

    def __contains__(self, item: Any) -> bool:
        return item in self.plain


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names as transformers does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attributes cannot start with '_': {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict,
                       namespace=_Namespace)
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """Messages and tools as plain JSON types (pydantic models dumped), the only things a template sees."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if hasattr(value, "model_dump"):
        return plain_data(value.model_dump())
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(v) for v in value]
    raise TemplateError(f"cannot pass {type(value).__name__} to a chat template")


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Drop ``None``-valued keys and alias reasoning fields, as transformers does before rendering, and pass
    tool-call arguments as mappings (see :func:`_arguments_as_mapping`)."""
    out = []
    for message in plain_data(list(messages)):
        if not isinstance(message, dict):
            raise TemplateError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function", c), dict)
                                                  for c in calls):
            raise TemplateError(f"a message's tool_calls must be a list of calls (objects), got {calls!r:.200}")
        for call in calls:
            _arguments_as_mapping(call.get("function", call))
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _arguments_as_mapping(function: dict[str, Any]) -> None:
    """Tool-call arguments as a dict, whatever the caller sent: the OpenAI wire format carries them as a JSON
    string, which the Qwen3.5, Qwen3-Coder, LFM2.5 and Gemma 4 templates cannot iterate (they crash)."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return
        if isinstance(parsed, dict):
            function["arguments"] = parsed


class ChatTemplate:
    """A checkpoint's chat template bound to its tokenizer."""

    def __init__(self, source: str, tokenizer: Tokenizer, placeholders: Sequence[str] = ()):
        """``placeholders``: control tokens that stand for an input (an image's marker), data in every role's
        content, so that only the template's markup for an input part makes them: a reply that wrote one,
        sent back as the assistant's content, is text, not an image without pixels."""
        self.source = source
        self.tokenizer = tokenizer
        self.placeholders = tuple(placeholders)
        try:
            self._template = _compile(source)
        except (jinja2.TemplateError, ValueError, RecursionError) as exc:  # (a literal of 5000 digits, deep nesting)
            raise CheckpointError(f"chat template does not parse: {exc}") from exc
        controls = sorted(tokenizer.added_tokens, key=len, reverse=True)
        marks = f"[{_MARK_START}{_MARK_END}]"
        self._data_re = re.compile("|".join([*map(re.escape, controls), marks]))
        self._marks_re = re.compile(marks)
        self._inputs_re = re.compile("|".join([*map(re.escape, sorted(self.placeholders, key=len, reverse=True)),
                                               marks]))
        self._markers_re = re.compile(f"{_MARK_START}({self._data_re.pattern}){_MARK_END}|{marks}")

    @cached_property
    def takes_tools(self) -> bool:
        """Whether the template renders a ``tools`` list: a probe chat rendered with a tool differs from the
        same chat without one (a template that fails on the probe takes none)."""
        probe = [{"role": "user", "content": "Hi"}]
        try:
            return self.render(probe, tools=[_PROBE_TOOL]) != self.render(probe)
        except TemplateError:
            return False

    @cached_property
    def renders_tool_calls(self) -> bool:
        """Whether assistant ``tool_calls`` appear in the rendering: a probe call's name shows up (some LFM2
        templates drop them, so the call text has to stay in the message content)."""
        call = {"id": "probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "probe", "content": "ok"}]
        try:
            return _PROBE_NAME in self.render(probe, add_generation_prompt=False)
        except TemplateError:
            return False

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text, as ``tokenizer.apply_chat_template(..., tokenize=False)`` gives it."""
        return self._render(normalize_messages(messages), plain_data(tools) if tools else None,
                            add_generation_prompt, plain_data(kwargs))

    def encode(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt's token ids; control-token text in user, system and tool content (and placeholder text
        anywhere) stays text."""
        return self.render_encoded(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)[1]

    def render_encoded(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The prompt as text (what :meth:`render` gives) and as safe token ids, from one rendering."""
        normalized = [self._mark(m, self._data_re if m.get("role") in DATA_ROLES else self._inputs_re)
                      for m in normalize_messages(messages)]
        marked_tools = self._mark(plain_data(tools), self._data_re) if tools else None
        marked = self._render(normalized, marked_tools, add_generation_prompt,
                              self._mark(plain_data(kwargs), self._marks_re))
        with profiling.span("tokenize"):
            pieces = self._markers_re.split(marked)
            ids = self.tokenizer.encode(pieces[0])
            for i, piece in enumerate(pieces[1:], start=1):
                if not piece:
                    continue
                ids += self.tokenizer.encode_plain(piece) if i % 2 == 1 else self.tokenizer.encode(piece)
        return self._markers_re.sub(lambda m: m.group(1) or "", marked), ids

    def _mark(self, value: Any, pattern: re.Pattern[str]) -> Any:
        """``value`` with every match of ``pattern`` in its strings wrapped in markers (roles left alone)."""
        if isinstance(value, str):
            marked = pattern.sub(f"{_MARK_START}\\g<0>{_MARK_END}", value)
            return value if marked == value else _Marked(marked, value)
        if isinstance(value, dict):
            return {k: (v if k == "role" else self._mark(v, pattern)) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark(v, pattern) for v in value]
        return value

    def _render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
                kwargs: dict[str, Any]) -> str:
        context = {**self.tokenizer.special_tokens, **kwargs}
        try:
            with profiling.span("template_render"):
                return self._template.render(messages=messages, tools=tools, documents=None,
                                             add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template: {exc}") from exc
        except (TypeError, ValueError, AttributeError, ArithmeticError, LookupError, RecursionError) as exc:
            raise TemplateError(f"chat template failed on these messages: {exc}") from exc


def read_template_source(folder: Path) -> str | None:
    """The chat template of a checkpoint: ``chat_template.jinja``, ``chat_template.json`` or
    ``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is used)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{jinja_file}: cannot read the chat template ({exc})") from exc
    for name in ("chat_template.json", "tokenizer_config.json"):
        value = read_json(folder / name, required=False).get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            if isinstance(named.get("default"), str):
                return named["default"]
    return None
