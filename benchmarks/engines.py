"""The runtimes being compared, behind one small interface: load a checkpoint, stream greedy token ids.

Each engine runs in its own process (see :mod:`benchmarks.worker`), because what a process loads first
decides which BLAS MLX calls: mlxchat puts OpenBLAS and its single-row gemv route under MLX when it is
imported; "mlx-lm" preloads the same OpenBLAS itself before importing MLX (its best CPU setting) and
computes in the dtype mlxchat uses; "mlx-lm-default" is mlx-lm as installed: the stored bfloat16 on
MLX's bundled reference BLAS. "mlxchat-8bit" / "mlxchat-4bit" run MLX-quantized copies of the checkpoint
(:mod:`benchmarks.mlx_quantized`). llama.cpp (llama-cpp-python, optional) runs GGUF conversions of the same
checkpoint at F32, F16, Q8_0 and Q4_0 (:mod:`benchmarks.gguf`). The image rows (:mod:`benchmarks.vision`)
hold mlxchat against "mlx-vlm", loaded like "mlx-lm": mlxchat's dtype, the same OpenBLAS preloaded.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

ENGINES = ("mlxchat", "mlxchat-8bit", "mlxchat-4bit", "mlxchat-8bit-x8", "mlxchat-4bit-x8", "mlx-lm", "mlx-lm-default",
           "llama.cpp-f32", "llama.cpp-f16",
           "llama.cpp-q8_0", "llama.cpp-q4_0")
SPLIT = {"mlxchat-tensor": "tensor", "mlxchat-pipeline": "pipeline"}
"""mlxchat split over several local processes (``--distributed``): one model over ``--ranks`` ranks."""
LABELS = {
    "mlxchat": "mlxchat",
    "mlxchat-tensor": "mlxchat, tensor parallel",
    "mlxchat-pipeline": "mlxchat, pipeline parallel",
    "mlxchat-8bit": "mlxchat 8-bit",
    "mlxchat-4bit": "mlxchat 4-bit",
    "mlxchat-8bit-x8": "mlxchat 8-bit, 8-bit x",
    "mlxchat-4bit-x8": "mlxchat 4-bit, 8-bit x",
    "mlx-lm": "mlx-lm (same dtype, OpenBLAS)",
    "mlx-lm-default": "mlx-lm (defaults)",
    "llama.cpp-f32": "llama.cpp F32",
    "llama.cpp-f16": "llama.cpp F16",
    "llama.cpp-q8_0": "llama.cpp Q8_0",
    "llama.cpp-q4_0": "llama.cpp Q4_0",
    "mlxchat-kv16": "mlxchat, float16 KV",
    "mlxchat-kv8": "mlxchat, 8-bit KV",
    "mlxchat-kv4": "mlxchat, 4-bit KV",
    "llama.cpp-f32-kv8": "llama.cpp F32, q8_0 KV",
    "mlxchat-session": "mlxchat, session turn",
    "mlx-vlm": "mlx-vlm (same dtype, OpenBLAS)",
}
VISION_ENGINES = ("mlxchat", "mlx-vlm")
"""The engines of the image rows."""
QUANTIZED_BITS = {"mlxchat-8bit": 8, "mlxchat-4bit": 4, "mlxchat-8bit-x8": 8, "mlxchat-4bit-x8": 4}
INT8_ACTIVATIONS = ("mlxchat-8bit-x8", "mlxchat-4bit-x8")
"""Quantized rows whose prompts' products round x to 8 bits (``mlxchat.quantized.set_int8_activations``), as
llama.cpp's quantized products do."""
KV_BITS = {"mlxchat-kv16": 16, "mlxchat-kv8": 8, "mlxchat-kv4": 4}
"""mlxchat with a float16 or quantized KV cache (``kv_bits``; quantized in groups of 64: its default)."""
COMPARISONS = {
    "mlxchat": ("mlx-lm", "mlx-lm-default", "llama.cpp-f32", "llama.cpp-f16", "llama.cpp-q8_0", "llama.cpp-q4_0"),
    "mlxchat-8bit": ("llama.cpp-q8_0", "mlxchat"),
    "mlxchat-4bit": ("llama.cpp-q4_0", "mlxchat"),
    "mlxchat-8bit-x8": ("llama.cpp-q8_0", "mlxchat-8bit"),
    "mlxchat-4bit-x8": ("llama.cpp-q4_0", "mlxchat-4bit"),
}
"""The ratio rows of the table: each mlxchat row over the engines it is held against (same bits first)."""


