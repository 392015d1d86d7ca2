"""The hardware limit every row is held against.

Decode reads every active weight once per token, so it cannot beat ``bandwidth / bytes read per token``.
Prefill is matrix-matrix work, so it cannot beat ``GEMM FLOP/s / (2 x active parameters)`` tokens per
second. This module measures the machine's memory read bandwidth and float32 GEMM throughput (on the CPU
with numpy's own BLAS; on a GPU with MLX) and counts, from a checkpoint's safetensors headers, the
parameters each token touches.
"""

from __future__ import annotations

import json
import re
import struct
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

BYTES_PER_PARAM = {
    "float32": 4.0,
    "f32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "f16": 2.0,
    "q8_0": 34 / 32,  # llama.cpp: 32 int8 and one float16 scale
    "q4_0": 18 / 32,  # 32 nibbles and one float16 scale
    "8-bit": 1 + 8 / 64,  # MLX affine, group 64: a float32 scale and bias each (mlxchat computes in float32)
    "4-bit": 0.5 + 8 / 64,
}


def _best_seconds(run: Any, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu() -> dict[str, Any]:
    """sgemv over a 256 MiB matrix (read bandwidth; every byte is read once) and a 2048^3 sgemm, numpy."""
    import numpy as np

    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((16384, 4096), dtype=np.float32)
    vector = rng.standard_normal(4096, dtype=np.float32)
    gemv = _best_seconds(lambda: matrix @ vector, 20)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    b = rng.standard_normal((2048, 2048), dtype=np.float32)
    gemm = _best_seconds(lambda: a @ b, 5)
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    return {
        "device": "cpu",
        "bandwidth_gbs": matrix.nbytes / gemv / 1e9,
        "gemm_gflops": 2 * 2048**3 / gemm / 1e9,
        "method": f"numpy {np.__version__} ({blas.get('name', '?')} {blas.get('version', '')}): best of 20 "
        f"sgemv 16384x4096 (read bandwidth), best of 5 sgemm 2048^3",
    }


def measure_gpu() -> dict[str, Any]:
    """The same numbers on MLX's GPU: a 1 GiB float32 matrix-vector product, and 4096^3 GEMMs in float32
    and bfloat16 (rows there compute in the checkpoint's bfloat16)."""
    import mlx.core as mx

    matrix = mx.random.normal((65536, 4096))
    vector = mx.random.normal((4096,))
    a = mx.random.normal((4096, 4096))
    b = a.astype(mx.bfloat16)
    mx.eval(matrix, vector, a, b)
    gemv = _best_seconds(lambda: mx.eval(matrix @ vector), 20)
    gemm = _best_seconds(lambda: mx.eval(a @ a), 10)
    gemm_bf16 = _best_seconds(lambda: mx.eval(b @ b), 10)
    return {
        "device": str(mx.default_device()),
        "bandwidth_gbs": matrix.nbytes / gemv / 1e9,
        "gemm_gflops": 2 * 4096**3 / gemm / 1e9,
        "gemm_gflops_bfloat16": 2 * 4096**3 / gemm_bf16 / 1e9,
        "method": f"MLX {version('mlx')} on {mx.default_device()}: best of 20 float32 matvec 65536x4096, "
        f"best of 10 GEMMs 4096^3 in float32 and bfloat16",
    }


def measure(device: str) -> dict[str, Any]:
    return measure_gpu() if device.startswith("gpu") else measure_cpu()


# -- what a token touches ---------------------------------------------------------------------------

_LOOKUP = re.compile(r"embed_tokens(_per_layer)?\.weight$")
_EXPERT = re.compile(r"\.experts\.|\.switch_(mlp|glu)\.")


def _tensor_shapes(folder: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def token_work(folder: Path) -> dict[str, Any]:
    """Parameters a decode step reads and a prompt token multiplies, from the checkpoint's headers.

    - Embedding tables (token and per-layer) are lookups: one row a token, not counted.
    - The lm_head (or the tied embedding acting as one) is read by every decode step; a prefill computes
      it for the last token only, so prefill work leaves it out.
    - Routed experts count with the fraction top_k / experts (only the chosen experts are read).
    - Attention over the cache (KV reads, the L^2 term) is not counted: small at these lengths.
    """
    config = json.loads((folder / "config.json").read_text())
    text = {**config, **config.get("text_config", {})}
    experts = text.get("num_experts") or text.get("num_local_experts") or 0
    top_k = text.get("num_experts_per_tok") or text.get("top_k_experts") or 0
    shapes = _tensor_shapes(folder)
    dense = lookup = expert = head = 0
    embedding = 0
    for name, shape in shapes.items():
        size = _numel(shape)
        if name.endswith("lm_head.weight"):
            head += size
        elif _LOOKUP.search(name):
            lookup += size
            if name.endswith("embed_tokens.weight") and "per_layer" not in name:
                embedding = size
        elif experts and _EXPERT.search(name):
            expert += size
        else:
            dense += size
    tied = head == 0
    head = head or embedding
    active_experts = expert * top_k / experts if experts else 0
    return {
        "total_params": dense + lookup + expert + (0 if tied else head),
        "decode_params": dense + active_experts + head,
        "prefill_params": dense + active_experts,
        "experts": experts,
        "top_k": top_k,
        "tied_head": tied,
    }


def bounds(work: dict[str, Any], limits: dict[str, Any], dtype: str) -> dict[str, float]:
    """Bandwidth-bound decode tokens/s and GEMM-bound prefill tokens/s for one engine's weight dtype
    (against the float32 GEMM unless the limits hold one for that dtype)."""
    per_param = BYTES_PER_PARAM.get(dtype.lower(), 4.0)
    gemm = limits.get(f"gemm_gflops_{dtype.lower()}", limits["gemm_gflops"])
    return {
        "decode_bound_tps": limits["bandwidth_gbs"] * 1e9 / (work["decode_params"] * per_param),
        "prefill_bound_tps": gemm * 1e9 / (2 * work["prefill_params"]),
    }
