"""Lists the import packages and builds the optional native pieces.

Packages: every folder holding Python source under a folder that pyproject.toml's ``package-dir`` maps
(``mlxchat`` -> ``core``...), found here so that a new subpackage is never left out of the wheel; files
beside them that are not Python source ship as package data (the rule is in pyproject.toml).

Native pieces (Linux only; mlxchat runs without them, on MLX's own kernels):

- ``mlxchat._blas_route``: the BLAS single-row route (see mlxchat.runtime).
- ``mlxchat._quantized``: quantized matmuls on the CPU as MLX primitives (see mlxchat.quantized).
- ``mlxchat._kernels``: fused float32 CPU kernels as MLX primitives (softmax, SwiGLU gate, RMS norm; see
  mlxchat.kernels).

The last two are compiled against the MLX headers of the build environment and with nanobind, the binding
library MLX's own Python module is built with; mlxchat uses them only when the MLX it runs with is that same
version, which is why pyproject.toml pins the same MLX for the build and for run time.
"""

import sys
import tomllib
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def packages() -> list[str]:
    """Every package under the folders pyproject.toml maps: a folder with a ``.py`` file is a package."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for name, folder in mapped.items():
        base = ROOT / folder
        for init in sorted(base.rglob("*.py")):
            parts = init.parent.relative_to(base).parts
            if "__pycache__" not in parts:
                found.append(".".join([name, *parts]))
    return sorted(set(found))


def mlx_extension(name: str, sources: list[str], depends: list[str]) -> Extension | None:
    try:
        import mlx
        import nanobind
    except ImportError:
        return None
    mlx_dir = Path(mlx.__path__[0])
    if not (mlx_dir / "include" / "mlx" / "mlx.h").exists():
        return None
    nb_dir = Path(nanobind.source_dir()).parent
    return Extension(
        name,
        sources=[*sources, str(nb_dir / "src" / "nb_combined.cpp")],
        depends=depends,
        include_dirs=[
            "core/native",
            str(mlx_dir / "include"),
            nanobind.include_dir(),
            str(nb_dir / "ext" / "robin_map" / "include"),
        ],
        library_dirs=[str(mlx_dir / "lib")],
        libraries=["mlx", "dl"],
        # installed beside the mlx package; an editable install finds libmlx.so already loaded by mlx.core
        runtime_library_dirs=["$ORIGIN/../mlx/lib"],
        # MLX's Python module binds its types in the nanobind domain "mlx": ours must join it to accept mx.array
        define_macros=[("NB_DOMAIN", "mlx")],
        # GCC 12's AVX-512 headers trip its own uninitialized-value warnings (_mm512_reduce_add_ps)
        extra_compile_args=[
            "-std=c++20", "-O3", "-fvisibility=hidden", "-Wno-uninitialized", "-Wno-maybe-uninitialized"
        ],
        language="c++",
        optional=True,
    )


ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "mlxchat._blas_route",
            sources=["core/native/blas_route.c"],
            extra_compile_args=["-O2"],
            libraries=["dl"],
            optional=True,
        )
    )
    for extension in (
        mlx_extension("mlxchat._quantized", ["core/native/quantized.cpp"],
                      ["core/native/qmatmul_kernels.h", "core/native/qmatmul_amx.h", "core/native/qmatmul_int8.h",
                       "core/native/pool.h", "core/native/simd.h", "core/native/dispatch.h"]),
        mlx_extension("mlxchat._kernels", ["core/native/kernels.cpp", "core/native/attention.cpp"],
                      [f"core/native/{h}" for h in ("attention.h", "attention_ops.h", "attention_packed.h",
                                                     "attention_dot.h", "dispatch.h", "pool.h", "simd.h")]),
    ):
        if extension is not None:
            ext_modules.append(extension)

setup(packages=packages(), ext_modules=ext_modules)
