"""``python -m benchmarks``: mlxchat beside mlx-lm (and llama.cpp) in one run; prints a table, writes JSON.

The driver itself never imports MLX: every measurement runs in a fresh process (benchmarks/worker.py).
Order of work: what mlxchat runs on here, the machine's limits, missing checkpoints (built once), one
repetition of every speed row, the session scenarios, then more repetitions while the time budget lasts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from . import report
from .checkpoints import DEFAULT_DIR, HERE, MARKER, MODELS, folder_of, is_built
from .engines import ENGINES
from .limits import BYTES_PER_PARAM, bounds, token_work
from .sessions import document_words
from .worker import RESULT_MARK

RESULTS = HERE / "results"
MLX_ENGINES = ("mlxchat", "mlx-lm", "mlx-lm-default")
SHORT = ("mlx-lm-default",)
"""Engines measured once, on the shortest prompt and a short decode (bfloat16 on the reference BLAS
runs at a few tokens per second here)."""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        help=f"comma-separated checkpoints (default: all of {', '.join(MODELS)}; "
        f"those without an mlxchat plugin are listed as skipped)",
    )
    parser.add_argument(
        "--engines", help=f"comma-separated engines (default: all available of {', '.join(ENGINES)})"
    )
    parser.add_argument("--reps", type=int, default=3, help="repetitions per row, at most (default 3)")
    parser.add_argument(
        "--budget",
        type=float,
        default=14.0,
        help="minutes; repetitions after the first stop when the next would not fit (0: no limit)",
    )
    parser.add_argument("--prefill", default="128,512,2048", help="prompt lengths (default 128,512,2048)")
    parser.add_argument(
        "--decode", type=int, default=64, help="tokens decoded after the first prompt (default 64)"
    )
    parser.add_argument("--short-decode", type=int, default=8, help="decode tokens for mlx-lm (defaults)")
    parser.add_argument(
        "--defaults-on",
        help="checkpoints with an mlx-lm (defaults) row (default: the first model; 'all' for every one)",
    )
    parser.add_argument(
        "--sessions",
        help="comma-separated checkpoints for the session scenarios (default: the "
        "first model, and the first hybrid one without the long history; "
        "'none' to skip)",
    )
    parser.add_argument("--chat-turns", type=int, default=10)
    parser.add_argument(
        "--history-tokens", type=int, default=4096, help="size of the long first message (0: none)"
    )
    parser.add_argument("--follow-ups", type=int, default=2, help="questions after the long message")
    parser.add_argument(
        "--reply-tokens", type=int, default=8, help="tokens per reply in the session scenarios"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: first model, one repetition, prefill 128, decode 16, 3-turn chat only",
    )
    parser.add_argument("--checkpoints", type=Path, default=DEFAULT_DIR, help="where checkpoints are kept")
    parser.add_argument(
        "--out",
        type=Path,
        help="results path without suffix (default results/latest, results/quick with --quick)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement process")
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.prefill, args.decode, args.budget = 1, "128", 16, 0
        args.chat_turns, args.history_tokens, args.follow_ups = 3, 0, 0
        args.models = args.models or next(iter(MODELS))
        args.sessions = args.sessions or args.models.split(",")[0]
    args.prefill = [int(n) for n in args.prefill.split(",")]
    args.out = args.out or RESULTS / ("quick" if args.quick else "latest")
    return args


# -- processes --------------------------------------------------------------------------------------


def run_job(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs one worker process; its result, or {"error": ...} with the end of its stderr."""
    command = [sys.executable, "-m", "benchmarks.worker", json.dumps(job)]
    try:
        done = subprocess.run(command, cwd=HERE.parent, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK) :])
            if "error" in result:
                result["stderr"] = done.stderr[-2000:]
            return result
    return {"error": f"worker exited with {done.returncode}", "stderr": done.stderr[-2000:]}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    ram = 0.0
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        mlx_lm = version("mlx-lm")
    except PackageNotFoundError:
        mlx_lm = "not installed"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": ram,
        "os": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "mlx_lm": mlx_lm,
    }


