"""Comparing a converted model's outputs with torch eager."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from .specs import as_numpy

# fp32 default: max error within 1e-5 of the output's scale (its largest magnitude).
DEFAULT_RTOL = 1e-5


@dataclasses.dataclass
class Agreement:
    """Max abs error, the same relative to the reference's scale, and whether it is within ``rtol``."""

    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    ok: bool = True
    detail: str = ""

    def __str__(self) -> str:
        return f"max abs err {self.max_abs_err:.3g}, rel to output scale {self.max_rel_err:.3g}" + \
            (f" ({self.detail})" if self.detail else "")


def _is_inexact(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 (and float8s) are numpy void-kind dtypes
    return dtype.kind in "fc" or (dtype.kind == "V" and "float" in dtype.name)


def compare(outputs: Sequence, references: Sequence, rtol: float = DEFAULT_RTOL) -> Agreement:
    """Outputs vs references, leaf by leaf. Floats: error relative to max |reference|; others: exact."""
    outputs, references = list(outputs), list(references)
    if len(outputs) != len(references):
        return Agreement(float("inf"), float("inf"), False, f"{len(outputs)} outputs, expected {len(references)}")
    worst_abs = worst_rel = 0.0
    ok, detail = True, ""
    for i, (o, r) in enumerate(zip(outputs, references)):
        o, r = as_numpy(o), as_numpy(r)
        if o.shape != r.shape:
            return Agreement(float("inf"), float("inf"), False, f"output {i}: shape {o.shape}, expected {r.shape}")
        if _is_inexact(r.dtype) or _is_inexact(o.dtype):
            o64, r64 = o.astype(np.complex128 if "c" in (o.dtype.kind + r.dtype.kind) else np.float64), \
                r.astype(np.complex128 if "c" in (o.dtype.kind + r.dtype.kind) else np.float64)
            same_nan = np.isnan(o64) == np.isnan(r64)
            same_inf = np.where(np.isinf(r64), o64 == r64, True)
            finite = np.isfinite(r64) & np.isfinite(o64)
            err = np.abs(o64 - r64)[finite]
            abs_err = float(err.max()) if err.size else 0.0
            scale = float(np.abs(r64[np.isfinite(r64)]).max()) if np.isfinite(r64).any() else 1.0
            rel = abs_err / max(scale, 1e-30) if abs_err else 0.0
            if not (same_nan.all() and same_inf.all()):
                ok, detail = False, f"output {i}: NaN/inf positions differ"
                abs_err = rel = float("inf")
            elif rel > rtol:
                ok, detail = False, f"output {i}"
        else:
            mismatch = o != r
            abs_err = float(np.abs(o.astype(np.float64) - r.astype(np.float64)).max()) if o.size else 0.0
            rel = 0.0 if not mismatch.any() else float("inf")
            if mismatch.any():
                ok, detail = False, f"output {i}: {int(mismatch.sum())} of {o.size} values differ"
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
    return Agreement(worst_abs, worst_rel, ok, detail)
