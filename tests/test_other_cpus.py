"""mlxchat on CPUs without AVX-512, emulated by QEMU's user-mode emulator (``qemu-x86_64 -cpu MODEL``): the native
kernels pick the paths that CPU has (AVX2 on Haswell; the scalar ones on Sandy Bridge, which has AVX but neither
AVX2 nor FMA) and never run an instruction it lacks (that would end the process with SIGILL), every fixture still
matches its transformers oracle, and the KV formats and the quantized products compute what they compute on this
machine up to float32 rounding (8-bit x on AVX2's integer kernel, or float x where there is none).

QEMU 7.2 (Debian 12's ``qemu-user``; ``.ci/run`` installs it) emulates x86-64 up to AVX2, not AVX-512. Its Sandy
Bridge model reports a CPUID from which OpenBLAS picks its Haswell kernels (an illegal instruction there, found
by OpenBLAS's own detection, not ours), so that run names OpenBLAS's core (``OPENBLAS_CORETYPE``) as a real Sandy
Bridge would be detected.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).parent
QEMU = shutil.which("qemu-x86_64")


def qemu_version() -> tuple[int, ...]:
    """qemu-x86_64's version ((0,) without it): AVX, AVX2 and FMA came to its emulator in 7.2."""
    if QEMU is None:
        return (0,)
    first = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=60).stdout.split("\n")[0]
    digits = re.search(r"version (\d+)\.(\d+)", first)
    return (int(digits[1]), int(digits[2])) if digits else (0,)


pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or sys.platform != "linux" or qemu_version() < (7, 2),
                                reason="needs an x86-64 Linux with qemu-user 7.2 or later (apt install qemu-user)")

CPUS = {  # environment, fixtures, then what the kernels take there: quantized, 8-bit x, attention
    "Haswell": ({}, "all", "avx2", "avx2", ["scalar", "avx2"]),
    # the scalar kernels are slower under emulation: the fixtures of each kind of layer
    "SandyBridge": ({"OPENBLAS_CORETYPE": "Sandybridge"}, "qwen3,qwen3_5,gemma4,lfm2_q4,qwen3_moe_q4", "scalar", "",
                    ["scalar"]),
}


def run_probe(prefix: list[str], names: str, env: dict[str, str]) -> dict[str, Any]:
    command = [*prefix, sys.executable, str(HERE / "cpu_probe.py"), str(HERE / "fixtures"), names]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **env})
    assert done.returncode == 0, f"{' '.join(command)} ended with {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def here() -> dict[str, Any]:
    return run_probe([], "qwen3", {})


@pytest.fixture(scope="module", params=list(CPUS))
def emulated(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    env, names, *_ = CPUS[request.param]
    assert QEMU is not None
    return request.param, run_probe([QEMU, "-cpu", request.param], names, env)


def test_the_kernels_take_the_paths_the_cpu_has(emulated: tuple[str, dict[str, Any]]) -> None:
    cpu, result = emulated
    assert (result["isa"], result["int8"], result["attention"]) == CPUS[cpu][2:]


def test_every_fixture_matches_its_oracle(emulated: tuple[str, dict[str, Any]]) -> None:
    assert emulated[1]["parity_failures"] == {}


def test_kv_formats_compute_what_they_compute_here(emulated: tuple[str, dict[str, Any]],
                                                   here: dict[str, Any]) -> None:
    """Logits of a prompt chunk, then single tokens, through float32, float16, 8-bit and 4-bit caches (where this
    machine has AVX-512 VNNI, packed keys meet a query rounded to int16: ~2e-4 of the logits)."""
    for bits, logits in emulated[1]["kv_logits"].items():
        ours, theirs = np.array(logits), np.array(here["kv_logits"][bits])
        assert np.abs(ours - theirs).max() <= 1e-3, f"kv_bits={bits}"


def test_quantized_products_equal_float64(emulated: tuple[str, dict[str, Any]]) -> None:
    errors = emulated[1]["quantized_errors"]
    assert errors and max(errors.values()) <= 1e-5, errors
