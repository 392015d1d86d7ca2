"""Tokenizer: a ``tokenizers`` backend with the checkpoint's special-token settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import Tokenizer as Backend
from tokenizers import models

from .checkpoint import read_json
from .errors import CheckpointError, InvalidInputError, MlxchatError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    """``tokenizer_config.json`` writes tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


LONG_TEXT = 16_384
"""Characters from which :meth:`Tokenizer.encode` releases the GIL while it works."""

T = TypeVar("T")


def _tokenized(encode: Callable[[], T]) -> T:
    """What ``encode`` gives; a panic of the Rust tokenizer is an :class:`InvalidInputError`. Its regex engine gives
    up on some texts (a run of ten million spaces: "retry-limit-in-match"), and pyo3 raises that as a
    ``PanicException``, a ``BaseException`` that no caller expects of a text."""
    try:
        return encode()
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise InvalidInputError(f"the tokenizer cannot split this text ({exc}); shorten it or break up its "
                                "longest runs of one character") from None


class Tokenizer:
    """Encodes and decodes text; knows the added (control) tokens and the special-token map."""

    def __init__(self, backend: Backend, config: dict[str, Any] | None = None):
        self.backend = backend
        self.config = config or {}
        self.special_tokens: dict[str, str] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(self.config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        added = backend.get_added_tokens_decoder()
        declared = self.config.get("added_tokens_decoder") or {}
        if not isinstance(declared, dict) or not all(isinstance(i, str) and i.isdecimal() for i in declared):
            raise CheckpointError("tokenizer_config.json: added_tokens_decoder must be an object of tokens by their "
                                  "ids ({\"151643\": {\"content\": ...}, ...})")
        for index, token in declared.items():
            content = _token_text(token)
            if content is not None and int(index) not in added and backend.token_to_id(content) is None:
                raise CheckpointError(f"tokenizer_config.json: added token {content!r} is not in tokenizer.json")
        self.added_tokens: dict[str, int] = {tok.content: idx for idx, tok in added.items()}
        self.special_ids: set[int] = {idx for idx, tok in added.items() if tok.special}

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: file not found (mlxchat reads tokenizers in the tokenizer.json format)")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a plain Exception with serde's message
            raise CheckpointError(f"{path}: cannot read tokenizer ({exc})") from exc
        return cls(backend, read_json(folder / "tokenizer_config.json", required=False))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def longest_token(self) -> int:
        """Characters of the longest token (byte-level vocabularies: bytes), a bound on how much text one token
        covers (it walks the vocabulary: keep what it gives)."""
        return max((len(token) for token in self.backend.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; added tokens written in it become their control tokens.

        ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a BOS), as for a raw prompt;
        chat templates write their own BOS, so rendered chats are encoded without it.
        """
        if len(text) < LONG_TEXT:
            return _tokenized(lambda: self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        # (the batch form lets go of the GIL: a long prompt tokenized on a server's thread leaves its event loop
        # running; the same ids)
        return _tokenized(lambda: self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` read as plain text: no added token is recognised in it."""
        return _tokenized(lambda: self._plain_ids(text))

    def _plain_ids(self, text: str) -> list[int]:
        normalizer, pre_tokenizer = self.backend.normalizer, self.backend.pre_tokenizer
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        pieces = [text] if pre_tokenizer is None else [p for p, _ in pre_tokenizer.pre_tokenize_str(text)]
        return [tok.id for piece in pieces for tok in self.backend.model.tokenize(piece)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


class NoTokenizer(Tokenizer):
    """The tokenizer of a model built without one (:func:`mlxchat.build_model`): prompts are token ids,
    and replies decode to no text."""

    def __init__(self) -> None:
        super().__init__(Backend(models.WordLevel(vocab={}, unk_token=None)))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise MlxchatError("this model was built without a tokenizer: give token ids, or build it with "
                           "tokenizer= (a checkpoint folder holding tokenizer.json)")

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text)
