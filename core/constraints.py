"""Constrained decoding: a reply that must be JSON, match a JSON Schema, a regex or a grammar, or call an
offered tool, always does.

The grammar engine is llguidance (MIT; its wheel requires nothing, xgrammar's requires torch and
transformers). ``python -m benchmarks.grammar_engines`` holds the two side by side (results in
benchmarks/results/grammar_engines.md): both take lazy (triggered) grammars and have wheels for Linux x86_64
and macOS arm64; llguidance compiled the 50-property schema an order of magnitude faster (paid per request),
xgrammar's per-token mask was faster (both tens of microseconds or less, beside a decode step of tens of
milliseconds); llguidance refuses the JSON Schema keywords it does not implement, where xgrammar accepted
some (``contains``, ``oneOf``, ``allOf``, ``if``/``then``) and wrote values that break them.

Every constraint is one Lark grammar in llguidance's dialect (``%json {schema}`` embeds a JSON Schema,
``<[id]>`` a control token, ``/re/`` a regex in Rust's syntax). A :class:`Constraint` says what a reply
must follow; a :class:`RowMatcher` follows one generating row through it, step by step: the decode step
asks it for the mask of the next token (:meth:`RowMatcher.mask`) and tells it each token
(:meth:`RowMatcher.advance`).

A reply goes through phases: the model's reasoning first (text and its closer, no other control token; at
most ``reasoning_budget`` tokens, then its closer is forced), then the grammar; with a ``trigger`` (strict
tools in ``auto`` mode) the reply is free until the model writes the trigger (a call's opener), the grammar
holds until the call ends, and the reply is free again. While the grammar holds, the end of the turn is
allowed only where the grammar accepts, and a grammar that has reached its end allows nothing else.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .errors import InvalidInputError
from .tokenizer import NoTokenizer, Tokenizer

DEFAULT_REASONING_BUDGET = 1024
"""Reasoning tokens a constrained reply may write before its reasoning is closed (``reasoning_budget``
unset)."""
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is laid out: ``json.dumps``'s separators, no other whitespace (a model writes no
runs of blanks, and random weights terminate)."""
FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")


class GrammarError(InvalidInputError):
    """A response format or tool schema the grammar engine cannot compile; ``path`` locates the part of the
    schema at fault (``"$"`` the whole)."""

    def __init__(self, message: str, path: str = "$"):
        super().__init__(message)
        self.path = path


# -- response formats ---------------------------------------------------------------------------------

