"""MLX's float32 matmuls are right on every OpenBLAS mlxchat can put under it (the system's, with 32-bit
integers, and the one in numpy's wheel, with 64-bit integers and affixed symbols), through both ways of the
route: single-row (and single-column) products to sgemv, a few rows against a large enough weight matrix to
the few-rows kernel, everything else to sgemm.

The BLAS is chosen when mlxchat is imported, so each library is checked in its own process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxchat import runtime

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS route exists on Linux only")

# Products as MLX issues them: (x rows, outputs, inputs, how the operands are laid out).
CHECK = r"""
import json, mlxchat, mlx.core as mx, numpy as np
state = mlxchat.runtime.configure_blas()
rng = np.random.default_rng(0)
cases = {
    "row x W.T (decode)": lambda: (rng.standard_normal((1, 300)), rng.standard_normal((77, 300)), "t"),
    "row x W": lambda: (rng.standard_normal((1, 300)), rng.standard_normal((300, 77)), "n"),
    "strided row x W.T": lambda: (rng.standard_normal((300, 3))[:, 1:2].T, rng.standard_normal((77, 300)), "t"),
    "W x column": lambda: (rng.standard_normal((77, 300)), rng.standard_normal((300, 1)), "n"),
    "W.T x column": lambda: (rng.standard_normal((300, 77)).T, rng.standard_normal((300, 1)), "n"),
    "few rows x W.T (verify)": lambda: (rng.standard_normal((5, 300)), rng.standard_normal((301, 300)), "t"),
    "eight rows x W.T": lambda: (rng.standard_normal((8, 257)), rng.standard_normal((700, 257)), "t"),
    "seven rows x W.T, odd last W row": lambda: (rng.standard_normal((7, 300)), rng.standard_normal((301, 300)), "t"),
    "eight rows x W.T, K in blocks": lambda: (rng.standard_normal((8, 2100)), rng.standard_normal((32, 2100)), "t"),
    "c + three long rows x W.T": lambda: (rng.standard_normal((3, 5000)), rng.standard_normal((64, 5000)), "c"),
    "13 rows x W.T (groups of rows)": lambda: (rng.standard_normal((13, 300)), rng.standard_normal((301, 300)), "t"),
    "c + 40 rows x W.T, K in blocks": lambda: (rng.standard_normal((40, 4100)), rng.standard_normal((33, 4100)), "c"),
    "64 rows x W.T": lambda: (rng.standard_normal((64, 260)), rng.standard_normal((256, 260)), "t"),
    "65 rows x W.T": lambda: (rng.standard_normal((65, 260)), rng.standard_normal((256, 260)), "t"),
    "rows x a small W.T (prefill)": lambda: (rng.standard_normal((33, 300)), rng.standard_normal((77, 300)), "t"),
    "c + 300 rows x W.T": lambda: (rng.standard_normal((300, 260)), rng.standard_normal((257, 260)), "c"),
    "rows.T x W": lambda: (rng.standard_normal((300, 33)).T, rng.standard_normal((300, 77)), "n"),
}
errors, counts = {}, []
for name, make in cases.items():
    a, b, layout = make()
    before = state.routed_counts()
    x, w = mx.array(a.astype(np.float32)), mx.array(b.astype(np.float32))
    if layout == "c":  # beta = 1: the product added to what the output holds
        c = rng.standard_normal((a.shape[0], b.shape[0]))
        out = np.array(mx.addmm(mx.array(c.astype(np.float32)), x, w.T))
        expected = c + a @ b.T
    else:
        out = np.array(x @ (w.T if layout == "t" else w))
        expected = a @ (b.T if layout == "t" else b)
    errors[name] = float(np.abs(out - expected).max() / np.abs(expected).max())
    after = state.routed_counts()
    counts.append([after[0] - before[0], after[1] - before[1]])
