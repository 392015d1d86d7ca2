"""``python -m benchmarks.shared_prefix``: conversations that copied one long prefix (the same system prompt and
tools, from the model's prompt cache pool), reading it where it lies, one copy for all (a decode step of them
reading the shared keys and values once: cascade attention, :func:`mlxchat.layers.attention.attend_shared`),
against each holding a copy of its own (as before), on one model in one process, the ways alternating.

For each prefix length: a cache prefilled with the prefix, ``--rows - 1`` copies of it (``copy_prefix``), each
row then ``--own`` tokens of its own (its user message), and the same caches loaded again as copies holding
everything; the median time of one decode step of all rows, each way, and of one row alone (the solo step that
inter-token latency is held against in issue 25). Beside them, the keys and values a step reads and the bytes
the caches hold, each way.

Writes ``results/shared_prefix.{json,md}``.
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


def step_times(model: Any, prefix: int, rows: int, own: int, reps: int) -> dict[str, Any]:
    """Median seconds of a decode step of ``rows`` caches that copied a ``prefix``-token prefix, reading it where it
    lies (shared) or each from a copy of its own, and of one such row alone; the bytes the rows' caches hold and
    the KV bytes a step reads each way (run on the model's worker; what a try adds is cut back after it)."""
    import mlx.core as mx

    from mlxchat.batching import batched_last_logits
    from mlxchat.cache import KVCache, distinct_nbytes
    from mlxchat.prompt_cache import last_logits_of

    module = model.module

    def fill(cache: Any, prompt: list[int]) -> None:
        """The whole prompt into the cache (a hybrid's state kept at the prefix's end)."""
        plan = cache.start_prefill(module, prompt, snapshot_at=[prefix], logits=True)
        while not plan.done:
            plan.run(plan.next_chunk)

    ids = [(7 * j) % 5000 + 10 for j in range(prefix + 1)]
    source = model.make_prompt_cache()
    fill(source, ids)
    shared = [source]
    for i in range(rows - 1):
        copy = model.make_prompt_cache()
        if copy.copy_prefix(source, [*ids[:prefix], 5001 + i]) != prefix:
            raise RuntimeError("a copy did not take the whole prefix")
        shared.append(copy)
    for i, cache in enumerate(shared):
        fill(cache, [*ids[:prefix], *((11 * j + i) % 5000 + 10 for j in range(own + 1))])
    copies = []  # the same content, each cache holding all of it (as before prefixes were shared)
    for cache in shared:
        copies.append(model.make_prompt_cache())
        copies[-1].load_state(*cache.state_dict())
    kv = [layer for layer in source.layers if type(layer) is KVCache]
    per_token = sum(2 * layer.shared.keys.shape[1] * layer.shared.keys.shape[3] * layer.shared.keys.itemsize
                    for layer in kv if layer.shared is not None)
    if not per_token or any(layer.shared is None for cache in shared for layer in cache.layers
                            if type(layer) is KVCache):
        raise RuntimeError("the copies do not read a shared prefix")
    saved = {id(layer): layer.snapshot() for cache in shared + copies for layer in cache.layers if not layer.trimmable}
    tokens = mx.array([11 + i for i in range(rows)])

    def back(cache: Any) -> None:
        for layer in cache.layers:
            if layer.trimmable:
                layer.trim_to(layer.offset - 1)
            else:
                layer.restore(saved[id(layer)])

    def step(caches: list[Any]) -> float:
        start = time.perf_counter()
        mx.eval(batched_last_logits(module, tokens, caches), [a for cache in caches for a in cache.arrays()])
        seconds = time.perf_counter() - start
        for cache in caches:
            back(cache)
        return seconds

    def alone(cache: Any) -> float:
        start = time.perf_counter()
        mx.eval(last_logits_of(module)(tokens[:1][None], cache.layers), cache.arrays())
        seconds = time.perf_counter() - start
        back(cache)
        return seconds

    ways = {"shared": lambda: step(shared), "copies": lambda: step(copies),
            "alone_shared": lambda: alone(shared[1]), "alone_copy": lambda: alone(copies[1])}
    times: dict[str, list[float]] = {label: [] for label in ways}
    for run in ways.values():  # warm-up
        run()
    for _ in range(reps):
        for label, run in ways.items():
            times[label].append(run())
    own_tokens = own + 1  # the own part and the token of the step
    return {**{label: statistics.median(values) for label, values in times.items()},
            "kv_per_token": per_token, "kv_read_copies": rows * (prefix + own_tokens) * per_token,
            "kv_read_shared": (prefix + rows * own_tokens) * per_token,
            "held_copies": distinct_nbytes(cache.held() for cache in copies),
            "held_shared": distinct_nbytes(cache.held() for cache in shared)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.shared_prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a benchmark checkpoint key or a folder")
    parser.add_argument("--prefixes", default="1024,2048,4096", help="shared prefix lengths (default 1024,2048,4096)")
    parser.add_argument("--rows", type=int, default=8, help="conversations decoding together (default 8)")
    parser.add_argument("--own", type=int, default=64, help="tokens of each conversation's own (default 64)")
    parser.add_argument("--reps", type=int, default=5, help="tries of each step (default 5)")
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_prefix")
    args = parser.parse_args(argv)

    import mlxchat

    from .checkpoints import DEFAULT_DIR

    folder = Path(args.model) if Path(args.model).is_dir() else DEFAULT_DIR / args.model
    command = " ".join(["python -m benchmarks.shared_prefix", *(argv if argv is not None else sys.argv[1:])])
    started = time.perf_counter()
    model = mlxchat.load_model(folder)
    steps = {}
    for prefix in (int(p) for p in args.prefixes.split(",")):
        steps[prefix] = model.worker.run(step_times, model, prefix, args.rows, args.own, args.reps)
        print(f"prefix {prefix}: {steps[prefix]}", flush=True)
    model.close()
    results = {"host": describe(), "command": command, "minutes": (time.perf_counter() - started) / 60,
               "model": folder.name, "rows": args.rows, "own": args.own, "reps": args.reps, "steps": steps}
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(markdown(results)) + "\n")
    print("\n".join(markdown(results)))


def markdown(results: dict[str, Any]) -> list[str]:
    host, rows = results["host"], results["rows"]
    lines = [f"# Conversations sharing a prefix ({host['cpu']}, {host['cores']} cores)", "",
             f"Checkpoint `{results['model']}`, float32 KV; command `{results['command']}` "
             f"({results['minutes']:.1f} min; the ways alternate in one process, medians of {results['reps']}). "
             f"{rows} caches copied one prefix from the prompt cache pool, then took {results['own']} tokens of "
             "their own. Shared: they read the prefix where it lies, one copy for all (and a decode step of all "
             "of them reads it once: cascade attention); copies: the same content, each cache holding all of it "
             "(as before). One decode step of one row and of all of them, and what the caches hold:", "",
             "| prefix | one row: own copy s | one row: shared s | all rows: copies s | all rows: shared s | "
             "faster | all ÷ one, copies → shared | KV read by a step | caches hold |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for prefix, t in results["steps"].items():
        lines.append(f"| {prefix} | {t['alone_copy']:.3f} | {t['alone_shared']:.3f} | {t['copies']:.3f} | "
                     f"{t['shared']:.3f} | {t['copies'] / t['shared']:.2f}× | {t['copies'] / t['alone_copy']:.2f}× "
                     f"→ {t['shared'] / t['alone_shared']:.2f}× | {t['kv_read_copies'] / 1e9:.2f} → "
                     f"{t['kv_read_shared'] / 1e9:.2f} GB | {t['held_copies'] / 1e9:.2f} → "
                     f"{t['held_shared'] / 1e9:.2f} GB |")
    return lines


if __name__ == "__main__":
    main()
