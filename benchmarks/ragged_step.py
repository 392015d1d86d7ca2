"""``python -m benchmarks.ragged_step``: the worker's step as one pass (decode rows and prompt chunks end to
end, :class:`mlxchat.cache.RaggedRows`) against the step before it (the decode rows' pass, then a pass of its
own for each prompt chunk), on the same model in one process, the two alternating.

- **A step**: 8 decoding rows (300-token caches) and one prompt chunk of 32 or 128 tokens (over a 1,000-token
  cache): the time of the one pass against the rows' pass plus the chunk's (medians of ``--reps``).
- **Threaded sessions** (issue 25): 8 ChatSessions each sending a turn from its own thread at once against
  one alone (:func:`benchmarks.batching.threaded_sessions`: the window measure, the rate in all, the rate
  while all decode, tokens equal to each alone), with the model's ``runs_ragged`` on and off.

Writes ``results/ragged_step.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .host import describe

RESULTS = Path(__file__).resolve().parent / "results"
ROWS, ROW_CACHE, CHUNK_CACHE = 8, 300, 1000


def step_times(model: Any, chunk: int, reps: int) -> dict[str, float]:
    """Median seconds of one step of :data:`ROWS` decode rows and a ``chunk``-token prompt chunk, as one pass
    and as separate passes (run on the model's worker; every cache is cut back after each try)."""
    import mlx.core as mx

    from mlxchat.batching import batched_last_logits, ragged_last_logits

    module = model.module
    rows = []
    for i in range(ROWS):
        cache = model.make_prompt_cache()
        cache.prefill(module, [(7 * j + i) % 5000 + 10 for j in range(ROW_CACHE)])
        rows.append(cache)
    document = model.make_prompt_cache()
    document.prefill(module, [(3 * j) % 5000 + 10 for j in range(CHUNK_CACHE)])
    current = [mx.array([11 + i]) for i in range(ROWS)]
    prompt = mx.array([(5 * j) % 5000 + 10 for j in range(chunk)])

    def one_pass() -> list[mx.array]:
        return [ragged_last_logits(module, [*current, prompt], [*rows, document], rows=len(rows))]

    def separate() -> list[mx.array]:
        decoded = batched_last_logits(module, mx.concatenate(current), rows)
        mx.eval(decoded, [a for cache in rows for a in cache.arrays()])
        return [decoded, module.last_logits(prompt[None], document.layers)]

    # What a try adds is cut back after it: keys and values trimmed, a recurrent state restored (a hybrid).
    saved = {id(layer): layer.snapshot() for cache in [*rows, document] for layer in cache.layers
             if not layer.trimmable}
    times: dict[str, list[float]] = {"one pass": [], "separate passes": []}
    for _ in range(reps):
        for label, run in (("one pass", one_pass), ("separate passes", separate)):
            start = time.perf_counter()
            mx.eval(run(), [a for cache in [*rows, document] for a in cache.arrays()])
            times[label].append(time.perf_counter() - start)
            for cache, back in [*((r, 1) for r in rows), (document, chunk)]:
                for layer in cache.layers:
                    if layer.trimmable:
                        layer.trim_to(layer.offset - back)
                    else:
                        layer.restore(saved[id(layer)])
    return {label: statistics.median(values) for label, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ragged_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a benchmark checkpoint key or a folder")
    parser.add_argument("--reps", type=int, default=3, help="tries of each step (default 3)")
    parser.add_argument("--session-reps", type=int, default=2, help="alternating session runs each way (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "ragged_step")
    args = parser.parse_args(argv)

    import mlxchat

    from .batching import threaded_sessions
    from .checkpoints import DEFAULT_DIR

    folder = Path(args.model) if Path(args.model).is_dir() else DEFAULT_DIR / args.model
    command = "python -m benchmarks.ragged_step " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()
    model = mlxchat.load_model(folder)
    kind = type(model.module)
    if not getattr(kind, "runs_ragged", False):
        raise SystemExit(f"{folder.name}: its module does not run ragged steps")
    steps = {chunk: model.worker.run(step_times, model, chunk, args.reps) for chunk in (32, 128)}
    sessions: list[dict[str, Any]] = []
    try:
        for rep in range(args.session_reps):
            for ragged in (True, False):
                kind.runs_ragged = ragged
                alone, together = threaded_sessions(model, 128, 64)
                sessions.append({"one pass": ragged, "rep": rep, "alone_tps": alone["aggregate_tps"], **together})
    finally:
        kind.runs_ragged = True
    model.close()
    results = {"host": describe(), "command": command, "minutes": (time.perf_counter() - started) / 60,
               "model": folder.name, "steps": steps, "sessions": sessions}
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(markdown(results)) + "\n")
    print("\n".join(markdown(results)))


def markdown(results: dict[str, Any]) -> list[str]:
    host = results["host"]
    lines = [f"# One pass a step against a pass per prompt chunk ({host['cpu']}, {host['cores']} cores)", "",
             f"Checkpoint `{results['model']}`, float32; command `{results['command']}` "
             f"({results['minutes']:.1f} min; the two ways alternate in one process).", "",
             f"A step of {ROWS} decode rows ({ROW_CACHE}-token caches) and one prompt chunk (over a "
             f"{CHUNK_CACHE}-token cache), median seconds:", "",
             "| prompt chunk | one pass | decode rows' pass + the chunk's pass | saved |",
             "| ---: | ---: | ---: | ---: |"]
    for chunk, times in results["steps"].items():
        one, separate = times["one pass"], times["separate passes"]
        lines.append(f"| {chunk} | {one:.3f} | {separate:.3f} | {1 - one / separate:.0%} |")
    lines += ["", "8 ChatSessions sending a turn each from their own threads at once, against one alone (window: "
              "tokens after each one's first over the first first token to the last token; in all: every token "
              "over the wall time, prompts included; all decoding: while all eight decode):", "",
              "| step | try | one alone tok/s | window tok/s (×) | in all tok/s | all decoding tok/s | "
              "tokens = alone |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["sessions"]:
        how = "one pass" if row["one pass"] else "a pass per prompt chunk"
        steady = row.get("all_decoding_tps")
        lines.append(f"| {how} | {row['rep'] + 1} | {row['alone_tps']:.2f} | {row['aggregate_tps']:.2f} "
                     f"({row['speedup']:.2f}×) | {row['in_all_tps']:.2f} | "
                     f"{'—' if steady is None else f'{steady:.2f}'} | {row['same_tokens']} |")
    return lines


if __name__ == "__main__":
    main()
