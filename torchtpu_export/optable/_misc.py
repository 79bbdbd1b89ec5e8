"""Symbolic-shape queries, scalar extraction and random tensors."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..numerics import Agreement
from ._entry import EXACT, S, aten, entry

_SHAPE = "an integer shape query"
_DYN = {0: {0: (2, 64), 1: (2, 64)}}   # both dims of the first input are symbolic


entry(aten.sym_size.int, lambda g: [
    S(g.f(3, 4), 0, desc="dim 0 of a dynamic 3x4", dynamic=_DYN), S(g.f(3, 5), 1, desc="dim 1", dynamic=_DYN),
    S(g.f(3, 5), -1, desc="dim -1", dynamic=_DYN)],
    call=lambda x, dim: x * aten.sym_size.int(x, dim), tol=EXACT, why=_SHAPE, lowp=())


def _factor_rewrite(make):
    """Replaces the scalar factor of the graph's ``mul.Tensor(x, factor)`` by ``make(graph, x)``."""
    def rewrite(gm):
        from ._rewrite import finish, nodes_of
        for node in nodes_of(gm, aten.mul.Tensor):
            x = node.args[0]
            with gm.graph.inserting_before(node):
                node.args = (x, make(gm.graph, x))
        gm.graph.eliminate_dead_code()
        finish(gm)
    return rewrite


def _numel(graph, x):
    return graph.call_function(aten.sym_numel.default, (x,))


def _stride0(graph, x):
    return graph.call_function(aten.sym_stride.int, (x, 0))


def _offset_plus_one(graph, x):
    import operator
    return graph.call_function(operator.add, (graph.call_function(aten.sym_storage_offset.default, (x,)), 1))


def _contiguous(graph, x):
    return graph.call_function(aten.sym_is_contiguous.default, (x,))


_INJECTED = "torch.export folds it into sym_size arithmetic; the harness puts the op into the captured graph"
entry(aten.sym_numel.default, lambda g: [S(g.f(3, 4), desc="dynamic 3x4", dynamic=_DYN)],
      call=lambda x: x * x.numel(), rewrite=_factor_rewrite(_numel), tol=EXACT, why=_SHAPE, lowp=(), note=_INJECTED)
entry(aten.sym_stride.int, lambda g: [S(g.f(3, 4), desc="stride of dim 0, dynamic 3x4", dynamic=_DYN)],
      call=lambda x: x * x.stride(0), rewrite=_factor_rewrite(_stride0), tol=EXACT, why=_SHAPE, lowp=(),
      note=_INJECTED)
entry(aten.sym_storage_offset.default, lambda g: [S(g.f(3, 4), desc="offset of a fresh tensor", dynamic=_DYN)],
      call=lambda x: x * (x.storage_offset() + 1), rewrite=_factor_rewrite(_offset_plus_one), tol=EXACT, why=_SHAPE,
      lowp=(), note=_INJECTED)
entry(aten.sym_is_contiguous.default, lambda g: [S(g.f(3, 4), desc="a contiguous input", dynamic=_DYN)],
      call=lambda x: x * int(x.is_contiguous()), rewrite=_factor_rewrite(_contiguous), tol=EXACT, why=_SHAPE,
      lowp=(), note=_INJECTED)

entry(aten._local_scalar_dense.default, lambda g: [
    S(g.f(3, 4), g.f(), desc="float 0-d"), S(g.i(3, 4), g.i(), desc="int 0-d"),
    S(g.f(2, 2), g.f(1, 1), desc="1x1")],
    call=lambda x, s: x + aten._local_scalar_dense.default(s), tol=EXACT, why="one value read out", lowp=())


# ---- random --------------------------------------------------------------------------------

def _distribution(check):
    def compare(outs, refs, sample):
        x = np.asarray(outs[0], np.float64).reshape(-1)
        ok, stat, detail = check(x)
        return Agreement(ok=ok, max_rel_err=stat, detail="" if ok else detail)
    return compare


def _uniform(x):
    n = x.size
    mean_err = abs(x.mean() - 0.5)
    ok = x.min() >= 0 and x.max() < 1 and mean_err < 5 * math.sqrt(1 / 12 / n)
    return ok, mean_err, f"values in [{x.min():.3g}, {x.max():.3g}], mean {x.mean():.4f}"


def _normal(x):
    n = x.size
    mean_err, std_err = abs(x.mean()), abs(x.std() - 1)
    ok = mean_err < 5 / math.sqrt(n) and std_err < 5 / math.sqrt(2 * n)
    return ok, max(mean_err, std_err), f"mean {x.mean():.4f}, std {x.std():.4f}"


def _permutation(outs, refs, sample):
    x = np.asarray(outs[0]).reshape(-1)
    ok = np.array_equal(np.sort(x), np.arange(x.size))
    return Agreement(ok=bool(ok), detail="" if ok else "not a permutation of 0..n-1")


_RANDOM = "random: compared by distribution (range, mean, spread), not values"
entry(aten.rand.default, lambda g: [S([64, 64], desc="4096 float32"), S([4096], dtype=torch.float64, desc="float64"),
                                    S([64, 64], dtype=torch.bfloat16, desc="bfloat16")],
      compare=_distribution(_uniform), tol=EXACT, why=_RANDOM, lowp=())
entry(aten.randn.default, lambda g: [S([64, 64], desc="4096 float32"), S([4096], dtype=torch.float64, desc="float64")],
      compare=_distribution(_normal), tol=EXACT, why=_RANDOM, lowp=())
entry(aten.randperm.default, lambda g: [S(10, desc="10"), S(100, dtype=torch.int32, desc="100 int32"), S(1, desc="1")],
      compare=_permutation, tol=EXACT, why="random: any permutation of 0..n-1", lowp=())
