"""``python -m benchmarks --cold-start``: from a command to its first token, in a fresh process each time.

What a user waits for before anything appears: the process starts, imports its engine, loads the weights
and generates one token of a short raw prompt (greedy), then exits. Each engine runs as its users run it:
``mlxchat generate --model DIR`` (float32 on a CPU, and the MLX-quantized 4-bit copy of the same weights),
``mlx_lm generate --model DIR`` (its defaults: bfloat16; and the 4-bit copy), and llama.cpp through
llama-cpp-python (``Llama(path)`` then one token; the F32 GGUF and its Q4_0). Every command is timed from
spawn to exit (``--max-tokens 1``: the first token is the last); one round first warms the page cache
(not counted), then the engines alternate for ``--reps`` rounds. Written as ``results/coldstart.json`` /
``.md``. Profile of mlxchat's own start: ``MLXCHAT_PROFILE`` does not cover loading; ``python -X importtime``
and :func:`mlxchat.load_model`'s phases (config, weights on the worker while the tokenizer loads) do.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoints import MODELS
from .engines import LABELS

ENGINES = ("mlxchat", "mlxchat-4bit", "mlx-lm", "mlx-lm-4bit", "llama.cpp-f32", "llama.cpp-q4_0")
WEIGHTS = {"mlxchat": "float32 (from bf16)", "mlxchat-4bit": "4-bit", "mlx-lm": "bfloat16", "mlx-lm-4bit": "4-bit",
           "llama.cpp-f32": "F32", "llama.cpp-q4_0": "Q4_0"}
NAMES = {**LABELS, "mlx-lm": "mlx-lm", "mlx-lm-4bit": "mlx-lm 4-bit"}
PROMPT = "The quick brown fox jumps over the lazy dog. Then it"

_LLAMA = """
import os, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=os.cpu_count(), verbose=False)
token = next(llm.generate(llm.tokenize(sys.argv[2].encode()), top_k=1, top_p=1.0, temp=0.0))
print(llm.detokenize([token]).decode(errors="replace"))
"""


def command(engine: str, folder: Path) -> list[str]:
    """The command line an engine's user types (as this interpreter's modules), for one checkpoint."""
    if engine.startswith("mlxchat"):
        target = _quantized(folder) if engine == "mlxchat-4bit" else folder
        return [sys.executable, "-c", "from mlxchat.cli import main; raise SystemExit(main())", "generate",
                "--model", str(target), "--raw", "--max-tokens", "1", "--temperature", "0", PROMPT]
    if engine.startswith("mlx-lm"):
        target = _quantized(folder) if engine == "mlx-lm-4bit" else folder
        return [sys.executable, "-m", "mlx_lm", "generate", "--model", str(target), "--prompt", PROMPT,
                "--max-tokens", "1", "--temp", "0", "--ignore-chat-template"]
    from .gguf import converted

    return [sys.executable, "-c", _LLAMA, str(converted(folder, engine.split("-")[-1])), PROMPT]


def _quantized(folder: Path) -> Path:
    from .mlx_quantized import folder_for

    return folder_for(folder, 4)


def timed(argv: list[str], timeout: float) -> dict[str, Any]:
    """Wall seconds from spawn to exit, and the CPU seconds the process used."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        return {"error": f"exited with {done.returncode}: {done.stderr.strip()[-300:]}"}
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    return {"seconds": wall, "cpu_s": cpu}


def measure(run: Any, engines: list[str]) -> dict[str, Any]:
    """Every (model, engine) row (:class:`benchmarks.__main__.Run`, prepared with these engines)."""
    keys = run.args.models.split(",") if run.args.models else ["qwen3-0.6b"]
    rows: dict[str, list[dict[str, Any]]] = {}
    for key in keys:
        folder = run.checkpoint(key)
        title = MODELS[key].title
        commands = {engine: command(engine, folder) for engine in engines}
        times: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
        for round_ in range(run.args.reps + 1):  # round 0 warms the page cache
            for engine, argv in commands.items():
                run.log(f"{title}: {NAMES.get(engine, engine)} cold start, round {round_}")
                result = timed(argv, run.args.timeout)
                if round_ or "error" in result:
                    times[engine].append(result)
        rows[title] = [summarize(engine, times[engine]) for engine in engines]
    return {"prompt": PROMPT, "reps": run.args.reps, "rows": rows, "not_measured": run.not_measured}


def summarize(engine: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"engine": engine, "error": errors[0]}
    seconds = [r["seconds"] for r in runs]
    return {"engine": engine, "weights": WEIGHTS[engine], "median_s": statistics.median(seconds),
            "min_s": min(seconds), "cpu_s": statistics.median(r["cpu_s"] for r in runs), "runs": len(runs)}


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Cold start: from the command to its first token (a fresh process, warm page cache)", "",
             f"One token of a short raw prompt, greedy, then exit; medians of {results['reps']} runs, engines "
             "alternating (benchmarks/coldstart.py).", ""]
    for title, rows in results["rows"].items():
        lines += [f"## {title}", "", "| engine | weights | start to first token s | fastest s | CPU s |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for row in rows:
            name = NAMES.get(row["engine"], row["engine"])
            if "error" in row:
                lines.append(f"| {name} | | error: {row['error']} | | |")
                continue
            lines.append(f"| {name} | {row['weights']} | {row['median_s']:.2f} | {row['min_s']:.2f} | "
                         f"{row['cpu_s']:.2f} |")
        lines.append("")
    lines += [f"- not measured: {reason}" for reason in results["not_measured"]]
    return "\n".join(lines)

