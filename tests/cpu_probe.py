"""Run by test_other_cpus.py, under QEMU's user-mode emulator posing as a CPU without AVX-512 (or natively, for
the comparison): what mlxchat computes there, as one JSON object on stdout.

    python tests/cpu_probe.py FIXTURES NAMES   (NAMES: fixture folder names, comma-separated, or "all")
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from int8_support import oracle

import mlxchat  # before mlx.core (imported where used): it puts OpenBLAS under MLX
from mlxchat.testing.fixtures import fixture_folders
from mlxchat.testing.parity import assert_parity, reference

KV_BITS = (None, 16, 8, 4)


def parity(root: Path, names: str) -> dict[str, str]:
    """Each fixture's parity with its transformers oracle: the failures, by name."""
    failures = {}
    for folder in fixture_folders(root):
        if names != "all" and folder.name not in names.split(","):
            continue
        try:
            assert_parity(folder)
        except AssertionError as error:
            failures[folder.name] = str(error)
    return failures


def kv_logits(root: Path) -> dict[str, list[list[float]]]:
    """The Qwen3 fixture's logits through its caches (a prompt chunk, then one token at a time) in each KV format
    (quantized ones in groups of 32: its heads have 32 features)."""
    import mlx.core as mx

    ids = [int(t) for t in reference(root / "qwen3")["input_ids"]]
    sizes = [17, *[1] * (len(ids) - 17)]
    model = mlxchat.load_model(root / "qwen3")

    def run(bits: int | None) -> list[list[float]]:
        cache, out, at = model.layer_caches(bits, 32)[0](), [], 0
        for size in sizes:
            logits = model.module(mx.array(ids[at : at + size])[None], cache)[0].astype(mx.float32)
            out += np.array(logits).tolist()
            at += size
        return out

    logits = {str(bits): model.worker.run(lambda bits=bits: run(bits)) for bits in KV_BITS}
    model.close()
    return logits


def quantized_errors() -> dict[str, float]:
    """Each width's product of 20 rows of x, float x and 8-bit x, against its float64 oracle (for 8-bit x, where
    this CPU has a kernel for it: the rounded x times the weights), as a fraction of sum |x| |w|."""
    import mlx.core as mx

    from mlxchat import _quantized

    mx.random.seed(0)
    errors = {}
    for bits in (3, 4, 8):
        packed, scales, biases = mx.quantize(mx.random.normal((40, 256)) * 0.5, 64, bits)
        x = mx.random.normal((20, 256))
        w = np.array(mx.dequantize(packed, scales, biases, 64, bits), dtype=np.float64)
        exact = (np.array(x, dtype=np.float64) @ w.T, np.abs(np.array(x, dtype=np.float64)) @ np.abs(w).T)
        for int8 in (False, True):
            expected, bound = oracle(np.array(x), w, 64) if int8 and _quantized.int8_kernel() else exact
            ours = np.array(_quantized.quantized_matmul(x, packed, scales, biases, 64, bits, int8))
            errors[f"{bits} bits{', int8' if int8 else ''}"] = float((np.abs(ours - expected) / bound).max())
    return errors


def main(argv: list[str]) -> None:
    from mlxchat import _kernels, _quantized

    root, names = Path(argv[1]), argv[2]
    result: dict[str, Any] = {
        "isa": _quantized.detected_isa(),
        "int8": _quantized.int8_kernel(),
        "attention": _kernels.attention_isas(),
        "parity_failures": parity(root, names),
        "kv_logits": kv_logits(root),
        "quantized_errors": quantized_errors(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
