"""``python -m benchmarks``: mlxchat beside mlx-lm (and llama.cpp) in one run; prints a table, writes JSON.

The driver never imports MLX: every measurement runs in a fresh process (benchmarks/worker.py). Order of
work: what mlxchat runs on here, the machine's limits, missing checkpoints (built once), the first
model's rows and its session scenario (always), the other models' rows, further session scenarios, the
image rows when asked for (``--vision``, always), then more repetitions. Everything after the first model
starts only while the time budget allows; what the budget leaves out is listed under the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import host, report, summary
from .checkpoints import ALL_MODELS, DEFAULT_DIR, HERE, MARKER, MODELS, VISION_MODELS, folder_of, is_built
from .engines import ENGINES, INT8_ACTIVATIONS, QUANTIZED_BITS, SPLIT, VISION_ENGINES
from .limits import token_work
from .sessions import document_words
from .vision import SIDE
from .worker import RESULT_MARK

RESULTS = HERE / "results"
SHORT = ("mlx-lm-default",)
"""Engines measured once, on the shortest prompt with a short decode (bfloat16 on the reference BLAS
runs at a few tokens per second on a CPU)."""
ROW_DTYPES = {"mlx-lm-default": "bfloat16", "mlxchat-8bit": "8-bit", "mlxchat-4bit": "4-bit",
              "mlxchat-8bit-x8": "8-bit", "mlxchat-4bit-x8": "4-bit", "llama.cpp-f32": "f32",
              "llama.cpp-f16": "f16", "llama.cpp-q8_0": "q8_0", "llama.cpp-q4_0": "q4_0"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--models",
        help=f"comma-separated checkpoints (default: every one an mlxchat plugin serves, of {', '.join(MODELS)}; "
        "'none': no text rows)",
    )
    add(
        "--engines",
        help=f"comma-separated engines (default: those available of {', '.join(ENGINES)}; image rows: "
        f"{', '.join(VISION_ENGINES)})",
    )
    add("--reps", type=int, default=3, help="repetitions per row, at most (default 3)")
    add(
        "--budget",
        type=float,
        default=13.0,
        help="minutes; after the first model, work starts only if it fits (default 13; 0: no limit)",
    )
    add("--prefill", default="128,512,2048", help="prompt lengths (default 128,512,2048)")
    add("--decode", type=int, help="tokens decoded after the first prompt (default 64; 16 with --context)")
    add("--short-decode", type=int, default=8, help="tokens decoded by mlx-lm (defaults) (default 8)")
    add("--defaults-on", help="checkpoints with an mlx-lm (defaults) row: keys or 'all' (default: the first)")
    add(
        "--sessions",
        help="checkpoints for the session scenarios: keys or 'none' (default: the first; with "
        "--full also the first hybrid one)",
    )
    add(
        "--batching",
        help="checkpoints for the batched decoding rows (1, 2, 4, 8 generations together): keys or 'none' "
        "(default: the first)",
    )
    add(
        "--constrained",
        help="checkpoints for the constrained-decoding rows (a 50-property JSON Schema against free decoding): "
        "keys (default: none)",
    )
    add("--chat-turns", type=int, default=10, help="turns of the chat scenario (default 10)")
    add(
        "--history-tokens",
        type=int,
        help="size of the long first message of the history scenario (default 0: none; 4096 with --full)",
    )
    add("--follow-ups", type=int, default=2, help="questions after the long message (default 2)")
    add("--reply-tokens", type=int, default=8, help="tokens per reply in the session scenarios (default 8)")
    add(
        "--vision",
        nargs="?",
        const="all",
        metavar="KEYS",
        help=f"image rows: a {SIDE}x{SIDE} picture and a question, vision tower, prefill and decode, beside "
        f"mlx-vlm, on these checkpoints with their vision towers (default: all of {', '.join(VISION_MODELS)})",
    )
    add(
        "--full",
        action="store_true",
        help="everything: no budget, the 4k-token history, hybrid sessions, mlx-lm (defaults) on every model, "
        "the image rows",
    )
    add(
        "--quick",
        action="store_true",
        help="smoke run: first model, one repetition, prefill 128, decode 16, 3-turn chat",
    )
    add(
        "--speculative",
        action="store_true",
        help="also measure speculative decoding: the demo model and a draft trained for it (built once, a few "
        "minutes), acceptance and decode tok/s with and without it (benchmarks/speculative.py)",
    )
    add("--speculative-prompts", type=int, default=8, help="held-out demo questions for --speculative (default 8)")
    add("--checkpoints", type=Path, default=DEFAULT_DIR, help="where checkpoints are kept")
    add(
        "--out",
        type=Path,
        help="results path without suffix (default results/latest; results/quick with --quick; results/context "
        "with --context)",
    )
    add(
        "--timeout",
        type=float,
        default=1800,
        help="seconds per measurement process (default 1800; with --context, per 4096 tokens of a row's length, "
        "or twice the row's duration predicted from the same engine's shorter rows, if more)",
    )
    add(
        "--distributed",
        help="also mlxchat split over --ranks local processes on the ring backend: 'tensor', 'pipeline' or both "
        "(comma-separated); rows 'mlxchat, tensor parallel' ... with each rank's peak RSS and the bytes a decode "
        "step hands to the collectives",
    )
    add("--ranks", type=int, default=2, help="processes a --distributed row runs on (default 2)")
    add(
        "--cold-start",
        action="store_true",
        help="the cold-start rows instead of the main run: a fresh process from the command to its first token, "
        "mlxchat generate (float32, 4-bit) beside mlx_lm generate (bf16, 4-bit) and llama.cpp (F32, Q4_0) on the "
        "same weights; --models (default qwen3-0.6b), --engines, --reps; writes results/coldstart.{json,md} "
        "(benchmarks/coldstart.py)",
    )
    add(
        "--context",
        metavar="LENGTHS",
        help="the long-context curves instead of the main run: prefill, TTFT, decode and peak memory at these "
        "prompt lengths (e.g. 1024,4096,8192,16384,32768) for mlxchat (float and 8-bit KV), llama.cpp F32 (F32 "
        "and q8_0 KV) and mlx-lm; --models: keys or checkpoint folders (default qwen3-0.6b,qwen3.5-0.8b); "
        "writes results/context.{json,md,png} (benchmarks/context.py)",
    )
    add(
        "--lora",
        action="store_true",
        help="LoRA training instead of the main run: mlxchat's train() beside mlx-lm's trainer, float and QLoRA "
        "(4-bit base), trained tokens/s and peak memory; --models: keys or checkpoint folders (default "
        "qwen3-0.6b); --engines: of mlxchat, mlx-lm, mlxchat-qlora, mlx-lm-qlora; writes results/lora.{json,md} "
        "(benchmarks/lora.py)",
    )
    add("--lora-steps", type=int, default=10, help="timed training steps of --lora, after a warm-up (default 10)")
    add("--lora-batch", type=int, default=4, help="sequences a step of --lora (default 4)")
    add("--lora-seq", type=int, default=512, help="tokens a sequence of --lora (default 512)")
    add(
        "--max-row-hours",
        type=float,
        default=4.0,
        help="with --context: a row predicted (from the same engine's two longest shorter rows) to take longer "
        "is not started (default 4)",
    )
    add(
        "--resume",
        action="store_true",
        help="with --context: keep the rows the results file already holds and measure only the others (a run "
        "that was stopped, or models and engines run one at a time into one file)",
    )
    args = parser.parse_args(argv)
    if args.full:
        args.budget = 0
        args.defaults_on = args.defaults_on or "all"
        args.history_tokens = 4096 if args.history_tokens is None else args.history_tokens
        args.vision = args.vision or "all"
    if args.quick:
        args.reps, args.prefill, args.decode, args.budget = 1, "128", 16, 0
        args.chat_turns, args.history_tokens = 3, 0
        args.models = args.models or next(iter(MODELS))
    args.history_tokens = args.history_tokens or 0
    args.prefill = [int(n) for n in args.prefill.split(",")]
    args.decode = args.decode or (16 if args.context else 64)
    args.out = args.out or RESULTS / ("context" if args.context else "quick" if args.quick else "latest")
    return args


def run_job(job: dict[str, Any], timeout: float, ranks: int = 1) -> dict[str, Any]:
    """Runs one worker process (``ranks`` of them for a split model, each with its own result: rank 0's
    is returned, with every rank's peak RSS); its result, or {"error": ...} with the end of its stderr
    (and ``timed_out`` or ``killed``, for a worker stopped from outside)."""
    command = [sys.executable, "-m", "benchmarks.worker", json.dumps(job)]
    try:
        if ranks == 1:
            runs = [subprocess.run(command, cwd=HERE.parent, capture_output=True, text=True, timeout=timeout)]
        else:
            runs = host.run_ranks(command, ranks, HERE.parent, timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "timed_out": True}
    results = []
    for done in runs:
        marked = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if not marked and done.returncode < 0:  # a signal: the kernel's out-of-memory killer sends SIGKILL
            return {"error": f"worker killed by signal {-done.returncode}"
                    + (" (out of memory?)" if done.returncode == -9 else ""), "killed": True,
                    "stderr": done.stderr[-2000:]}
        if not marked:
            return {"error": f"worker exited with {done.returncode}", "stderr": done.stderr[-2000:]}
        result = json.loads(marked[-1][len(RESULT_MARK) :])
        if "error" in result:
            result["stderr"] = done.stderr[-2000:]
            return result
        results.append(result)
    if ranks > 1:
        results[0]["rank_peak_rss_bytes"] = [r["peak_rss_bytes"] for r in results]
    return results[0]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Unbuilt(Exception):
    """A checkpoint that could not be built: its rows are listed as not measured."""


@dataclass(frozen=True)
class Task:
    kind: str  # "speed", "sessions", "batching", "constrained" or "vision"
    key: str
    engine: str
    rep: int = 0
    always: bool = False
    """Runs whatever the budget says (the first model's rows and scenario)."""


class Run:
    """One benchmark run: the plan, its execution under the time budget, and the collected results."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.argv = args, argv
        self.start = time.time()
        self.not_measured: list[str] = []
        self.raw: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        self.speculative_results: dict[str, Any] | None = None

    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed() / 60:5.1f} min] {message}", file=sys.stderr, flush=True)

    def job(self, job: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Runs a worker (``timeout``: seconds, default ``--timeout``) and adds its wall and CPU seconds (CPU
        time shows what a shared machine cost)."""
        begin, cpu = time.time(), _children_cpu()
        ranks = self.args.ranks if job.get("engine") in SPLIT else 1
        result = run_job(job, timeout or self.args.timeout, ranks)
        if "error" in result:
            self.log(f"  error: {result['error']}\n{result.get('stderr', '')[-800:]}")
        result["duration_s"], result["cpu_s"] = time.time() - begin, _children_cpu() - cpu
        return result

    # -- what to measure --------------------------------------------------------------------------

    def prepare(self) -> None:
        self.log("what mlxchat runs on here")
        self.info = self.job({"job": "info"})
        if "error" in self.info:
            raise SystemExit(f"cannot import mlxchat: {self.info['error']}\n{self.info.get('stderr', '')}")
        self.compute_dtype = self.info["compute_dtype"] or "bfloat16"
        device = "gpu" if self.info["gpu"] else "cpu"
        self.log(f"limits of this machine ({device})")
        self.limits = self.job({"job": "limits", "device": device})
        self.models = self.select_models()
        self.vision_models = self.select_vision_models()
        if not self.models and not self.vision_models:
            raise SystemExit("no model to measure:\n" + "\n".join(self.not_measured))
        self.engines = self.select_engines()
        self.vision_engines = self.select_vision_engines()
        self.folders: dict[str, Path] = {}
        self.unbuilt: dict[str, str] = {}
        self.works: dict[str, dict[str, Any]] = {}

    def prepare_context(self) -> None:
        """What :mod:`benchmarks.context` needs of :meth:`prepare`: what mlxchat runs on, the machine's
        limits; it converts the GGUFs itself (so :meth:`checkpoint` derives nothing)."""
        self.prepare_derived([])
        device = "gpu" if self.info["gpu"] else "cpu"
        self.log(f"limits of this machine ({device})")
        self.limits = self.job({"job": "limits", "device": device})

    def prepare_cold_start(self, known: tuple[str, ...]) -> list[str]:
        """What :mod:`benchmarks.coldstart` needs of :meth:`prepare`; the engines it can run here."""
        wanted = self.args.engines.split(",") if self.args.engines else list(known)
        unknown = [e for e in wanted if e not in known]
        if unknown:
            raise SystemExit(f"unknown --cold-start engine(s) {', '.join(unknown)}; known: {', '.join(known)}")
        self.prepare_derived([])
        if self.info["llama_cpp"] and any(e.startswith("llama.cpp") for e in wanted):
            self.not_measured.append(f"llama.cpp rows: {self.info['llama_cpp']}")
            wanted = [e for e in wanted if not e.startswith("llama.cpp")]
        if importlib.util.find_spec("mlx_lm") is None and any("4bit" in e or e.startswith("mlx-lm") for e in wanted):
            self.not_measured.append("mlx-lm and 4-bit rows: mlx-lm (its converter makes the 4-bit copy) is not "
                                     "installed")
            wanted = [e for e in wanted if "4bit" not in e and not e.startswith("mlx-lm")]
        self.engines = [e for e in wanted if e.startswith("llama.cpp")] + (
            ["mlxchat-4bit"] if any("4bit" in e for e in wanted) else [])
        return wanted

    def prepare_derived(self, engines: list[str]) -> None:
        """What mlxchat runs on, and the engines whose checkpoints :meth:`checkpoint` derives (GGUF files for
        llama.cpp-*, MLX-quantized copies for mlxchat-*bit)."""
        self.log("what mlxchat runs on here")
        self.info = self.job({"job": "info"})
        if "error" in self.info:
            raise SystemExit(f"cannot import mlxchat: {self.info['error']}\n{self.info.get('stderr', '')}")
        self.compute_dtype = self.info["compute_dtype"] or "bfloat16"
        self.engines = [] if self.info["llama_cpp"] else engines
        self.folders, self.unbuilt, self.works = {}, {}, {}

    def select_models(self) -> list[str]:
        """The requested models that an mlxchat plugin serves and that fit in memory at mlxchat's dtype."""
        if self.args.models == "none":
            return []
        keys = self.args.models.split(",") if self.args.models else list(MODELS)
        return self.servable(keys, MODELS)

    def select_vision_models(self) -> list[str]:
        if not self.args.vision:
            return []
        keys = list(VISION_MODELS) if self.args.vision == "all" else self.args.vision.split(",")
        return self.servable(keys, VISION_MODELS)

    def servable(self, keys: list[str], known: dict[str, Any]) -> list[str]:
        chosen = []
        for key in keys:
            if key not in known:
                raise SystemExit(f"unknown model {key!r}; known: {', '.join(known)}")
            spec = known[key]
            reason: str | None
            if spec.model_type not in self.info["model_types"]:
                reason = f"plugin not available (no mlxchat plugin serves model_type {spec.model_type!r} yet)"
            else:
                short = host.memory_shortfall("mlxchat", spec.params, spec.lookup_params, self.compute_dtype)
                reason = f"does not fit for mlxchat on this machine ({short})" if short else None
            if reason:
                self.not_measured.append(f"{spec.title}: {reason}")
                self.log(f"{spec.title}: skipped, {reason}")
            else:
                chosen.append(key)
        return chosen

    def select_engines(self) -> list[str]:
        """The text rows' engines (none without text rows)."""
        wanted = self.args.engines.split(",") if self.args.engines else list(ENGINES)
        if self.args.distributed:
            wanted += [f"mlxchat-{mode}" for mode in self.args.distributed.split(",")]
        known = list(dict.fromkeys((*ENGINES, *SPLIT, *VISION_ENGINES)))
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise SystemExit(f"unknown engine(s) {', '.join(unknown)}; known: {', '.join(known)}")
        wanted = [name for name in wanted if name in (*ENGINES, *SPLIT) and self.models]
        if self.info["llama_cpp"] and any(name.startswith("llama.cpp") for name in wanted):
            self.not_measured.append(f"llama.cpp rows: {self.info['llama_cpp']}")
            wanted = [name for name in wanted if not name.startswith("llama.cpp")]
        if importlib.util.find_spec("mlx_lm") is None and any(name in QUANTIZED_BITS for name in wanted):
            self.not_measured.append("mlxchat 8-bit / 4-bit rows: mlx-lm (its converter makes them) is not installed")
            wanted = [name for name in wanted if name not in QUANTIZED_BITS]
        return wanted

    def select_vision_engines(self) -> list[str]:
        if not self.vision_models:
            return []
        given = self.args.engines.split(",") if self.args.engines else VISION_ENGINES
        wanted = [name for name in VISION_ENGINES if name in given]
        if "mlx-vlm" in wanted and importlib.util.find_spec("mlx_vlm") is None:
            self.not_measured.append("mlx-vlm image rows: mlx-vlm is not installed (pip install mlx-vlm)")
            wanted.remove("mlx-vlm")
        return wanted

    def checkpoint(self, key: str) -> Path:
        """The model's checkpoint folder, built (and converted to GGUF) the first time a task needs it."""
        if key in self.folders:
            return self.folders[key]
        if key in self.unbuilt:
            raise Unbuilt(self.unbuilt[key])
        folder = folder_of(key, self.args.checkpoints)
        if not is_built(key, self.args.checkpoints):
            self.log(f"building checkpoint {key} (once; transformers, bf16)")
            command = [sys.executable, "-m", "benchmarks.checkpoints", key, "--root", str(self.args.checkpoints)]
            if subprocess.run(command, cwd=HERE.parent).returncode != 0:
                self.unbuilt[key] = (f"{ALL_MODELS[key].title}: its checkpoint could not be built (the error is in "
                                     "the output above; building needs the bench extra: pip install -e '.[bench]')")
                raise Unbuilt(self.unbuilt[key])
        self.folders[key] = folder
        if key not in MODELS:  # a vision checkpoint: the image rows need nothing derived from it
            return folder
        for kind in (e.split("-")[-1] for e in self.engines if e.startswith("llama.cpp")):
            self.log(f"converting {key} to GGUF {kind}")
            subprocess.run([sys.executable, "-m", "benchmarks.gguf", str(folder), kind], cwd=HERE.parent, check=False)
        for bits in (QUANTIZED_BITS[e] for e in self.engines if e in QUANTIZED_BITS):
            self.log(f"quantizing {key} to {bits} bits with mlx-lm's converter")
            command = [sys.executable, "-m", "benchmarks.mlx_quantized", str(folder), str(bits)]
            subprocess.run(command, cwd=HERE.parent, check=False, stdout=subprocess.DEVNULL)
        self.works[key] = token_work(folder)
        return folder

    def engines_for(self, key: str) -> list[str]:
        """mlx-lm (defaults) is slow on a CPU (bfloat16 on the reference BLAS): one model unless asked."""
        wanted = self.args.defaults_on
        chosen = self.models if wanted == "all" else (wanted.split(",") if wanted else self.models[:1])
        return [e for e in self.engines if e not in SHORT or key in chosen]

    def session_models(self) -> list[str]:
        if self.args.sessions == "none":
            return []
        if self.args.sessions:
            return [k for k in self.args.sessions.split(",") if k in self.models]
        hybrid = [k for k in self.models if MODELS[k].hybrid][:1] if self.args.full else []
        return list(dict.fromkeys(self.models[:1] + hybrid))

    def batching_models(self) -> list[str]:
        if self.args.batching == "none":
            return []
        return [k for k in self.args.batching.split(",") if k in self.models] if self.args.batching else self.models[:1]

    def plan(self) -> list[Task]:
        """The first model's rows and scenario, then the other models, then the image rows, then more
        repetitions; engines alternate their order from one model (and repetition) to the next."""
        sessions, batching = self.session_models(), self.batching_models()
        tasks: list[Task] = []
        for index, key in enumerate(self.models):
            engines = self.engines_for(key)
            first = index == 0
            tasks += [Task("speed", key, e, 0, first) for e in (engines if index % 2 == 0 else engines[::-1])]
            if key in sessions:
                tasks += [Task("sessions", key, e, 0, first) for e in ("mlxchat", "mlx-lm")]
            if key in batching:  # float32, and the same weights at 4 bits when that row runs
                tasks += [Task("batching", key, e, 0, first) for e in ("mlxchat", "mlxchat-4bit", "mlxchat-4bit-x8")
                          if e in ("mlxchat", *engines)]
            if key in (self.args.constrained or "").split(","):
                tasks.append(Task("constrained", key, "mlxchat", 0, first))
        engines = self.vision_engines
        for index, key in enumerate(self.vision_models):  # asked for by name: run whatever the budget says
            tasks += [Task("vision", key, e, 0, True) for e in (engines if index % 2 == 0 else engines[::-1])]
        for rep in range(1, self.args.reps):
            for index, key in enumerate(self.models):
                engines = [e for e in self.engines_for(key) if e not in SHORT]
                tasks += [Task("speed", key, e, rep) for e in (engines if (index + rep) % 2 == 0 else engines[::-1])]
            for index, key in enumerate(self.vision_models):
                engines = self.vision_engines if (index + rep) % 2 == 0 else self.vision_engines[::-1]
                tasks += [Task("vision", key, e, rep) for e in engines]
        return tasks

    # -- measuring --------------------------------------------------------------------------------

    def speculative(self) -> None:
        """The speculative-decoding rows (--speculative), after the rest; always run when asked for."""
        self.log("speculative decoding: the demo model and its draft")
        job = {"job": "speculative", "prompts": self.args.speculative_prompts, "draft_tokens": [2, 4],
               "max_tokens": 16 if self.args.quick else 64, "heavy": True}
        self.speculative_results = self.job(job)

    def execute(self, tasks: list[Task]) -> None:
        budget = self.args.budget * 60
        for task in tasks:
            label = f"{ALL_MODELS[task.key].title} {task.engine} {task.kind} run {task.rep + 1}"
            if budget and not task.always and self.elapsed() + self.estimate(task) > budget:
                self.not_measured.append(
                    f"{label}: left out, the {self.args.budget:g}-minute budget was spent (--budget 0 runs everything)"
                )
                continue
            dtype = ROW_DTYPES.get(task.engine, self.compute_dtype)
            spec = ALL_MODELS[task.key]
            short = host.memory_shortfall(task.engine, spec.params, spec.lookup_params, dtype)
            if short:
                note = f"{spec.title} {task.engine}: does not fit in memory now, {short}"
                self.not_measured += [note] if note not in self.not_measured else []
                continue
            self.log(label)
            jobs = {"speed": self.speed_job, "sessions": self.sessions_job, "batching": self.batching_job,
                    "constrained": self.constrained_job, "vision": self.vision_job}
            try:
                job = jobs[task.kind](task)
            except Unbuilt as exc:  # the rest of the run goes on without this model
                self.not_measured += [str(exc)] if str(exc) not in self.not_measured else []
                continue
            self.raw.setdefault((task.kind, task.key, task.engine), []).append(self.job(job))

    def estimate(self, task: Task) -> float:
        """Seconds a task will likely take: its own earlier run, else the same engine's first-model run
        scaled by parameter count, else nothing known (0)."""
        done = self.raw.get((task.kind, task.key, task.engine))
        if done:
            return done[-1]["duration_s"]
        first = self.raw.get((task.kind, self.models[0], task.engine)) if self.models else None
        if first:
            return first[-1]["duration_s"] * ALL_MODELS[task.key].params / MODELS[self.models[0]].params
        return 0.0

    def speed_job(self, task: Task) -> dict[str, Any]:
        folder, short = self.checkpoint(task.key), task.engine in SHORT
        return {
            "job": "speed",
            "engine": task.engine,
            "folder": str(folder),
            "blas_path": self.info["blas_path"],
            "dtype": self.info["compute_dtype"],
            "prefill": self.args.prefill[:1] if short else self.args.prefill,
            "decode": self.args.short_decode if short else self.args.decode,
            "decode_at": self.args.prefill[0],
            "tokenizer_size": json.loads((folder / MARKER).read_text())["tokenizer_size"],
        }

    def batching_job(self, task: Task) -> dict[str, Any]:
        folder = self.checkpoint(task.key)
        if task.engine in QUANTIZED_BITS:
            from .mlx_quantized import folder_for

            folder = folder_for(folder, QUANTIZED_BITS[task.engine])
        return {
            "job": "batching",
            "int8_activations": task.engine in INT8_ACTIVATIONS,
            "folder": str(folder),
            "prompt": self.args.prefill[0],
            "decode": self.args.decode,
            "tokenizer_size": json.loads((folder / MARKER).read_text())["tokenizer_size"],
        }

    def constrained_job(self, task: Task) -> dict[str, Any]:
        return {**self.batching_job(task), "job": "constrained", "mask_steps": 40 if self.args.quick else 400}

    def sessions_job(self, task: Task) -> dict[str, Any]:
        folder, args = self.checkpoint(task.key), self.args
        history = args.history_tokens
        return {
            "job": "sessions",
            "engine": task.engine,
            "folder": str(folder),
            "blas_path": self.info["blas_path"],
            "dtype": self.info["compute_dtype"],
            "chat_turns": args.chat_turns,
            "document_words": document_words(str(folder / "tokenizer.json"), history) if history else 0,
            "follow_ups": args.follow_ups,
            "hybrid": MODELS[task.key].hybrid,
            "reply_tokens": args.reply_tokens,
        }

    def vision_job(self, task: Task) -> dict[str, Any]:
        return {
            "job": "vision",
            "engine": task.engine,
            "folder": str(self.checkpoint(task.key)),
            "blas_path": self.info["blas_path"],
            "dtype": self.info["compute_dtype"],
            "decode": self.args.decode,
        }

    # -- results ----------------------------------------------------------------------------------

    def collect(self) -> dict[str, Any]:
        models = {}
        for key in (k for k in self.models if k in self.folders):
            rows = {
                e: summary.speed_row(self.raw[("speed", key, e)], self.works[key], self.limits)
                for e in self.engines_for(key)
                if ("speed", key, e) in self.raw
            }
            sessions = {
                e: self.raw[("sessions", key, e)][0] for e in ("mlxchat", "mlx-lm") if ("sessions", key, e) in self.raw
            }
            models[key] = {
                "title": MODELS[key].title,
                "checkpoint": json.loads((self.folders[key] / MARKER).read_text()),
                "work": self.works[key],
                "engines": rows,
                "ratios": summary.comparisons(rows),
                "sessions": summary.session_rows(sessions) if sessions else None,
                "batching": (self.raw.get(("batching", key, "mlxchat")) or [None])[0],
                "batching_4bit": (self.raw.get(("batching", key, "mlxchat-4bit")) or [None])[0],
                "batching_4bit_x8": (self.raw.get(("batching", key, "mlxchat-4bit-x8")) or [None])[0],
                "constrained": (self.raw.get(("constrained", key, "mlxchat")) or [None])[0],
            }
        vision = {}
        for key in (k for k in self.vision_models if k in self.folders):
            rows = {e: summary.vision_row(self.raw[("vision", key, e)]) for e in self.vision_engines
                    if ("vision", key, e) in self.raw}
            vision[key] = {
                "title": VISION_MODELS[key].title,
                "checkpoint": json.loads((self.folders[key] / MARKER).read_text()),
                "engines": rows,
                "ratios": summary.vision_ratios(rows),
            }
        notes: dict[str, str] = {}
        for model in [*models.values(), *vision.values()]:
            for engine, row in model["engines"].items():
                if "blas" in row:
                    notes.setdefault(engine, f"{row['dtype']} weights, {row['blas']}")
        args = self.args
        return {
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python -m benchmarks", *self.argv]),
            "machine": host.describe(),
            "runtime": {
                k: self.info.get(k)
                for k in (
                    "mlxchat",
                    "mlx",
                    "device",
                    "blas",
                    "blas_path",
                    "gemv_route",
                    "blas_note",
                    "quantized_kernels",
                    "compute_dtype",
                    "model_types",
                )
            },
            "limits": self.limits,
            "engine_notes": notes,
            "settings": {
                k: getattr(args, k)
                for k in (
                    "reps",
                    "budget",
                    "prefill",
                    "decode",
                    "short_decode",
                    "chat_turns",
                    "history_tokens",
                    "follow_ups",
                    "reply_tokens",
                    "vision",
                )
            },
            "not_measured": self.not_measured,
            "models": models,
            "speculative": self.speculative_results,
            "vision": vision,
            "duration_s": self.elapsed(),
        }


def write(results: dict[str, Any], out: Path, markdown: Callable[[dict[str, Any]], str] = report.markdown) -> None:
    """``out``.json (the results) and ``out``.md (``markdown`` of them, also printed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out.with_suffix('.json')}, {out.with_suffix('.md')}", file=sys.stderr)


def main(argv: list[str]) -> None:
    run = Run(parse(argv), argv)
    if run.args.context:
        from . import context

        run.prepare_context()
        context.main(run, [int(n) for n in run.args.context.split(",")], run.args.decode, run.args.out)
        return
    if run.args.lora:
        from . import lora

        run.prepare_derived([])
        write(lora.measure(run), run.args.out if "--out" in argv else RESULTS / "lora", lora.markdown)
        return
    if run.args.cold_start:
        from . import coldstart

        engines = run.prepare_cold_start(coldstart.ENGINES)
        write(coldstart.measure(run, engines), run.args.out if "--out" in argv else RESULTS / "coldstart",
              coldstart.markdown)
        return
    run.prepare()
    run.execute(run.plan())
    if run.args.speculative:
        run.speculative()
    write(run.collect(), run.args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
