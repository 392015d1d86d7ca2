"""Builders of fixture folders: a tiny random checkpoint of a transformers class, a small tokenizer, a
chat template, and the oracle's outputs stored beside them (``reference.npz``), which
:func:`mlxchat.testing.assert_parity` compares with.

These run when fixtures are built, not when tests run: they need torch and transformers (mlxchat's
``fixtures`` extra), imported inside the functions. A builder script of a plugin reads like::

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from mlxchat.testing.builders import build_fixture, byte_level_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    build_fixture(folder, LlamaForCausalLM(config).eval(), byte_level_tokenizer(SPECIALS),
                  template=TEMPLATE, tokenizer_config={"eos_token": "<|eot_id|>", "bos_token": None})
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

SEED = 1234
SEQ_LEN = 40
"""Length of the reference sequence (longer than any sliding window or chunk a fixture exercises)."""
PROMPT_LEN = 12
GREEDY_TOKENS = 32

_WORDS = ("the capital of france is paris and the weather in tokyo is sunny today what time is it in rome "
          "hello hi thanks you are a helpful assistant please call the function get_weather city name "
          "arguments think about it first then answer user system tool response numbers 0 1 2 3 4 5 6 7 8 9 "
          "json { } [ ] : , \" ' . ? ! - _ = < > / | ( ) \n").split(" ")


def corpus(lines: int = 400) -> list[str]:
    """Seeded chat-like text for training a tiny tokenizer."""
    rng = random.Random(SEED)
    out = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]
    out.append('{"name": "get_weather", "arguments": {"city": "Paris"}}')
    return out


def byte_level_tokenizer(specials: list[tuple[str, bool]], vocab_size: int = 420) -> Any:
    """A byte-level BPE (every string round-trips) with a GPT-style pre-tokenizer split and the given added
    tokens, as ``(text, special)`` pairs, numbered after the learned vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in specials])
    return tok


def save_tokenizer(folder: Path, tok: Any, config: dict[str, Any], template: str | None) -> None:
    """tokenizer.json, tokenizer_config.json (with the added tokens) and chat_template.jinja."""
    tok.save(str(folder / "tokenizer.json"))
    added = {str(tok.token_to_id(t.content)): {"content": t.content, "special": t.special}
             for t in tok.get_added_tokens_decoder().values()}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, **config}, indent=1))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)


def perturb(model: Any, *, norm_scale: float = 0.3, router_scale: float = 0.5) -> None:
    """Move weights away from their init values so that a wrong norm or routing shows in the logits (norms
    initialised to ones would hide a missing one)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.add_(norm_scale * torch.randn(param.shape, generator=gen))
            elif name.endswith("mlp.gate.weight") or "router" in name:
                param.copy_(router_scale * torch.randn(param.shape, generator=gen))


def write_reference(folder: Path, model: Any, vocab_size: int, *, variant_of: str | None = None) -> None:
    """transformers' float32 outputs for a seeded random sequence: the full forward's logits
    (``logits``), the logits of the prompt in one chunk and then one token at a time through its own cache
    (``stepwise_logits``), and the greedy continuation of the prompt (``greedy``); and fixture.json."""
    import torch
    import transformers

    rng = np.random.default_rng(SEED)
    ids = rng.integers(0, vocab_size, size=SEQ_LEN).astype(np.int32)
    tokens = torch.tensor(ids[None], dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens).logits[0].float().numpy()
        out = model(tokens[:, :PROMPT_LEN], use_cache=True)
        steps = [out.logits[0].float().numpy()]
        for i in range(PROMPT_LEN, SEQ_LEN):
            out = model(tokens[:, i : i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits[0].float().numpy())
        prompt = tokens[:, :PROMPT_LEN]
        generated = model.generate(prompt, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                                   do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    np.savez_compressed(folder / "reference.npz", input_ids=ids, logits=logits.astype(np.float32),
                        stepwise_logits=np.concatenate(steps).astype(np.float32), prompt_len=np.int32(PROMPT_LEN),
                        greedy=generated[0, PROMPT_LEN:].numpy().astype(np.int32))
    write_fixture_info(folder, f"transformers {transformers.__version__} {type(model).__name__}, float32 "
                       f"(torch {torch.__version__})", variant_of)


def write_fixture_info(folder: Path, oracle: str, variant_of: str | None = None, kind: str = "text",
                       tolerance: float | None = None, tolerance_note: str | None = None) -> None:
    """fixture.json: what the reference came from, for a variant of another fixture which one, the kind of
    reference ("vision": prompts with images, which :func:`assert_parity` does not read), and a tolerance
    other than the default, with why."""
    info = {"oracle": oracle, **({"variant_of": variant_of} if variant_of else {}),
            **({"kind": kind} if kind != "text" else {}),
            **({"tolerance": tolerance, "tolerance_note": tolerance_note} if tolerance is not None else {})}
    (folder / "fixture.json").write_text(json.dumps(info, indent=1) + "\n")


def build_fixture(
    folder: Path,
    model: Any,
    tokenizer: Any,
    *,
    template: str | None,
    tokenizer_config: dict[str, Any],
    generation_config: dict[str, Any] | None = None,
    variant_of: str | None = None,
) -> None:
    """A whole fixture folder from a transformers model in eval mode and a ``tokenizers`` tokenizer: the
    weights perturbed (:func:`perturb`) and saved, the tokenizer, chat template and generation config
    written, and transformers' outputs stored as the reference."""
    perturb(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder, tokenizer, tokenizer_config, template)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    write_reference(folder, model, model.config.get_text_config().vocab_size, variant_of=variant_of)


DELETE = object()
"""A :func:`patch_config` value that removes the key."""


def patch_config(folder: Path, **changes: Any) -> None:
    """Edit config.json: set keys, or remove those given ``DELETE`` (e.g. to write a release's dialect)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))
