"""Reductions, scans, softmax, sort and top-k."""
from __future__ import annotations

import math

import torch

from ._entry import EXACT, F32_ACCUM, F32_ULPS, S, aten, edge_values, entry, ties_in_any_order

_SUM = "float32 sums: the summation order differs (pairwise vs tree)"


def _distinct(g, *shape, dtype=torch.int32):
    """Integers without ties, so argmax/sort indices are unambiguous."""
    n = math.prod(shape)
    return (g.perm(n) - n // 2).reshape(shape).to(dtype)


def _reduce(*, ints=True, bools=True, dtype_kw=True, keep_ints=False):
    def samples(g):
        out = [S(g.f(3, 4, 5), [1], desc="dim=[1]"),
               S(g.f(3, 4, 5), [-1], True, desc="dim=[-1], keepdim"),
               S(g.f(3, 4, 5), [0, 2], desc="dims [0, 2]"),
               S(g.f(3, 4), [], desc="dim=[] (all)"),
               S(g.f(3, 4), None, True, desc="dim=None, keepdim"),
               S(g.f(), [0], desc="0-d, dim=[0]"),
               S(g.t(g.f(2, 3, 4)), [-2], desc="transposed, dim=[-2]"),
               S(g.f(2, 0, 3), [1], desc="empty dim"),
               S(edge_values(), [1], desc="edge values", lowp=False)]
        if ints:
            out += [S(g.i(3, 4), [1], desc="int32 (accumulates in int64)"),
                    S(g.i(3, 4, dtype=torch.int64), [0], True, desc="int64")]
        if bools:
            out.append(S(g.b(3, 4), [1], desc="bool"))
        if dtype_kw:
            out.append(S(g.f(3, 4), [1], dtype=torch.float64, desc="dtype=float64"))
        return out
    return samples


entry(aten.sum.dim_IntList, _reduce(), tol=F32_ACCUM, why=_SUM)


def _mean_dim(g):
    return [s for s in _reduce(ints=False, bools=False)(g)] + \
        [S(g.i(3, 4), [1], dtype=torch.float32, desc="int32 with dtype=float32")]


entry(aten.mean.dim, _mean_dim, tol=F32_ACCUM, why=_SUM)
entry(aten.mean.default, lambda g: [S(g.f(3, 4, 5), desc="3x4x5"), S(g.f(), desc="0-d"),
                                    S(g.t(g.f(4, 6)), desc="transposed"), S(edge_values(), desc="edge values"),
                                    S(g.i(3, 4), dtype=torch.float32, desc="int32 with dtype=float32")],
      tol=F32_ACCUM, why=_SUM)


def _prod(g):
    return [S(g.f(3, 4, lo=0.5, hi=1.5), desc="float32"), S(g.f(), desc="0-d"), S(g.i(3, 4, lo=-3, hi=4), desc="int32"),
            S(g.b(3, 4), desc="bool"), S(edge_values(), desc="edge values", lowp=False),
            S(g.t(g.f(3, 4, lo=0.5, hi=1.5)), desc="transposed"),
            S(g.f(2, 3, lo=0.5, hi=1.5), dtype=torch.float64, desc="dtype=float64")]


entry(aten.prod.default, _prod, tol=F32_ACCUM, why="float32 products: the multiplication order differs")


def _prod_dim(g):
    return [S(g.f(3, 4, lo=0.5, hi=1.5), 1, desc="dim=1"), S(g.f(3, 4, lo=0.5, hi=1.5), -1, True, desc="dim=-1 keepdim"),
            S(g.f(), 0, desc="0-d"), S(g.i(3, 4, lo=-3, hi=4), 0, desc="int32"), S(g.b(3, 4), 1, desc="bool"),
            S(edge_values(), 1, desc="edge values", lowp=False),
            S(g.t(g.f(3, 4, lo=0.5, hi=1.5)), 0, desc="transposed")]


entry(aten.prod.dim_int, _prod_dim, tol=F32_ACCUM, why="float32 products: the multiplication order differs")


def _amax(g):
    return [S(g.f(3, 4, 5), [1], desc="dim=[1]"), S(g.f(3, 4, 5), [-1, 0], True, desc="dims [-1, 0] keepdim"),
            S(g.f(3, 4), desc="dim=() (all)"), S(g.f(), [0], desc="0-d"), S(edge_values(), [1], desc="edge values (nan wins)"),
            S(g.i(3, 4), [0], desc="int32"), S(g.b(3, 4), [1], desc="bool"), S(g.t(g.f(3, 4)), [0], desc="transposed")]


entry(aten.amax.default, _amax, tol=EXACT, why="selects an input")
entry(aten.amin.default, _amax, tol=EXACT, why="selects an input")


def _any(g):
    return [S(g.b(3, 4), desc="bool"), S(torch.zeros(3, 4), desc="all zeros"), S(edge_values(), desc="edge values"),
            S(g.i(3, 4, lo=0, hi=2), desc="int32"), S(g.b(), desc="0-d")]


entry(aten.any.default, _any, tol=EXACT, why="bool output")
entry(aten.any.dim, lambda g: [S(g.b(3, 4), 1, desc="dim=1"), S(g.b(3, 4), -2, True, desc="dim=-2 keepdim"),
                               S(edge_values(), 0, desc="edge values"), S(g.i(3, 4, lo=0, hi=2), 1, desc="int32"),
                               S(g.b(), 0, desc="0-d")], tol=EXACT, why="bool output")
entry(aten.any.dims, lambda g: [S(g.b(2, 3, 4), [0, 2], desc="dims [0, 2]"),
                                S(g.b(2, 3, 4), [-1], True, desc="dims [-1] keepdim"),
                                S(g.i(3, 4, lo=0, hi=2), None, desc="dim=None"), S(edge_values(), [1], desc="edge values")],
      tol=EXACT, why="bool output")


def _var(g):
    return [S(g.f(3, 4, 5), [1], correction=1, desc="dim=[1]"),
            S(g.f(3, 4, 5), [0, -1], correction=0, keepdim=True, desc="dims [0, -1], correction=0, keepdim"),
            S(g.f(3, 4), None, desc="dim=None (unbiased)"), S(g.f(3, 4), [1], correction=2, desc="correction=2"),
            S(g.f(1, 4), [0], desc="one element, correction=1 (nan/inf)", lowp=False),
            S(g.t(g.f(3, 6)), [1], desc="transposed"), S(edge_values(), [1], desc="edge values", lowp=False),
            S(g.f(3, 4) * 1000 + 1e4, [1], desc="large mean")]


entry(aten.var.correction, _var, tol=F32_ACCUM, why=_SUM)


def _var_dim(g):
    return [S(g.f(3, 4, 5), [1], desc="dim=[1] unbiased"), S(g.f(3, 4, 5), [0, 2], False, True, desc="biased keepdim"),
            S(g.t(g.f(3, 6)), [-1], desc="transposed")]


entry(aten.var.dim, _var_dim, tol=F32_ACCUM, why=_SUM)


def _arg(g):
    return [S(g.f(3, 4, 5), 1, desc="dim=1"), S(g.f(3, 4, 5), -1, True, desc="dim=-1 keepdim"),
            S(g.f(3, 4), desc="dim=None (flattened)"), S(g.f(3, 4), None, True, desc="dim=None keepdim"),
            S(g.f(), desc="0-d"), S(edge_values(), 1, desc="edge values (nan wins)", lowp=False),
            S(_distinct(g, 3, 4), 0, desc="int32"), S(g.t(g.f(3, 4)), 1, desc="transposed"),
            S(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]), 1, desc="ties: the first index")]


