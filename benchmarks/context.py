"""``python -m benchmarks --context 1024,4096,8192,16384,32768``: speed and memory as the context grows.

For each model and context length, each engine in its own fresh process (the engines' order alternating
from one length to the next): a prompt of that many tokens, then greedy decoding at that depth. A row gives
prefill tokens/s (the prompt over the time to first token), the time to first token, decode tokens/s over
the decoded tokens, and peak memory (MLX's allocator where the engine keeps one, and the process RSS).
Engines: mlxchat with float KV, float16 KV (``kv_bits=16``), 8-bit KV (``kv_bits=8``) and 4-bit KV, llama.cpp
F32 with its default (F16) and its q8_0 KV cache (``-ctk q8_0 -ctv q8_0``), mlx-lm, and on hybrid models a
ChatSession turn whose user message is that long (``mlxchat-session``, at the largest length unless
``--engines`` names it).

A multi-hour run must not fail or waste hours, so:

- every row is written to ``results/context.json`` / ``.md`` as soon as it is measured, and ``--resume``
  keeps the rows a file already holds (a killed run, or models and engines run one at a time, go on into
  the same file);
- a row's duration is predicted from the same engine's shorter rows (:func:`predicted_seconds`); a row
  predicted to take more than ``--max-row-hours`` is not started, and a row's time limit is twice its
  prediction (or ``--timeout`` per 4096 tokens of its length, if more: :func:`row_limit`); a row that runs
  out of it is recorded as timed out, and the longer lengths of that engine are not started;
- a row whose estimated peak memory (:func:`peak_estimate`, plus whatever the same engine's shorter row
  measured above its own estimate) exceeds what the machine has available is not started, with the
  estimate in its place; a worker the kernel kills is recorded as such.

What is measured is held against arithmetic (:func:`decode_bound`): decode reads the weights and the
whole KV cache every token, so it cannot beat the machine's bandwidth over those bytes; the report
(:mod:`benchmarks.context_report`) puts both beside the issue's goals.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import host
from .checkpoints import HERE, MARKER, MODELS
from .engines import KV_BITS, LABELS
from .limits import BYTES_PER_PARAM, token_work

ENGINES = ("mlxchat", "mlxchat-kv16", "mlxchat-kv8", "mlxchat-kv4", "llama.cpp-f32", "llama.cpp-f32-kv8", "mlx-lm",
           "mlxchat-session")
SESSION = "mlxchat-session"
"""Measured by default on hybrid models at the run's largest length only (issue 27's goal: a 32k-token
session turn on Qwen3.5-0.8B shapes runs); everywhere when ``--engines`` names it."""
MODELS_DEFAULT = ("qwen3-0.6b", "qwen3.5-0.8b")
LIMIT_PER = 4096
"""A row's default time limit is ``--timeout`` for every ``LIMIT_PER`` tokens of its length (at least one)."""
MARGIN = 1e9
"""Memory left free beside a row's estimated peak."""
KV_GROUP = 64
"""mlxchat's quantized KV: its group size (the default), a scale and a bias per group in the compute dtype."""
MLXCHAT_CHUNK, TILED_ABOVE = 512, 256 * 2**20
"""mlxchat prefills in chunks of 512 tokens and tiles a chunk's attention over the keys once its scores
would pass 256 MiB (``mlxchat.layers.attention``)."""
MLX_LM_CHUNK = 2048
"""mlx-lm's ``stream_generate`` prefills 2048 tokens at a time; on a CPU, MLX's attention holds a chunk's
scores in full (2048 x context x heads floats, about 1.1x that at its peak, measured)."""
Q8_0_BLOCK = 32
"""llama.cpp refuses a q8_0 cache whose head dimension is not a whole number of its blocks."""
LLAMA_BATCH = 512
"""llama.cpp's micro-batch: without flash attention its compute buffer holds a batch's scores."""
OVERHEAD = 0.6e9
"""The runtime itself (libraries, a prompt's activations); from the small rows' peak RSS less weights and KV."""


