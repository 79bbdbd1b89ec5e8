"""Indexing: index/index_put, gather/scatter, select/slice scatter, masked scatter, embedding, nonzero."""
from __future__ import annotations

import torch

from ._entry import EXACT, F32_ACCUM, S, aten, entry

_MOVE = "moves values"
L = torch.int64


def _idx(*values, dtype=L):
    return torch.tensor(values, dtype=dtype)


def _index(g):
    return [S(g.f(5, 4), [_idx(0, 4, -1, 2)], desc="dim 0, negative index"),
            S(g.f(3, 5), [None, _idx(1, -2)], desc="None then dim 1"),
            S(g.f(4, 5), [_idx(0, 3).reshape(2, 1), _idx(1, 2, 4).reshape(1, 3)], desc="two broadcast index tensors"),
            S(g.f(2, 3, 4), [None, _idx(2, 0), _idx(1, 3)], desc="adjacent advanced dims after a slice"),
            S(g.f(2, 3, 4), [_idx(1, 0), None, _idx(3, 2)], desc="advanced dims split by a slice"),
            S(g.i(4, 3), [_idx(3, 3, 0, dtype=torch.int32)], desc="int32 data, int32 index"),
            S(g.t(g.f(5, 3)), [_idx(4, 0)], desc="transposed"),
            S(g.f(4), [_idx(2)[0]], desc="0-d index"),
            S(g.f(3, 4), [g.b(3, 4)], desc="bool mask (data-dependent length)"),
            S(g.f(3, 4), [g.b(3)], desc="bool row mask (data-dependent length)")]


entry(aten.index.Tensor, _index, tol=EXACT, why=_MOVE)


def _index_put(g):
    mask = g.b(3, 4)
    return [S(g.f(5, 3), [_idx(0, 4, -2)], g.f(3, 3), desc="rows"),
            S(g.f(5, 3), [_idx(1, 1, 3)], g.f(3, 3), True, desc="accumulate with duplicates"),
            S(g.f(4, 5), [_idx(0, 3), _idx(4, 1)], g.f(2), desc="points"),
            S(g.f(4, 5), [None, _idx(2, 0)], g.f(), desc="0-d value broadcast"),
            S(g.f(3, 4), [mask], g.f(), desc="bool mask, 0-d value"),
            S(g.i(4, 3), [_idx(2, 0)], g.i(2, 3), True, desc="int32 accumulate"),
            S(g.f(3, 4), [g.b(3)], g.f(4), desc="bool row mask, broadcast row"),
            S(g.f(3, 4), [torch.tensor([True, False, True])], g.f(2, 4), desc="bool row mask, one row per true entry"),
            S(g.f(2, 3), [None, torch.tensor([False, True, True])], g.f(2, 1), True, desc="slice then mask, accumulate")]


entry(aten.index_put.default, _index_put, tol=F32_ACCUM, why="accumulate adds duplicates in some order")


def _index_select(g):
    return [S(g.f(5, 3), 0, _idx(4, 0, 0, 2), desc="dim 0 with repeats"),
            S(g.f(3, 5), -1, _idx(1, 3), desc="dim -1"),
            S(g.f(3, 5), 1, _idx(1, 3, dtype=torch.int32), desc="int32 index"),
            S(g.f(), 0, _idx(0), desc="0-d input"), S(g.b(4, 2), 0, _idx(3, 1), desc="bool"),
            S(g.t(g.f(3, 5)), 0, _idx(2, 0), desc="transposed")]


entry(aten.index_select.default, _index_select, tol=EXACT, why=_MOVE)


def _gather(g):
    return [S(g.f(3, 4), 1, torch.randint(0, 4, (3, 5), generator=g.g), desc="dim 1"),
            S(g.f(3, 4), 0, torch.randint(0, 3, (2, 4), generator=g.g), desc="dim 0, fewer rows"),
            S(g.f(3, 4, 5), -1, torch.randint(0, 5, (3, 2, 2), generator=g.g), desc="dim -1, smaller index"),
            S(g.i(3, 4), 1, torch.randint(0, 4, (3, 4), generator=g.g), desc="int32"),
            S(g.f(), 0, _idx(0).reshape(()), desc="0-d"),
            S(g.t(g.f(3, 4)), 0, torch.randint(0, 3, (3, 4), generator=g.g), desc="transposed")]


entry(aten.gather.default, _gather, tol=EXACT, why=_MOVE)


def _unique_index(g, rows, cols, size, dim=0):
    """An index for scatter along ``dim`` with no duplicates within a line (scatter order is undefined)."""
    lines = [torch.randperm(size, generator=g.g)[:rows if dim == 0 else cols] for _ in range(cols if dim == 0 else rows)]
    idx = torch.stack(lines, dim=1 if dim == 0 else 0)
    return idx


