"""Reductions: sum, mean, max/min, prod, any/all, arg-max/min, variance, cumulative sums, sort/top-k."""
from __future__ import annotations

import math

import numpy as np
import torch

from .dims import broadcast_shapes, is_static
from .ir import Tensor
from .registry import BOOL, I32, builds

aten = torch.ops.aten


def _axes(dims, rank) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank for d in dims}) if rank else []


def reduce(ctx, code: str, x: Tensor, dims, keepdim: bool, dtype=None) -> Tensor:
    """``code`` (SUM, MEAN, REDUCE_MAX, ...) over ``dims`` (None: all) of ``x``."""
    axes = _axes(dims, x.rank)
    dtype = dtype or x.dtype
    if not axes:
        return x
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if keepdim else \
        tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return ctx.op(code, [x, np.asarray(axes, np.int32)], shape=shape, dtype=dtype, keepDims=bool(keepdim))


@builds(aten.sum.dim_IntList, aten.sum.default)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    dt = ctx.out_dtype()
    x = ctx.cast(x, dt)
    if x.rank == 0:
        return x
    return reduce(ctx, "SUM", x, dim, keepdim)


@builds(aten.mean.dim, aten.mean.default)
def mean(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    if x.rank == 0:
        return x
    return reduce(ctx, "MEAN", x, dim, keepdim)


@builds(aten.prod.dim_int, aten.prod.default)
def prod(ctx, x, dim=None, keepdim=False, *, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    if x.rank == 0:
        return x
    return reduce(ctx, "REDUCE_PROD", x, dim, keepdim)


def _minmax_reduce(code):
    def rule(ctx, x, dim=None, keepdim=False):
        if x.rank == 0:
            return x
        if x.dtype == BOOL:
            return reduce(ctx, "REDUCE_ANY" if code == "REDUCE_MAX" else "REDUCE_ALL", x, dim, keepdim)
        return nan_propagating(ctx, x, reduce(ctx, code, x, dim, keepdim), dim, keepdim)
    return rule


def nan_propagating(ctx, x: Tensor, y: Tensor, dim, keepdim) -> Tensor:
    """``y`` (a max or min of ``x``) with NaN where ``x`` has one, as torch gives (TFLite skips NaNs)."""
    if x.dtype.kind != "f":
        return y
    nan = ctx.op("NOT_EQUAL", [x, x], shape=x.shape, dtype=BOOL)
    any_nan = reduce(ctx, "REDUCE_ANY", nan, dim, keepdim, BOOL)
    return ctx.op("SELECT_V2", [any_nan, ctx.const(np.asarray(np.nan, x.dtype)), y], shape=y.shape, dtype=y.dtype)


builds(aten.amax.default, aten.max.default)(_minmax_reduce("REDUCE_MAX"))
builds(aten.amin.default, aten.min.default)(_minmax_reduce("REDUCE_MIN"))


def _as_bool(ctx, x):
    if x.dtype == BOOL:
        return x
    return ctx.op("NOT_EQUAL", [x, ctx.const(np.zeros((), x.dtype))], shape=x.shape, dtype=BOOL)


@builds(aten.any.dim, aten.any.dims, aten.any.default)
def any_(ctx, x, dim=None, keepdim=False):
    x = _as_bool(ctx, x)
    if x.rank == 0:
        return x
    return reduce(ctx, "REDUCE_ANY", x, dim, keepdim, BOOL)


@builds(aten.all.dim, aten.all.dims, aten.all.default)
def all_(ctx, x, dim=None, keepdim=False):
    x = _as_bool(ctx, x)
    if x.rank == 0:
        return x
    return reduce(ctx, "REDUCE_ALL", x, dim, keepdim, BOOL)


def _arg(code):
    def rule(ctx, x, dim=None, keepdim=False):
        if dim is None:
            flat = ctx.reshape(x, (max(x.size, 1),))
            y = ctx.op(code, [flat, np.asarray(0, np.int32)], shape=(), dtype=I32, outputType=2)
            return ctx.reshape(y, (1,) * x.rank) if keepdim else y
        if x.rank == 0:
            return ctx.const(np.zeros((), np.int32))
        d = dim % x.rank
        shape = x.shape[:d] + x.shape[d + 1:]
        y = ctx.op(code, [x, np.asarray(d, np.int32)], shape=shape, dtype=I32, outputType=2)
        return ctx.reshape(y, x.shape[:d] + (1,) + x.shape[d + 1:]) if keepdim else y
    return rule


builds(aten.argmax.default)(_arg("ARG_MAX"))
builds(aten.argmin.default)(_arg("ARG_MIN"))


def _value_index(value_code, index_code):
    def rule(ctx, x, dim, keepdim=False):
        if x.rank == 0:
            return x, ctx.const(np.zeros((), np.int32))
        values = nan_propagating(ctx, x, reduce(ctx, value_code, x, [dim], keepdim), [dim], keepdim)
        index = _arg(index_code)(ctx, x, dim, keepdim)
        if x.dtype.kind == "f":
            # torch points at the first NaN of a row that has one
            nan = ctx.op("NOT_EQUAL", [x, x], shape=x.shape, dtype=BOOL)
            nan_index = _arg("ARG_MAX")(ctx, ctx.cast(nan, I32), dim, keepdim)
            has_nan = reduce(ctx, "REDUCE_ANY", nan, [dim], keepdim, BOOL)
            index = ctx.op("SELECT_V2", [has_nan, nan_index, index], shape=index.shape, dtype=I32)
        return values, index
    return rule


builds(aten.max.dim)(_value_index("REDUCE_MAX", "ARG_MAX"))
builds(aten.min.dim)(_value_index("REDUCE_MIN", "ARG_MIN"))


def variance(ctx, x, dims, correction, keepdim) -> Tensor:
    axes = _axes(dims, x.rank)
    n = math.prod(x.shape[a] for a in axes)
    m = reduce(ctx, "MEAN", x, axes, True)
    d = ctx.op("SUB", [x, m], shape=x.shape, dtype=x.dtype)
    ss = reduce(ctx, "SUM", ctx.op("MUL", [d, d], shape=x.shape, dtype=x.dtype), axes, keepdim)
    if not is_static(n):
        # a dynamic count: divide by it at run time (torch gives inf for a count of at most the correction)
        denom = ctx.cast(ctx.const(n - correction), x.dtype)
        return ctx.op("DIV", [ss, denom], shape=ss.shape, dtype=x.dtype)
    denom = max(n - correction, 0)
    scale = np.asarray(1.0 / denom if denom else np.inf, x.dtype)
    return ctx.op("MUL", [ss, ctx.const(scale)], shape=ss.shape, dtype=x.dtype)


@builds(aten.var.correction, aten.var.dim, aten.var.default)
def var(ctx, x, dim=None, *args, correction=None, keepdim=False, unbiased=None):
    if ctx.node.target is aten.var.dim:  # (dim, unbiased=True, keepdim=False)
        unbiased = args[0] if args else (True if unbiased is None else unbiased)
        keepdim = args[1] if len(args) > 1 else keepdim
        correction = 1 if unbiased else 0
    elif ctx.node.target is aten.var.default:
        correction = 1 if (dim if isinstance(dim, bool) else True) else 0
        dim = None
    elif correction is None:
        correction = 1
    x = ctx.cast(x, ctx.out_dtype())
    return variance(ctx, x, dim, correction, keepdim)


@builds(aten.std.correction, aten.std.dim)
def std(ctx, x, dim=None, *args, correction=None, keepdim=False, unbiased=None):
    return ctx.op("SQRT", [var(ctx, x, dim, *args, correction=correction, keepdim=keepdim, unbiased=unbiased)])


@builds(aten.var_mean.correction)
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    x = ctx.cast(x, ctx.out_dtype(0))
    v = variance(ctx, x, dim, 1 if correction is None else correction, keepdim)
    return v, reduce(ctx, "MEAN", x, dim, keepdim)


@builds(aten.cumsum.default)
def cumsum(ctx, x, dim, *, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    if x.rank == 0:
        return x
    return ctx.op("CUMSUM", [x, np.asarray(dim % x.rank, np.int32)], exclusive=False, reverse=False)


@builds(aten.logsumexp.default)
def logsumexp(ctx, x, dim, keepdim=False):
    m = reduce(ctx, "REDUCE_MAX", x, dim, True)
    e = ctx.op("EXP", [ctx.op("SUB", [x, m], shape=x.shape, dtype=x.dtype)], shape=x.shape, dtype=x.dtype)
    s = reduce(ctx, "SUM", e, dim, True)
    y = ctx.op("ADD", [ctx.op("LOG", [s], shape=s.shape, dtype=x.dtype), m], shape=s.shape, dtype=x.dtype)
    return ctx.reshape(y, ctx.out_shape())


@builds(aten.topk.default)
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    if x.rank == 0:
        return x, ctx.const(np.zeros((), np.int32))
    dim = dim % x.rank
    return _top_k(ctx, x, k, dim, largest)


def _top_k(ctx, x, k, dim, largest):
    # TOPK_V2 works on the last axis, largest first
    perm = list(range(x.rank))
    perm[dim], perm[-1] = perm[-1], perm[dim]
    xt = ctx.transpose(x, perm)
    src = xt if largest else ctx.op("NEG", [xt], shape=xt.shape, dtype=xt.dtype)
    if src.dtype == BOOL:
        src = ctx.cast(src, I32)
    shape = xt.shape[:-1] + (k,)
    values, indices = ctx.tensor(shape, src.dtype), ctx.tensor(shape, I32)
    ctx.op("TOPK_V2", [src, ctx.const(k) if not is_static(k) else np.asarray(k, np.int32)], outputs=[values, indices])
    if not largest:
        values = ctx.op("NEG", [values], shape=shape, dtype=values.dtype)
    values = ctx.cast(values, x.dtype)
    return ctx.transpose(values, perm), ctx.transpose(indices, perm)


@builds(aten.sort.default, aten.sort.stable)
def sort(ctx, x, *args, **kwargs):
    if ctx.node.target is aten.sort.stable:
        dim = kwargs.get("dim", -1)
        descending = kwargs.get("descending", False)
    else:
        dim = args[0] if args else kwargs.get("dim", -1)
        descending = args[1] if len(args) > 1 else kwargs.get("descending", False)
    if x.rank == 0:
        return x, ctx.const(np.zeros((), np.int32))
    dim = dim % x.rank
    return _top_k(ctx, x, x.shape[dim], dim, bool(descending))


def _abs_pow_sum(ctx, x, p, dims, keepdim):
    a = ctx.op("ABS", [x], shape=x.shape)
    if p == 1:
        return reduce(ctx, "SUM", a, dims, keepdim)
    if p == 2:
        return ctx.op("SQRT", [reduce(ctx, "SUM", ctx.op("MUL", [x, x], shape=x.shape), dims, keepdim)],
                      shape=_kept(x, dims, keepdim))
    if p == float("inf"):
        return reduce(ctx, "REDUCE_MAX", a, dims, keepdim)
    if p == float("-inf"):
        return reduce(ctx, "REDUCE_MIN", a, dims, keepdim)
    if p == 0:
        nz = ctx.cast(ctx.op("NOT_EQUAL", [x, ctx.const(np.zeros((), x.dtype))], shape=x.shape, dtype=BOOL), x.dtype)
        return reduce(ctx, "SUM", nz, dims, keepdim)
    s = reduce(ctx, "SUM", ctx.op("POW", [a, ctx.const(np.asarray(p, x.dtype))], shape=x.shape), dims, keepdim)
    return ctx.op("POW", [s, ctx.const(np.asarray(1.0 / p, x.dtype))], shape=s.shape)


def _kept(x, dims, keepdim):
    axes = _axes(dims, x.rank)
    return tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if keepdim else \
        tuple(d for i, d in enumerate(x.shape) if i not in axes)


@builds(aten.linalg_vector_norm.default)
def vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    if x.rank == 0:
        return ctx.op("ABS", [x])
    return _abs_pow_sum(ctx, x, float(ord), dim, keepdim)


def _pair_distances(ctx, a, b, p):
    # (..., P, M) and (..., R, M) -> (..., P, R): the differences of every pair, reduced over M
    lead = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    pa, ra, m = a.shape[-2], b.shape[-2], a.shape[-1]
    a4 = ctx.reshape(a, a.shape[:-2] + (pa, 1, m))
    b4 = ctx.reshape(b, b.shape[:-2] + (1, ra, m))
    d = ctx.op("SUB", [a4, b4], shape=tuple(lead) + (pa, ra, m))
    return _abs_pow_sum(ctx, d, float(p), [d.rank - 1], False)


@builds(aten._cdist_forward.default)
def cdist(ctx, a, b, p, compute_mode=None):
    return _pair_distances(ctx, a, b, p)


@builds(aten._pdist_forward.default)
def pdist(ctx, x, p=2.0):
    n = x.shape[0]
    full = _pair_distances(ctx, x, x, p)
    i, j = np.triu_indices(n, 1)
    flat = ctx.reshape(full, (n * n,))
    return ctx.op("GATHER", [flat, (i * n + j).astype(np.int32)], shape=(len(i),), axis=0)