def kv_format(engine: str, compute_dtype: str) -> tuple[str, float]:
    """The KV cache an engine keeps: its name and bytes per cached element."""
    if KV_BITS.get(engine) == 16:
        return "float16", 2.0
    if engine in KV_BITS:
        bits = KV_BITS[engine]
        return f"{bits}-bit, groups of {KV_GROUP}", bits / 8 + 2 * BYTES_PER_PARAM[compute_dtype] / KV_GROUP
    if engine == "llama.cpp-f32":
        return "F16 (llama.cpp's default)", 2.0
    if engine == "llama.cpp-f32-kv8":
        return "q8_0", BYTES_PER_PARAM["q8_0"]
    return compute_dtype, BYTES_PER_PARAM[compute_dtype]


def weight_dtype(engine: str, compute_dtype: str) -> str:
    return "f32" if engine.startswith("llama.cpp") else compute_dtype


@dataclass(frozen=True)
class Shape:
    """What a token costs a model: its weights (from the checkpoint's headers) and its growing KV cache."""

    attention_layers: int
    """Layers whose cache grows with the context (full attention; linear-attention, convolution and
    sliding-window layers keep a bounded state, left out)."""
    heads: int
    kv_heads: int
    head_dim: int
    total_params: float
    decode_params: float
    positions: int
    """The checkpoint's context window (``max_position_embeddings``)."""

    @property
    def kv_elements(self) -> int:
        """Keys and values cached per token."""
        return 2 * self.attention_layers * self.kv_heads * self.head_dim

    def kv_bytes(self, engine: str, compute_dtype: str, length: int) -> float:
        return self.kv_elements * kv_format(engine, compute_dtype)[1] * length

    def weight_bytes(self, engine: str, compute_dtype: str) -> float:
        """Weights a decode step reads."""
        return self.decode_params * BYTES_PER_PARAM[weight_dtype(engine, compute_dtype)]


def shape_of(folder: Path) -> Shape:
    config = json.loads((folder / "config.json").read_text())
    text = {**config, **config.get("text_config", {})}
    types = text.get("layer_types")
    layers = sum(t == "full_attention" for t in types) if types else text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    work = token_work(folder)
    return Shape(attention_layers=layers, heads=heads, kv_heads=text.get("num_key_value_heads") or heads,
                 head_dim=text.get("head_dim") or text["hidden_size"] // heads,
                 total_params=work["total_params"], decode_params=work["decode_params"],
                 positions=text["max_position_embeddings"])


def decode_bound(shape: Shape, engine: str, compute_dtype: str, length: int,
                 bandwidth_gbs: float | None) -> float | None:
    """Tokens/s of a decode step at this depth that reads its weights and whole KV cache at the machine's
    measured bandwidth (and nothing else); None when the bandwidth was not measured."""
    if bandwidth_gbs is None:
        return None
    read = shape.weight_bytes(engine, compute_dtype) + shape.kv_bytes(engine, compute_dtype, length)
    return bandwidth_gbs * 1e9 / read


def peak_estimate(shape: Shape, engine: str, compute_dtype: str, length: int) -> dict[str, float]:
    """Estimated peak RSS of a row, in parts: the weights as loaded, the KV cache, prefill's attention
    scratch, the runtime."""
    family = "mlxchat" if engine.startswith("mlxchat") else engine
    dtype = weight_dtype(engine, compute_dtype)
    weights = host.weight_bytes(family, shape.total_params, 0.0, dtype)  # no per-layer tables in these models
    scores = 4.0 * shape.heads * length  # float32 scores of one query against the context
    if engine.startswith("mlxchat"):
        scratch = min(scores * min(MLXCHAT_CHUNK, length), 2 * TILED_ABOVE)
    elif engine == "mlx-lm":
        scratch = 1.1 * scores * min(MLX_LM_CHUNK, length)
    elif engine == "llama.cpp-f32":
        scratch = scores * min(LLAMA_BATCH, length)
    else:  # flash attention: tiles
        scratch = 0.0
    kv = shape.kv_bytes(engine, compute_dtype, length)
    return {"weights": weights, "kv": kv, "scratch": scratch, "total": weights + kv + scratch + OVERHEAD}


