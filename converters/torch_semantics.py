"""Tables of torch's own arithmetic that every target reproduces the same way (numpy, at conversion)."""
from __future__ import annotations

import math

import numpy as np


def linear_resize_matrix(n_in: int, n_out: int, align_corners: bool, scale: float | None = None) -> np.ndarray:
    """(n_out, n_in) weights of torch's (bi)linear upsampling along one axis: output i reads input
    positions floor(src) and floor(src) + 1 (clamped), src = i * (n_in - 1) / (n_out - 1) with
    ``align_corners``, else (i + 0.5) / scale - 0.5 clamped at 0 (scale: the given factor, or
    n_out / n_in)."""
    if align_corners:
        r = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        r = 1.0 / scale if scale else n_in / n_out
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        src = r * i if align_corners else max(r * (i + 0.5) - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        m[i, i0] += 1 - lam
        m[i, i1] += lam
    return m


def antialiased_linear_resize_matrix(n_in: int, n_out: int, align_corners: bool,
                                     scale: float | None = None) -> np.ndarray:
    """(n_out, n_in) weights of torch's antialiased bilinear resize (``_upsample_bilinear2d_aa``,
    PIL's): a triangle filter widened by the downscaling factor, each row normalised to sum 1."""
    if align_corners:
        s = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        s = 1.0 / scale if scale else n_in / n_out
    support = 1.0 * s if s >= 1.0 else 1.0
    invscale = 1.0 / s if s >= 1.0 else 1.0
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        size = min(int(center + support + 0.5), n_in) - lo
        w = np.array([max(0.0, 1.0 - abs((j + lo - center + 0.5) * invscale)) for j in range(size)])
        total = w.sum()
        if total != 0.0:
            w = w / total
        m[i, lo:lo + size] = w
    return m
