"""Builds the optional native pieces (Linux only; mlxchat runs without them, on MLX's own kernels):

- ``mlxchat._blas_route``: the BLAS single-row route (see mlxchat.runtime).
- ``mlxchat._quantized``: quantized matmuls on the CPU as MLX primitives (see mlxchat.quantized).
- ``mlxchat._kernels``: fused float32 CPU kernels as MLX primitives (softmax, SwiGLU gate, RMS norm; see
  mlxchat.kernels).

The last two are compiled against the MLX headers of the build environment and with nanobind, the binding
library MLX's own Python module is built with; mlxchat uses them only when the MLX it runs with is that same
version (``pip install --no-build-isolation -e .`` builds against the MLX already installed).
"""

import sys
from pathlib import Path

from setuptools import Extension, setup


def mlx_extension(name: str, source: str, depends: list[str]) -> Extension | None:
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
        sources=[source, str(nb_dir / "src" / "nb_combined.cpp")],
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
        mlx_extension("mlxchat._quantized", "core/native/quantized.cpp", ["core/native/qmatmul_kernels.h"]),
        mlx_extension("mlxchat._kernels", "core/native/kernels.cpp", []),
    ):
        if extension is not None:
            ext_modules.append(extension)

setup(ext_modules=ext_modules)
