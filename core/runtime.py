"""What MLX runs on here: the BLAS behind its CPU backend, the device, and the compute dtype policy.

MLX's Linux CPU wheel links the reference (netlib) BLAS, which multiplies float32 matrices at a few
GFLOP/s. Symbols resolve through the global scope first, so a ``cblas_sgemm`` loaded with RTLD_GLOBAL
*before* ``mlx.core`` is imported is the one MLX calls. :func:`configure_blas` (run when ``mlxchat`` is
imported) loads the ``mlxchat._blas_route`` shim that way: it sends one-row products (all of decode) to
``sgemv``, which reads weights several times faster than ``sgemm`` with M == 1, products of 2 to 64 rows
(all of them with AVX-512) against a weight matrix (a speculative round's verify pass, a follow-up turn's prompt, an
expert's share of a prompt) to its own few-rows kernel, which reads the weights once for all rows (OpenBLAS's
sgemm packs them: about a third of the speed for 8 rows, half for 20), and everything else to OpenBLAS.
Which OpenBLAS, in order:

1. the system's (Debian/Ubuntu ``libopenblas0-pthread``, Fedora ``openblas``...), loaded globally as well;
2. the one inside numpy's wheel (scipy-openblas, a 64-bit-integer build whose symbols carry a
   ``scipy_``/``64_`` affix, reachable only through the shim): measured as fast as the system's, so
   ``pip install`` alone gives fast CPU math.

Environment:

- ``MLXCHAT_BLAS``: ``system`` or ``numpy`` to pick one of the above, a path to a CBLAS library, or ``off``
  to keep MLX's bundled one.
- ``MLXCHAT_GEMV``: ``0`` disables the route (single rows and few rows alike).
- ``MLXCHAT_ROWS``: the most rows of x the few-rows kernel takes (a whole number, at most 256; ``0``: none); by
  default 64 with AVX2, every product in passes of at most 128 rows with AVX-512, 8 on other CPUs.

A ``cblas_sgemm`` already in the process when mlxchat is imported (a library linked to the system
OpenBLAS, such as a distribution's numpy, imported first) comes first in the global scope and takes MLX's
calls instead: :func:`configure_blas` finds out which library owns the first ``cblas_sgemm``, and when it is
not the one chosen, says so (a warning, the state's note, ``mlxchat info``) and what to do: import mlxchat
first, or start Python with ``LD_PRELOAD`` naming the route.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib.util
import os
import platform
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
# The CBLAS entry points of a library, by integer width, and its configuration string (version, build).
_INTERFACES = {32: ("cblas_sgemm", "openblas_get_config"), 64: ("scipy_cblas_sgemm64_", "scipy_openblas_get_config64_")}


@dataclass
class BlasState:
    """Which BLAS MLX's CPU backend calls, as set up by :func:`configure_blas`."""

    library: str = "bundled reference BLAS"
    path: str | None = None
    gemv_route: bool = False
    note: str = ""
    _route: Any = field(default=None, repr=False)

    def route_taken(self) -> bool:
        """Whether a one-row float32 product really goes through the route (runs one; imports mlx.core)."""
        if self._route is None:
            return False
        import mlx.core as mx

        before = self.routed_counts()[0]
        with mx.stream(mx.cpu):
            mx.eval(mx.ones((1, 64)) @ mx.ones((64, 64)))
        return self.routed_counts()[0] > before

    def routed_counts(self) -> tuple[int, int]:
        """(products sent to sgemv, products sent to sgemm) since start, or (0, 0) without the route."""
        if self._route is None:
            return (0, 0)
        out = (ctypes.c_long * 2)()
        self._route.mlxchat_blas_route_counts(out)
        return (out[0], out[1])


_state: BlasState | None = None


def _system_openblas() -> str | None:
    for candidate in _OPENBLAS_CANDIDATES:
        if os.path.exists(candidate):
            return candidate
    return ctypes.util.find_library("openblas")


