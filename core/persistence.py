"""Sessions and prompt caches on disk, so that a conversation resumes with nothing to prefill again.

One file in the safetensors format: the arrays of the prompt cache (each layer's state and each snapshot's,
an array shared by several written once), and in its metadata one JSON document with the cache's layout
(tokens, image keys, layer fields such as ``KVCache.shifts``, snapshot positions), what the file was
written for, and the caller's extras (a session's transcript and settings). Loading rebuilds the exact
cache :meth:`~mlxchat.prompt_cache.PromptCache.state_dict` described, so the next turn reuses all of it,
on every kind of layer cache (KV, sliding window, conv and DeltaNet states).

A cache means something only to the model that made it: the file records a fingerprint of that model
(architecture, config, quantization, compute dtype, vocabulary) and refuses to load into another one,
naming what differs. Weights are not fingerprinted: a fine-tune with the same config and vocabulary is
not told apart. Files are written to a temporary name and moved into place, so a crash leaves the old
file or the new one, never half of one.

A session is saved with these fields (``ChatSession``'s state at the time of writing): ``messages``,
``system``, ``default_config``, ``tools`` (their JSON schemas: pass the functions again with ``tools=`` for
automatic calls), ``context_policy``, ``auto_tools``, ``max_tool_rounds``, ``decisions`` (approvals given
while a turn waits), ``hidden`` (messages a ``truncate_oldest`` policy leaves out), ``calls_made`` (the
call-id counter), ``report`` and ``tool_calls`` (the last reply's).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import weakref
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
from pydantic import ValidationError

from .architecture import Architecture
from .config import ModelConfig
from .errors import InvalidInputError, SavedStateError, SessionStateError
from .generation import GenerationReport
from .limits import check_token_ids
from .messages import ChatMessage, ToolCall
from .prompt_cache import PromptCache
from .tokenizer import Tokenizer
from .worker import Worker

FORMAT = "mlxchat.saved"
VERSION = 1
_KEY = "mlxchat"


class SavingModel(Protocol):
    """What saving and loading need from a model (a :class:`~mlxchat.model.GenerativeModel` is one)."""

    architecture: Architecture
    config: ModelConfig
    quantization: dict[str, Any] | None
    dtype: mx.Dtype
    tokenizer: Tokenizer
    worker: Worker
    path: Path | None

    def make_prompt_cache(self) -> PromptCache: ...


_fingerprints: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def fingerprint(model: SavingModel) -> dict[str, str]:
    """What a saved cache depends on, part by part (hashed where long): a cache loads only into a model
    whose every part is the same."""
    if model not in _fingerprints:
        _fingerprints[model] = {
            "architecture": model.architecture.name,
            "config": _digest(model.config.model_dump(mode="json")),
            "quantization": _digest(model.quantization),
            "dtype": str(model.dtype).removeprefix("mlx.core."),
            "vocabulary": _digest(model.tokenizer.backend.to_str()),
        }
    return _fingerprints[model]


def save_prompt_cache(model: SavingModel, cache: PromptCache, path: str | os.PathLike[str],
                      extras: dict[str, Any] | None = None) -> None:
    """Write ``cache`` (a prompt cache of ``model``) and the JSON ``extras`` to ``path`` (replacing it)."""
    target = Path(path)
    header = {"format": FORMAT, "version": VERSION, "model": {"fingerprint": fingerprint(model),
                                                                "path": str(model.path) if model.path else None},
              "extras": extras or {}}
    try:
        json.dumps(header["extras"])
    except (TypeError, ValueError) as exc:
        raise SavedStateError(f"cannot save: the state is not JSON ({exc})") from None

    def write() -> None:  # on the worker: the arrays are its
        arrays, fields = cache.state_dict()
        unique, aliases = _deduplicated(arrays)
        mx.eval(list(unique.values()))
        document = json.dumps({**header, "cache": fields, "aliases": aliases}, ensure_ascii=False)
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.safetensors")
        try:
            mx.save_safetensors(str(temporary), unique, metadata={_KEY: document})
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)

    model.worker.run(write)


def load_prompt_cache(model: SavingModel, path: str | os.PathLike[str]) -> tuple[PromptCache, dict[str, Any]]:
    """The prompt cache saved at ``path``, as a cache of ``model``, and the extras saved with it.

    Raises :class:`SavedStateError` when the file is not one, is damaged, or was written for another model.
    """
    source = Path(path)
    if not source.is_file():
        raise SavedStateError(f"{source}: no such file")

    def read() -> tuple[PromptCache, dict[str, Any]]:  # on the worker: the arrays become its
        try:
            loaded: Any = mx.load(str(source), format="safetensors", return_metadata=True)
            arrays: dict[str, mx.array] = loaded[0]
            header = json.loads(loaded[1][_KEY])
        except (KeyError, ValueError, RuntimeError) as exc:
            raise SavedStateError(f"{source}: not a file mlxchat saved ({type(exc).__name__}: {exc})") from None
        _check_header(header, model, source)
        for alias, name in header["aliases"].items():
            if name not in arrays:
                raise SavedStateError(f"{source}: damaged (the array {name!r} is missing)")
            arrays[alias] = arrays[name]
        try:
            check_token_ids(header["cache"]["tokens"], model.config.vocab_size, "saved token id")
        except (InvalidInputError, KeyError, TypeError) as exc:
            raise SavedStateError(f"{source}: damaged ({exc})") from None
        cache = model.make_prompt_cache()
        cache.load_state(arrays, header["cache"])
        mx.eval(list(arrays.values()))
        return cache, header["extras"]

    return model.worker.run(read)


def save_session(session: Any, path: str | os.PathLike[str]) -> None:
    """Save a :class:`~mlxchat.session.ChatSession` that is not in a turn: its transcript, settings, last
    report and calls (the fields the module docstring lists), and its prompt cache."""
    if session._busy:
        raise SessionStateError("a turn of this session is in progress; save it when the turn is over")
    state = {
        "messages": [m.model_dump() for m in session._messages],
        "system": session._system,
        "default_config": session._defaults.model_dump(mode="json"),
        "tools": session._tools,
        "context_policy": session._context_policy,
        "auto_tools": session._auto_tools,
        "max_tool_rounds": session._max_tool_rounds,
        "decisions": {call_id: vars(decision) for call_id, decision in session._decisions.items()},
        "hidden": session._hidden,
        "calls_made": session._calls_made,
        "report": session._report.model_dump(mode="json") if session._report is not None else None,
        "tool_calls": [{**c.model_dump(), "status": c.status, "raw": c.raw, "error": c.error}
                       for c in session._tool_calls],
    }
    save_prompt_cache(session.model, session.cache, path, {"session": state})


def load_session_state(model: SavingModel, path: str | os.PathLike[str]
                       ) -> tuple[list[ChatMessage], PromptCache, dict[str, Any]]:
    """A saved session's messages, its prompt cache (as a cache of ``model``) and its other fields."""
    cache, extras = load_prompt_cache(model, path)
    state = extras.get("session")
    if not isinstance(state, dict):
        raise SavedStateError(f"{path}: holds a prompt cache, not a session")
    try:
        messages = [ChatMessage.model_validate(m) for m in state["messages"]]
    except (ValidationError, KeyError, TypeError) as exc:
        raise SavedStateError(f"{path}: the saved messages are malformed ({exc})") from None
    return messages, cache, state