def predicted_seconds(length: int, earlier: list[dict[str, Any]]) -> tuple[float, bool] | None:
    """How long a row will likely take, from the same engine's measured rows at shorter lengths, and whether
    two of them back it: ``a L + b L^2`` through the last two (prefill's weights cost in proportion to the
    length, its attention to its square), never less than the last one grown in proportion; from one row,
    that row grown with the square of the length (an upper bound); None without any."""
    points = sorted((r["context"], r["duration_s"]) for r in earlier if r["context"] < length)[-2:]
    if not points:
        return None
    last, seconds = points[-1]
    if len(points) == 1:
        return seconds * (length / last) ** 2, False
    (l1, t1), (l2, t2) = points
    b = (t2 / l2 - t1 / l1) / (l2 - l1)
    a = t1 / l1 - b * l1
    return max(a * length + b * length**2, seconds * length / last), True


def row_limit(floor: float, length: int, predicted: float | None) -> float:
    """Seconds a row may take: ``floor`` per :data:`LIMIT_PER` tokens of its length, or twice its predicted
    duration, whichever is more."""
    return max(floor * max(1.0, length / LIMIT_PER), 2 * predicted if predicted else 0.0)


def tokenizer_size(folder: Path) -> int:
    """Token ids prompts may draw from: the benchmark checkpoint's record, else the config's vocabulary."""
    marker = folder / MARKER
    if marker.is_file():
        return int(json.loads(marker.read_text())["tokenizer_size"])
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def measured(row: dict[str, Any]) -> bool:
    return "prefill_tps" in row


