"""MLX-quantized copies of the benchmark checkpoints for the mlxchat 8-bit and 4-bit rows.

    python -m benchmarks.mlx_quantized CHECKPOINT_FOLDER BITS      # BITS: 8 or 4

mlx-lm's own converter (``mlx_lm.convert -q``: affine, group size 64, every linear and embedding layer,
tied heads included) writes them beside the checkpoint, as ``<folder>-mlx-<bits>bit``, from the same
random weights the other rows use; what a user gets from ``mlx_lm.convert`` or an mlx-community repo.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .checkpoints import MARKER

BITS = (8, 4)
GROUP_SIZE = 64


def folder_for(folder: Path, bits: int) -> Path:
    return folder.with_name(f"{folder.name}-mlx-{bits}bit")


def convert(folder: Path, bits: int) -> Path:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    target = folder_for(folder, bits)
    if (target / MARKER).exists() and (target / MARKER).stat().st_mtime >= (folder / MARKER).stat().st_mtime:
        return target
    from mlx_lm import convert as mlx_lm_convert

    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    mlx_lm_convert(str(folder), str(work), quantize=True, q_group_size=GROUP_SIZE, q_bits=bits)
    for name in ("chat_template.jinja", MARKER):  # the template file and the benchmark's record of the weights
        if (folder / name).exists() and not (work / name).exists():
            shutil.copyfile(folder / name, work / name)
    shutil.rmtree(target, ignore_errors=True)
    work.rename(target)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(convert(Path(sys.argv[1]), int(sys.argv[2])))