def available_memory() -> float | None:
    """Bytes the kernel says can be allocated without swapping (Linux), else None."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def memory_shortfall(params: float, dtype: str) -> str | None:
    """Why a row would not fit in memory now, or None: weights in the compute dtype, plus the stored
    bfloat16 copy while it is converted, plus 1 GB."""
    free = available_memory()
    if free is None:
        return None
    per_param = BYTES_PER_PARAM.get(dtype, 4.0)
    need = params * (per_param + (0 if dtype == "bfloat16" else 2)) + 1e9
    if need <= free:
        return None
    return f"needs about {need / 1e9:.0f} GB in {dtype}, {free / 1e9:.0f} GB available"


# -- aggregation ------------------------------------------------------------------------------------


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def aggregate(jobs: list[dict[str, Any]], work: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    """Medians over repetitions of one engine on one model, and the fractions of the hardware bound."""
    ok = [j for j in jobs if "error" not in j]
    if not ok:
        return {"failed": jobs[-1]["error"], "raw": jobs} if jobs else {"skipped": "not run"}
    lengths = sorted({r["prompt"] for j in ok for r in j["runs"]})
    prefill = {}
    for n in lengths:
        runs = [r for j in ok for r in j["runs"] if r["prompt"] == n]
        prefill[str(n)] = {
            "tps": statistics.median(r["prefill_tps"] for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        }
    decode_runs = [r for j in ok for r in j["runs"] if "decode_tps" in r]
    dtype = ok[0]["dtype"]
    limit = bounds(work, limits, dtype)
    decode = _median([r["decode_tps"] for r in decode_runs])
    peaks = [max((r["peak_bytes"] or 0) for r in j["runs"]) for j in ok]
    return {
        "dtype": dtype,
        "blas": ok[0]["blas"],
        "reps": len(ok),
        "prefill": prefill,
        "decode_tps": decode,
        "decode_tokens": decode_runs[0]["generated"] if decode_runs else None,
        "peak_gb": statistics.median(peaks) / 1e9 if any(peaks) else None,
        "rss_gb": statistics.median([j["peak_rss_bytes"] for j in ok]) / 1e9,
        "load_s": _median([j["load_s"] for j in ok]),
        "bounds": limit,
        "decode_fraction": decode / limit["decode_bound_tps"] if decode else None,
        "prefill_fraction": {n: p["tps"] / limit["prefill_bound_tps"] for n, p in prefill.items()},
        "errors": [j["error"] for j in jobs if "error" in j],
        "raw": jobs,
    }


def ratios(rows: dict[str, Any], other: str) -> dict[str, float | None]:
    """mlxchat's throughput over another engine's, per metric (above 1: mlxchat is faster)."""
    mine, theirs = rows.get("mlxchat", {}), rows.get(other, {})
    if "prefill" not in mine or "prefill" not in theirs:
        return {}

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    out = {
        f"prefill_{n}": over(p["tps"], theirs["prefill"].get(n, {}).get("tps"))
        for n, p in mine["prefill"].items()
    }
    first = next(iter(mine["prefill"]), None)
    if first is not None and first in theirs["prefill"]:
        out["ttft_speedup"] = over(theirs["prefill"][first]["ttft_s"], mine["prefill"][first]["ttft_s"])
    out["decode"] = over(mine.get("decode_tps"), theirs.get("decode_tps"))
    return out


# -- the run ----------------------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.start = time.time()
        self.skipped: list[str] = []
        self.durations: dict[tuple[str, str], float] = {}

    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed() / 60:5.1f} min] {message}", file=sys.stderr, flush=True)

    def job(self, job: dict[str, Any]) -> dict[str, Any]:
        """Runs a worker; adds its wall time and CPU time (the CPU time tells what a quiet machine would
        take when other processes share the cores)."""
        begin, cpu = time.time(), _children_cpu()
        result = run_job(job, self.args.timeout)
        if "error" in result:
            self.log(f"  error: {result['error']}\n{result.get('stderr', '')[-800:]}")
        result["duration_s"] = time.time() - begin
        result["cpu_s"] = _children_cpu() - cpu
        return result

    def select_models(self, info: dict[str, Any]) -> list[str]:
        """The requested models that an mlxchat plugin serves and that fit in memory at mlxchat's dtype."""
        keys = self.args.models.split(",") if self.args.models else list(MODELS)
        chosen = []
        for key in keys:
            if key not in MODELS:
                raise SystemExit(f"unknown model {key!r}; known: {', '.join(MODELS)}")
            spec = MODELS[key]
            reason = None
            if spec.model_type not in info["model_types"]:
                reason = f"plugin not available (no mlxchat plugin serves model_type {spec.model_type!r} yet)"
            else:
                short = memory_shortfall(spec.params, info["compute_dtype"] or "bfloat16")
                if short:
                    reason = f"does not fit for mlxchat on this machine ({short})"
            if reason:
                self.skipped.append(f"{spec.title}: {reason}")
                self.log(f"{spec.title}: skipped, {reason}")
                continue
            chosen.append(key)
        return chosen

    def select_engines(self, info: dict[str, Any]) -> list[str]:
        wanted = self.args.engines.split(",") if self.args.engines else list(ENGINES)
        engines = []
        for name in wanted:
            if name not in ENGINES:
                raise SystemExit(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
            if name.startswith("llama.cpp") and info["llama_cpp"]:
                if self.args.engines:
                    self.skipped.append(f"{name}: {info['llama_cpp']}")
                continue
            engines.append(name)
        if not self.args.engines and info["llama_cpp"]:
            self.skipped.append(f"llama.cpp rows: {info['llama_cpp']}")
        return engines

    def engines_for(self, key: str, models: list[str], engines: list[str]) -> list[str]:
        """mlx-lm (defaults) is slow here (bfloat16 on the reference BLAS): one model unless asked."""
        wanted = self.args.defaults_on
        with_defaults = models if wanted == "all" else (wanted.split(",") if wanted else models[:1])
        return [e for e in engines if e not in SHORT or key in with_defaults]

    def ensure_checkpoint(self, key: str) -> Path:
        if not is_built(key, self.args.checkpoints):
            self.log(f"building checkpoint {key} (once; transformers, bf16)")
            subprocess.run(
                [sys.executable, "-m", "benchmarks.checkpoints", key, "--root", str(self.args.checkpoints)],
                cwd=HERE.parent,
                check=True,
            )
        return folder_of(key, self.args.checkpoints)

    def speed_job(self, key: str, engine: str, info: dict[str, Any], folder: Path) -> dict[str, Any]:
        short = engine in SHORT
        return {
            "job": "speed",
            "engine": engine,
            "folder": str(folder),
            "blas_path": info.get("blas_path"),
            "dtype": info["compute_dtype"],
            "prefill": self.args.prefill[:1] if short else self.args.prefill,
            "decode": self.args.short_decode if short else self.args.decode,
            "decode_at": self.args.prefill[0],
            "tokenizer_size": json.loads((folder / MARKER).read_text())["tokenizer_size"],
        }


def main(argv: list[str]) -> None:
    args = parse(argv)
    run = Run(args)
    run.log("what mlxchat runs on here")
    info = run.job({"job": "info"})
    if "error" in info:
        raise SystemExit(f"cannot import mlxchat: {info['error']}\n{info.get('stderr', '')}")
    device = "gpu" if info["gpu"] else "cpu"
    run.log(f"limits of this machine ({device})")
    limits = run.job({"job": "limits", "device": device})
    models = run.select_models(info)
    engines = run.select_engines(info)
    folders = {key: run.ensure_checkpoint(key) for key in models}
    works = {key: token_work(folders[key]) for key in models}
    if any(e.startswith("llama.cpp") for e in engines):
        for key in models:
            for engine in (e for e in engines if e.startswith("llama.cpp")):
                run.log(f"converting {key} to GGUF {engine.split('-')[-1]}")
                subprocess.run(
                    [sys.executable, "-m", "benchmarks.gguf", str(folders[key]), engine.split("-")[-1]],
                    cwd=HERE.parent,
                    check=False,
                )

    raw: dict[tuple[str, str], list[dict[str, Any]]] = {(k, e): [] for k in models for e in engines}
    skipped_rows: dict[tuple[str, str], str] = {}

    def measure(rep: int, key: str, engine: str) -> None:
        dtype = {"mlx-lm-default": "bfloat16", "llama.cpp-f32": "f32", "llama.cpp-q8_0": "q8_0"}.get(
            engine, info["compute_dtype"] or "bfloat16"
        )
        short = memory_shortfall(works[key]["total_params"], dtype)
        if short:
            skipped_rows[(key, engine)] = short
            run.log(f"{key} {engine}: skipped ({short})")
            return
        run.log(f"{key} {engine} run {rep + 1}")
        result = run.job(run.speed_job(key, engine, info, folders[key]))
        raw[(key, engine)].append(result)
        run.durations[(key, engine)] = result["duration_s"]

    for index, key in enumerate(models):
        order = run.engines_for(key, models, engines)
        for engine in order if index % 2 == 0 else order[::-1]:
            measure(0, key, engine)

    session_rows = run_sessions(run, info, models, folders)

    budget = args.budget * 60
    for rep in range(1, args.reps):
        for index, key in enumerate(models):
            order = run.engines_for(key, models, engines)
            for engine in order if (index + rep) % 2 == 0 else order[::-1]:
                if engine in SHORT or (key, engine) in skipped_rows:
                    continue
                if budget and run.elapsed() + run.durations.get((key, engine), 0) > budget:
                    run.log(
                        f"{key} {engine} run {rep + 1}: left out, the {args.budget:g}-minute budget is spent"
                    )
                    continue
                measure(rep, key, engine)

    results = collect(
        run, info, limits, models, engines, folders, works, raw, skipped_rows, session_rows, argv
    )
    write(results, args.out)


def run_sessions(
    run: Run, info: dict[str, Any], models: list[str], folders: dict[str, Path]
) -> dict[str, Any]:
    args = run.args
    if args.sessions == "none":
        return {}
    if args.sessions:
        keys = [k for k in args.sessions.split(",") if k in models]
    else:
        hybrid = [k for k in models if MODELS[k].hybrid]
        keys = list(dict.fromkeys(models[:1] + hybrid[:1]))
    out = {}
    for key in keys:
        folder = folders[key]
        history = args.history_tokens if (args.sessions or key == models[0]) else 0
        words = document_words(str(folder / "tokenizer.json"), history) if history else 0
        base = {
            "job": "sessions",
            "folder": str(folder),
            "blas_path": info.get("blas_path"),
            "dtype": info["compute_dtype"],
            "chat_turns": args.chat_turns,
            "document_words": words,
            "follow_ups": args.follow_ups,
            "hybrid": MODELS[key].hybrid,
            "reply_tokens": args.reply_tokens,
        }
        results = {}
        for engine in ("mlxchat", "mlx-lm"):
            run.log(f"{key} sessions: {engine}")
            results[engine] = run.job({**base, "engine": engine})
        out[key] = merge_sessions(results)
    return out


def merge_sessions(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    notes, columns = [], []
    for engine, result in results.items():
        if "unavailable" in result:
            notes.append(result["unavailable"])
        elif "error" in result:
            notes.append(f"{engine}: {result['error']}")
        else:
            columns.append(result["rows"])
    rows = []
    for parts in zip(*columns, strict=True) if columns else ():
        merged: dict[str, Any] = {}
        for part in parts:
            merged.update(part)
        rows.append(merged)
    return {"notes": notes, "rows": rows, "raw": results}


def collect(
    run: Run,
    info: dict[str, Any],
    limits: dict[str, Any],
    models: list[str],
    engines: list[str],
    folders: dict[str, Path],
    works: dict[str, Any],
    raw: dict[tuple[str, str], list[dict[str, Any]]],
    skipped_rows: dict[tuple[str, str], str],
    session_rows: dict[str, Any],
    argv: list[str],
) -> dict[str, Any]:
    args = run.args
    out_models = {}
    for key in models:
        rows = {}
        for engine in run.engines_for(key, models, engines):
            if (key, engine) in skipped_rows and not raw[(key, engine)]:
                rows[engine] = {"skipped": skipped_rows[(key, engine)]}
            else:
                rows[engine] = aggregate(raw[(key, engine)], works[key], limits)
        meta = json.loads((folders[key] / MARKER).read_text())
        out_models[key] = {
            "title": MODELS[key].title,
            "checkpoint": meta,
            "work": works[key],
            "engines": rows,
            "ratios": {
                other: ratios(rows, other) for other in engines if other != "mlxchat" and ratios(rows, other)
            },
            "sessions": session_rows.get(key),
        }
    notes = {}
    for engine in engines:
        example = next(
            (r for m in out_models.values() for e, r in m["engines"].items() if e == engine and "blas" in r),
            None,
        )
        if example:
            notes[engine] = f"{example['dtype']} weights, {example['blas']}"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks" + (" " + " ".join(argv) if argv else ""),
        "machine": machine(),
        "runtime": {
            k: info.get(k)
            for k in (
                "mlxchat",
                "mlx",
                "device",
                "blas",
                "blas_path",
                "gemv_route",
                "blas_note",
                "compute_dtype",
                "model_types",
            )
        },
        "limits": limits,
        "engine_notes": notes,
        "settings": {
            "reps": args.reps,
            "budget_min": args.budget,
            "prefill": args.prefill,
            "decode": args.decode,
            "short_decode": args.short_decode,
            "chat_turns": args.chat_turns,
            "history_tokens": args.history_tokens,
            "follow_ups": args.follow_ups,
            "reply_tokens": args.reply_tokens,
        },
        "skipped": run.skipped + [f"{MODELS[k].title} {e}: {why}" for (k, e), why in skipped_rows.items()],
        "models": out_models,
        "duration_s": run.elapsed(),
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = report.markdown(results)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out.with_suffix('.json')}, {out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
