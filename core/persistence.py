"""Sessions and prompt caches on disk, so that a conversation resumes with nothing to prefill again.

One file in the safetensors format: the arrays of the prompt cache (each layer's state and each snapshot's,
an array shared by several written once), and in its metadata one JSON document with the cache's layout
(tokens, image keys, layer fields such as ``KVCache.shifts``, snapshot positions), what the file was
written for, and the caller's extras (a session's transcript and settings). Loading rebuilds the exact
cache :meth:`~mlxchat.prompt_cache.PromptCache.state_dict` described, so the next turn reuses all of it,
on every kind of layer cache (KV, sliding window, conv and DeltaNet states).

A cache means something only to the model that made it: the file records a fingerprint of that model
(architecture, config, quantization, compute dtype, vocabulary) and refuses to load into another one,
naming what differs. The base weights are not fingerprinted (a fine-tune with the same config and vocabulary
is not told apart), but an unfused LoRA adapter is (:attr:`~mlxchat.GenerativeModel.adapter_digest`): a file
saved under another adapter (or none) loads with an empty cache, its extras intact, so a session resumes and
prefills its conversation again instead of reusing another model's keys and values.

Files are written to a temporary name and moved into place, so a crash or a full disk leaves the old file
or the new one, never half of one (a write that fails is a :class:`SavedStateError`).
The document holds a checksum of itself and of the arrays' bytes: a file damaged on disk since (truncated, a
bit flipped in the cache, the transcript or the header) is refused, never loaded as a wrong cache or session.
Files of format version 1 (their checksum covering the cache alone, or absent in the oldest) are still read.

A session is saved as the JSON of its :class:`~mlxchat.session_state.SessionState` (what
``ChatSession.export_state()`` gives, read back through ``import_state()``): ``messages``, ``system``,
``default_config``, ``tools`` (their JSON schemas: pass the functions again with ``tools=`` for automatic
calls), ``context_policy``, ``auto_tools``, ``max_tool_rounds``, ``decisions`` (approvals given while a turn
waits), ``hidden`` (messages a ``truncate_oldest`` policy leaves out), ``calls_made`` (the call-id counter),
``report`` and ``tool_calls`` (the last reply's). Only the session's public methods are used here.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import weakref
from pathlib import Path
from typing import Any, Literal, Protocol

import mlx.core as mx
from pydantic import ValidationError

from .architecture import Architecture
from .cache import check_kv_format
from .config import ModelConfig
from .errors import InvalidInputError, SavedStateError
from .files import durable_replace
from .limits import check_token_ids
from .multimodal import images_kept
from .prompt_cache import PromptCache
from .session_state import SETTINGS, SessionState
from .tokenizer import Tokenizer
from .worker import Worker

FORMAT = "mlxchat.saved"
VERSION = 2
"""The version written; 2's checksum covers the whole document (1's the cache's layout and arrays only)."""
READABLE = (1, 2)
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
    module: Any

    def make_prompt_cache(self, max_snapshots: int = ..., *, kv_bits: int | None | Literal["model"] = "model",
                          kv_group_size: int | None = None) -> PromptCache: ...


_fingerprints: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def fingerprint(model: SavingModel) -> dict[str, str]:
    """What a saved cache depends on, part by part (hashed where long): a cache loads only into a model
    whose every part is the same (but for the adapter: see the module)."""
    if model not in _fingerprints:
        _fingerprints[model] = {
            "architecture": model.architecture.name,
            "config": _digest(model.config.model_dump(mode="json")),
            "quantization": _digest(model.quantization),
            "dtype": str(model.dtype).removeprefix("mlx.core."),
            "vocabulary": _digest(model.tokenizer.backend.to_str()),
        }
    return {**_fingerprints[model], "adapter": getattr(model, "adapter_digest", "none")}


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
        # signed as it will be read back (JSON turns keys into strings: extras' {10: ...} sorted otherwise)
        signed = json.loads(json.dumps({**header, "cache": fields, "aliases": aliases}))
        document = json.dumps({**signed, "digest": _checksum(unique, signed)}, ensure_ascii=False)
        temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.safetensors")
        try:
            mx.save_safetensors(str(temporary), unique, metadata={_KEY: document})
            durable_replace(temporary, target)
        except (OSError, RuntimeError) as exc:  # a full disk, a folder gone: the old file stays as it was
            raise SavedStateError(f"could not write {target} ({type(exc).__name__}: {exc}); "
                                  "the file there before, if any, is unchanged") from None
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
        same_adapter = _check_header(header, arrays, model, source)
        for alias, name in header["aliases"].items():
            if not isinstance(name, str) or name not in arrays or alias in arrays:
                raise SavedStateError(f"{source}: damaged (the array {alias!r} names {name!r})")
            arrays[alias] = arrays[name]
        try:
            check_token_ids(header["cache"]["tokens"], model.config.vocab_size, "saved token id")
        except (InvalidInputError, KeyError, TypeError) as exc:
            raise SavedStateError(f"{source}: damaged ({exc})") from None
        kv_format = _kv_format(header["cache"].get("kv_format"), source)
        cache = model.make_prompt_cache(**kv_format)
        if same_adapter:
            cache.load_state(arrays, header["cache"], _layer_arrays(model, kv_format))
            mx.eval(list(arrays.values()))
        return cache, header["extras"]

    return model.worker.run(read)


