"""What MLX runs on here: the BLAS behind its CPU backend, the device, and the compute dtype policy.

MLX's Linux CPU wheel links the reference (netlib) BLAS, which multiplies float32 matrices at a few
GFLOP/s. Symbols resolve through the global scope first, so loading OpenBLAS with RTLD_GLOBAL *before*
``mlx.core`` is imported makes MLX call OpenBLAS instead (~50-100x faster GEMM). On top of that the
``mlxchat._blas_route`` shim sends one-row products (all of decode) to ``sgemv``, which reads weights
several times faster than ``sgemm`` with M == 1. :func:`configure_blas` does both; ``mlxchat`` calls it
on import. Environment:

- ``MLXCHAT_BLAS``: path of the BLAS library to load, or ``off`` to keep MLX's bundled one.
- ``MLXCHAT_GEMV``: ``0`` disables the single-row route.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import platform
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

INSTALL_HINT = "apt-get install libopenblas0-pthread"


@dataclass
class BlasState:
    """Which BLAS MLX's CPU backend calls, as set up by :func:`configure_blas`."""

    library: str = "bundled reference BLAS"
    path: str | None = None
    gemv_route: bool = False
    note: str = ""
    _route: Any = field(default=None, repr=False)

    def routed_counts(self) -> tuple[int, int]:
        """(products sent to sgemv, products sent to sgemm) since start, or (0, 0) without the route."""
        if self._route is None:
            return (0, 0)
        out = (ctypes.c_long * 2)()
        self._route.mlxchat_blas_route_counts(out)
        return (out[0], out[1])


_state: BlasState | None = None


def _find_openblas() -> str | None:
    requested = os.environ.get("MLXCHAT_BLAS")
    if requested:
        return requested
    for candidate in _OPENBLAS_CANDIDATES:
        if os.path.exists(candidate):
            return candidate
    return ctypes.util.find_library("openblas")


def _load_route(blas_path: str) -> Any:
    spec = importlib.util.find_spec("mlxchat._blas_route")
    if spec is None or spec.origin is None:
        return None
    route = ctypes.CDLL(spec.origin, mode=ctypes.RTLD_GLOBAL)
    route.mlxchat_blas_route_init.argtypes = [ctypes.c_char_p]
    if route.mlxchat_blas_route_init(blas_path.encode()) != 0:
        return None
    return route


def configure_blas() -> BlasState:
    """Put OpenBLAS (and the single-row route) under MLX's CPU backend; idempotent.

    Has an effect only on Linux and only before ``mlx.core`` is first imported; afterwards it reports
    what is in place.
    """
    global _state
    if _state is not None:
        return _state
    _state = BlasState()
    if sys.platform != "linux":
        _state.library = "Accelerate (macOS)" if sys.platform == "darwin" else "platform default"
        return _state
    if os.environ.get("MLXCHAT_BLAS", "").lower() == "off":
        _state.note = "MLXCHAT_BLAS=off"
        return _state
    if "mlx.core" in sys.modules:
        _state.note = "mlx.core was imported before mlxchat; import mlxchat first to use OpenBLAS"
        warnings.warn(f"mlxchat: {_state.note} (float32 matmuls now run on MLX's slow reference BLAS)",
                      RuntimeWarning, stacklevel=3)
        return _state
    path = _find_openblas()
    if path is None:
        _state.note = f"no OpenBLAS found; float32 matmuls run on the slow reference BLAS ({INSTALL_HINT})"
        return _state
    try:
        route = None if os.environ.get("MLXCHAT_GEMV") == "0" else _load_route(path)
        # The route must come first in the global scope so that its cblas_sgemm is the one MLX binds to.
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        _state.note = f"could not load {path}: {exc}"
        return _state
    _state.library = "OpenBLAS"
    _state.path = path
    _state.gemv_route = route is not None
    _state._route = route
    return _state


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def default_dtype(checkpoint_dtype: Any) -> Any:
    """The dtype weights are computed in when the caller names none.

    On a GPU the checkpoint's own dtype. On the CPU float32: MLX's CPU bfloat16/float16 kernels are
    several times slower than float32 (measured by the benchmark harness; see the README).
    """
    import mlx.core as mx

    return checkpoint_dtype if on_gpu() else mx.float32


def runtime_info() -> dict[str, Any]:
    """MLX version, device, BLAS and plugins: what ``mlxchat info`` prints."""
    import mlx.core as mx

    from .quantized import kernel_info
    from .registry import registry

    state = configure_blas()
    return {
        "mlxchat": _version(),
        "mlx": mx.__version__,  # type: ignore[attr-defined]
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": state.library,
        "blas_path": state.path,
        "gemv_route": state.gemv_route,
        "blas_note": state.note,
        **kernel_info(),
        "cpu_count": os.cpu_count(),
        "plugins": {name: sorted(arch.model_types) for name, arch in registry().architectures().items()},
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxchat")
    except PackageNotFoundError:
        return "unknown"
