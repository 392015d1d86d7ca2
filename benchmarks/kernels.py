"""``python -m benchmarks.kernels``: the matrix kernels under mlxchat on a CPU, one at a time, through MLX.

- **BLAS**: float32 matmuls as MLX issues them (weights stored [out, in], as checkpoints store them), on
  each OpenBLAS mlxchat can load (``MLXCHAT_BLAS=system`` / ``numpy``): GEMM GFLOP/s at prefill shapes and
  single-row GB/s of weights read at decode shapes (through the sgemv route).
- **Quantized**: GB/s of packed weights (with their scales and biases) that the native 4- and 8-bit
  kernels read at decode shapes for one row, and numpy's own float32 sgemv beside them as the bandwidth
  reference of the moment; GFLOP/s for 4 and 8 rows (batched decoding, speculative drafts), where the
  kernels are bound by arithmetic rather than by the read.
- **Attention**: GB/s of KV cache (float32, 8-bit, 4-bit) that one decode step's attention reads at
  Qwen3-0.6B's shapes, through ``mlxchat.layers.attend`` (the fused kernel on a CPU), over enough layers'
  caches that the last-level cache cannot hold them; and GFLOP/s of a 512-token prefill chunk over 4k keys.

Every library runs in its own process (the BLAS is chosen at import); rounds alternate and the table shows
medians over rounds of the best of a few calls. Each call evaluates 16 products at once, as a decode step
evaluates a whole forward: one evaluation alone costs tens of microseconds of scheduling, which would hide
the kernels. A shared machine distorts all of it: compare rows taken in one run only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

GEMM_SHAPES = [(512, 3072, 1024), (512, 1024, 3072), (2048, 2048, 2048)]
"""(rows of x, outputs, inputs): a prefill chunk through Qwen3-0.6B's up and down projections, and a square."""
GEMV_SHAPES = [(3072, 1024), (1024, 3072), (151936, 1024), (16384, 4096)]
"""(outputs, inputs): Qwen3-0.6B's up, down and lm_head; a 256 MiB matrix (float32) that no cache holds."""
QUANT_ROWS = (1, 4, 8)
PER_EVAL = 16
ATTENTION_KEYS = (4096, 32768)
"""Cached keys of the measured decode steps (Qwen3-0.6B: 16 query heads, 8 KV heads, head 128)."""


def _best(run: Any, repeats: int = 5) -> float:
    run()
    return min(_timed(run) for _ in range(repeats))


def _timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_blas() -> dict[str, Any]:
    import mlxchat  # noqa: I001  (before mlx.core: it puts the BLAS under MLX)
    import mlx.core as mx

    out: dict[str, Any] = {"library": mlxchat.runtime_info()["blas"]}
    for m, n, k in GEMM_SHAPES:
        x, w = mx.random.normal((m, k)), mx.random.normal((n, k))
        mx.eval(x, w)
        out[f"gemm {m}x{n}x{k}"] = 2 * m * n * k / _best(lambda x=x, w=w: mx.eval(x @ w.T)) / 1e9
    for n, k in GEMV_SHAPES:
        xs, w = [mx.random.normal((1, k)) for _ in range(PER_EVAL)], mx.random.normal((n, k))
        mx.eval(xs, w)
        out[f"gemv {n}x{k}"] = PER_EVAL * w.nbytes / _best(lambda xs=xs, w=w: mx.eval([x @ w.T for x in xs]), 5) / 1e9
    return out


def measure_quantized() -> dict[str, Any]:
    import mlxchat.quantized as mq  # noqa: I001  (before mlx.core: mlxchat puts the BLAS under MLX)
    import mlx.core as mx
    import numpy as np

    native, why = mq._native()
    out: dict[str, Any] = {"kernels": why or f"{native.isa()}, {native.threads()} threads"}
    for n, k in GEMV_SHAPES:
        w = mx.random.normal((n, k))
        for bits in (4, 8):
            packed, scales, biases = mx.quantize(w, 64, bits)
            mx.eval(packed, scales, biases)
            size = packed.nbytes + scales.nbytes + biases.nbytes
            for rows in QUANT_ROWS:
                xs = [mx.random.normal((rows, k)) for _ in range(PER_EVAL)]
                mx.eval(xs)

                def run(xs: list[mx.array] = xs, p: mx.array = packed, s: mx.array = scales, b: mx.array = biases,
                        bits: int = bits) -> None:
                    mx.eval([mq.quantized_matmul(x, p, s, b, 64, bits) for x in xs])

                seconds = _best(run, 5) / PER_EVAL
                if rows == 1:
                    out[f"{bits}-bit x1 {n}x{k} GB/s"] = size / seconds / 1e9
                else:
                    out[f"{bits}-bit x{rows} {n}x{k} GFLOP/s"] = 2 * rows * n * k / seconds / 1e9
        matrix = np.asarray(w)
        vector = np.ones(k, dtype=np.float32)
        out[f"numpy sgemv {n}x{k} GB/s"] = matrix.nbytes / _best(lambda m=matrix, v=vector: m @ v, 10) / 1e9
    return out


