"""Training a byte-level BPE tokenizer in Qwen's shape: every string round-trips, numbers are split into
single digits (so arithmetic is learnt digit by digit), and the control tokens are added tokens."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

# Qwen2/Qwen3's pre-tokenizer split: ``\p{N}`` alone keeps every digit its own piece.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen's split, except that a capitalised word is split into its letters (and never takes the space or mark
# before it). A name is then the same pieces after a space as after a quote, and copying a name never seen in
# training is copying a few dozen letter tokens, as copying a number is copying digits: a 2M-parameter model
# copies digits early in training, yet failed to copy unseen names made of a few hundred BPE pieces.
NAME_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?<!\p{L})(?![\p{Lu}\p{Lt}])\p{L}+|\p{L}|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# (text, special) as in Qwen3's tokenizer: the chat markers are special (dropped by
# ``skip_special_tokens``); the reasoning and tool markers are not, so they survive decoding.
QWEN_SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<think>", False), ("</think>", False), ("<tool_call>", False), ("</tool_call>", False),
    ("<tool_response>", False), ("</tool_response>", False),
)


def _pipeline(split: str) -> Backend:
    tok = Backend(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_specials(tok: Backend, special_tokens: Sequence[tuple[str, bool]]) -> Backend:
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in special_tokens])
    return tok


def untrained_tokenizer(special_tokens: Sequence[tuple[str, bool]] = QWEN_SPECIAL_TOKENS) -> Backend:
    """The pipeline with the control tokens and no vocabulary yet: enough to render chat templates (which
    need to know the control tokens) before there is text to train on."""
    return _add_specials(_pipeline(QWEN_SPLIT), special_tokens)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[tuple[str, bool]] = QWEN_SPECIAL_TOKENS,
    split: str = QWEN_SPLIT,
) -> Backend:
    """A byte-level BPE of ``vocab_size`` pieces (the 256 bytes included) trained on ``texts``, with
    ``special_tokens`` appended after it as added tokens, as Qwen's vocabulary has them. ``split`` is the
    pre-tokenizer's regular expression (no piece crosses a boundary it draws).

    Control-token text in ``texts`` (rendered chats are full of it) is cut out before training, so no
    merges are spent on pieces of the markers.
    """
    markers = re.compile("|".join(re.escape(text) for text, _ in special_tokens) or "(?!)")

    def pieces() -> Iterator[str]:
        for text in texts:
            yield from (p for p in markers.split(text) if p)

    tok = _pipeline(split)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(pieces(), trainer)
    return _add_specials(tok, special_tokens)
