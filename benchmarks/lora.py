"""``python -m benchmarks --lora``: LoRA training speed and memory, mlxchat's training loop beside mlx-lm's.

Each row is one engine in its own fresh process (engines alternating, repetitions after), training the same
adapter on the same checkpoint and data: rank 8 (scale 2: alpha 16) on the seven projections of every layer,
``--lora-batch`` sequences of ``--lora-seq`` tokens a step (the same random token ids for both), Adam at
1e-4, no gradient clipping, no dropout, float32 compute (mlxchat's CPU default; mlx-lm is cast to it and runs
on the same OpenBLAS). Engines:

- ``mlxchat``: :func:`mlxchat.train.lora`, then :func:`mlxchat.train.train` (the real loop: bucketing, batches,
  AdamW with weight decay 0, its log every step);
- ``mlx-lm``: ``mlx_lm.tuner.linear_to_lora_layers``, then ``mlx_lm.tuner.trainer.train`` (what ``mlx_lm.lora``
  runs: its compiled step, its batching);
- ``mlxchat-qlora`` / ``mlx-lm-qlora``: the same on the 4-bit copy of the checkpoint (mlx-lm's converter,
  group size 64: :mod:`benchmarks.mlx_quantized`), the base quantized, only the adapter training.

A row: trained tokens per second (``batch * seq`` a step over the steps after the first, the time each loop
itself measures per step), and MLX's peak memory over the run (``mx.get_peak_memory()``: weights, activations,
gradients, optimizer state) and the process's peak RSS. Written as ``results/lora.json`` / ``.md``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .checkpoints import MODELS

ENGINES = ("mlxchat", "mlx-lm", "mlxchat-qlora", "mlx-lm-qlora")
LABELS = {"mlxchat": "mlxchat", "mlx-lm": "mlx-lm", "mlxchat-qlora": "mlxchat QLoRA (4-bit base)",
          "mlx-lm-qlora": "mlx-lm QLoRA (4-bit base)"}
MODEL_DEFAULT = "qwen3-0.6b"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, SCALE, LEARNING_RATE, BITS = 8, 2.0, 1e-4, 4


def measure(run: Any) -> dict[str, Any]:
    """Every (model, repetition, engine) row of a run (:class:`benchmarks.__main__.Run`, prepared)."""
    keys = run.args.models.split(",") if run.args.models else [MODEL_DEFAULT]
    engines = run.args.engines.split(",") if run.args.engines else list(ENGINES)
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown --lora engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    shape = {"steps": run.args.lora_steps, "batch": run.args.lora_batch, "seq": run.args.lora_seq}
    rows: dict[str, list[dict[str, Any]]] = {}
    for key in keys:
        folder = Path(key) if "/" in key else run.checkpoint(key)
        title = MODELS[key].title if key in MODELS else key
        quantized = _quantized(run, folder) if any(e.endswith("-qlora") for e in engines) else None
        runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
        for rep in range(run.args.reps):
            for engine in engines:
                run.log(f"{title}: {LABELS[engine]}, LoRA training (repetition {rep + 1})")
                source = quantized if engine.endswith("-qlora") else folder
                runs[engine].append(run.job({"job": "lora", "engine": engine, "folder": str(source),
                                             "blas_path": run.info["blas_path"], **shape}))
        rows[title] = [_median(engine, done) for engine, done in runs.items()]
    return {**shape, "rank": RANK, "scale": SCALE, "targets": list(TARGETS), "learning_rate": LEARNING_RATE,
            "reps": run.args.reps, "blas_path": run.info["blas_path"], "rows": rows,
            "not_measured": run.not_measured}


def _quantized(run: Any, folder: Path) -> Path:
    from .mlx_quantized import folder_for

    run.log(f"quantizing {folder.name} to {BITS} bits with mlx-lm's converter (once)")
    import subprocess

    command = [sys.executable, "-m", "benchmarks.mlx_quantized", str(folder), str(BITS)]
    subprocess.run(command, cwd=Path(__file__).parent.parent, check=False, stdout=subprocess.DEVNULL)
    return folder_for(folder, BITS)


def _median(engine: str, done: list[dict[str, Any]]) -> dict[str, Any]:
    good = [r for r in done if "error" not in r]
    if not good:
        return {"engine": engine, **(done[-1] if done else {"error": "not run"})}
    best = sorted(good, key=lambda r: r["tokens_per_s"])[len(good) // 2]
    return {**best, "engine": engine, "runs_tokens_per_s": [r["tokens_per_s"] for r in good],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in good)}


# -- one engine, in a worker process ------------------------------------------------------------------------


def train_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train one engine's adapter (``job``: engine, folder, steps, batch, seq, blas_path)."""
    from .engines import _preload_blas, peak_rss_bytes

    engine, folder = job["engine"], job["folder"]
    if engine.startswith("mlx-lm"):  # the OpenBLAS mlxchat runs on, preloaded before MLX binds its BLAS
        blas = _preload_blas(job.get("blas_path"))
    else:
        import mlxchat  # first: it puts OpenBLAS under MLX as it is imported

        blas = mlxchat.runtime_info()["blas_path"] or "MLX's bundled BLAS"
    import mlx.core as mx
    import numpy as np

    steps, batch, seq = job["steps"], job["batch"], job["seq"]
    vocab = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size") or 32000
    rng = np.random.default_rng(0)
    # one more token than the forward's width: the targets; steps + 1 batches, the first one a warm-up
    data = rng.integers(256, min(vocab, 30000), ((steps + 1) * batch, seq + 1)).tolist()
    start = time.perf_counter()
    run = _mlxchat if engine.startswith("mlxchat") else _mlx_lm
    step_s, trainable, losses = run(folder, data, steps + 1, batch, seq)
    wall = time.perf_counter() - start
    timed = step_s[1:]
    return {"engine": engine, "blas": blas, "trainable": trainable, "steps_timed": len(timed),
            "tokens_per_s": batch * seq * len(timed) / sum(timed), "step_s": timed, "first_step_s": step_s[0],
            "loss_first": losses[0], "loss_last": losses[-1], "wall_s": wall,
            "peak_bytes": int(mx.get_peak_memory()), "peak_rss_bytes": peak_rss_bytes()}


