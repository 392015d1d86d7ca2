"""mlxchat's MLX extensions (``mlxchat._quantized``, ``mlxchat._kernels``), loaded only for the MLX they
were built for.

Their C++ interface to MLX is not stable across MLX versions, so each reports the MLX it was compiled
against and is used only when that MLX runs (pyproject.toml pins it on Linux, for the build and at run
time). An installed extension built for another MLX is switched off with one warning that says what to
do: without it CPU work runs on MLX's own, slower kernels.
"""

from __future__ import annotations

import importlib
import os
import warnings
from functools import cache
from types import ModuleType

import mlx.core as mx


def load_extension(name: str, switch: str) -> tuple[ModuleType | None, str]:
    """The extension ``mlxchat.<name>``, or None and why it is not used (``switch`` set to off or 0, not
    built, or built for another MLX: the last also warns)."""
    if os.environ.get(switch, "").lower() in ("off", "0"):
        return None, f"{switch}=off"
    try:
        module = importlib.import_module(f"mlxchat.{name}")
    except ImportError as exc:
        return None, f"not built ({exc})"
    running = ".".join(mx.__version__.split(".")[:3])  # type: ignore[attr-defined]
    built = module.mlx_version()
    if built != running:
        why = (f"built for MLX {built}, running MLX {running}: install the MLX mlxchat pins "
               f"(pip install 'mlx[cpu]=={built}') or reinstall mlxchat against this one")
        warnings.warn(f"mlxchat: native kernels {name} off, {why}", RuntimeWarning, stacklevel=2)
        return None, why
    return module, ""


@cache
def kernels_extension() -> tuple[ModuleType | None, str]:
    """``mlxchat._kernels`` (:func:`load_extension`; ``MLXCHAT_KERNELS=off`` switches it off), loaded once."""
    return load_extension("_kernels", "MLXCHAT_KERNELS")
