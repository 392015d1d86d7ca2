"""Batched decoding in the harness (``python -m benchmarks --batching``): the aggregate decode tokens/s of B
generations of one model decoding together, against one alone.

Each prompt first runs alone (its tokens are the reference, its decode rate the B=1 row); then the first B
prompts run through ``model.generate_batch`` (the same path as concurrent server requests and sessions:
the worker runs their decode steps as one forward pass). The aggregate of a batch is the sum of its rows'
decode rates (their decoding windows coincide: every row prefills before the first batched step), and the
tokens of every row are compared with its run alone (greedy).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

SIZES = (2, 4, 8)


def run(job: dict[str, Any]) -> dict[str, Any]:
    """The harness's ``batching`` job on one model: ``job["sizes"]`` batches of ``job["prompt"]``-token
    prompts, ``job["decode"]`` tokens each."""
    import mlxchat

    from .worker import prompt_ids

    start = time.perf_counter()
    model = mlxchat.load_model(Path(job["folder"]))
    sizes = job.get("sizes", SIZES)
    config = {"max_tokens": job["decode"], "temperature": 0.0}
    prompts = [prompt_ids(job["prompt"], 100 + i, job["tokenizer_size"]) for i in range(max(sizes))]
    model.generate(prompts[0], {"max_tokens": 2, "temperature": 0.0})  # warm-up
    model.generate_batch(prompts[:2], {"max_tokens": 2, "temperature": 0.0})
    alone = [model.generate(prompt, config) for prompt in prompts]
    one = statistics.median(result.report.decode_tps for result in alone)
    rows = [{"streams": 1, "aggregate_tps": one, "per_stream_tps": one, "speedup": 1.0, "same_tokens": ""}]
    for size in sizes:
        results = model.generate_batch(prompts[:size], config)
        total = sum(result.report.decode_tps for result in results)
        same = sum(result.tokens == reference.tokens for result, reference in zip(results, alone, strict=False))
        rows.append({"streams": size, "aggregate_tps": total, "per_stream_tps": total / size,
                     "speedup": total / one if one else None, "same_tokens": f"{same}/{size}"})
    model.close()
    return {"rows": rows, "prompt": job["prompt"], "decode": job["decode"], "seconds": time.perf_counter() - start}


def table(results: dict[str, Any]) -> list[str]:
    """The markdown section of a run's batching results (per model)."""
    if not results:
        return []
    lines = ["### Batched decoding (generations of one model decoding together)", "",
             "Each batch's prompts decode together through `model.generate_batch` (as concurrent server requests "
             "and sessions do); aggregate = the sum of the rows' decode tok/s; tokens compared with each prompt "
             "run alone (greedy; benchmarks/batching.py).", "",
             "| model | streams | aggregate decode tok/s | per stream | × one stream | tokens = alone |",
             "|---|---|---|---|---|---|"]
    for model, result in results.items():
        if "rows" not in result:
            lines.append(f"| {model} | — | {result.get('error', 'not measured')} | | | |")
            continue
        for row in result["rows"]:
            lines.append(f"| {model} | {row['streams']} | {row['aggregate_tps']:.2f} | {row['per_stream_tps']:.2f} | "
                         f"{row['speedup']:.2f}× | {row['same_tokens'] or '—'} |")
    return lines + [""]
