"""The oracle of products with 8-bit x (see core/native/qmatmul_int8.h), in numpy: shared by
test_int8_activations.py and cpu_probe.py."""

from __future__ import annotations

import numpy as np


def rounded(x: np.ndarray, group_size: int) -> np.ndarray:
    """x as the kernels see it: each group rounded (half to even) to int8 against its largest magnitude."""
    groups = x.astype(np.float32).reshape(*x.shape[:-1], -1, group_size)
    peak = np.abs(groups).max(-1, keepdims=True)
    inverse = np.where(peak > 1e-30, np.float32(127) / np.where(peak > 0, peak, 1), 0).astype(np.float32)
    q = np.rint(groups * inverse)
    return (q.astype(np.float64) * (peak / np.float32(127)).astype(np.float64)).reshape(x.shape)


def oracle(x: np.ndarray, w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rounded x times the dequantized weights w (float64), and sum |x| |w|: the scale of float32 rounding."""
    xr = rounded(x, group_size)
    return xr @ w.T, np.abs(xr) @ np.abs(w).T