def _scatter(value: bool):
    def samples(g):
        src = (lambda *s: 1.5) if value else (lambda *s: g.f(*s))
        return [S(g.f(4, 3), 0, _unique_index(g, 2, 3, 4), src(2, 3), desc="dim 0"),
                S(g.f(3, 5), 1, _unique_index(g, 3, 2, 5, dim=1), src(3, 2), desc="dim 1"),
                S(g.f(3, 5), -1, _unique_index(g, 2, 2, 5, dim=1), src(3, 4), desc="dim -1, larger src"),
                S(g.i(4, 3), 0, _unique_index(g, 2, 3, 4), 7 if value else g.i(2, 3), desc="int32"),
                S(g.t(g.f(4, 3)), 0, _unique_index(g, 2, 3, 4), src(2, 3), desc="transposed")]
    return samples


entry(aten.scatter.src, _scatter(False), tol=EXACT, why=_MOVE)
entry(aten.scatter.value, _scatter(True), tol=EXACT, why=_MOVE)


def _scatter_add(g):
    return [S(g.f(4, 3), 0, torch.randint(0, 4, (5, 3), generator=g.g), g.f(5, 3), desc="dim 0 with duplicates"),
            S(g.f(3, 4), -1, torch.randint(0, 4, (3, 6), generator=g.g), g.f(3, 6), desc="dim -1"),
            S(g.i(4, 3), 0, torch.randint(0, 4, (2, 3), generator=g.g), g.i(2, 3), desc="int32"),
            S(g.f(4, 3), 0, torch.randint(0, 4, (2, 2), generator=g.g), g.f(3, 3), desc="index smaller than src")]


entry(aten.scatter_add.default, _scatter_add, tol=F32_ACCUM, why="duplicates add in some order")


def _scatter_reduce(g):
    out = []
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            out.append(S(g.f(4, 3, lo=0.5, hi=2), 0, torch.randint(0, 3, (5, 3), generator=g.g), g.f(5, 3, lo=0.5, hi=2),
                         reduce, include_self=include_self, desc=f"{reduce}, include_self={include_self}"))
    out += [S(g.i(4, 3), 0, torch.randint(0, 4, (5, 3), generator=g.g), g.i(5, 3), "mean", desc="int32 mean (floors)"),
            S(g.i(4, 3), 1, torch.randint(0, 3, (4, 2), generator=g.g), g.i(4, 2), "amax", include_self=False,
              desc="int32 amax, dim 1")]
    return out


entry(aten.scatter_reduce.two, _scatter_reduce, tol=F32_ACCUM, why="duplicates reduce in some order")

entry(aten.select_scatter.default, lambda g: [
    S(g.f(3, 4), g.f(4), 0, 1, desc="row"), S(g.f(3, 4, 2), g.f(3, 4), -1, -1, desc="negative dim and index"),
    S(g.i(3, 4), g.i(3), 1, 0, desc="int32"), S(g.f(3), g.f(), 0, 2, desc="1-d, 0-d src")], tol=EXACT, why=_MOVE)

entry(aten.slice_scatter.default, lambda g: [
    S(g.f(5, 4), g.f(2, 4), 0, 1, 3, desc="rows 1:3"), S(g.f(4, 6), g.f(4, 3), 1, 0, 6, 2, desc="step 2"),
    S(g.f(4, 6), g.f(4, 2), -1, -2, desc="negative start, no end"), S(g.i(4, 3), g.i(4, 3), desc="whole tensor")],
    tol=EXACT, why=_MOVE)


def _masked_scatter(g):
    mask = g.b(3, 4)
    return [S(g.f(3, 4), mask, g.f(12), desc="flat source"),
            S(g.f(3, 4), g.b(1, 4), g.f(3, 4), desc="broadcast mask"),
            S(g.i(3, 4), mask, g.i(4, 5), desc="int32, 2-d source"),
            S(g.f(3, 4), torch.zeros(3, 4, dtype=torch.bool), g.f(2), desc="empty mask")]


entry(aten.masked_scatter.default, _masked_scatter, tol=EXACT, why=_MOVE)


def _embedding(g):
    return [S(g.f(10, 4), torch.randint(0, 10, (3, 5), generator=g.g), desc="2-d indices"),
            S(g.f(10, 4), torch.randint(0, 10, (6,), generator=g.g, dtype=torch.int64).to(torch.int32), desc="int32 indices"),
            S(g.f(10, 4), torch.randint(0, 10, (3,), generator=g.g), 2, desc="padding_idx (forward unchanged)"),
            S(g.f(10, 4), torch.tensor(7), desc="0-d index"),
            S(g.t(g.f(10, 4)), torch.randint(0, 10, (4,), generator=g.g), desc="transposed weight")]


entry(aten.embedding.default, _embedding, tol=EXACT, why=_MOVE)


def _nonzero(g):
    return [S(g.b(3, 4), desc="bool 3x4"), S(g.i(5, lo=-1, hi=2), desc="int32 1-d"),
            S(torch.tensor([[0.0, 1.5], [float("nan"), 0.0]]), desc="float, nan counts"),
            S(torch.zeros(2, 3), desc="all zero (no rows)")]


entry(aten.nonzero.default, _nonzero, tol=EXACT, why="indices", lowp=(),
      note="its row count depends on the values; a tpu program returns it padded, with the count, and the xla "
           "runtime trims it (a nonzero result read by another op inside the program is unsupported)")