class Curves:
    """One ``--context`` run: the plan, the rows as they come (written after each), the notes."""

    def __init__(self, run: Any, lengths: list[int], decode: int, out: Path):
        self.run, self.args = run, run.args
        self.lengths, self.decode, self.out = sorted(lengths), decode, out
        self.started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        self.results: dict[str, Any] = {
            "date": self.started,
            "command": " ".join(["python -m benchmarks", *run.argv]),
            "machine": host.describe(),
            "runtime": {k: run.info.get(k) for k in ("mlxchat", "mlx", "device", "blas", "blas_path",
                                                     "compute_dtype")},
            "limits": run.limits,
            "lengths": self.lengths,
            "decode": decode,
            "models": {},
            "not_measured": [],
        }
        if self.args.resume and out.with_suffix(".json").exists():
            self.resume(json.loads(out.with_suffix(".json").read_text()))

    # -- resuming ---------------------------------------------------------------------------------

    def resume(self, stored: dict[str, Any]) -> None:
        """Keeps a stored file's measured rows (errors, time-outs and skips are measured again)."""
        if stored.get("decode") != self.decode:
            raise SystemExit(f"--resume: {self.out.with_suffix('.json')} decoded {stored.get('decode')} tokens a "
                             f"row, this run {self.decode}; pass --decode {stored.get('decode')} or another --out")
        self.results["lengths"] = sorted({*stored["lengths"], *self.lengths})
        self.results["limits"] = stored.get("limits") or self.results["limits"]
        self.results["resumed"] = [*stored.get("resumed", []), stored["date"]]
        for title, model in stored["models"].items():
            model["rows"] = [row for row in model["rows"] if measured(row)]
            self.results["models"][title] = model

    def stored(self, title: str, engine: str, length: int) -> dict[str, Any] | None:
        rows = self.results["models"].get(title, {}).get("rows", [])
        return next((r for r in rows if r["engine"] == engine and r["context"] == length and measured(r)), None)

    # -- the plan ---------------------------------------------------------------------------------

    def engines(self) -> list[str]:
        named = self.args.engines.split(",") if self.args.engines else None
        engines = named or list(ENGINES)
        unknown = [e for e in engines if e not in ENGINES]
        if unknown:
            raise SystemExit(f"unknown --context engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}")
        if self.run.info["llama_cpp"] and any(e.startswith("llama.cpp") for e in engines):
            self.note(f"llama.cpp rows: {self.run.info['llama_cpp']}")
            engines = [e for e in engines if not e.startswith("llama.cpp")]
        if "mlx-lm" in engines and importlib.util.find_spec("mlx_lm") is None:
            self.note("mlx-lm rows: mlx-lm is not installed (pip install -e '.[bench]')")
            engines.remove("mlx-lm")
        return engines

    def note(self, text: str) -> None:
        if text not in self.results["not_measured"]:
            self.results["not_measured"].append(text)
            self.run.log(f"not measured: {text}")

    def folder(self, key: str) -> tuple[str, Path] | None:
        """(title, folder) of a --models entry (a benchmark key, built on first use, or a folder)."""
        from .__main__ import Unbuilt

        if "/" in key or key not in MODELS:
            folder = Path(key)
            if not (folder / "config.json").is_file():
                raise SystemExit(f"--models {key}: neither a benchmark checkpoint ({', '.join(MODELS)}) nor a "
                                 "checkpoint folder")
            return key, folder
        try:
            return MODELS[key].title, self.run.checkpoint(key)
        except Unbuilt as exc:
            self.note(str(exc))
            return None

    def gguf(self, title: str, folder: Path) -> bool:
        """The F32 GGUF the llama.cpp rows load, converted once; False (and a note) when it cannot be."""
        self.run.log(f"{title}: the F32 GGUF for llama.cpp (converted once)")
        done = subprocess.run([sys.executable, "-m", "benchmarks.gguf", str(folder), "f32"], cwd=HERE.parent,
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = " ".join(done.stderr.strip().splitlines()[-1:])
            self.note(f"{title}, llama.cpp rows: its GGUF conversion failed ({tail})")
            return False
        return True

    # -- measuring --------------------------------------------------------------------------------

    def measure(self) -> dict[str, Any]:
        keys = self.args.models.split(",") if self.args.models else list(MODELS_DEFAULT)
        engines = self.engines()
        if importlib.util.find_spec("matplotlib") is None:
            self.note("the chart: matplotlib is not installed (pip install -e '.[bench]'); the tables hold every row")
        for key in keys:
            found = self.folder(key)
            if found is None:
                continue
            title, folder = found
            shape = shape_of(folder)
            config = json.loads((folder / "config.json").read_text())
            hybrid = MODELS[key].hybrid if key in MODELS else False
            model = self.results["models"].setdefault(title, {"rows": []})
            model.update({"folder": str(folder), "shape": asdict(shape), "hybrid": hybrid,
                          "architecture": config.get("architectures", ["?"])[0]})
            chosen = [e for e in engines if e != SESSION or self.args.engines or hybrid]
            if "llama.cpp-f32-kv8" in chosen and shape.head_dim % Q8_0_BLOCK:
                self.note(f"{title}, llama.cpp F32 with q8_0 KV: llama.cpp's q8_0 cache needs head dimensions in "
                          f"blocks of {Q8_0_BLOCK}, this model's are {shape.head_dim}")
                chosen.remove("llama.cpp-f32-kv8")
            if any(e.startswith("llama.cpp") for e in chosen) and not self.gguf(title, folder):
                chosen = [e for e in chosen if not e.startswith("llama.cpp")]
            self.model_rows(title, folder, shape, chosen)
        self.write()
        return self.results

    def model_rows(self, title: str, folder: Path, shape: Shape, engines: list[str]) -> None:
        stopped: dict[str, str] = {}  # engines not started at longer lengths: why
        for index, length in enumerate(self.lengths):
            for engine in engines if index % 2 == 0 else engines[::-1]:
                if engine == SESSION and not self.args.engines and length != self.lengths[-1]:
                    continue
                if self.stored(title, engine, length) is not None:
                    continue
                rows = [r for r in self.results["models"][title]["rows"] if measured(r)]
                earlier = [r for r in rows if r["engine"] == engine] or \
                    [r for r in rows if engine == SESSION and r["engine"] == "mlxchat"]
                row = self.row(title, folder, shape, engine, length, stopped.get(engine), earlier)
                self.add(title, row)
                if row.get("timed_out") or row.get("killed"):
                    stopped[engine] = f"not started: {row['error']} at {length} tokens"

    def row(self, title: str, folder: Path, shape: Shape, engine: str, length: int, stopped: str | None,
            earlier: list[dict[str, Any]]) -> dict[str, Any]:
        """One row, or why it was not started (``earlier``: the same engine's measured rows)."""
        dtype = self.run.info["compute_dtype"] or "bfloat16"
        estimate = peak_estimate(shape, engine, dtype, length)
        shorter = [r for r in earlier if r["context"] < length and r.get("peak_rss_bytes")]
        if shorter:  # what the formula missed on the longest of them
            previous = max(shorter, key=lambda r: r["context"])
            estimate["measured excess"] = max(0.0, previous["peak_rss_bytes"] - previous["estimated_peak_bytes"])
            estimate["total"] += estimate["measured excess"]
        row: dict[str, Any] = {"engine": engine, "context": length, "estimated_peak_bytes": estimate["total"]}
        if stopped:
            return {**row, "skipped": stopped}
        if length + self.decode > shape.positions:
            return {**row, "skipped": f"beyond the model's context window ({shape.positions} tokens)"}
        free = host.available_memory()
        if free is not None and estimate["total"] + MARGIN > free:
            parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in estimate.items() if k != "total")
            return {**row, "skipped": f"does not fit: needs about {estimate['total'] / 1e9:.1f} GB ({parts}), "
                                      f"{free / 1e9:.1f} GB available"}
        predicted, backed = predicted_seconds(length, earlier) or (None, False)
        if predicted is not None:
            row["predicted_s"] = predicted
        if backed and predicted is not None and predicted > self.args.max_row_hours * 3600:
            return {**row, "skipped": f"predicted to take {predicted / 3600:.1f} h from its shorter rows, more "
                                      f"than --max-row-hours {self.args.max_row_hours:g}"}
        limit = row_limit(self.args.timeout, length, predicted)
        guess = f"predicted {predicted / 60:.0f} min, " if predicted else ""
        self.run.log(f"{title}: {LABELS.get(engine, engine)} at {length} tokens ({guess}limit {limit / 60:.0f} min, "
                     f"estimated peak {estimate['total'] / 1e9:.1f} GB)")
        result = self.run.job({"job": "context", "engine": engine, "folder": str(folder), "length": length,
                               "decode": self.decode, "blas_path": self.run.info["blas_path"],
                               "dtype": self.run.info["compute_dtype"], "tokenizer_size": tokenizer_size(folder)},
                              timeout=limit)
        return {**row, **result, "limit_s": limit}

    def add(self, title: str, row: dict[str, Any]) -> None:
        rows = self.results["models"][title]["rows"]
        rows[:] = [r for r in rows if (r["engine"], r["context"]) != (row["engine"], row["context"])] + [row]
        self.write()

    # -- writing ----------------------------------------------------------------------------------

    def write(self) -> None:
        """The .json (replaced whole, so a kill leaves the last complete one), then the .md and the chart,
        which ``python -m benchmarks.context_report`` can draw again from the .json."""
        from . import context_report

        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.results["duration_s"] = self.run.elapsed()
        replace_file(self.out.with_suffix(".json"), json.dumps(self.results, indent=1))
        try:
            context_report.write(self.results, self.out)
        except Exception as exc:  # the rows are in the .json; a report that fails must not stop the run
            self.run.log(f"the report could not be written ({type(exc).__name__}: {exc}); the rows are in "
                         f"{self.out.with_suffix('.json')}")


def replace_file(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


def main(run: Any, lengths: list[int], decode: int, out: Path) -> None:
    from . import context_report

    results = Curves(run, lengths, decode, out).measure()
    print(context_report.markdown(results))
    written = [out.with_suffix(s) for s in (".json", ".md", ".png") if out.with_suffix(s).exists()]
    print(f"\nwritten: {', '.join(map(str, written))}", file=sys.stderr)
