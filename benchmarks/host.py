"""This machine: what it is (for the table's header) and whether a row's weights fit in its memory now."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from .limits import BYTES_PER_PARAM


def describe() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ),
            cpu,
        )
    ram = 0.0
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


def weight_bytes(engine: str, params: float, lookup: float, dtype: str) -> float:
    """Peak bytes of an engine's weights while it loads a bfloat16 checkpoint into ``dtype``.

    mlxchat reads the stored weights, then converts all but lookup tables (per-layer embeddings stay
    stored); mlx-lm converts lazily, tensor by tensor; llama.cpp maps its GGUF file.
    """
    size = BYTES_PER_PARAM.get(dtype, 4.0)
    if engine == "mlxchat" and dtype != "bfloat16":
        return 2 * params + size * (params - lookup)
    return size * params


def memory_shortfall(engine: str, params: float, lookup: float, dtype: str) -> str | None:
    """Why a row would not fit in memory now (its weights plus 1 GB), or None."""
    free = available_memory()
    if free is None:
        return None
    need = weight_bytes(engine, params, lookup, dtype) + 1e9
    if need <= free:
        return None
    return f"needs about {need / 1e9:.0f} GB ({dtype}), {free / 1e9:.0f} GB available"


def run_ranks(command: list[str], ranks: int, cwd: Path, timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """``command`` as ``ranks`` processes of a ring over loopback, set up as ``mlx.launch --backend ring`` does
    (``MLX_RANK``, ``MLX_HOSTFILE``) but without its polling loop, which would take a core from the ranks."""
    sockets = [socket.socket() for _ in range(ranks)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    hosts = [[f"127.0.0.1:{s.getsockname()[1]}"] for s in sockets]
    for s in sockets:
        s.close()
    with tempfile.NamedTemporaryFile("w", suffix=".json") as hostfile:
        json.dump(hosts, hostfile)
        hostfile.flush()
        processes = [subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": hostfile.name})
                     for r in range(ranks)]
        try:
            outputs = [p.communicate(timeout=timeout) for p in processes]
        finally:
            for p in processes:
                p.kill()
    return [subprocess.CompletedProcess(command, p.returncode, out, err) for p, (out, err) in zip(processes, outputs,
                                                                                                    strict=True)]
