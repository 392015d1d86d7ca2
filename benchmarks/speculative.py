"""Speculative decoding in the harness (``python -m benchmarks --speculative``): acceptance and decode tokens/s
with and without a draft, on a pair whose acceptance means something (on random weights it means nothing).

The draft is :mod:`benchmarks.draft`'s: a 2-layer, 0.53M-parameter Qwen3 trained with ``mlxchat.train`` on the
demo model's own data and tokenizer (built on first use, a few minutes). The targets:

- ``demo``: the shipped demo model (1.8M parameters, 7 MB of float32 weights). On a CPU a model this small is
  bound by the dispatch of its few hundred operations, not by its weights; the draft (2 layers against 4)
  costs about half of it a step, and a verify pass about one step.
- ``demo-0.6b-bytes``: the same model made to read as many weight bytes per token as Qwen3-0.6B (2.4 GB) and
  still predict what the demo model predicts: its MLP is padded to 131,072 units whose weights are zero
  (they add exact zeros), and four more decoder layers follow whose output projections are zero (each adds
  exact zeros to the residual stream). Its tokens are the demo model's up to float32 summation order, so the
  pair's acceptance is the demo pair's, while every step streams the weights of a 0.6B model: what the
  mechanism buys a bandwidth-bound target at this acceptance.

Prompts are held-out demo questions (:class:`mlxchat.demo.data.DemoData`), greedy; each prompt runs plainly
and speculatively in turn, the tokens compared.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

UNITS = 131072
"""MLP width of the heavy target (4 + 4 layers at hidden size 192: 2.42 GB of float32 weights a token)."""
EXTRA_LAYERS = 4


def heavy_target(demo: Any) -> Any:
    """The demo model, padded to read 2.4 GB of weights a token (see the module docstring)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxchat
    from mlxchat.checkpoint import read_json
    from mlxchat.demo import MODEL_DIR

    config = {k: v for k, v in read_json(MODEL_DIR / "config.json").items() if k != "dtype"}
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    config.update(num_hidden_layers=layers + EXTRA_LAYERS, intermediate_size=UNITS)
    weights = dict(tree_flatten(demo.worker.run(lambda: demo.module.parameters())))
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def padded(name: str, value: mx.array) -> mx.array:
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return mx.concatenate([value, mx.zeros((UNITS - value.shape[0], hidden))])
        if name.endswith("down_proj.weight"):
            return mx.concatenate([value, mx.zeros((hidden, UNITS - value.shape[1]))], axis=1)
        return value

    given = {name: padded(name, value) for name, value in weights.items()}
    for layer in range(layers, layers + EXTRA_LAYERS):
        prefix = f"model.layers.{layer}."
        random = {"self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight":
                  (kv_heads * head_dim, hidden), "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                  "mlp.gate_proj.weight": (UNITS, hidden), "mlp.up_proj.weight": (UNITS, hidden)}
        for name, shape in random.items():
            given[prefix + name] = mx.random.normal(shape, key=mx.random.key(layer)) * 0.02
        given[prefix + "self_attn.o_proj.weight"] = mx.zeros((hidden, heads * head_dim))
        given[prefix + "mlp.down_proj.weight"] = mx.zeros((hidden, UNITS))
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            size = head_dim if "_norm" in norm and "self_attn" in norm else hidden
            given[prefix + norm + ".weight"] = mx.ones((size,))
    return mlxchat.build_model(config, weights=given, tokenizer=MODEL_DIR)


def prompts(count: int) -> list[list[dict[str, Any]]]:
    """Held-out demo questions that need no tools, up to the last user turn."""
    import random

    from mlxchat.demo.data import DemoData

    conversations = [c for c in DemoData(0).validation() if not c.tools]
    random.Random(0).shuffle(conversations)
    out = []
    for conversation in conversations[:count]:
        last = max(i for i, m in enumerate(conversation.messages) if m["role"] == "user")
        out.append(conversation.messages[: last + 1])
    return out


def measure(target: Any, draft: Any, questions: list[Any], draft_tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """Per setting (plain, then each k): median decode tok/s over the prompts, acceptance, same tokens."""
    settings: dict[str, dict[str, Any]] = {"plain": {"tps": [], "drafted": 0, "accepted": 0, "same": 0}}
    speculative = {k: target.with_draft(draft, k) for k in draft_tokens}
    target.generate(questions[0], {"max_tokens": 4, "temperature": 0.0})  # warm-up
    for question in questions:
        plain = target.generate(question, {"max_tokens": max_tokens, "temperature": 0.0})
        settings["plain"]["tps"].append(plain.report.decode_tps)
        for k, model in speculative.items():
            result = model.generate(question, {"max_tokens": max_tokens, "temperature": 0.0})
            row = settings.setdefault(f"k={k}", {"tps": [], "drafted": 0, "accepted": 0, "same": 0})
            row["tps"].append(result.report.decode_tps)
            row["drafted"] += result.report.draft_tokens
            row["accepted"] += result.report.accepted_draft_tokens
            row["same"] += result.tokens == plain.tokens
    base = statistics.median(settings["plain"]["tps"])
    return {name: {"decode_tps": statistics.median(row["tps"]),
                   "speedup": statistics.median(row["tps"]) / base if base else None,
                   "acceptance": row["accepted"] / row["drafted"] if row["drafted"] else None,
                   "same_tokens": f"{row['same']}/{len(questions)}" if name != "plain" else "",
                   } for name, row in settings.items()}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """The harness's ``speculative`` job: both targets against the trained draft."""
    import mlxchat

    from .draft import draft_path

    start = time.perf_counter()
    draft = mlxchat.load_model(draft_path())
    demo = mlxchat.load_model()
    questions = prompts(job["prompts"])
    pairs = {"demo": demo}
    if job.get("heavy", True):
        pairs["demo-0.6b-bytes"] = heavy_target(demo)
    results = {name: measure(target, draft, questions, job["draft_tokens"], job["max_tokens"])
               for name, target in pairs.items()}
    return {"pairs": results, "prompts": len(questions), "max_tokens": job["max_tokens"],
            "draft_parameters": sum(v.size for v in _leaves(draft)), "seconds": time.perf_counter() - start}


def _leaves(model: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.module.parameters())]


def table(results: dict[str, Any]) -> list[str]:
    """The markdown section of a run's results."""
    if not results or "pairs" not in results:
        return [f"Speculative decoding: {results.get('error', 'not measured')}", ""] if results else []
    lines = ["### Speculative decoding (demo model and its trained draft)", "",
             f"{results['prompts']} held-out demo questions, greedy, {results['max_tokens']} tokens at most; "
             f"the draft has {results['draft_parameters'] / 1e6:.2f} M parameters (benchmarks/draft.py). "
             "`demo-0.6b-bytes` is the demo model padded with zero-output weights to read 2.4 GB a token "
             "(benchmarks/speculative.py): the demo pair's acceptance on a bandwidth-bound target.", "",
             "| target | setting | decode tok/s | speedup | acceptance | tokens = plain |", "|---|---|---|---|---|---|"]
    for target, settings in results["pairs"].items():
        for name, row in settings.items():
            acceptance = "—" if row["acceptance"] is None else f"{100 * row['acceptance']:.0f}%"
            speedup = "—" if row["speedup"] is None else f"{row['speedup']:.2f}×"
            lines.append(f"| {target} | {name} | {row['decode_tps']:.1f} | {speedup} | {acceptance} | "
                         f"{row['same_tokens'] or '—'} |")
    return lines + [""]
