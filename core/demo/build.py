"""Build the demo model from nothing: data, tokenizer, training, evaluation, the shipped checkpoint.

    python -m mlxchat.demo.build [--out FOLDER] [--seed 0] [--steps N] ...

Every step is seeded, so the same command on the same machine rebuilds the same model. Without ``--out``
it replaces the model shipped in the package (``mlxchat/demo/model``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..chat_template import ChatTemplate
from ..checkpoint import read_json
from ..loading import load_model
from ..tokenizer import Tokenizer
from ..tools.schema import tool_schemas
from ..train import (
    NAME_SPLIT,
    Example,
    LogRecord,
    TrainConfig,
    encode_chat,
    from_scratch,
    save_checkpoint,
    train,
    train_tokenizer,
    untrained_tokenizer,
)
from . import MODEL_DIR
from .data import Conversation, DemoData
from .evaluate import evaluate
from .world import DEMO_TOOLS

TEMPLATE = Path(__file__).with_name("qwen3.jinja")


@dataclass(frozen=True)
class Recipe:
    """Everything the build depends on besides the code. The shipped model's card lists the flags of each of
    its stages (a stage goes on from the checkpoint the one before wrote, ``init``)."""

    seed: int = 0
    conversations: int = 80000
    vocab_size: int = 2048
    """At most this many BPE pieces (the 256 bytes included; the control tokens come on top). The demo data
    runs out of merges before that: with names spelt letter by letter (``NAME_SPLIT``) it has about 960."""
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    steps: int = 6800
    learning_rate: float = 1e-3
    """At 3e-3 (hidden size 256) a build had learnt none of the held-out tasks after 1500 steps; 1e-3 had some."""
    warmup_steps: int = 100
    batch_tokens: int = 2048
    weight_decay: float = 0.1
    eval_every: int = 1000
    fresh_places: bool = True
    """See :class:`~mlxchat.demo.data.DemoData`."""
    mixture: str = ""
    """Task weights replacing some of :data:`~mlxchat.demo.data.MIXTURE`'s, as ``task=weight,...``."""
    init: str = ""
    """A checkpoint folder to go on training (its tokenizer and shape are kept); empty: from nothing."""


def parse_mixture(text: str) -> dict[str, float]:
    """``"capital=30,arithmetic=40"`` -> ``{"capital": 30.0, "arithmetic": 40.0}``."""
    weights = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        task, _, weight = item.partition("=")
        try:
            weights[task.strip()] = float(weight)
        except ValueError:
            raise ValueError(f"mixture item {item!r} is not task=weight") from None
    return weights


