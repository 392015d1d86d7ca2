"""``python -m benchmarks.kv_error``: how far quantized KV caches move a model's logits from float KV's,
mlxchat and mlx-lm side by side on the same checkpoints, the same token ids and the same chunks.

Each engine runs 120 random token ids through fresh caches in chunks of 24, 5, 60 and 3 tokens, then one at a
time (groups of 32 fill inside chunks and between steps), once with float KV and once with 8- and 4-bit KV
(groups of 32), and reports the largest absolute logit difference over every position. mlxchat's float16 KV
(no groups) is the yardstick: how far rounding the cache to float16 alone moves the same logits. mlxchat keeps the
newest tokens in float until a group fills and pads a head narrower than a group; mlx-lm's
``QuantizedKVCache`` quantizes every token at once and refuses a head narrower than a group. The default
checkpoints are the test fixtures (random weights, float32). Writes ``results/kv_error.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .host import describe

RESULTS = Path(__file__).resolve().parent / "results"
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
CHECKPOINTS = ("qwen3", "qwen3_moe", "qwen3_5", "lfm2", "gemma4")
CHUNKS, LENGTH, GROUP = (24, 5, 60, 3), 120, 32


def logits(run_chunk: Callable[[list[int]], Any], ids: list[int]) -> np.ndarray:
    """Every position's logits (float32), ``ids`` fed in :data:`CHUNKS` then one at a time."""
    import mlx.core as mx

    out, at = [], 0
    for size in [*CHUNKS, *[1] * (len(ids) - sum(CHUNKS))]:
        chunk = run_chunk(ids[at : at + size]).astype(mx.float32)
        mx.eval(chunk)
        out.append(np.array(chunk))
        at += size
    return np.concatenate(out)


def mlxchat_errors(folder: Path, ids: list[int]) -> dict[int, float]:
    import mlx.core as mx

    import mlxchat

    with mlxchat.load_model(folder, dtype="float32") as model:
        def run(bits: int | None) -> np.ndarray:
            cache = model.layer_caches(bits, GROUP)[0]()
            return model.worker.run(logits, lambda chunk: model.module(mx.array(chunk)[None], cache)[0], ids)

        reference = run(None)
        return {bits: float(np.abs(run(bits) - reference).max()) for bits in (16, 8, 4)}


def mlx_lm_errors(folder: Path, ids: list[int]) -> dict[int, float]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)

    def run(bits: int | None) -> np.ndarray:
        cache = make_prompt_cache(model)
        if bits:
            cache = [QuantizedKVCache(group_size=GROUP, bits=bits) if type(c) is KVCache else c for c in cache]
        return logits(lambda chunk: model(mx.array(chunk)[None], cache=cache)[0], ids)

    reference = run(None)
    return {bits: float(np.abs(run(bits) - reference).max()) for bits in (8, 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_error", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", default=",".join(CHECKPOINTS),
                        help="fixture names or folders, comma-separated (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_error")
    args = parser.parse_args(argv)
    rows = []
    for name in args.checkpoints.split(","):
        folder = Path(name) if Path(name).is_dir() else FIXTURES / name
        vocab = json.loads((folder / "config.json").read_text())
        vocab = vocab.get("vocab_size") or vocab.get("text_config", {}).get("vocab_size")
        ids = np.random.default_rng(3).integers(0, vocab, LENGTH).tolist()
        row: dict[str, Any] = {"checkpoint": folder.name}
        for engine, errors in (("mlxchat", mlxchat_errors), ("mlx-lm", mlx_lm_errors)):
            try:
                row[engine] = errors(folder, ids)
            except Exception as exc:  # noqa: BLE001 - an engine that cannot run a checkpoint is a row's finding
                row[engine] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
        print(row, flush=True)
    command = "python -m benchmarks.kv_error " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"host": describe(), "command": command, "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(markdown(results)) + "\n")
    print("\n".join(markdown(results)))


def markdown(results: dict[str, Any]) -> list[str]:
    def cell(value: Any, bits: int) -> str:
        return f"{value[bits]:.2e}" if isinstance(value, dict) else "did not run"

    def cells(row: dict[str, Any], *columns: tuple[str, int]) -> str:
        return " | ".join(cell(row[engine], bits) for engine, bits in columns)

    lines = ["# Quantized KV: largest logit difference from float KV, mlxchat and mlx-lm", "",
             f"Command `{results['command']}`; {LENGTH} random token ids in chunks of "
             f"{', '.join(map(str, CHUNKS))}, then one at a time; groups of {GROUP}; float32 weights.", "",
             "| checkpoint | mlxchat float16 | mlxchat 8-bit | mlx-lm 8-bit | mlxchat 4-bit | mlx-lm 4-bit |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in results["rows"]:
        columns = cells(row, ("mlxchat", 16), ("mlxchat", 8), ("mlx-lm", 8), ("mlxchat", 4), ("mlx-lm", 4))
        lines.append(f"| {row['checkpoint']} | {columns} |")
    failures = [f"- {engine} on {row['checkpoint']}: {row[engine]}" for row in results["rows"]
                for engine in ("mlxchat", "mlx-lm") if not isinstance(row[engine], dict)]
    return lines + (["", "Did not run:", "", *failures] if failures else [])


if __name__ == "__main__":
    main()
