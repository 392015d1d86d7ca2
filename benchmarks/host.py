"""This machine: what it is (for the table's header) and whether a row's weights fit in its memory now."""

from __future__ import annotations

import os
import platform
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


def memory_shortfall(params: float, dtype: str) -> str | None:
    """Why a row would not fit in memory now, or None: weights in the compute dtype, plus the stored
    bfloat16 copy while it is converted, plus 1 GB."""
    free = available_memory()
    if free is None:
        return None
    need = params * (BYTES_PER_PARAM.get(dtype, 4.0) + (0 if dtype == "bfloat16" else 2)) + 1e9
    if need <= free:
        return None
    return f"needs about {need / 1e9:.0f} GB in {dtype}, {free / 1e9:.0f} GB available"
