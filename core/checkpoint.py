"""Checkpoint folders: where they are (local or Hugging Face Hub) and what their files hold.

Every failure names the file or tensor it is about.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import CheckpointError

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def resolve_checkpoint(path_or_repo: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, downloaded (or read from the cache when offline)."""
    local = Path(path_or_repo).expanduser()
    if local.exists():
        if not local.is_dir():
            raise CheckpointError(f"{local} is a file; expected a checkpoint folder holding config.json")
        return local
    repo = str(path_or_repo)
    if repo.count("/") != 1 or repo.startswith((".", "/", "~")):
        raise CheckpointError(f"{repo}: no such folder, and not a Hugging Face repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"{repo} is not in the local Hugging Face cache and the Hub cannot be reached "
            f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}): {exc}"
        ) from exc
    except HfHubHTTPError as exc:
        raise CheckpointError(f"could not download {repo} from the Hugging Face Hub: {exc}") from exc


def read_json(path: Path, *, required: bool = True) -> dict[str, Any]:
    """A JSON object file of a checkpoint; ``{}`` for a missing optional one. One that cannot be read (a folder,
    a broken link), is not JSON, nests too deep for the parser or writes an integer of more digits than Python
    converts is a :class:`CheckpointError` naming it, and so is one that is no regular file (a folder; a named
    pipe, whose reading would wait for a writer for ever)."""
    if not path.exists():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return {}
    if not path.is_file():
        raise CheckpointError(f"{path}: not a regular file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: malformed JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at top level")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, ``model.safetensors``, or all of them."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        for name in weight_map.values():
            if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
                raise CheckpointError(f"{index}: shard {name!r} is not the name of a file in the checkpoint folder")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.exists():
                raise CheckpointError(f"{file}: shard listed in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    return files


def check_safetensors(path: Path) -> dict[str, Any]:
    """Validate a safetensors file's header against its size; return the header. The tensors' bytes must
    follow one another without overlap or gaps, as the format requires: MLX reads overlapping ones, so one
    tensor's bytes would load as another's too."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise TypeError(f"the header is a JSON {type(header).__name__}, not an object")
        end = 0
        for start, stop in sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"):
            if start != end or stop < start:
                raise ValueError(f"a tensor's data_offsets [{start}, {stop}] overlap another's or leave a gap "
                                 f"(the next tensor starts at byte {end})")
            end = stop
        end += 8 + header_len
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    except (struct.error, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors file ({exc})") from exc
    if end > size:
        raise CheckpointError(
            f"{path}: corrupt safetensors file (truncated: tensors need {end} bytes, file has {size})"
        )
    return header


def tensor_names(folder: Path) -> set[str]:
    """Names of the tensors a checkpoint holds, from the safetensors headers alone."""
    return {name for file in weight_files(folder) for name in check_safetensors(file) if name != "__metadata__"}


def read_weights(folder: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in weight_files(folder):
        check_safetensors(file)
        try:
            loaded = mx.load(str(file))
        except Exception as exc:  # MLX raises RuntimeError/ValueError with its own wording
            raise CheckpointError(f"{file}: cannot read safetensors ({exc})") from exc
        assert isinstance(loaded, dict)
        for name in loaded:
            if name in weights:
                raise CheckpointError(f"{file}: tensor {name} appears in more than one shard")
        weights.update(loaded)
    return weights


# safetensors dtypes numpy can map (bfloat16 as its bits, viewed back by MLX).
_NUMPY_DTYPES: dict[str, Any] = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                                 "U32": np.uint32, "I32": np.int32, "U16": np.uint16, "I16": np.int16,
                                 "U8": np.uint8, "I8": np.int8, "I64": np.int64, "U64": np.uint64, "BOOL": np.bool_}


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie in a safetensors file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's data in the file."""


def tensor_locations(folder: Path) -> dict[str, TensorLocation]:
    """Every tensor of a checkpoint, by name, and where its bytes are (from the headers alone)."""
    out = {}
    for file in weight_files(folder):
        header = check_safetensors(file)
        with file.open("rb") as f:
            start = 8 + struct.unpack("<Q", f.read(8))[0]
        for name, entry in header.items():
            if name != "__metadata__":
                offset = start + entry["data_offsets"][0]
                out[name] = TensorLocation(file, entry["dtype"], tuple(entry["shape"]), offset)
    return out


def read_slice(location: TensorLocation, axis: int, ranges: Sequence[tuple[int, int]]) -> mx.array | None:
    """The ``ranges`` along ``axis`` of a tensor, concatenated, reading only the pages that hold them (a memory
    map); ``None`` for a dtype numpy cannot map (then read the whole tensor)."""
    dtype = _NUMPY_DTYPES.get(location.dtype)
    if dtype is None or not location.shape:
        return None
    data = np.memmap(location.path, dtype=dtype, mode="r", offset=location.offset, shape=location.shape)
    axis %= data.ndim
    parts = [data[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
    values = np.concatenate(parts, axis=axis) if len(parts) > 1 else np.array(parts[0])
    del data, parts
    out = mx.array(values)
    return out.view(mx.bfloat16) if location.dtype == "BF16" else out