def _numpy_openblas() -> str | None:
    """The OpenBLAS numpy's wheel bundles (``site-packages/numpy.libs/libscipy_openblas*.so``), if any."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "numpy.libs"
    found = sorted(libs.glob("libscipy_openblas*.so*"))
    return str(found[0]) if found else None


def _candidates() -> list[tuple[str, str]]:
    """(path, where it comes from) in the order to try."""
    requested = os.environ.get("MLXCHAT_BLAS", "")
    if requested not in ("", "system", "numpy"):
        return [(requested, "MLXCHAT_BLAS")]
    found = []
    if requested != "numpy" and (system := _system_openblas()):
        found.append((system, "system"))
    if requested != "system" and (bundled := _numpy_openblas()):
        found.append((bundled, "numpy's wheel"))
    return found


def _interface(path: str) -> tuple[int, str]:
    """(integer width of its CBLAS: 32, 64, or 0 for none, its version) of a BLAS library; OSError if it
    cannot be loaded."""
    library = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    for width, (sgemm, config) in _INTERFACES.items():
        if hasattr(library, sgemm):
            name = "BLAS"
            if hasattr(library, config):
                getter = getattr(library, config)
                getter.restype = ctypes.c_char_p
                name = " ".join(getter().decode(errors="replace").split()[:2])  # e.g. "OpenBLAS 0.3.31"
            return width, name
    return 0, ""


def _load_route(blas_path: str) -> Any:
    spec = importlib.util.find_spec("mlxchat._blas_route")
    if spec is None or spec.origin is None:
        return None
    route = ctypes.CDLL(spec.origin, mode=ctypes.RTLD_GLOBAL)
    route.mlxchat_blas_route_init.argtypes = [ctypes.c_char_p]
    route.mlxchat_blas_route_set_gemv.argtypes = [ctypes.c_int]
    route.mlxchat_blas_route_set_rows.argtypes = [ctypes.c_int]
    if route.mlxchat_blas_route_init(blas_path.encode()) not in (32, 64):
        return None
    route.mlxchat_blas_route_set_rows(_rows_setting())
    return route


def _rows_setting() -> int:
    """``MLXCHAT_ROWS`` as the route takes it (-1: the CPU's default; the route caps it at 256); anything but a
    whole number is ignored with a warning (this runs at import, where an error would stop mlxchat loading)."""
    text = os.environ.get("MLXCHAT_ROWS", "").strip()
    if not text:
        return -1
    if text.isdigit():
        return min(int(text), 2**31 - 1)  # (a C int: a longer number would wrap)
    warnings.warn(f"mlxchat: MLXCHAT_ROWS={text!r} is not a whole number; the CPU's default is used",
                  RuntimeWarning, stacklevel=2)
    return -1


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
    problems = []
    for path, origin in _candidates():
        try:
            if _use(path, origin):
                return _state
        except OSError as exc:
            problems.append(f"could not load {path}: {exc}")
            continue
        problems.append(f"{path} ({origin}) is not usable here")
    _state.note = "; ".join(problems) or (
        "no OpenBLAS found (neither the system's nor numpy's); float32 matmuls run on the slow reference BLAS"
    )
    return _state


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p),
                ("saddr", ctypes.c_void_p)]


def _sgemm_owner() -> str | None:
    """The file of the first ``cblas_sgemm`` in the process's global scope: the one MLX will call."""
    process = ctypes.CDLL(None)
    if not hasattr(process, "cblas_sgemm"):
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.cast(process.cblas_sgemm, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return os.path.realpath(info.fname.decode()) if info.fname else None


def _lost_to(owner: str, chosen: str, route: Any) -> None:
    """Records that ``owner``'s cblas_sgemm, loaded before mlxchat, takes MLX's calls instead of ``chosen``."""
    assert _state is not None
    spec = importlib.util.find_spec("mlxchat._blas_route")
    preload = spec.origin if route is not None and spec is not None else chosen
    _state.library = "a cblas_sgemm loaded before mlxchat"
    _state.path = owner
    _state.gemv_route = False
    _state.note = (f"{owner} was loaded before mlxchat and its cblas_sgemm takes MLX's calls instead of "
                   f"{'the single-row route' if route is not None else chosen} (decode runs several times "
                   f"slower): import mlxchat before the library that loads it, or start Python with "
                   f"LD_PRELOAD={preload}")
    warnings.warn(f"mlxchat: {_state.note}", RuntimeWarning, stacklevel=4)


def _use(path: str, origin: str) -> bool:
    """Puts the BLAS at ``path`` under MLX; False if it has no usable interface (or needs the route, absent)."""
    assert _state is not None
    width, version = _interface(path)
    gemv = os.environ.get("MLXCHAT_GEMV") != "0"
    if width == 0:
        return False
    route = _load_route(path) if gemv or width == 64 else None
    if width == 64 and route is None:
        return False  # its symbols carry an affix: only the route can call it
    if route is not None:
        route.mlxchat_blas_route_set_gemv(int(gemv))
    if width == 32:
        # after the route, so that the route's cblas_sgemm comes first; cblas_dgemm etc. resolve here
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _state.library = f"{version} ({origin}{', 64-bit integers' if width == 64 else ''})"
    _state.path = path
    atexit.register(_settle_threads)
    _state.gemv_route = route is not None and gemv
    _state._route = route
    chosen = ctypes.cast(route.cblas_sgemm if route is not None else ctypes.CDLL(path).cblas_sgemm, ctypes.c_void_p)
    owner = _sgemm_owner()
    if owner is not None and ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value != chosen.value:
        _lost_to(owner, path, route)
    return True


def _settle_threads(limit: float = 0.5) -> None:
    """At exit, wait (``limit`` seconds at most) until no other thread of the process is running. OpenBLAS
    0.3.21's threads spin for ~0.1 s after each product, then sleep; one whose spin ends while OpenBLAS shuts
    down at exit (after Python's own exit hooks) overwrites the shutdown's wakeup and sleeps for ever, and the
    exit waits for it for ever (3 of ~680 runs of ``mlxchat generate``): asleep before, they wake."""
    own, until = threading.get_native_id(), time.monotonic() + limit
    while time.monotonic() < until:
        try:
            states = [(Path("/proc/self/task") / task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for task in os.listdir("/proc/self/task") if int(task) != own]
        except (OSError, IndexError, ValueError):  # a thread that ended while being read: look again
            states = ["R"]
        if "R" not in states:
            return
        time.sleep(0.005)


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

    from . import kernels, quantized
    from .registry import registry

    state = configure_blas()
    route = state.gemv_route and state.route_taken()
    return {
        "mlxchat": package_version(),
        "mlx": mx.__version__,  # type: ignore[attr-defined]
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "blas": state.library,
        "blas_path": state.path,
        "gemv_route": route,
        "blas_route": "mlxchat native" if route else f"off ({_route_off(state)})",
        "blas_note": state.note,
        **quantized.kernel_info(),
        **kernels.kernel_info(),
        "cpu_count": os.cpu_count(),
        "plugins": {name: sorted(arch.model_types) for name, arch in registry().architectures().items()},
    }


def _route_off(state: BlasState) -> str:
    """Why one-row products do not go through the route."""
    if sys.platform != "linux":
        return "Linux only"
    if os.environ.get("MLXCHAT_GEMV") == "0":
        return "MLXCHAT_GEMV=0"
    if state.note:
        return "see the note"
    if importlib.util.find_spec("mlxchat._blas_route") is None:
        return "not built"
    return "not taken by MLX's products"


def package_version() -> str:
    """mlxchat's installed version ("unknown" when it runs from a source tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxchat")
    except PackageNotFoundError:
        return "unknown"
