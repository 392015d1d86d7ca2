"""Files replaced whole: what a crash leaves is the old file or the new one, never a mix (saved sessions,
spilled caches, training checkpoints, profiles)."""

from __future__ import annotations

import os
from pathlib import Path


def durable_replace(written: Path, target: Path) -> None:
    """Put the file ``written`` in place of ``target`` so that a crash leaves one or the other whole: its
    bytes reach the disk before the rename, and the rename before this returns."""
    with open(written, "rb") as file:
        os.fsync(file.fileno())
    os.replace(written, target)
    if hasattr(os, "O_DIRECTORY"):  # the folder's entry (POSIX; Windows has no folder handles)
        folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