def measure_attention() -> dict[str, Any]:
    from mlxchat.kernels import kernel_info  # noqa: I001  (before mlx.core: mlxchat puts the BLAS under MLX)
    import mlx.core as mx
    import numpy as np
    from mlxchat.cache import KVCache, QuantizedKVCache
    from mlxchat.layers import attend

    heads, kv_heads, dims = 16, 8, 128
    out: dict[str, Any] = {"kernels": kernel_info()["fused_kernels"]}
    q, k, v = mx.random.normal((1, heads, 1, dims)), mx.random.normal((1, kv_heads, 1, dims)), mx.random.normal(
        (1, kv_heads, 1, dims))
    for keys in ATTENTION_KEYS:
        for bits in (None, 8, 4):
            caches: list[KVCache] = []
            while sum(c.nbytes for c in caches) < 1 << 30:  # no last-level cache holds them
                cache = KVCache() if bits is None else QuantizedKVCache(bits, 64)
                for start in range(0, keys, 4096):
                    chunk = min(4096, keys - start)
                    cache.update_and_fetch(mx.random.normal((1, kv_heads, chunk, dims)),
                                           mx.random.normal((1, kv_heads, chunk, dims)))
                    mx.eval(cache.state)
                caches.append(cache)

            def step(caches: list[KVCache] = caches, keys: int = keys) -> None:
                for cache in caches:
                    cache.trim_to(keys)
                mx.eval([attend(q, k, v, cache, dims**-0.5) for cache in caches])

            name = "float32" if bits is None else f"{bits}-bit"
            out[f"decode {name} {keys} keys"] = sum(c.nbytes for c in caches) / _best(step, 3) / 1e9
            del caches
    chunk, keys = 512, 4096
    q, k, v = (mx.random.normal((1, h, n, dims)) for h, n in ((heads, chunk), (kv_heads, keys), (kv_heads, keys)))
    mx.eval(q, k, v)
    flops = 4 * heads * dims * chunk * (keys - chunk / 2)
    prefill = _best(lambda: mx.eval(attend(q, k, v, None, 0.1)))
    out[f"prefill {chunk} over {keys} keys (GFLOP/s)"] = flops / prefill / 1e9
    matrix, vector = np.ones((16384, 4096), dtype=np.float32), np.ones(4096, dtype=np.float32)
    out["numpy sgemv 16384x4096"] = matrix.nbytes / _best(lambda: matrix @ vector, 10) / 1e9
    return out


def _child(kind: str, blas: str) -> dict[str, Any]:
    env = {**__import__("os").environ, "MLXCHAT_BLAS": blas}
    done = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--child", kind], env=env, check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds, engines alternating (default 3)")
    parser.add_argument("--only", choices=["blas", "quantized", "attention"], help="one of the tables")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        measure = {"blas": measure_blas, "quantized": measure_quantized, "attention": measure_attention}
        print(json.dumps(measure[args.child]()))
        return
    jobs = [("blas", "system"), ("blas", "numpy")] if args.only in (None, "blas") else []
    jobs += [(kind, "") for kind in ("quantized", "attention") if args.only in (None, kind)]
    rounds: dict[tuple[str, str], list[dict[str, Any]]] = {job: [] for job in jobs}
    for index in range(args.rounds):
        for job in jobs if index % 2 == 0 else jobs[::-1]:
            rounds[job].append(_child(*job))
            print(f"round {index + 1}: {job[0]} {job[1]} done", file=sys.stderr, flush=True)
    titles = {"quantized": "native quantized kernels", "attention": "attention"}
    units = {"blas": "GFLOP/s (gemm), GB/s of weights (gemv)",
             "quantized": "GB/s of packed weights (one row), GFLOP/s (several)",
             "attention": "GB/s of KV cache read by a decode step"}
    for (kind, _), results in rounds.items():
        title = results[0]["library"] if kind == "blas" else f"{titles[kind]} ({results[0]['kernels']})"
        unit = units[kind]
        print(f"\n{title}: medians of {len(results)} rounds, {unit}")
        for key in results[0]:
            if key in ("library", "kernels"):
                continue
            print(f"  {key:<38} {statistics.median(r[key] for r in results):8.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