def _mlxchat(folder: str, data: list[list[int]], steps: int, batch: int,
             seq: int) -> tuple[list[float], int, list[float]]:
    from mlx.utils import tree_flatten

    import mlxchat
    from mlxchat.train import Example, TrainConfig, lora, train

    model = mlxchat.load_model(folder)
    lora(model, rank=RANK, alpha=RANK * SCALE, targets=TARGETS, seed=0)
    trainable = sum(v.size for _, v in tree_flatten(model.module.trainable_parameters()))
    examples = [Example.pretraining(ids) for ids in data]  # seq + 1 tokens: a forward seq wide, seq targets
    config = TrainConfig(steps=steps, learning_rate=LEARNING_RATE, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0,
                         betas=(0.9, 0.999), grad_clip=None, batch_tokens=batch * (seq + 1), log_every=1)
    log = train(model, examples, config)
    ends = [record.elapsed_s for record in log]
    model.close()
    return [b - a for a, b in zip([0.0, *ends], ends, strict=False)], trainable, [r.loss for r in log]


def _mlx_lm(folder: str, data: list[list[int]], steps: int, batch: int,
            seq: int) -> tuple[list[float], int, list[float]]:
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.trainer import TrainingArgs
    from mlx_lm.tuner.trainer import train as mlx_lm_train
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(folder)
    model.set_dtype(mx.float32)  # mlxchat's compute dtype on a CPU (quantized weights stay as they are)
    model.freeze()
    keys = [f"self_attn.{k}" for k in TARGETS[:4]] + [f"mlp.{k}" for k in TARGETS[4:]]
    linear_to_lora_layers(model, len(model.layers), {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": keys})
    mx.random.seed(0)
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))

    class Steps(TrainingCallback):  # type: ignore[misc]
        """Each step's time as mlx-lm's loop measures it (tokens over its tokens/s), and its loss."""

        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.losses: list[float] = []
            self.seen = 0

        def on_train_loss_report(self, info: dict[str, Any]) -> None:
            tokens, self.seen = info["trained_tokens"] - self.seen, info["trained_tokens"]
            self.step_s.append(tokens / info["tokens_per_second"])
            self.losses.append(info["train_loss"])

    # seq tokens an example: mlx-lm pads a batch to 1 + a multiple of 32 and trains on all but the last column
    dataset = [(ids[:seq], 0) for ids in data]
    args = TrainingArgs(batch_size=batch, iters=steps, val_batches=0, steps_per_report=1, steps_per_eval=10**9,
                        steps_per_save=10**9, max_seq_length=seq + 1, adapter_file=str(_scratch() / "adapters.st"))
    callback = Steps()
    mlx_lm_train(model, optim.Adam(learning_rate=LEARNING_RATE), dataset, args=args, training_callback=callback)
    return callback.step_s, trainable, callback.losses


def _scratch() -> Path:
    import tempfile

    return Path(tempfile.mkdtemp(prefix="lora-bench-"))


# -- the report ---------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# LoRA training: {results['batch']} x {results['seq']} tokens a step, rank {results['rank']} on "
             f"{', '.join(results['targets'])}, {results['steps']} timed steps after a warm-up, median of "
             f"{results['reps']}", ""]
    for title, rows in results["rows"].items():
        lines += [f"## {title}", "", "| engine | trained tok/s | peak MLX GB | peak RSS GB | trainable | loss first -> "
                  "last |", "| --- | ---: | ---: | ---: | ---: | --- |"]
        for row in rows:
            name = LABELS.get(row["engine"], row["engine"])
            if "error" in row:
                lines.append(f"| {name} | error: {row['error']} | | | | |")
                continue
            lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['peak_bytes'] / 1e9:.3f} | "
                         f"{row['peak_rss_bytes'] / 1e9:.3f} | {row['trainable']:,} | "
                         f"{row['loss_first']:.3f} -> {row['loss_last']:.3f} |")
        lines.append("")
    blas = {row.get("blas") for rows in results["rows"].values() for row in rows if row.get("blas")}
    lines += [f"- BLAS: {', '.join(sorted(blas))}" if blas else "- BLAS: unknown"]
    lines += [f"- not measured: {reason}" for reason in results["not_measured"]]
    return "\n".join(lines)

