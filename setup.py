"""Builds the optional native piece: the BLAS single-row route (Linux only; see mlxchat.runtime)."""

import sys

from setuptools import Extension, setup

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

setup(ext_modules=ext_modules)