print(json.dumps({"library": state.library, "gemv_route": state.gemv_route, "errors": errors, "counts": counts}))
"""


def _run(blas: str, gemv: str = "1", rows: str | None = "64") -> dict[str, object]:
    """The products above in a fresh process (``rows``: MLXCHAT_ROWS, None for the CPU's default)."""
    env = {**os.environ, "MLXCHAT_BLAS": blas, "MLXCHAT_GEMV": gemv}
    env.pop("MLXCHAT_ROWS", None)
    if rows is not None:
        env["MLXCHAT_ROWS"] = rows
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


LIBRARIES = [
    pytest.param("system", marks=pytest.mark.skipif(runtime._system_openblas() is None, reason="no system OpenBLAS")),
    pytest.param("numpy", marks=pytest.mark.skipif(runtime._numpy_openblas() is None, reason="numpy has no OpenBLAS")),
]


@pytest.mark.parametrize("blas", LIBRARIES)
def test_products_are_right_through_sgemv_and_sgemm(blas: str) -> None:
    result = _run(blas)
    assert "OpenBLAS" in str(result["library"]) and result["gemv_route"]
    assert ("system" in str(result["library"])) == (blas == "system")
    for name, error in result["errors"].items():  # type: ignore[attr-defined]
        assert error < 1e-5, f"{name}: relative error {error:.1e}"
    # single rows and columns went to sgemv, up to 64 rows to the few-rows kernel, the rest to sgemm
    assert result["counts"] == [[1, 0]] * 13 + [[0, 1]] * 4


def test_the_few_rows_kernel_takes_every_product_by_default_where_it_runs_on_avx512() -> None:
    blas = "system" if runtime._system_openblas() is not None else "numpy"
    result = _run(blas, rows=None)
    avx512 = " avx512f " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
    assert all(error < 1e-5 for error in result["errors"].values())  # type: ignore[attr-defined]
    expected = [1, 0] if avx512 else [0, 1]  # 65 rows, 300 rows (in passes)
    assert result["counts"][13] == result["counts"][15] == expected  # type: ignore[index]


def test_a_rows_setting_that_is_not_a_whole_number_is_ignored_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, rows in (("", -1), ("0", 0), (" 40 ", 40), ("300", 300), ("9" * 20, 2**31 - 1)):
        monkeypatch.setenv("MLXCHAT_ROWS", text)
        assert runtime._rows_setting() == rows
    for text in ("1.5", "-3", "many"):
        monkeypatch.setenv("MLXCHAT_ROWS", text)
        with pytest.warns(RuntimeWarning, match="MLXCHAT_ROWS"):
            assert runtime._rows_setting() == -1


@pytest.mark.parametrize("blas", LIBRARIES)
def test_without_the_gemv_route_everything_is_sgemm_and_still_right(blas: str) -> None:
    result = _run(blas, gemv="0")
    assert not result["gemv_route"]
    assert all(error < 1e-5 for error in result["errors"].values())  # type: ignore[attr-defined]
    if blas == "numpy":  # reachable only through the route, which now sends everything to sgemm
        assert result["counts"] == [[0, 1]] * 17


def test_the_default_is_the_system_openblas_else_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLXCHAT_BLAS", raising=False)
    system, bundled = runtime._system_openblas(), runtime._numpy_openblas()
    expected = [(system, "system")] if system else []
    expected += [(bundled, "numpy's wheel")] if bundled else []
    assert runtime._candidates() == expected
    monkeypatch.setenv("MLXCHAT_BLAS", "numpy")
    assert runtime._candidates() == (expected[-1:] if bundled else [])


# A library exporting cblas_sgemm loaded before mlxchat (as a distribution's numpy loads libopenblas): its
# cblas_sgemm comes first in the process and takes MLX's calls. gemv_route must say what MLX really calls.
LOADED_FIRST = r"""
import ctypes, json, sys, warnings
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import mlxchat
import mlx.core as mx
state = mlxchat.runtime.configure_blas()
before = state.routed_counts()[0]
mx.eval(mx.ones((1, 300)) @ mx.ones((300, 77)))
routed = state.routed_counts()[0] - before
info = mlxchat.runtime.runtime_info()
print(json.dumps({"gemv_route": state.gemv_route, "routed": routed, "note": state.note,
                  "info_route": info["gemv_route"], "blas_route": info["blas_route"],
                  "warnings": [str(w.message) for w in caught]}))
"""

SYSTEM_OPENBLAS = pytest.mark.skipif(runtime._system_openblas() is None, reason="no system OpenBLAS")


def _loaded_first(preload: str | None = None) -> dict[str, object]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLXCHAT_")}
    if preload:
        env["LD_PRELOAD"] = preload
    blas = runtime._system_openblas()
    assert blas is not None
    done = subprocess.run([sys.executable, "-c", LOADED_FIRST, blas], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@SYSTEM_OPENBLAS
def test_an_openblas_loaded_first_is_reported_and_the_route_claimed_only_when_taken() -> None:
    result = _loaded_first()
    assert result["routed"] == 0  # MLX's product went to the library loaded first
    assert result["gemv_route"] is False and result["info_route"] is False
    assert "loaded before mlxchat" in str(result["note"]) and "LD_PRELOAD=" in str(result["note"])
    assert str(result["blas_route"]).startswith("off")
    assert any("LD_PRELOAD=" in message for message in result["warnings"])  # type: ignore[attr-defined]


@SYSTEM_OPENBLAS
def test_with_the_route_preloaded_it_wins_over_an_openblas_loaded_first() -> None:
    spec = importlib.util.find_spec("mlxchat._blas_route")
    if spec is None or spec.origin is None:
        pytest.skip("the route is not built")
    result = _loaded_first(preload=spec.origin)
    assert result["routed"] == 1 and result["gemv_route"] is True and result["info_route"] is True
    assert result["note"] == "" and result["warnings"] == []
    assert result["blas_route"] == "mlxchat native"
