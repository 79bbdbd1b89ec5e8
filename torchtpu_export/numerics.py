"""Comparing a converted model's outputs with torch eager."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from .specs import as_numpy, dtype_kind

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


def tolerance_arg(text: str) -> float:
    """A ``--tolerance`` value (argparse's ``type=``): a finite number from 0; anything else is a usage error
    (exit 2), never a check that fails (a negative one) or passes whatever the outputs (NaN)."""
    import argparse
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"a tolerance is a finite number from 0 (relative to the output's scale, "
                                         f"e.g. 1e-4), got {text!r}")
    return value


def _is_inexact(dtype: np.dtype) -> bool:
    return dtype_kind(dtype) in "fc"  # (ml_dtypes' bfloat16 and float8s are numpy void-kind dtypes)


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


PERMUTATIONS = 400   # a call-level permutation test: a p-value down to 1/401


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / a.size
    fb = np.searchsorted(b, grid, side="right") / b.size
    return float(np.max(np.abs(fa - fb))) if grid.size else 0.0


def _call_ks_test(ref: np.ndarray, got: np.ndarray, tol: float = 0.0, seed: int = 0) -> tuple[float, float]:
    """(KS statistic of the pooled values, permutation p-value) for two sets of calls (calls x values).

    Values within ``tol`` count as equal (float rounding moves a value, not its probability): the
    statistic is the largest of F_a(x) - F_b(x + tol) and F_b(x) - F_a(x + tol). Values of one call
    can be correlated (a dropped channel zeroes many at once), so the null distribution is built by
    permuting whole calls between the two sets, not single values."""
    calls = np.concatenate([ref, got])
    grid = np.unique(calls)
    ordered = [np.sort(c) for c in calls]
    # per call, how many of its values lie at or below each grid point (and each grid point + tol)
    low = np.stack([np.searchsorted(c, grid, side="right") for c in ordered]).astype(np.float64)
    high = np.stack([np.searchsorted(c, grid + tol, side="right") for c in ordered]).astype(np.float64)
    k, per_call = ref.shape[0], ref.shape[1]

    def stat(first: np.ndarray) -> float:
        na, nb = first.sum() * per_call, (~first).sum() * per_call
        a_low, a_high = low[first].sum(0) / na, high[first].sum(0) / na
        b_low, b_high = low[~first].sum(0) / nb, high[~first].sum(0) / nb
        return float(max(np.max(a_low - b_high), np.max(b_low - a_high), 0.0))

    first = np.zeros(len(calls), bool)
    first[:k] = True
    observed = stat(first)
    rng = np.random.default_rng(seed)
    exceed = sum(stat(rng.permutation(first)) >= observed for _ in range(PERMUTATIONS))
    return observed, (exceed + 1) / (PERMUTATIONS + 1)


def same_distribution(reference_runs: Sequence, runs: Sequence, rtol: float = DEFAULT_RTOL,
                      alpha: float = 0.005) -> Agreement:
    """Whether repeated calls of a random program agree in distribution with repeated eager calls.

    Each argument holds the outputs of several calls (lists of arrays, same shapes). Per output:
    elements that eager gives the same value on every call are compared as values (a majority of
    the program's calls must match them: the rare draw of a near-certain event is allowed); the
    others must change from call to call, and their values must pass a two-sample
    Kolmogorov-Smirnov test against eager's (values within ``rtol`` of the output's scale count as
    equal), its null distribution from permuting whole calls (values within a call may be
    correlated); NaN counts as +inf. ``max_abs_err`` is the largest
    KS statistic, ``max_rel_err`` the smallest p-value's shortfall below 1.
    """
    worst_d, worst_p = 0.0, 1.0
    for i in range(len(reference_runs[0])):
        ref = np.stack([as_numpy(r[i]) for r in reference_runs])
        got = np.stack([as_numpy(r[i]) for r in runs])
        if ref.dtype.kind == "c":
            ref, got = np.concatenate([ref.real, ref.imag], -1), np.concatenate([got.real, got.imag], -1)
        ref, got = ref.astype(np.float64), got.astype(np.float64)
        ref, got = np.where(np.isnan(ref), np.inf, ref), np.where(np.isnan(got), np.inf, got)
        fixed = np.all(ref == ref[:1], axis=0)
        if fixed.any():
            want = ref[0][fixed]
            finite = np.isfinite(want)
            scale = max(float(np.max(np.abs(want[finite]))) if finite.any() else 0.0, 1.0)
            close = np.isclose(got[:, fixed], want, rtol=0, atol=rtol * scale) | (got[:, fixed] == want)
            share = close.mean(axis=0)
            if share.min() < 0.5:
                return Agreement(math.inf, math.inf, False,
                                 f"output {i}: {int((share < 0.5).sum())} values that eager always gives "
                                 "(deterministic ones) differ in most calls")
        varying = ~fixed
        if not varying.any():
            continue
        a, b = ref[:, varying], got[:, varying]
        if np.all(b == b[:1]):
            return Agreement(math.inf, math.inf, False, f"output {i}: the same values on every call; "
                                                        "eager draws new ones")
        finite = np.isfinite(a)
        tol = rtol * max(float(np.max(np.abs(a[finite]))) if finite.any() else 0.0, 1.0)
        d, p = _call_ks_test(a.reshape(len(a), -1), b.reshape(len(b), -1), tol=tol, seed=i)
        worst_d, worst_p = max(worst_d, d), min(worst_p, p)
        if p < alpha:
            return Agreement(d, 1 - p, False, f"output {i}: distributions differ (Kolmogorov-Smirnov {d:.3f}, "
                                              f"p = {p:.4f} by permuting {len(a) + len(b)} calls)")
    return Agreement(worst_d, 1 - worst_p, True)
