"""Joining the process group ``mlx.launch`` started, and saying what it is."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
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


def close_connections(group: mx.distributed.Group) -> None:
    """Shut down this process's connections of a ring group (``mlx.launch --backend ring``), as MLX does when
    it destroys one (it offers no call for it): a collective waiting on them fails instead of polling, and the
    ranks next to this one see the group end. The other backends' connections are left as they are.

    The ring's connections are the TCP sockets listening on this rank's addresses in ``MLX_HOSTFILE`` (from
    the rank before) or connected to the next rank's; they are found among the process's open files."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if launched_backend() != "ring" or not hostfile:
        return
    nodes = json.loads(Path(hostfile).read_text())
    rank = group.rank()
    ours = {address for entry in nodes[rank] for address in _addresses(entry)}
    right = {address for entry in nodes[(rank + 1) % group.size()] for address in _addresses(entry)}
    for name in os.listdir("/dev/fd"):
        try:
            copy = os.dup(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            continue
        try:
            connection = socket.socket(fileno=copy)
        except OSError:  # not a socket
            os.close(copy)
            continue
        with connection:
            try:
                if connection.getsockname()[:2] in ours or connection.getpeername()[:2] in right:
                    connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected, or no address of these families
                pass


def _addresses(entry: str) -> set[tuple[str, int]]:
    host, _, port = entry.rpartition(":")
    found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return {(str(info[4][0]), int(info[4][1])) for info in found}