def check_response_format(value: Any) -> dict[str, Any] | None:
    """The shape of a ``response_format`` (OpenAI's, plus ``regex`` and ``grammar``); ``None`` and
    ``{"type": "text"}`` mean free text. Whether a schema compiles is checked by :func:`format_rule`."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in FORMAT_TYPES:
        raise ValueError(f"response_format must be a dict whose type is one of {', '.join(FORMAT_TYPES)}, "
                         f"got {value!r:.120}")
    kind = value["type"]
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise ValueError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}')
    elif kind == "regex" and not isinstance(value.get("pattern"), str):
        raise ValueError('response_format regex needs {"pattern": "..."}')
    elif kind == "grammar" and not isinstance(value.get("grammar"), str):
        raise ValueError('response_format grammar needs {"grammar": "<Lark grammar>"}')
    return None if kind == "text" else value


def as_response_format(value: Any) -> tuple[dict[str, Any] | None, type | None]:
    """A ``response_format`` from what the session API takes: a format dict, a bare JSON Schema dict, or a
    pydantic model class (also returned, to validate the reply into)."""
    from pydantic import BaseModel

    if isinstance(value, type) and issubclass(value, BaseModel):
        schema = value.model_json_schema()
        return {"type": "json_schema", "json_schema": {"name": value.__name__, "schema": schema,
                                                       "strict": True}}, value
    if isinstance(value, dict) and value.get("type") not in FORMAT_TYPES:
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": value}}, None
    return check_response_format(value), None


def format_schema(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema a JSON format's reply follows (``None`` for regex and grammar formats), its objects
    closed (see :func:`closed`)."""
    if fmt["type"] == "json_object":
        return {"type": "object"}
    if fmt["type"] == "json_schema":
        schema = fmt["json_schema"].get("schema", {})
        return closed({} if schema is True else schema)
    return None


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema with ``properties`` that does
    not say (as OpenAI's strict mode requires and xgrammar assumes): a reply writes the properties the schema
    names, never keys of its own invention (what JSON Schema alone would allow)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("enum", "const", "default", "examples") else v for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def json_rule(schema: dict[str, Any] | bool) -> str:
    """A Lark rule body that matches JSON valid against ``schema`` (laid out as :data:`JSON_STYLE`)."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("a schema must be a JSON object (or true)")
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def regex_rule(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def format_rule(fmt: dict[str, Any]) -> str:
    """A Lark rule body for a JSON or regex format (a grammar format is a whole grammar of its own)."""
    schema = format_schema(fmt)
    return json_rule(schema) if schema is not None else regex_rule(fmt["pattern"])


def format_grammar(fmt: dict[str, Any]) -> str:
    """The whole grammar of a response format, checked: a failure is a :class:`GrammarError` naming where
    in the schema it lies."""
    grammar = fmt["grammar"] if fmt["type"] == "grammar" else f"start: {format_rule(fmt)}\n"
    problem = grammar_problem(grammar)
    if problem:
        schema = format_schema(fmt)
        path = failing_path(schema) if schema is not None else "$"
        raise GrammarError(f"response_format cannot be compiled at {path}: {problem}", path)
    return grammar


def grammar_problem(grammar: str) -> str:
    """Why llguidance cannot compile ``grammar`` (empty when it can)."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_lark(grammar))
    if not failed:
        return ""
    reason = messages[0].strip().splitlines()[0]
    return reason.split("failed to compile JSON schema: ", 1)[-1]


_CHILDREN = ("properties", "patternProperties", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SINGLE = ("items", "additionalProperties", "not", "contains")


def failing_path(schema: Any, path: str = "$", defs: dict[str, Any] | None = None) -> str:
    """The deepest part of ``schema`` that does not compile alone (with the root's ``$defs``), as a
    JSON path; ``path`` when none of its parts fails by itself."""
    if not isinstance(schema, dict):
        return path
    defs = defs if defs is not None else {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    parts: list[tuple[str, Any]] = []
    for key in _CHILDREN:
        if isinstance(schema.get(key), dict):
            parts += [(f"{path}.{key}.{name}", sub) for name, sub in schema[key].items()]
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            parts += [(f"{path}.{key}[{i}]", sub) for i, sub in enumerate(schema[key])]
    parts += [(f"{path}.{key}", schema[key]) for key in _SINGLE if isinstance(schema.get(key), dict)]
    for where, sub in parts:
        if not isinstance(sub, dict):  # a boolean schema: where it makes its parent fail, the parent is the place
            continue
        if grammar_problem(f"start: {json_rule({**defs, **sub})}\n"):
            return failing_path(sub, where, defs)
    return path


# -- constraints --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Constraint:
    """What one reply must follow: ``grammar`` (llguidance Lark) after the model's ``reasoning`` section
    (``(opener, closer)`` as :attr:`~mlxchat.generation.GenerationConfig.reply_prefix_after` gives it:
    an empty opener when the prompt opened it; ``None`` when the reply does not reason), which may run
    ``reasoning_budget`` tokens. With a ``trigger`` the grammar is lazy: it starts each time the reply
    writes the trigger (which the grammar itself begins with) and the reply is free between."""

    grammar: str
    reasoning: tuple[str, str] | None = None
    reasoning_budget: int = DEFAULT_REASONING_BUDGET
    trigger: str | None = None


def reasoning_section(generation_prompt: str, markers: tuple[str, str] | None) -> tuple[str, str] | None:
    """Where a reply may reason, from the text its template opens it with (:attr:`Constraint.reasoning`):
    inside a block the prompt opened, or one the model may open itself; ``None`` when the prompt closed it
    (reasoning turned off) or the model does not reason."""
    if markers is None:
        return None
    opener, closer = markers
    if generation_prompt.rfind(opener) > generation_prompt.rfind(closer):
        return "", closer
    return None if closer in generation_prompt else markers


def response_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    """The constraint of a ``GenerationConfig.response_format`` alone (no reasoning section)."""
    fmt = check_response_format(response_format)
    return None if fmt is None else Constraint(format_grammar(fmt))


class TokenTable:
    """llguidance's view of a model's vocabulary, built once per model from its ``tokenizers`` backend
    (byte-level BPE and SentencePiece vocabularies alike) with the model's end-of-turn ids. Masks are as
    wide as the model's logits (``vocab_size``), which may have more rows than the tokenizer has tokens
    (Qwen's, Gemma 3's) or fewer (a trimmed embedding): llguidance's table spans both (``width``)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = sorted(eos_ids)
        if isinstance(tokenizer, NoTokenizer):
            raise InvalidInputError("constrained decoding needs the model's tokenizer (this model has none)")
        self.width = max(vocab_size, tokenizer.vocab_size)
        self.table = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.width, eos_token=self.eos_ids)
        self.text_only = np.ones(vocab_size, dtype=bool)
        """Any token but control tokens (the end of turn, call markup) and the rows past the tokenizer's."""
        self.text_only[[i for i in tokenizer.added_tokens.values() if i < vocab_size]] = False
        self.text_only[self.eos_ids] = False
        self.text_only[tokenizer.vocab_size:] = False

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.table, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {matcher_error(matcher)}")
        return matcher

    def only(self, tokens: Sequence[int]) -> np.ndarray:
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[list(tokens)] = True
        return mask


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """llguidance's reason for a matcher's error, its first line only: the rest is the engine's internal state
    (a dump of its parser and grammar), which stays out of replies."""
    reason = matcher.get_error().strip().split("\n", 1)[0].split("<state>", 1)[0].strip()
    return reason[:300] or "the grammar engine failed"


def markup(tokenizer: Tokenizer, text: str) -> str:
    """A piece of call markup in Lark: its control token when ``text`` is one, else the text itself."""
    token = tokenizer.added_tokens.get(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


_tables_lock = threading.Lock()


def token_table(owner: Any, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> TokenTable:
    """The :class:`TokenTable` cached on ``owner`` (the model), built on first use (seconds for a 150k
    vocabulary: llguidance reads the whole tokenizer.json)."""
    with _tables_lock:
        table = getattr(owner, "_token_table", None)
        if table is None:
            table = TokenTable(tokenizer, vocab_size, eos_ids)
            owner._token_table = table
        return table


_executor: llguidance.LLExecutor | None = None


def fill_masks(rows: Sequence[RowMatcher]) -> None:
    """Compute the grammar masks of several rows' next tokens at once, on llguidance's own threads
    (``fill_next_token_bitmask_par``, without the GIL), for their :meth:`RowMatcher.mask` to take; a row
    alone computes its own."""
    global _executor
    due = [row for row in rows if row._grammar_holds() and not row.matcher.is_error()]
    if len(due) < 2:
        return
    with _tables_lock:
        _executor = _executor or llguidance.LLExecutor()
    bits = llnp.allocate_token_bitmask(len(due), due[0].table.width)
    llnp.fill_next_token_bitmask_par(_executor, [(row.matcher, i) for i, row in enumerate(due)], bits)
    for i, row in enumerate(due):
        row._filled = bits[i]


class RowMatcher:
    """One generating row's way through its :class:`Constraint` (see the module docstring for the
    phases). ``mask()`` is the boolean mask of the next token (``None``: any token); ``advance(token)``
    takes the token sampled under it."""

    def __init__(self, table: TokenTable, constraint: Constraint):
        self.table, self.constraint = table, constraint
        self.matcher = table.matcher(constraint.grammar)
        self._bits = llnp.allocate_token_bitmask(1, table.width)
        """Where llguidance writes this row's packed mask (one bit a token, 32 to a word)."""
        # The first mask, now: a grammar that compiles but cannot be followed (a schema that refers to itself
        # without end) fails its request here, before any work, not in a step shared with other generations.
        llnp.fill_next_token_bitmask(self.matcher, self._bits)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be followed: {matcher_error(self.matcher)}")
        self._filled: np.ndarray | None = self._bits[0]
        """The next mask's words when computed ahead (the first, or :func:`fill_masks` with other rows')."""
        self._forced: list[int] = []
        self._tail = ""
        self._spent = 0
        self._opener: list[int] = []
        self._closer: list[int] = []
        reasoning = constraint.reasoning
        if reasoning is None:
            self.phase = "free" if constraint.trigger else "grammar"
        else:
            self._opener = table.tokenizer.encode(reasoning[0]) if reasoning[0] else []
            self._closer = table.tokenizer.encode(reasoning[1])
            self.phase = "may_reason" if self._opener else "reasoning"
            self._reasoning = table.text_only.copy()
            self._reasoning[self._closer] = True

    def mask(self) -> np.ndarray | None:
        if self.phase == "reasoning" and self._spent >= self.constraint.reasoning_budget:
            self.phase, self._forced = "closing", list(self._closer)
        if self.phase in ("opening", "closing"):
            return self.table.only(self._forced[:1])
        if self.phase == "reasoning":
            return self._reasoning
        if not self._grammar_holds():
            return None
        mask = self._grammar_mask()
        if self.phase == "may_reason":
            mask[self._opener[0]] = True
        return mask

    def _grammar_holds(self) -> bool:
        """Whether the next token's mask is the grammar's: a lazy grammar's reply is free before its trigger,
        from its first token on (where it may also open its reasoning)."""
        return self.phase == "grammar" or (self.phase == "may_reason" and not self.constraint.trigger)

    def _grammar_mask(self) -> np.ndarray:
        words, self._filled = self._filled, None
        if words is None:
            llnp.fill_next_token_bitmask(self.matcher, self._bits)
            if self.matcher.is_error():
                raise GrammarError(f"the constrained reply left its grammar: {matcher_error(self.matcher)}")
            words = self._bits[0]
        mask = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.table.vocab_size].view(bool)
        # The end of turn: any of the model's stop tokens where the grammar may end, none elsewhere (a lazy
        # grammar's end returns to free text instead).
        mask[self.table.eos_ids] = self.matcher.is_accepting() and not self.constraint.trigger
        return mask

    def advance(self, token: int) -> None:
        self._filled = None
        if self.phase in ("opening", "closing"):
            self._forced.pop(0)
            if not self._forced:
                self._after_forced()
        elif self.phase == "may_reason":
            if token == self._opener[0]:
                self.phase, self._forced = "opening", self._opener[1:]
                if not self._forced:
                    self.phase = "reasoning"
            else:
                self._begin()
                self.advance(token)  # the reply's first token, in the phase it begins
        elif self.phase in ("reasoning", "free"):
            self._spent += self.phase == "reasoning"
            self._tail = (self._tail + self.table.tokenizer.decode([token]))[-64:]
            if self.phase == "reasoning" and self._closer and self.constraint.reasoning[1] in self._tail:  # type: ignore[index]
                self._begin()
            elif self.phase == "free" and self.constraint.trigger and self._tail.endswith(self.constraint.trigger):
                self.matcher.reset()
                self.phase, self._tail = "grammar", ""
                self.matcher.consume_tokens(self.table.tokenizer.encode(self.constraint.trigger))
        else:
            self._consume(token)

    def _after_forced(self) -> None:
        if self.phase == "opening":
            self.phase = "reasoning"
        else:
            self._begin()

    def _begin(self) -> None:
        """The reasoning is over: the grammar holds (or, lazy, waits for its trigger)."""
        self.phase, self._tail = ("free" if self.constraint.trigger else "grammar"), ""

    def _consume(self, token: int) -> None:
        if token in self.table.eos_ids:
            return
        self.matcher.consume_token(token)
        if self.constraint.trigger and self.matcher.is_stopped():
            self.phase = "free"


def tool_constraint(parser: Any, tools: Sequence[dict[str, Any]], markup: Callable[[str], str], mode: str,
                    name: str | None, fmt: dict[str, Any] | None) -> Constraint | None:
    """The grammar a reply follows given its tools: ``required`` or a named function: one or more calls
    (exactly one of ``name``); ``auto`` with a JSON response format: the format or calls; ``auto`` with
    strict tools: calls constrained lazily, from their opener on. ``None`` when nothing is constrained or
    the parser gives no grammar."""
    strict = any((t.get("function") or {}).get("strict") or t.get("strict") for t in tools)
    if mode == "auto" and fmt is None and not strict:
        return None
    offered = [t for t in tools if name is None or t["function"]["name"] == name]
    rules = parser.call_grammar(offered, markup) if parser is not None else None
    if rules is None:
        return None
    if mode in ("required", "function"):
        start = "start: call" if name is not None else "start: call (call_gap call)*\ncall_gap: /\\n?/"
        return Constraint(f"{start}\n{rules}")
    if fmt is not None:
        if fmt["type"] == "grammar":
            raise InvalidInputError("a grammar response_format cannot be combined with tool calls; use "
                                    "tool_choice 'none'")
        return Constraint(f"start: answer | call (call_gap call)*\ncall_gap: /\\n?/\nanswer: {format_rule(fmt)}\n"
                          f"{rules}")
    return Constraint(f"start: call\n{rules}", trigger=parser.start)


def tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of a tool's arguments (an object of anything when it declares none)."""
    parameters = (tool.get("function") or {}).get("parameters") or {"type": "object"}
    return closed(parameters) if isinstance(parameters, dict) else {"type": "object"}


def check_tool_grammar(constraint: Constraint, tools: Sequence[dict[str, Any]]) -> None:
    """Refuse a tool grammar llguidance cannot compile, naming the tool and where in its schema."""
    problem = grammar_problem(constraint.grammar)
    if not problem:
        return
    for tool in tools:
        schema = tool_schema(tool)
        if grammar_problem(f"start: {json_rule(schema)}\n"):
            path = failing_path(schema)
            raise GrammarError(f"the parameters of tool {tool['function']['name']!r} cannot be compiled at {path}: "
                               f"{grammar_problem(f'start: {json_rule(schema)}')}", path)
    raise GrammarError(f"the tool-call grammar cannot be compiled: {problem}")


def raw_string_rule(schema: Any) -> str | None:
    """A Lark rule body for a string argument written raw (unquoted, as XML-style and Gemma-style calls do):
    its ``enum``/``const`` as alternatives, else its ``pattern`` (anchors dropped) or any text without ``<``
    (which would open markup) within ``minLength``/``maxLength``; ``None`` when ``schema`` is not a plain
    string schema."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return " | ".join(json.dumps(v) for v in values) if all(isinstance(v, str) for v in values) else None
    if schema.get("type") != "string":
        return None
    if "pattern" in schema:
        return regex_rule("(?:" + schema["pattern"].removeprefix("^").removesuffix("$") + ")")
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    return regex_rule(f"[^<]{{{low},{'' if high is None else int(high)}}}")


def argument_properties(tool: dict[str, Any]) -> tuple[list[tuple[str, Any]], set[str]]:
    """A tool's parameters in their declared order, and which are required."""
    schema = tool_schema(tool)
    properties = schema.get("properties") or {}
    return list(properties.items()), set(schema.get("required") or [])


def keyword_arguments(tool: dict[str, Any], index: int, value: Callable[[Any], str], key: Callable[[str], str],
                      separator: str = "", after: str = "") -> tuple[list[str], str]:
    """Lark rules for a call's arguments written ``KEY VALUE AFTER SEP KEY VALUE AFTER ...`` (``key(name)``
    is the text before a value, ``value(schema)`` a rule body for it): the value rules and the arguments'
    expression, required parameters first (in order), then each optional one."""
    properties, required = argument_properties(tool)
    ordered = [p for p in properties if p[0] in required] + [p for p in properties if p[0] not in required]
    rules, items = [], []
    for j, (name, schema) in enumerate(ordered):
        rules.append(f"tc_v{index}_{j}: {value(schema)}")
        item = f"{json.dumps(key(name))} tc_v{index}_{j}" + (f" {json.dumps(after)}" if after else "")
        items.append((item, name in required))
    if not items:
        return rules, ""
    sep = f"{json.dumps(separator)} " if separator else ""
    head, rest = items[0], items[1:]
    tail = " ".join(f"{sep}{item}" if needed else f"({sep}{item})?" for item, needed in rest)
    body = f"{head[0]} {tail}".strip()
    return rules, body if head[1] else f"({body})?"


def tool_choice_of(value: Any) -> tuple[str, str | None]:
    """``(mode, name)`` of a ``tool_choice``: ``"auto"`` (or ``None``), ``"none"``, ``"required"``, or
    ``{"type": "function", "function": {"name": ...}}``."""
    if value is None or value in ("auto", "none", "required"):
        return value or "auto", None
    name = (value.get("function") or {}).get("name") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise InvalidInputError('tool_choice must be "auto", "none", "required" or {"type": "function", '
                                f'"function": {{"name": ...}}}}, got {value!r:.120}')
    return "function", name


@dataclass(frozen=True)
class ReplyShape:
    """What a turn's replies must be: ``first`` constrains its first reply, ``later`` the ones after tool
    results (a required call is required once); ``model`` is the pydantic class a JSON reply is validated
    into. ``prefix``: for a format whose parser gives no grammar, the markup a required call's reply is
    made to start with instead (:meth:`~mlxchat.tools.parsing.ToolCallParser.forced_prefix`)."""

    mode: str
    first: Constraint | None
    later: Constraint | None
    json: bool = False
    model: type | None = None
    prefix: str | None = None

    def parse(self, result: Any) -> Any:
        """``result`` (a ChatResult) with ``parsed`` set from its text, when it is a whole JSON reply."""
        if not self.json or result.finish_reason != "stop" or result.tool_calls:
            return result
        try:
            value = json.loads(result.text)
            if self.model is not None:
                value = self.model.model_validate(value)  # type: ignore[attr-defined]
        except ValueError:  # pydantic's ValidationError is one: a rule the schema does not express
            return result
        return result.model_copy(update={"parsed": value})


def reply_shape(parser_for: Callable[[Sequence[dict[str, Any]]], Any], tools: Sequence[dict[str, Any]],
                markup: Callable[[str], str], response_format: Any, tool_choice: Any) -> ReplyShape:
    """The :class:`ReplyShape` of a turn offering ``tools`` (``parser_for(tools)`` gives the family's
    tool-call parser, which owns its call grammar), checked: every grammar compiles, a named function is
    offered, a required call has tools and a format that gives its grammar."""
    fmt, model = as_response_format(response_format)
    mode, name = tool_choice_of(tool_choice)
    names = [t["function"]["name"] for t in tools]
    if mode in ("required", "function") and not tools:
        raise InvalidInputError(f"tool_choice {name or mode!r} needs tools")
    if mode == "function" and name not in names:
        raise InvalidInputError(f"tool_choice names the function {name!r}, which is not among the tools offered "
                                f"({', '.join(names)})")
    plain = Constraint(format_grammar(fmt)) if fmt is not None else None
    first = later = None
    prefix = None
    if tools and mode != "none":
        parser = parser_for(tools)
        first = tool_constraint(parser, tools, markup, mode, name, fmt)
        if first is None and mode in ("required", "function"):
            prefix = parser.forced_prefix(name) if parser is not None else None
            if prefix is None:
                raise InvalidInputError(f"this model cannot be made to call {'a tool' if name is None else name!r} "
                                        "(its tool-call format gives no grammar and no opener); use tool_choice "
                                        "'auto'")
        later = first if mode == "auto" else tool_constraint(parser, tools, markup, "auto", None, fmt)
        for constraint in {first, later} - {None}:
            check_tool_grammar(constraint, tools)  # type: ignore[arg-type]
    return ReplyShape(mode, first or plain, later or plain, json=fmt is not None and format_schema(fmt) is not None,
                      model=model, prefix=prefix)