def restore_session(session_class: Any, model: Any, path: str | os.PathLike[str],
                    **options: Any) -> Any:
    """A ``session_class`` session over ``model`` resumed from ``path`` exactly as it was saved; ``options``
    (``ChatSession``'s: ``system``, ``tools``, ``default_config``, ``context_policy``) replace the saved ones."""
    messages, cache, state = load_session_state(model, path)
    try:
        tool_settings: dict[str, Any] = {k: state[k] for k in ("auto_tools", "max_tool_rounds") if k in state}
        settings = {"system": state["system"], "default_config": state["default_config"],
                    "tools": state["tools"] or None, "context_policy": state["context_policy"], **tool_settings,
                    **options}
        session = session_class(model, cache=cache, **settings)
        session.prime_history(messages)
        hidden, calls_made = state["hidden"], state["calls_made"]
        if not (isinstance(hidden, int) and 0 <= hidden <= len(messages)) or not isinstance(calls_made, int):
            raise ValueError(f"hidden {hidden!r} or calls_made {calls_made!r} is out of range")
        session._hidden = hidden
        session._calls_made = max(calls_made, session._calls_made)
        session._report = None if state["report"] is None else GenerationReport.model_validate(state["report"])
        session._tool_calls = [ToolCall.model_validate(c) for c in state["tool_calls"]]
        session._load_decisions(state.get("decisions", {}))
    except (ValidationError, KeyError, TypeError, ValueError) as exc:
        raise SavedStateError(f"{path}: the saved session is malformed ({exc})") from None
    return session


def _check_header(header: Any, model: SavingModel, source: Path) -> None:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SavedStateError(f"{source}: not a session or prompt cache mlxchat saved")
    if header.get("version") != VERSION:
        raise SavedStateError(f"{source}: saved in format version {header.get('version')!r}; this mlxchat reads "
                              f"version {VERSION}")
    if not all(isinstance(header.get(k), dict) for k in ("model", "cache", "aliases", "extras")):
        raise SavedStateError(f"{source}: damaged (its header lacks a part)")
    saved = header["model"].get("fingerprint") or {}
    mine = fingerprint(model)
    differ = [part for part in mine if saved.get(part) != mine[part]]
    if differ:
        where = header["model"].get("path") or "another model"
        detail = ", ".join(f"{part} {saved.get(part)!r} there, {mine[part]!r} here" if part in ("architecture", "dtype")
                           else part for part in differ)
        raise SavedStateError(f"{source}: saved for another model ({where}); its prompt cache fits only that model "
                              f"(differs: {detail}); load it with the model it was saved with")


def _deduplicated(arrays: dict[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays with each array object kept once, and the names that alias a kept one."""
    kept: dict[str, mx.array] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, array in arrays.items():
        if id(array) in first:
            aliases[name] = first[id(array)]
        else:
            first[id(array)] = name
            kept[name] = array
    return kept, aliases


def _digest(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