entry(aten.argmax.default, _arg, tol=EXACT, why="indices")
entry(aten.argmin.default, _arg, tol=EXACT, why="indices")


def _max_dim(g):
    return [S(g.f(3, 4, 5), 1, desc="dim=1"), S(g.f(3, 4, 5), -1, True, desc="dim=-1 keepdim"),
            S(g.f(), 0, desc="0-d"), S(edge_values(), 1, desc="edge values (nan wins)", lowp=False),
            S(_distinct(g, 3, 4), 0, desc="int32"), S(g.t(g.f(3, 4)), 1, desc="transposed"),
            S(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]), 1, desc="ties: the first index")]


entry(aten.max.dim, _max_dim, tol=EXACT, why="selects an input; indices")
entry(aten.min.dim, _max_dim, tol=EXACT, why="selects an input; indices")


def _cumsum(g):
    return [S(g.f(3, 4), 1, desc="dim=1"), S(g.f(3, 4, 5), -3, desc="dim=-3"), S(g.f(), 0, desc="0-d"),
            S(g.i(3, 4), 1, desc="int32 (accumulates in int64)"), S(g.b(3, 4), 0, desc="bool"),
            S(g.f(3, 4), 0, dtype=torch.float64, desc="dtype=float64"), S(edge_values(), 1, desc="edge values", lowp=False),
            S(g.t(g.f(3, 4)), 0, desc="transposed")]


entry(aten.cumsum.default, _cumsum, tol=F32_ACCUM, why=_SUM)


def _softmax(g):
    masked = g.f(3, 4)
    masked[0, 1:] = -math.inf
    masked[2, :] = -math.inf
    return [S(g.f(3, 4), 1, False, desc="dim=1"), S(g.f(2, 3, 4), -3, False, desc="dim=-3"),
            S(g.f(3, 4) * 30, -1, False, desc="large logits"), S(g.f(), 0, False, desc="0-d"),
            S(masked, 1, False, desc="-inf masked, one row all -inf (nan)", lowp=False),
            S(g.t(g.f(3, 4)), 0, False, desc="transposed")]


entry(aten._softmax.default, _softmax, tol=F32_ULPS * 2, why="exp and a float32 sum over a short row")
entry(aten._log_softmax.default, _softmax, tol=F32_ULPS * 2, why="exp, log and a float32 sum over a short row")


def _sort(g):
    x = g.f(3, 5)
    x[1, 2] = math.nan
    x[2, 0] = math.inf
    return [S(g.f(3, 5), desc="default dim=-1"), S(g.f(3, 5), 0, True, desc="dim=0 descending"),
            S(x, -1, desc="nan sorts last", lowp=False), S(x, -1, True, desc="descending, nan first", lowp=False),
            S(g.f(), desc="0-d"), S(_distinct(g, 3, 5), 1, desc="int32"),
            S(_distinct(g, 4, 3, dtype=torch.int64), 0, True, desc="int64 descending"),
            S(g.t(g.f(3, 5)), desc="transposed")]


entry(aten.sort.default, _sort, tol=EXACT, why="a permutation of the input; indices (in any order among ties, "
      "as torch's unstable sort)", compare=ties_in_any_order((1,), 1))


def _topk(g):
    return [S(g.f(3, 6), 2, desc="k=2"), S(g.f(3, 6), 3, 0, desc="k=3, dim=0"),
            S(g.f(3, 6), 2, -1, False, desc="smallest"), S(_distinct(g, 3, 6), 4, desc="int32"),
            S(g.f(4, 6), 6, 1, True, True, desc="k = size"), S(g.t(g.f(3, 6)), 2, desc="transposed"),
            S(g.f(), 1, desc="0-d")]


entry(aten.topk.default, _topk, tol=EXACT, why="selects inputs; indices (in any order among ties)",
      compare=ties_in_any_order((1,), 2))