def hf_config(recipe: Recipe, vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """The checkpoint's ``config.json``: a small Qwen3, tied embeddings, vocabulary padded to 64."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": -(-vocab_size // 64) * 64,
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_hidden_layers,
        "num_attention_heads": recipe.num_attention_heads,
        "num_key_value_heads": recipe.num_key_value_heads,
        "head_dim": recipe.hidden_size // recipe.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }


def tokenizer_for(conversations: Sequence[Conversation], recipe: Recipe, source: str) -> Tokenizer:
    """A BPE trained on the rendered training conversations."""
    tools = tool_schemas(DEMO_TOOLS)
    bootstrap = ChatTemplate(source, Tokenizer(untrained_tokenizer()))
    texts = [bootstrap.render(c.messages, tools=tools if c.tools else None, add_generation_prompt=False)
             for c in conversations[:10000]]
    backend = train_tokenizer(texts, recipe.vocab_size, split=NAME_SPLIT)
    return Tokenizer(backend, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                               "model_max_length": 4096, "clean_up_tokenization_spaces": False,
                               "split_special_tokens": False})


def encode_all(conversations: Sequence[Conversation], template: ChatTemplate, stop_id: int) -> list[Example]:
    tools = tool_schemas(DEMO_TOOLS)
    examples = []
    for c in conversations:
        example = encode_chat(template, c.messages, tools=tools if c.tools else None, stop_ids={stop_id})
        if not example.trained_turns:
            raise RuntimeError(f"no assistant turn of a {c.task!r} conversation is trainable: {c.messages}")
        examples.append(example)
    return examples


def build(recipe: Recipe, out: Path, eval_limit: int | None = None, log: Any = print) -> dict[str, Any]:
    """Run the whole build into ``out``; returns the report (also written to ``out/build_report.json``)."""
    started = time.perf_counter()
    data = DemoData(recipe.seed, recipe.fresh_places, parse_mixture(recipe.mixture))
    conversations = data.training(recipe.conversations)
    source = TEMPLATE.read_text(encoding="utf-8")
    start = load_model(recipe.init) if recipe.init else None
    tokenizer = start.tokenizer if start else tokenizer_for(conversations, recipe, source)
    template = ChatTemplate(source, tokenizer)
    eos_id, pad_id = tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>")
    assert eos_id is not None and pad_id is not None
    examples = encode_all(conversations, template, eos_id)
    validation = encode_all(data.validation()[::3], template, eos_id)  # a third keeps evaluation cheap
    prepared = time.perf_counter() - started
    log(f"data: {len(examples)} conversations, {sum(len(e.ids) for e in examples)} tokens "
        f"({sum(sum(e.mask) for e in examples)} targets); tokenizer {tokenizer.vocab_size}; {prepared:.0f} s")

    if start:
        config = {k: v for k, v in read_json(Path(recipe.init) / "config.json").items() if k != "dtype"}
        module = cast(nn.Module, start.module)
    else:
        config = hf_config(recipe, tokenizer.vocab_size, eos_id, pad_id)
        module = from_scratch(config, seed=recipe.seed)
    params = sum(v.size for v in dict(tree_flatten(module.parameters())).values())
    log(f"model: {params / 1e6:.2f}M parameters")
    train_config = TrainConfig(steps=recipe.steps, learning_rate=recipe.learning_rate,
                               warmup_steps=recipe.warmup_steps, batch_tokens=recipe.batch_tokens,
                               weight_decay=recipe.weight_decay, eval_every=recipe.eval_every, log_every=50,
                               seed=recipe.seed)

    def save() -> None:
        save_checkpoint(out, module, config=config, tokenizer=tokenizer, chat_template=source,
                        generation_config={"bos_token_id": pad_id, "eos_token_id": [eos_id, pad_id],
                                           "pad_token_id": pad_id, "do_sample": False})

    def report(r: LogRecord) -> None:
        log(f"step {r.step:5d} {r.kind:5s} loss {r.loss:.4f} lr {r.learning_rate:.2e} {r.elapsed_s:6.0f} s")
        if r.kind == "eval":
            save()  # a usable checkpoint at every evaluation, so a long build can be inspected or stopped

    history = train(module, examples, train_config, eval_examples=validation, on_log=report)
    trained = time.perf_counter() - started - prepared
    scores = evaluate(load_model(out), recipe.seed, eval_limit)
    earlier = read_json(Path(recipe.init) / "build_report.json") if recipe.init else {}
    result: dict[str, Any] = {
        "recipe": asdict(recipe),
        "stages": [*earlier.get("stages", []), {"recipe": asdict(recipe), "scores": scores}],
        "parameters": params,
        "vocabulary": tokenizer.vocab_size,
        "scores": scores,
        "eval_limit": eval_limit,
        "seconds": {"data": round(prepared), "training": round(trained),
                    "total": round(time.perf_counter() - started) + earlier.get("seconds", {}).get("total", 0)},
        "final_loss": {kind: next((r.loss for r in reversed(history) if r.kind == kind), None)
                       for kind in ("train", "eval")},
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} cores",
    }
    (out / "build_report.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "README.md").write_text(model_card(result), encoding="utf-8")
    for metric, value in scores.items():
        log(f"{metric:14s} {100 * value:6.1f}%")
    log(f"total {result['seconds']['total']} s")
    return result


METRIC_NAMES = {
    "capitals": "capital of a country (unseen phrasing)",
    "arithmetic": "two-digit addition and subtraction (unseen problems)",
    "conversions": "metric unit conversion (unseen amounts)",
    "tool_calls": "one tool call: valid JSON, right function and city (unseen cities)",
    "two_calls": "two calls in one turn for two cities (unseen cities)",
    "tool_answers": "answer quotes every tool result and city",
    "dont_know": "says \"I don't know\" outside its world",
}


def model_card(result: dict[str, Any]) -> str:
    """The checkpoint's README: what the model is, what it is not, and how it scored."""
    stages = [stage["recipe"] for stage in result["stages"]]
    first = stages[0]
    rows = "\n".join(f"| {METRIC_NAMES[m]} | {100 * v:.1f}% |" for m, v in result["scores"].items())
    limit = f" (first {result['eval_limit']} items per metric)" if result["eval_limit"] else ""
    commands = "\n".join(f"    python -m mlxchat.demo.build {stage_arguments(r, i, len(stages))}".rstrip()
                          for i, r in enumerate(stages))
    steps = sum(r["steps"] for r in stages)
    return f"""# mlxchat demo model

A {result['parameters'] / 1e6:.1f}M-parameter Qwen3-architecture chat model that mlxchat trains itself, from
nothing, with `python -m mlxchat.demo.build` (seed {first['seed']}): synthetic conversations of a tiny
world rendered through the real Qwen3 chat template, a byte-level BPE of {result['vocabulary']} tokens trained
on them (capitalised words spelt letter by letter, so that the model can copy names it has never seen),
{steps} AdamW steps of {first['batch_tokens']} tokens with the loss on the assistant's turns only, in
{len(stages)} stage(s):

{commands}

Each stage goes on from the checkpoint the one before wrote; the last writes the package's model.
It ships inside the package so that `mlxchat chat` and `mlxchat generate` work offline, and it is the
subject of mlxchat's end-to-end tests.

**What it does**: names the capital of about 100 countries; adds and subtracts two-digit numbers, reasoning
digit by digit inside `<think>`; converts metric units; answers greetings and thanks; calls the tools
`get_weather(city)` and `get_time(city)` (`mlxchat.demo.world.DEMO_TOOLS`), one or two calls in a turn,
and writes its answer from the tool results; says it does not know anything else.

**What it is not**: a general assistant. It has seen nothing outside that world, conversations of a few
hundred tokens, and only these two tools; the tools themselves are deterministic stand-ins. And it makes
mistakes: the held-out accuracy below (questions, numbers and city names it was never trained on) is what
to expect.

Held-out accuracy, greedy{limit}:

| held-out task | accuracy |
|---|---|
{rows}

Built in {result['seconds']['total'] / 60:.0f} minutes on {result['machine']}; the full report is
`build_report.json`.
"""


def stage_arguments(recipe: dict[str, Any], index: int, count: int) -> str:
    """The command-line flags of stage ``index`` of ``count``: those that differ from the default recipe, and
    the folders that chain the stages (``stage1``, ... in place of the paths the build was run with)."""
    default = asdict(Recipe())
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in recipe.items() if k != "init" and v != default[k]]
    if index > 0:
        flags.append(f"--init stage{index}")
    if index < count - 1:
        flags.append(f"--out stage{index + 1}")
    return " ".join(flags)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxchat.demo.build", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the package's model)")
    parser.add_argument("--eval-limit", type=int, default=None,
                        help="held-out items per metric (default: all)")
    for f in fields(Recipe):
        kind = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(f.default, bool) else type(f.default)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)
    args = parser.parse_args(argv)
    recipe = replace(Recipe(), **{f.name: getattr(args, f.name) for f in fields(Recipe)
                                  if getattr(args, f.name) is not None})
    build(recipe, args.out or MODEL_DIR, args.eval_limit, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
