"""Resumable training state: the trainable weights, the optimizer's state and the step, written so that a run
killed at any moment resumes from its last complete checkpoint.

Each checkpoint is a folder ``step-NNNNNNN`` (``state.safetensors`` and ``state.json``); the file ``latest``
names the newest complete one and is replaced atomically after the folder's files have reached the disk, so
a half-written folder is never read, even after a power cut. The two newest are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, TypeVar, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten
from pydantic import TypeAdapter, ValidationError

from ..errors import CheckpointError
from ..files import durable_replace

_KEEP = 2


def save_state(folder: str | os.PathLike[str], module: nn.Module, optimizer: optim.Optimizer, step: int,
               extra: dict[str, Any], files: dict[str, dict[str, mx.array]] | None = None) -> Path:
    """Write the state after ``step`` updates (``extra``: anything JSON the run needs to go on, e.g. its log;
    ``files``: more safetensors files for the folder, by name, complete before ``latest`` names it)."""
    try:
        return _save_state(Path(folder), module, optimizer, step, extra, files)
    except (OSError, RuntimeError) as exc:  # a full disk, a folder gone or not writable: the last checkpoint stays
        raise CheckpointError(f"cannot write the training checkpoint of step {step} under {folder} "
                              f"({type(exc).__name__}: {exc})") from None


def _save_state(root: Path, module: nn.Module, optimizer: optim.Optimizer, step: int, extra: dict[str, Any],
                files: dict[str, dict[str, mx.array]] | None) -> Path:
    out = root / f"step-{step:07d}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tensors = {f"params.{k}": v for k, v in _flat(module.trainable_parameters())}
    tensors |= {f"optimizer.{k}": v for k, v in _flat(optimizer.state)}
    mx.save_safetensors(str(out / "state.safetensors"), tensors)
    (out / "state.json").write_text(json.dumps({"step": step, **extra}) + "\n", encoding="utf-8")
    for name, arrays in (files or {}).items():
        mx.save_safetensors(str(out / name), arrays)
    _to_disk(out / "state.safetensors", out / "state.json", *(out / name for name in files or {}), out)
    pointer = root / "latest.tmp"
    pointer.write_text(out.name, encoding="utf-8")
    durable_replace(pointer, root / "latest")  # its folder's entries (the new step's too) reach the disk with it
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-_KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _to_disk(*paths: Path) -> None:
    """Make each file's bytes (each folder's entries, where the system has folder handles) reach the disk."""
    for path in paths:
        if path.is_dir() and not hasattr(os, "O_DIRECTORY"):
            continue
        handle = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


T = TypeVar("T")


def load_state(folder: str | os.PathLike[str], module: nn.Module, optimizer: optim.Optimizer, steps: int,
               kind: type[T]) -> tuple[dict[str, Any], list[T]] | None:
    """Restore the newest checkpoint under ``folder`` into ``module`` and ``optimizer`` (of a run of ``steps``);
    returns its JSON (``step`` and the run's extras) and its log as ``kind`` records, or ``None`` when there is
    none yet. Everything is checked before anything is restored: a refused checkpoint leaves both untouched."""
    root = Path(folder)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    out = root
    try:
        out = root / pointer.read_text(encoding="utf-8").strip()
        info = json.loads((out / "state.json").read_text(encoding="utf-8"))
        tensors = cast(dict[str, mx.array], mx.load(str(out / "state.safetensors")))
    except (OSError, ValueError, RuntimeError, RecursionError) as exc:
        raise CheckpointError(f"{out}: cannot read the training checkpoint: {exc}") from exc
    counts = [info.get(name, 0) for name in ("step", "trained")] if isinstance(info, dict) else [None]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) or "step" not in info:
        raise CheckpointError(f"{out}: state.json is damaged (no step count)")
    if info["step"] > steps:
        raise CheckpointError(f"{out}: the checkpoint is at step {info['step']} of a run of {steps}: give the run's "
                              "steps, or a new folder")
    try:
        log = TypeAdapter(list[kind]).validate_python(info.get("log", []))  # type: ignore[valid-type]
    except ValidationError as exc:
        raise CheckpointError(f"{out}: the checkpoint's log is damaged ({exc.error_count()} errors)") from None
    params = {k[len("params."):]: v for k, v in tensors.items() if k.startswith("params.")}
    if not arrays_fit(params, dict(_flat(module.trainable_parameters()))):
        raise CheckpointError(f"{out}: the checkpoint's trainable weights do not fit this model (another model, or "
                              "other adapter settings): start in a new folder")
    optimizer.init(module.trainable_parameters())  # the fresh state the saved one must match (shapes as params')
    moments = {k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.")}
    if not arrays_fit(moments, dict(_flat(optimizer.state))):
        raise CheckpointError(f"{out}: the checkpoint's optimizer state does not fit this run (damaged, or another "
                              "optimizer): start in a new folder")
    module.update(tree_unflatten(list(params.items())))
    optimizer.state = _merged(optimizer.state, tree_unflatten(list(moments.items())))
    mx.eval(module.parameters(), optimizer.state)
    return info, log


def arrays_fit(saved: dict[str, mx.array], expected: dict[str, mx.array]) -> bool:
    """Whether ``saved`` holds exactly the arrays ``expected`` names, each of its shape and dtype."""
    return set(saved) == set(expected) and all(
        saved[k].shape == expected[k].shape and saved[k].dtype == expected[k].dtype for k in expected)


def _flat(tree: Any) -> list[tuple[str, mx.array]]:
    return [(k, v) for k, v in cast(list[tuple[str, Any]], tree_flatten(tree)) if isinstance(v, mx.array)]


def _merged(current: Any, saved: Any) -> Any:
    """``current`` (a fresh optimizer's state tree) with the arrays ``saved`` holds put in."""
    if isinstance(current, dict):
        given = saved if isinstance(saved, dict) else {}
        return {k: _merged(v, given.get(k)) for k, v in current.items()}
    if isinstance(current, list):
        given_list = saved if isinstance(saved, list) else []
        return [_merged(v, given_list[i] if i < len(given_list) else None) for i, v in enumerate(current)]
    return saved if isinstance(saved, mx.array) else current
