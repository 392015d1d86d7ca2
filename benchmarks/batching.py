"""Batched decoding in the harness (``python -m benchmarks --batching``): the aggregate decode tokens/s of B
generations of one model decoding together, against one alone.

Each prompt first runs alone (its tokens are the reference, its decode rate the B=1 row); then the first B
prompts run through ``model.generate_batch`` (offline batch work: the worker runs their decode steps as one
forward pass). The aggregate of a batch is the sum of its rows' decode rates (their decoding windows
coincide: every row prefills before the first batched step), and the tokens of every row are compared with
its run alone (greedy).

Then the way applications and the server reach the same steps (issue 25): 8 chat sessions over one
model, each sending a chat turn from its own thread at once (a barrier releases them together), against
one session alone. Their prompts go in through the worker's steps beside the others' decoding (chunked
prefill), so one newcomer's prompt does not stop the rest. Reported: the aggregate decode rate over the
window in which they decode (every token after each one's first, over the first first token to the last
token), the rate in all (every token, prompts included, over the wall time), and the ratio to one session
alone (the goal: >= 4x). End-of-reply tokens are banned, so every reply is ``decode`` tokens long.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

SIZES = (2, 4, 8)
SESSIONS = 8
SESSIONS_GOAL = 4.0


def run(job: dict[str, Any]) -> dict[str, Any]:
    """The harness's ``batching`` job on one model: ``job["sizes"]`` batches of ``job["prompt"]``-token
    prompts, ``job["decode"]`` tokens each."""
    import mlxchat
    import mlxchat.quantized

    from .worker import prompt_ids

    start = time.perf_counter()
    mlxchat.quantized.set_int8_activations(job.get("int8_activations", False))
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
    rows += threaded_sessions(model, job["prompt"], job["decode"])
    model.close()
    return {"rows": rows, "prompt": job["prompt"], "decode": job["decode"], "seconds": time.perf_counter() - start}


def threaded_sessions(model: Any, prompt: int, decode: int) -> list[dict[str, Any]]:
    """The rows of :data:`SESSIONS` sessions sending from their own threads at once, and of one alone (see the
    module docstring)."""
    from mlxchat import Done

    from .texts import SYSTEM, document

    config = {"max_tokens": decode, "temperature": 0.0, "logit_bias": {eos: -100.0 for eos in model.eos_ids}}
    questions = [f"Question {i}: what does this say?\n\n{document(prompt // 2, seed=200 + i)}"
                 for i in range(SESSIONS)]

    def turn(question: str, start: threading.Barrier | None = None) -> tuple[float, float, float, Any, list[float]]:
        """(sent, first piece, last piece, result, each piece's time) of one turn of a new session."""
        session = model.chat_session(system=SYSTEM)
        if start is not None:
            start.wait()
        sent = time.perf_counter()
        pieces: list[float] = []
        for event in session.send_stream(question, config=config):
            if isinstance(event, Done):
                result = event.result
            else:
                pieces.append(time.perf_counter())
        return sent, pieces[0], pieces[-1], result, pieces

    turn(questions[0])  # warm-up
    alone = [turn(question) for question in questions]
    one = statistics.median(a[3].report.decode_tps for a in alone)
    start = threading.Barrier(SESSIONS)
    together: list[Any] = [None] * SESSIONS

    def send(index: int) -> None:
        together[index] = turn(questions[index], start)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(SESSIONS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sent = min(t[0] for t in together)
    first, last = min(t[1] for t in together), max(t[2] for t in together)
    generated = [t[3].report.generated_tokens for t in together]
    decoding = sum(n - 1 for n in generated) / (last - first) if last > first else 0.0
    same = sum(t[3].tokens == a[3].tokens for t, a in zip(together, alone, strict=True))
    # While all of them decode (after the last one's first piece, before the first one's last): each one's
    # tokens counted by its share of pieces in that window.
    begin, end = max(t[1] for t in together), min(t[2] for t in together)
    steady = (sum(t[3].report.generated_tokens * sum(begin <= p <= end for p in t[4]) / len(t[4]) for t in together)
              / (end - begin)) if end > begin else None
    return [{"how": "sessions", "streams": 1, "aggregate_tps": one, "per_stream_tps": one, "speedup": 1.0,
             "same_tokens": "", "in_all_tps": statistics.median(
                 a[3].report.generated_tokens / (a[2] - a[0]) for a in alone)},
            {"how": "sessions", "streams": SESSIONS, "aggregate_tps": decoding, "per_stream_tps": decoding / SESSIONS,
             "speedup": decoding / one if one else None, "same_tokens": f"{same}/{SESSIONS}",
             "in_all_tps": sum(generated) / (last - sent), "all_decoding_tps": steady,
             "all_decoding_speedup": steady / one if steady and one else None}]


def table(results: dict[str, Any]) -> list[str]:
    """The markdown section of a run's batching results (per model)."""
    if not results:
        return []
    lines = ["### Batched decoding (generations of one model decoding together)", "",
             "`generate_batch`: the prompts go in first, then decode together (offline batch work); aggregate = the "
             "sum of the rows' decode tok/s. `sessions`: "
             f"{SESSIONS} ChatSessions over the model, each sending a turn from its own thread at once (as "
             "applications and the server do), against one session alone; aggregate = every token after each "
             "one's first over the window from the first first token to the last token; in all = every token over "
             f"the wall time, prompts included (goal of issue 25: >= {SESSIONS_GOAL:g}x one session); all decoding = "
             "the tokens of the window in which every session decodes (after the last first token, before the "
             "first last one), over that window. Tokens compared with each prompt run alone (greedy; "
             "benchmarks/batching.py).", "",
             "| model | how | streams | aggregate decode tok/s | per stream | × one stream | tok/s in all | "
             "all decoding tok/s (×) | tokens = alone |", "|---|---|---|---|---|---|---|---|---|"]
    for model, result in results.items():
        if "rows" not in result:
            lines.append(f"| {model} | — | — | {result.get('error', 'not measured')} | | | | | |")
            continue
        for row in result["rows"]:
            in_all = f"{row['in_all_tps']:.2f}" if "in_all_tps" in row else "—"
            steady = (f"{row['all_decoding_tps']:.2f} ({row['all_decoding_speedup']:.2f}×)"
                      if row.get("all_decoding_tps") else "—")
            lines.append(f"| {model} | {row.get('how', 'generate_batch')} | {row['streams']} | "
                         f"{row['aggregate_tps']:.2f} | {row['per_stream_tps']:.2f} | {row['speedup']:.2f}× | "
                         f"{in_all} | {steady} | {row['same_tokens'] or '—'} |")
    return lines + [""]
