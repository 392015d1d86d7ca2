"""GGUF copies of the benchmark checkpoints for the llama.cpp rows (only when llama-cpp-python is installed).

    python -m benchmarks.gguf CHECKPOINT_FOLDER TYPE      # TYPE: f32 or q8_0

The conversion is llama.cpp's own ``convert_hf_to_gguf.py``, which llama-cpp-python's wheel does not
ship: point ``LLAMA_CPP_CONVERT`` at it (it sits at the root of a llama.cpp checkout, next to the
``gguf-py`` package it imports), or ``LLAMA_CPP_DIR`` at the checkout.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from .checkpoints import HERE

GGUF_DIR = Path(os.environ.get("MLXCHAT_BENCH_GGUF", HERE / "gguf"))
TYPES = ("f32", "q8_0")


def available() -> str | None:
    """None when the llama.cpp rows can run, else why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles for ~20 minutes)"
    if converter() is None:
        return "llama.cpp's convert_hf_to_gguf.py not found (set LLAMA_CPP_CONVERT or LLAMA_CPP_DIR)"
    return None


def converter() -> Path | None:
    candidates = [os.environ.get("LLAMA_CPP_CONVERT")]
    if os.environ.get("LLAMA_CPP_DIR"):
        candidates.append(str(Path(os.environ["LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py"))
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.origin is not None:
        package = Path(spec.origin).parent
        candidates += [
            str(package / "convert_hf_to_gguf.py"),
            str(package / "vendor/llama.cpp/convert_hf_to_gguf.py"),
        ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def converted(folder: Path, kind: str) -> Path:
    """Where the GGUF of a checkpoint folder lives (made by :func:`convert`)."""
    path = GGUF_DIR / f"{folder.name}-{kind}.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not converted yet (python -m benchmarks.gguf {folder} {kind})")
    return path


def convert(folder: Path, kind: str) -> Path:
    if kind not in TYPES:
        raise ValueError(f"GGUF type must be one of {', '.join(TYPES)}, got {kind!r}")
    script = converter()
    if script is None:
        raise RuntimeError(available())
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    target = GGUF_DIR / f"{folder.name}-{kind}.gguf"
    if target.exists() and target.stat().st_mtime >= (folder / "config.json").stat().st_mtime:
        return target
    partial = target.with_suffix(".partial")
    subprocess.run(
        [sys.executable, str(script), str(folder), "--outfile", str(partial), "--outtype", kind],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    partial.rename(target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(convert(Path(sys.argv[1]), sys.argv[2]))