def _kv_format(saved: Any, source: Path) -> dict[str, Any]:
    """The KV format a saved cache was written in (the loaded cache is made in it, whatever the model's)."""
    if saved is None:
        return {"kv_bits": None}
    try:
        bits, group_size = saved
        check_kv_format(bits, group_size)
    except (InvalidInputError, TypeError, ValueError) as exc:
        raise SavedStateError(f"{source}: damaged (its KV format {saved!r}: {exc})") from None
    return {"kv_bits": bits, "kv_group_size": group_size}


def save_session(session: Any, path: str | os.PathLike[str]) -> None:
    """Save a :class:`~mlxchat.session.ChatSession` that is not in a turn: its state (the module docstring says
    what that holds) and its prompt cache."""
    state = session.export_state()
    save_prompt_cache(session.model, session.cache, path, {"session": state.model_dump(mode="json")})


def load_session_state(model: SavingModel, path: str | os.PathLike[str]) -> tuple[PromptCache, SessionState]:
    """A saved session's prompt cache (as a cache of ``model``) and its state."""
    cache, extras = load_prompt_cache(model, path)
    saved = extras.get("session")
    if not isinstance(saved, dict):
        raise SavedStateError(f"{path}: holds a prompt cache, not a session")
    try:
        state = SessionState.model_validate(saved)
    except ValidationError as exc:
        raise SavedStateError(f"{path}: the saved session is malformed ({exc})") from None
    if not images_kept(state.messages):
        raise SavedStateError(f"{path}: an image of the saved conversation is not kept in it (a session saves its "
                              "images as data: URLs; a file or URL named in a saved one is not read)")
    return cache, state


def restore_session(session_class: Any, model: Any, path: str | os.PathLike[str], **options: Any) -> Any:
    """A ``session_class`` session over ``model`` resumed from ``path`` exactly as it was saved; ``options``
    (``ChatSession``'s) make the session, and those that are settings (``system``, ``tools``,
    ``default_config``, ``context_policy``, ``auto_tools``, ``max_tool_rounds``) replace the saved ones."""
    cache, state = load_session_state(model, path)
    session = session_class(model, cache=cache, **options)
    given = session.export_state()
    try:
        session.import_state(state.model_copy(update={name: getattr(given, name) for name in SETTINGS
                                                      if name in options}))
    except InvalidInputError as exc:  # a saved setting this model cannot take (tools, for one without a format)
        session.close()
        hint = "; tools=[] drops the saved tools" if state.tools and "tools" not in options else \
            "; give that setting again"
        raise SavedStateError(f"{path}: cannot be resumed over this model ({exc}){hint}") from None
    return session


def _layer_arrays(model: SavingModel, kv_format: dict[str, Any]) -> list[dict[str, mx.array]] | None:
    """Each layer cache's arrays in this model, with shapes and dtypes a saved cache must match: one token
    run through a fresh cache, lazily (the graph is built for its shapes and never computed). ``None``
    where the module cannot run so (the saved cache is then checked without them)."""
    probe = model.make_prompt_cache(**kv_format)
    try:
        model.module(mx.array([[0]]), probe.layers)
    except (TypeError, ValueError, RuntimeError):  # a module that needs more than tokens
        return None
    return [layer.state_dict()[0] for layer in probe.layers]


def _check_header(header: Any, arrays: dict[str, mx.array], model: SavingModel, source: Path) -> bool:
    """Refuse a file that is not one of ours, is damaged or was saved for another model; whether it was saved
    under the adapter the model has now (files from before adapters were recorded: under none)."""
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SavedStateError(f"{source}: not a session or prompt cache mlxchat saved")
    if type(header.get("version")) is not int or header["version"] not in READABLE:
        raise SavedStateError(f"{source}: saved in format version {header.get('version')!r}; this mlxchat reads "
                              f"versions {', '.join(map(str, READABLE))}")
    if not all(isinstance(header.get(k), dict) for k in ("model", "cache", "aliases", "extras")) or \
            not isinstance(header["model"].get("fingerprint") or {}, dict):
        raise SavedStateError(f"{source}: damaged (its header lacks a part)")
    digest = header.get("digest")
    if header["version"] == 1:  # its checksum covered the cache alone (the oldest files had none)
        intact = digest is None or digest == _checksum(arrays, header["cache"])
    else:
        intact = digest == _checksum(arrays, {key: value for key, value in header.items() if key != "digest"})
    if not intact:
        raise SavedStateError(f"{source}: damaged (it does not match the checksum written with it)")
    saved = {"adapter": "none", **(header["model"].get("fingerprint") or {})}
    mine = fingerprint(model)
    differ = [part for part in mine if part != "adapter" and saved.get(part) != mine[part]]
    if differ:
        where = header["model"].get("path") or "another model"
        detail = ", ".join(f"{part} {saved.get(part)!r} there, {mine[part]!r} here" if part in ("architecture", "dtype")
                           else part for part in differ)
        raise SavedStateError(f"{source}: saved for another model ({where}); its prompt cache fits only that model "
                              f"(differs: {detail}); load it with the model it was saved with")
    return bool(saved["adapter"] == mine["adapter"])


def _checksum(arrays: dict[str, mx.array], layout: dict[str, Any]) -> str:
    """A digest of the cache's layout (tokens, layer fields) and its arrays' names, dtypes, shapes and bytes."""
    digest = hashlib.blake2b(json.dumps(layout, sort_keys=True).encode(), digest_size=16)
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        view = memoryview(array)  # type: ignore[arg-type]
        digest.update(view if view.c_contiguous else view.tobytes())
    return digest.hexdigest()


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
