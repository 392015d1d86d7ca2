"""Streaming detokenization that never splits a UTF-8 character and never emits a replacement character
for bytes that are still arriving."""

from __future__ import annotations

from .tokenizer import Tokenizer

# Decoding restarts from a recent token every so often so that a long reply costs O(n), not O(n^2).
_WINDOW = 24


class StreamingDetokenizer:
    """Feed token ids one at a time; get back the text they complete.

    Decodes a short window of recent tokens and emits what the window's text gained. A window ending in an
    incomplete character (decoded as U+FFFD) waits for the next token.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self._start = 0
        self._window_text = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        window = self.tokenizer.decode(self.tokens[self._start :])
        if window.endswith("\ufffd"):
            return ""
        delta = self._delta(window)
        if len(self.tokens) - self._start > _WINDOW:
            # Re-anchor on the last token: its decoded text is the base the next deltas are measured from.
            self._start = len(self.tokens) - 1
            self._window_text = self.tokenizer.decode(self.tokens[self._start :])
        return delta

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character is emitted as decoded)."""
        return self._delta(self.tokenizer.decode(self.tokens[self._start :]))

    def _delta(self, window: str) -> str:
        if window.startswith(self._window_text):
            delta = window[len(self._window_text) :]
        else:  # the decoder rewrote earlier text (rare): measure against a full decode instead
            delta = self.tokenizer.decode(self.tokens)[len(self.text) :]
        self._window_text = window
        self.text += delta
        return delta