def peak_rss_bytes() -> int:
    """The process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024


class Engine:
    """One runtime with one checkpoint loaded."""

    name = ""
    dtype = ""
    blas = ""

    def stream(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        """Greedy token ids, yielded as each one is ready (stops early on the checkpoint's EOS)."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        """Start a new peak-memory window (where the runtime keeps one)."""

    def peak_bytes(self) -> int | None:
        """Peak bytes the runtime's allocator held since :meth:`reset_peak` (None: it keeps no count)."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "dtype": self.dtype, "blas": self.blas}


def _mlx_dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _mlx_blas_gflops() -> float | None:
    """float32 GEMM speed MLX gets in this process: tells which BLAS is really underneath (CPU only)."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    a = mx.random.normal((512, 512))
    mx.eval(a)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(a @ a)
        best = min(best, time.perf_counter() - start)
    return 2 * 512**3 / best / 1e9


class MlxEngine(Engine):
    """Shared by mlxchat and mlx-lm: MLX's allocator keeps the peak."""

    def reset_peak(self) -> None:
        import mlx.core as mx

        mx.reset_peak_memory()

    def peak_bytes(self) -> int | None:
        import mlx.core as mx

        return int(mx.get_peak_memory())

    def describe(self) -> dict[str, Any]:
        import mlx.core as mx

        return {
            **super().describe(),
            "device": str(mx.default_device()),
            "mlx": version("mlx"),
            "blas_gflops_512": _mlx_blas_gflops(),
        }


class Mlxchat(MlxEngine):
    """mlxchat with its defaults; on an MLX-quantized checkpoint the dtype column says the bits."""

    def __init__(self, folder: Path, name: str = "mlxchat", distributed: str | None = None,
                 kv_bits: int | None = None, int8_activations: bool = False):
        import mlxchat
        import mlxchat.quantized

        self.name, self.kv_bits = name, kv_bits
        mlxchat.quantized.set_int8_activations(int8_activations)
        self.model = mlxchat.load_model(folder, distributed=distributed, kv_bits=kv_bits)  # type: ignore[arg-type]
        info = mlxchat.runtime_info()
        self.info = info
        quantization = self.model.quantization
        self.dtype = f"{quantization['bits']}-bit" if quantization else _mlx_dtype_name(self.model.dtype)
        where = f" ({info['blas_path']})" if info["blas_path"] else ""
        self.blas = info["blas"] + where + (" + single-row gemv route" if info["gemv_route"] else "")
        if quantization:
            self.blas = f"quantized products on {info['quantized_kernels']}, the rest on {self.blas}"

    def stream(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        from mlxchat import GenerationConfig

        config = GenerationConfig(max_tokens=max_tokens, temperature=0.0)
        for chunk in self.model.stream(ids, config):
            if chunk.token is not None:
                yield chunk.token

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mlxchat": self.info["mlxchat"],
            "blas_path": self.info["blas_path"],
            "gemv_route": self.info["gemv_route"],
            "blas_note": self.info["blas_note"],
            "quantized_kernels": self.info.get("quantized_kernels"),
            "kv_bits": self.kv_bits,
        }


class MlxLm(MlxEngine):
    """mlx-lm's own load and stream_generate; ``dtype`` None keeps the stored dtype."""

    def __init__(self, folder: Path, *, blas_path: str | None, dtype: str | None, name: str):
        self.name = name
        self.blas = _preload_blas(blas_path)
        from mlx_lm import load

        loaded = load(str(folder), lazy=dtype is not None)
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.dtype = _materialize(self.model, dtype)

    def stream(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        from mlx_lm import stream_generate

        for response in stream_generate(self.model, self.tokenizer, ids, max_tokens=max_tokens):
            yield response.token

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mlx_lm": version("mlx-lm")}


class MlxVlm(MlxEngine):
    """mlx-vlm's own load of a vision-language checkpoint, computing in ``dtype`` (the image rows drive it
    through :mod:`benchmarks.vision`)."""

    def __init__(self, folder: Path, *, blas_path: str | None, dtype: str | None):
        self.name = "mlx-vlm"
        self.blas = _preload_blas(blas_path)
        from mlx_vlm import load

        self.model, self.processor = load(str(folder), lazy=True)
        self.dtype = _materialize(self.model, dtype)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mlx_vlm": version("mlx-vlm")}


def _preload_blas(blas_path: str | None) -> str:
    """Loads ``blas_path`` for MLX to bind to; says which BLAS MLX will call."""
    if not blas_path:
        return "MLX's bundled BLAS"
    # Must happen before mlx.core is imported: MLX binds cblas_* to the first definition it finds.
    if "mlx.core" in sys.modules:
        raise RuntimeError(f"mlx.core was imported before {blas_path} was preloaded: MLX would not use it")
    ctypes.CDLL(blas_path, mode=ctypes.RTLD_GLOBAL)
    return f"OpenBLAS preloaded ({blas_path})"


def _materialize(model: Any, dtype: str | None) -> str:
    """Casts a lazily loaded model to ``dtype`` (None: as stored), evaluates it; its weights' dtype."""
    import mlx.core as mx

    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    floats = [p.dtype for _, p in _leaves(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)]
    return _mlx_dtype_name(max(set(floats), key=floats.count))


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return cast(list[tuple[str, Any]], tree_flatten(tree))


class LlamaCpp(Engine):
    """llama-cpp-python on a GGUF file (converted from the same checkpoint by :mod:`benchmarks.gguf`)."""

    def __init__(self, gguf: Path, *, name: str, context: int, q8_kv: bool = False):
        """``q8_kv``: keys and values cached as q8_0 (llama.cpp's ``-ctk q8_0 -ctv q8_0``, which needs its
        flash attention); else llama.cpp's default cache, F16, without flash attention (llama-cpp-python's
        default)."""
        from llama_cpp import Llama

        self.name = name
        self.dtype = "F32" if q8_kv else name.split("-")[-1].upper()
        self.blas = "llama.cpp (ggml CPU kernels)"
        q8_0 = 8  # ggml_type GGML_TYPE_Q8_0
        kv = {"type_k": q8_0, "type_v": q8_0, "flash_attn": True} if q8_kv else {}
        self.kv_cache, self.flash_attn = ("q8_0", True) if q8_kv else ("f16", False)
        self.llm = Llama(model_path=str(gguf), n_ctx=context, n_batch=512, n_threads=os.cpu_count(), verbose=False,
                         **kv)

    def stream(self, ids: list[int], max_tokens: int) -> Iterator[int]:
        eos = self.llm.token_eos()
        for count, token in enumerate(self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True), 1):
            yield token
            if count >= max_tokens or token == eos:
                return

    def describe(self) -> dict[str, Any]:
        import llama_cpp

        features = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        return {**super().describe(), "llama_cpp_python": version("llama-cpp-python"), "ggml_features": features,
                "kv_cache": self.kv_cache, "flash_attn": self.flash_attn}


def open_engine(name: str, folder: Path, *, blas_path: str | None, dtype: str | None, context: int) -> Engine:
    """``dtype``: what the "mlx-lm" engine computes in (mlxchat's dtype); ``blas_path``: the OpenBLAS
    mlxchat found (None off Linux-CPU)."""
    if name == "mlxchat":
        return Mlxchat(folder)
    if name in KV_BITS:
        return Mlxchat(folder, name, kv_bits=KV_BITS[name])
    if name == "llama.cpp-f32-kv8":
        from .gguf import converted

        return LlamaCpp(converted(folder, "f32"), name=name, context=context, q8_kv=True)
    if name in QUANTIZED_BITS:
        from .mlx_quantized import folder_for

        return Mlxchat(folder_for(folder, QUANTIZED_BITS[name]), name, int8_activations=name in INT8_ACTIVATIONS)
    if name in SPLIT:
        return Mlxchat(folder, name, SPLIT[name])
    if name == "mlx-lm":
        return MlxLm(folder, blas_path=blas_path, dtype=dtype, name=name)
    if name == "mlx-lm-default":
        return MlxLm(folder, blas_path=None, dtype=None, name=name)
    if name.startswith("llama.cpp-"):
        from .gguf import converted

        return LlamaCpp(converted(folder, name.split("-")[-1]), name=name, context=context)
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")


class Traffic:
    """Counts the bytes a split model hands to MLX's collectives (the payloads: an all-reduce of n bytes
    moves about 2 n (N-1)/N per rank over a ring, an all-gather n (N-1) of each rank's n), by wrapping them."""

    CALLS = ("all_sum", "all_gather", "send")

    def __init__(self) -> None:
        import mlx.core as mx

        self.bytes = {name: 0 for name in self.CALLS}
        self.calls = {name: 0 for name in self.CALLS}
        self._real = {name: getattr(mx.distributed, name) for name in self.CALLS}
        for name in self.CALLS:
            setattr(mx.distributed, name, self._counted(name))

    def _counted(self, name: str) -> Any:
        real = self._real[name]

        def call(x: Any, *args: Any, **kwargs: Any) -> Any:
            self.bytes[name] += x.nbytes
            self.calls[name] += 1
            return real(x, *args, **kwargs)

        return call

    def snapshot(self) -> dict[str, int]:
        return {**{f"{k}_bytes": v for k, v in self.bytes.items()}, **{f"{k}_calls": v for k, v in self.calls.items()}}
