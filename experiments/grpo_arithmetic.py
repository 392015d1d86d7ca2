"""GRPO on the demo model: two-digit addition and subtraction, rewarded only for the right final number.

    python experiments/grpo_arithmetic.py [--steps 80] [--seed 0] [--results experiments/results]

The demo model gets about 95% of its 300 held-out problems right (greedy). This samples groups of answers
to training problems (never the held-out ones), rewards exact final numbers (mlxchat.train.rewards.exact_match)
and updates a rank-8 LoRA adapter with GRPO; then measures accuracy on the held-out problems again, greedy and
sampled (``--samples`` answers a problem at the run's temperature).

Writes, under ``--results``, ``grpo_arithmetic_seed<N>.json`` (the summary: accuracies, the exact sign tests of
the held-out changes, the reward's trend) and ``grpo_arithmetic_seed<N>_steps.jsonl`` (one record a step, written
as the run goes); the adapter and resumable checkpoints go to ``--out`` (a run started again resumes there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np

import mlxchat
from mlxchat.demo.data import ADD_QUESTIONS, SUB_QUESTIONS, DemoData
from mlxchat.train import GRPOConfig, GRPORecord, grpo, lora, rewards, save_adapter

_NUMBER = re.compile(r"-?\d+")
MAX_TOKENS = 160


def answers(model: mlxchat.GenerativeModel, items: list, temperature: float, samples: int, seed: int) -> list[list]:
    """Each held-out item's final numbers (``None`` where the reply has none), ``samples`` replies an item
    (greedy: one)."""
    rows = [item for item in items for _ in range(samples)]
    configs = [{"temperature": temperature, "max_tokens": MAX_TOKENS, "seed": seed * 100_003 + n}
               for n in range(len(rows))]
    results = model.generate_batch([item.messages for item in rows], configs)
    found = []
    for result in results:
        numbers = _NUMBER.findall(result.text.rsplit("</think>", 1)[-1])
        found.append(int(numbers[-1]) if numbers else None)
    return [found[i * samples:(i + 1) * samples] for i in range(len(items))]


def sign_test(up: int, down: int) -> float:
    """Two-sided exact sign test (McNemar's exact test on paired changes): the chance of a split at least this
    uneven if changes went either way with probability 1/2."""
    n, k = up + down, min(up, down)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def paired(before: list[int], after: list[int]) -> dict:
    """Items better and worse after (per item counts of right answers), with the sign test over them."""
    up = sum(a > b for b, a in zip(before, after, strict=True))
    down = sum(a < b for b, a in zip(before, after, strict=True))
    return {"better": up, "worse": down, "p_value": round(sign_test(up, down), 4)}


def trend(log: list[GRPORecord]) -> dict:
    """The sampled reward's first and last quarter and its least-squares slope per 100 steps (with its
    standard error), over the run's steps."""
    rewards_ = np.array([r.reward for r in log])
    steps = np.arange(1, len(log) + 1, dtype=float)
    quarter = max(len(log) // 4, 1)
    slope, se = 0.0, 0.0
    if len(log) > 2:
        design = np.stack([steps, np.ones_like(steps)], axis=1)
        coef, residual, *_ = np.linalg.lstsq(design, rewards_, rcond=None)
        slope = float(coef[0])
        sigma2 = float(residual[0]) / (len(log) - 2) if residual.size else 0.0
        se = math.sqrt(sigma2 / float(((steps - steps.mean()) ** 2).sum()))
    return {"reward_first_quarter": round(float(rewards_[:quarter].mean()), 4),
            "reward_last_quarter": round(float(rewards_[-quarter:].mean()), 4),
            "reward_slope_per_100_steps": round(100 * slope, 4), "slope_standard_error": round(100 * se, 4)}


def training_prompts(data: DemoData, count: int, rng: random.Random) -> list[dict]:
    prompts = []
    while len(prompts) < count:
        op, a, b = rng.choice("+-"), rng.randint(10, 99), rng.randint(10, 99)
        if (op, a, b) in data.split.arithmetic:
            continue
        questions = ADD_QUESTIONS if op == "+" else SUB_QUESTIONS
        question = rng.choice(questions).format(a=a, b=b)
        prompts.append({"messages": [{"role": "user", "content": question}], "answer": a + b if op == "+" else a - b})
    return prompts


def evaluate(model: mlxchat.GenerativeModel, items: list, temperature: float, samples: int, seed: int) -> dict:
    greedy = answers(model, items, 0.0, 1, seed)
    sampled = answers(model, items, temperature, samples, seed)
    expected = [item.expected["answer"] for item in items]
    return {"greedy": [g[0] for g in greedy],
            "greedy_right": [int(g[0] == e) for g, e in zip(greedy, expected, strict=True)],
            "sampled_right": [sum(s == e for s in row) for row, e in zip(sampled, expected, strict=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0, help="the adapter's start, the sampling and the data order")
    parser.add_argument("--out", default=None, help="adapter and checkpoints (default runs/grpo_arithmetic_seed<N>)")
    parser.add_argument("--results", default="experiments/results")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=4, help="sampled answers per held-out problem")
    parser.add_argument("--limit", type=int, default=None, help="only the first N held-out problems (smoke runs)")
    args = parser.parse_args()
    out = Path(args.out or f"runs/grpo_arithmetic_seed{args.seed}")
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = results / f"grpo_arithmetic_seed{args.seed}"
    data = DemoData(0)
    held_out = data.evaluation()["arithmetic"][: args.limit]
    prompts = training_prompts(data, 2000, random.Random(1))
    model = mlxchat.load_model()
    before = evaluate(model, held_out, args.temperature, args.samples, seed=1)
    lora(model, rank=8, alpha=16, seed=args.seed)
    config = GRPOConfig(steps=args.steps, group_size=8, prompts_per_step=8, max_tokens=120,
                        learning_rate=args.learning_rate, temperature=args.temperature, beta=0.04, seed=args.seed,
                        save_every=10)
    steps_file = stem.with_name(stem.name + "_steps.jsonl")

    def on_step(record: GRPORecord) -> None:
        with steps_file.open("a", encoding="utf-8") as file:
            file.write(json.dumps(dataclasses.asdict(record)) + "\n")

    steps_file.unlink(missing_ok=True)
    start = time.perf_counter()
    log = grpo(model, prompts, [rewards.exact_match(pattern=r"(-?\d+)\.?$")], config, verbose=True,
               checkpoint_dir=out / "checkpoints", on_step=on_step)
    seconds = time.perf_counter() - start
    steps_file.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in log), encoding="utf-8")
    after = evaluate(model, held_out, args.temperature, args.samples, seed=1)
    save_adapter(model, out)
    flips = [{"question": item.messages[-1]["content"], "answer": item.expected["answer"],
              "before": b, "after": a}
             for item, b, a, rb, ra in zip(held_out, before["greedy"], after["greedy"], before["greedy_right"],
                                           after["greedy_right"], strict=True) if rb != ra]
    n = len(held_out)
    summary = {
        "held_out": n, "steps": args.steps, "seed": args.seed, "learning_rate": args.learning_rate,
        "temperature": args.temperature, "group_size": 8, "prompts_per_step": 8, "rank": 8, "beta": 0.04,
        "train_seconds": round(seconds, 1),
        "greedy_before": sum(before["greedy_right"]) / n, "greedy_after": sum(after["greedy_right"]) / n,
        "greedy_change": paired(before["greedy_right"], after["greedy_right"]),
        "sampled_per_problem": args.samples,
        "sampled_before": sum(before["sampled_right"]) / (n * args.samples),
        "sampled_after": sum(after["sampled_right"]) / (n * args.samples),
        "sampled_change": paired(before["sampled_right"], after["sampled_right"]),
        **trend(log), "max_kl": round(max(r.kl for r in log), 5), "final_kl": round(log[-1].kl, 5),
        "wrong_to_right": [f for f in flips if f["after"] == f["answer"]],
        "right_to_wrong": [f for f in flips if f["before"] == f["answer"]],
    }
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, list)}))


if __name__ == "__main__":
    main()
