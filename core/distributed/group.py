"""Joining the process group ``mlx.launch`` started, and saying what it is."""

from __future__ import annotations

import os
from typing import Any, Literal

import mlx.core as mx

from ..errors import DistributedError

Mode = Literal["tensor", "pipeline"]
MODES: tuple[Mode, ...] = ("tensor", "pipeline")
LAUNCH_HINT = "mlx.launch --backend ring -n 2 -- mlxchat generate --distributed tensor ..."

# Variables each backend's launcher sets (mlx.launch, mpirun), in the order MLX tries the backends.
_BACKEND_ENV = (("jaccl", "MLX_JACCL_COORDINATOR"), ("ring", "MLX_HOSTFILE"), ("nccl", "NCCL_HOST_IP"),
                ("mpi", "OMPI_COMM_WORLD_SIZE"))


def launched_backend() -> str | None:
    """The backend this process was launched for (``None``: not launched in a group)."""
    return next((name for name, variable in _BACKEND_ENV if os.environ.get(variable)), None)


def join(mode: str) -> mx.distributed.Group:
    """The group of every process ``mlx.launch`` started with this one; a clear error when there is none."""
    if mode not in MODES:
        raise ValueError(f"distributed must be one of {', '.join(MODES)}, got {mode!r}")
    try:
        group = mx.distributed.init()
    except RuntimeError as exc:
        raise DistributedError(f"cannot join the process group ({exc})") from exc
    if group.size() < 2:
        raise DistributedError(f"distributed={mode!r} needs at least 2 processes, and this one runs alone: start "
                               f"every rank with mlx.launch (e.g. `{LAUNCH_HINT}`)")
    return group


def group_info() -> dict[str, Any] | None:
    """Rank, size and backend of the group this process was launched in (``None`` when it was not)."""
    backend = launched_backend()
    if backend is None:
        return None
    group = mx.distributed.init()
    return {"rank": group.rank(), "size": group.size(), "backend": backend}
