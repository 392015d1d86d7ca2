"""SFT with LoRA on the demo model: teach it conversions from smaller to larger units, which it gets wrong.

    python experiments/lora_units.py [--steps 300] [--out runs/lora_units]

The demo model converts larger units to smaller ones ("5 kilometers in meters" -> 5000) and was never shown
the other way. This trains a rank-8 LoRA adapter on "How many kilometers are in 5000 meters?" questions
(worked as a division in the reasoning, like its own multiplications), with a quarter of the examples in the
direction it knows so it keeps that; then measures greedy accuracy on held-out amounts, both directions,
before and after. Prints one JSON line; the adapter is written in peft's layout to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import mlxchat
from mlxchat.demo.data import CONVERSION_QUESTIONS, conversion_exchange
from mlxchat.demo.world import CONVERSIONS
from mlxchat.train import TrainConfig, encode_chat, lora, save_adapter, train

_NUMBER = re.compile(r"-?\d+")


def upward(index: int, n: int, phrasing: int) -> tuple[list[dict], int]:
    """A smaller-to-larger question: ``n * factor`` small units in large ones, answer ``n``."""
    large, large_plural, small_plural, factor = CONVERSIONS[index]
    amount = n * factor
    question = CONVERSION_QUESTIONS[phrasing].format(n=amount, unit=small_plural, to=large_plural)
    name = large if n == 1 else large_plural
    reasoning = (f"1 {large} is {factor} {small_plural}, so {amount} {small_plural} is {amount} ÷ {factor} = {n} "
                 f"{name}.")
    answer = f"{amount} {small_plural} is {n} {name}."
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": answer, "reasoning_content": reasoning}], n


def accuracy(model: mlxchat.GenerativeModel, items: list[tuple[list[dict], int]]) -> float:
    prompts = [messages[:1] for messages, _ in items]
    results = model.generate_batch(prompts, {"temperature": 0.0, "max_tokens": 120})
    right = 0
    for result, (_, expected) in zip(results, items, strict=True):
        numbers = _NUMBER.findall(result.text.rsplit("</think>", 1)[-1])
        right += bool(numbers) and int(numbers[-1]) == expected
    return right / len(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/lora_units")
    args = parser.parse_args()
    rng = random.Random(0)
    pairs = [(i, n) for i in range(len(CONVERSIONS)) for n in range(1, 100)]
    held_out = set(rng.sample(pairs, 60))
    trained = [p for p in pairs if p not in held_out]
    test_up = [upward(i, n, rng.randrange(len(CONVERSION_QUESTIONS))) for i, n in sorted(held_out)]
    test_down = [(conversion_exchange(i, n, rng.randrange(len(CONVERSION_QUESTIONS))).messages, n * CONVERSIONS[i][3])
                 for i, n in sorted(held_out)]

    model = mlxchat.load_model()
    before = {"smaller_to_larger": accuracy(model, test_up), "larger_to_smaller": accuracy(model, test_down)}
    examples = []
    stop = model.tokenizer.token_id("<|im_end|>")
    for i, n in trained:
        messages, _ = upward(i, n, rng.randrange(len(CONVERSION_QUESTIONS)))
        examples.append(encode_chat(model.chat_template, messages, stop_ids={stop}))
        if rng.random() < 0.33:
            known = conversion_exchange(i, n, rng.randrange(len(CONVERSION_QUESTIONS))).messages
            examples.append(encode_chat(model.chat_template, known, stop_ids={stop}))
    lora(model, rank=8, alpha=16, seed=0)
    start = time.perf_counter()
    log = train(model, examples, TrainConfig(steps=args.steps, learning_rate=2e-3, warmup_steps=20,
                                             batch_tokens=2048, weight_decay=0.0, log_every=50))
    seconds = time.perf_counter() - start
    after = {"smaller_to_larger": accuracy(model, test_up), "larger_to_smaller": accuracy(model, test_down)}
    save_adapter(model, args.out)
    print(json.dumps({"held_out": len(held_out), "train_examples": len(examples), "steps": args.steps,
                      "train_seconds": round(seconds, 1), "final_loss": round(log[-1].loss, 4),
                      "before": before, "after": after}))


if __name__ == "__main__":
    main()
