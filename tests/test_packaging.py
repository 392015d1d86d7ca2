"""What a wheel holds is derived, not hand-kept: every folder of Python source under the folders
pyproject.toml maps is a package, every other file beside it (bar build products and the native sources)
ships as package data; the MLX the native kernels are built for is the MLX installed with them, and on
Linux CI the kernels are on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

from mlxchat import extensions

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAPPED = PYPROJECT["tool"]["setuptools"]["package-dir"]

# setuptools' own view of the distribution (packages and the data files build_py would copy), from the tree
DISTRIBUTION = r"""
import contextlib, io, json, warnings
from distutils.core import run_setup
warnings.simplefilter("ignore")
with contextlib.redirect_stdout(io.StringIO()):
    dist = run_setup("setup.py", stop_after="config")
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    data = {package: [f"{source}/{name}" for name in names] for package, source, _, names in build_py.data_files}
print(json.dumps({"packages": dist.packages, "data": data}))
"""


@pytest.fixture(scope="module")
def distribution() -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", DISTRIBUTION], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def source_folders() -> dict[str, Path]:
    """Import name -> folder, for every folder holding a .py file under the mapped folders."""
    found = {}
    for name, folder in MAPPED.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in parts:
                found[".".join([name, *parts])] = path.parent
    return found


def test_every_folder_with_python_source_is_a_package(distribution: dict[str, object]) -> None:
    packages = set(distribution["packages"])  # type: ignore[call-overload]
    assert set(source_folders()) <= packages
    assert {"mlxchat.distributed", "mlxchat.server", "mlxchat_qwen35"} <= packages


def test_every_other_file_beside_the_source_ships_as_package_data(distribution: dict[str, object]) -> None:
    shipped = {str(ROOT / path) for paths in distribution["data"].values() for path in paths}  # type: ignore[attr-defined]
    expected = set()
    for folder in MAPPED.values():
        for path in (ROOT / folder).rglob("*"):
            inside = path.relative_to(ROOT / folder).parts
            if path.is_file() and path.suffix not in (".py", ".pyc", ".so") and not (
                    {"__pycache__", "native"} & set(inside)):
                expected.add(str(path))
    assert {str(ROOT / "core/py.typed"), str(ROOT / "core/demo/qwen3.jinja"),
            str(ROOT / "core/demo/model/model.safetensors")} <= expected
    assert expected <= shipped
    assert not any(path.endswith((".so", ".pyc")) or "/native/" in path for path in shipped)


def test_the_native_kernels_are_built_and_run_on_one_pinned_mlx() -> None:
    def linux_mlx(requirements: list[str]) -> Requirement:
        found = [Requirement(r) for r in requirements if Requirement(r).name == "mlx"]
        linux = [r for r in found if r.marker is None or r.marker.evaluate({"sys_platform": "linux"})]
        assert len(linux) == 1, requirements
        return linux[0]

    build = linux_mlx(PYPROJECT["build-system"]["requires"])
    run = linux_mlx(PYPROJECT["project"]["dependencies"])
    assert str(build.specifier) == str(run.specifier) and str(run.specifier).startswith("==")


def test_an_extension_built_for_another_mlx_is_off_with_a_warning_that_says_what_to_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stale = ModuleType("mlxchat._stale")
    stale.mlx_version = lambda: "0.0.1"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlxchat._stale", stale)
    with pytest.warns(RuntimeWarning, match=r"built for MLX 0\.0\.1.*pip install 'mlx\[cpu\]==0\.0\.1'"):
        module, why = extensions.load_extension("_stale", "MLXCHAT_STALE")
    assert module is None and "built for MLX 0.0.1" in why
    monkeypatch.setenv("MLXCHAT_STALE", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert extensions.load_extension("_stale", "MLXCHAT_STALE") == (None, "MLXCHAT_STALE=off")


@pytest.mark.skipif(not (sys.platform == "linux" and os.environ.get("CI") == "true"),
                    reason="CI on Linux must have the native kernels on; elsewhere they are optional")
def test_on_linux_ci_every_native_kernel_is_on() -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLXCHAT_")}
    done = subprocess.run([sys.executable, "-m", "mlxchat.cli", "info", "--json"], env=env, capture_output=True,
                          text=True, check=True)
    info = json.loads(done.stdout)
    for kernel in ("blas_route", "quantized_kernels", "fused_kernels"):
        assert info[kernel].startswith("mlxchat native"), f"{kernel}: {info[kernel]}"
