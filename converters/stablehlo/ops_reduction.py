"""Reductions, scans, softmax, sort and top-k."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import torch

from .registry import lowers

aten = torch.ops.aten


def axes(x, dim) -> tuple | None:
    """torch's dim argument (None, int, or list; [] means all) as a tuple of axes, or None for all."""
    if dim is None:
        return None
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return None
    return tuple(d % max(x.ndim, 1) for d in dim) if x.ndim else None


@lowers(aten.sum.dim_IntList)
def sum_(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.sum(ctx.cast(x, ctx.out_dtype()), axis=axes(x, dim), keepdims=keepdim)


@lowers(aten.mean.dim)
def mean_dim(ctx, x, dim=None, keepdim=False, *, dtype=None):
    return jnp.mean(ctx.cast(x, ctx.out_dtype()), axis=axes(x, dim), keepdims=keepdim)


@lowers(aten.mean.default)
def mean(ctx, x, *, dtype=None):
    return jnp.mean(ctx.cast(x, ctx.out_dtype()))


@lowers(aten.prod.default)
def prod(ctx, x, *, dtype=None):
    return jnp.prod(ctx.cast(x, ctx.out_dtype()))


@lowers(aten.prod.dim_int)
def prod_dim(ctx, x, dim, keepdim=False, *, dtype=None):
    return jnp.prod(ctx.cast(x, ctx.out_dtype()), axis=axes(x, dim), keepdims=keepdim)


@lowers(aten.amax.default)
def amax(ctx, x, dim=(), keepdim=False):
    return jnp.max(x, axis=axes(x, list(dim)), keepdims=keepdim)


@lowers(aten.amin.default)
def amin(ctx, x, dim=(), keepdim=False):
    return jnp.min(x, axis=axes(x, list(dim)), keepdims=keepdim)


@lowers(aten.any.default)
def any_(ctx, x):
    return jnp.any(x != 0)


@lowers(aten.any.dim, aten.any.dims)
def any_dim(ctx, x, dim=None, keepdim=False):
    return jnp.any(x != 0, axis=axes(x, dim), keepdims=keepdim)


def _var(x, dim, correction, keepdim):
    ax = axes(x, dim)
    n = x.size if ax is None else math.prod(x.shape[a] for a in ax)
    mean = jnp.mean(x, axis=ax, keepdims=True)
    sq = jnp.sum(jnp.square(jnp.abs(x - mean)), axis=ax, keepdims=keepdim)
    return sq / jnp.maximum(jnp.asarray(n - correction, sq.dtype), 0)


@lowers(aten.var.correction)
def var_correction(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _var(ctx.cast(x, ctx.out_dtype()), dim, 1 if correction is None else correction, keepdim)


@lowers(aten.var.dim)
def var_dim(ctx, x, dim=None, unbiased=True, keepdim=False):
    return _var(ctx.cast(x, ctx.out_dtype()), dim, 1 if unbiased else 0, keepdim)


def _arg(fn, x, dim, keepdim):
    if dim is None:
        out = fn(x.reshape(-1))
        return out.reshape((1,) * x.ndim) if keepdim else out
    return fn(x, axis=dim % max(x.ndim, 1), keepdims=keepdim) if x.ndim else jnp.zeros((), jnp.int32)


@lowers(aten.argmax.default)
def argmax(ctx, x, dim=None, keepdim=False):
    return _arg(jnp.argmax, x, dim, keepdim)


@lowers(aten.argmin.default)
def argmin(ctx, x, dim=None, keepdim=False):
    return _arg(jnp.argmin, x, dim, keepdim)


@lowers(aten.max.dim)
def max_dim(ctx, x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), ctx.out_dtype(1))
    return jnp.max(x, axis=dim, keepdims=keepdim), jnp.argmax(x, axis=dim, keepdims=keepdim)


@lowers(aten.min.dim)
def min_dim(ctx, x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), ctx.out_dtype(1))
    return jnp.min(x, axis=dim, keepdims=keepdim), jnp.argmin(x, axis=dim, keepdims=keepdim)


@lowers(aten.cumsum.default)
def cumsum(ctx, x, dim, *, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    return jnp.cumsum(x, axis=dim % x.ndim) if x.ndim else x


@lowers(aten._softmax.default)
def softmax(ctx, x, dim, half_to_float=False):
    x = ctx.cast(x, ctx.out_dtype())
    return jax.nn.softmax(x, axis=dim % x.ndim) if x.ndim else jnp.ones_like(x)


@lowers(aten._log_softmax.default)
def log_softmax(ctx, x, dim, half_to_float=False):
    x = ctx.cast(x, ctx.out_dtype())
    return jax.nn.log_softmax(x, axis=dim % x.ndim) if x.ndim else jnp.zeros_like(x)


@lowers(aten.sort.default)
def sort(ctx, x, dim=-1, descending=False):
    if x.ndim == 0:
        return x, jnp.zeros((), ctx.out_dtype(1))
    dim = dim % x.ndim
    idx = jnp.argsort(x, axis=dim, stable=True, descending=descending)
    return jnp.take_along_axis(x, idx, axis=dim), idx


@lowers(aten.topk.default)
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):
    if x.ndim == 0:
        return x, jnp.zeros((), ctx.out_dtype(1))
    dim = dim % x.ndim
    xt = jnp.moveaxis(x, dim, -1)
    if largest and not jnp.issubdtype(x.dtype, jnp.bool_):
        vals, idx = lax.top_k(xt, k)
    else:
        idx = jnp.argsort(xt, axis=-1, stable=True, descending=largest)[..., :k]
        vals = jnp.take_along_axis(xt, idx, axis=-1)
    return jnp.moveaxis(vals, -1, dim), jnp.moveaxis(idx, -1, dim)


# ---- non-core ops that torch.export's core decomposition leaves in graphs ------------------

@lowers(aten.linalg_vector_norm.default)
def linalg_vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = jnp.abs(ctx.cast(x, ctx.out_dtype()))
    ax = axes(x, dim)
    if ord == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=ax, keepdims=keepdim)
    if math.isinf(ord):
        return (jnp.max if ord > 0 else jnp.min)(x, axis=ax, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(x, axis=ax, keepdims=keepdim)
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=ax, keepdims=keepdim))
    return jnp.power(jnp.sum(jnp.power(x, ord), axis=ax, keepdims=keepdim), 1.0 / ord)


@lowers(aten.var_mean.correction)
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    x = ctx.cast(x, ctx.out_dtype(0))
    var = _var(x, dim, 1 if correction is None else correction, keepdim)
    return var, jnp.mean(x, axis=axes(x, dim), keepdims=keepdim)


@lowers(aten.cumprod.default)
def cumprod(ctx, x, dim, *, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    return jnp.cumprod(x, axis=dim % x.ndim) if x.ndim else x


@lowers(aten.sort.stable)
def sort_stable(ctx, x, *, stable=None, dim=-1, descending=False):
    return sort(ctx, x, dim, descending)


@lowers(aten.logsumexp.default)
def logsumexp(ctx, x, dim, keepdim=False):
    x = ctx.cast(x, ctx.out_dtype())
    return jax.scipy.special.logsumexp(x, axis=axes(x, dim), keepdims=keepdim)


@lowers(aten.max.default)
def max_all(ctx, x):
    return jnp.max(x)


@lowers(aten.min.default)
def min_all(ctx, x):
    return jnp.min(x)


def _nth_sorted(x, dim, keepdim, position):
    """Value and index of the element at ``position`` (per slice) of a stable ascending sort, NaN last."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = dim % x.ndim
    idx = jnp.argsort(x, axis=dim, stable=True)
    vals = jnp.take_along_axis(x, idx, axis=dim)
    pos = jnp.expand_dims(position, dim)
    v = jnp.take_along_axis(vals, pos, axis=dim)
    i = jnp.take_along_axis(idx, pos, axis=dim)
    return (v, i) if keepdim else (jnp.squeeze(v, dim), jnp.squeeze(i, dim))


def _median_position(x, dim, ignore_nan):
    # torch returns the lower median; with NaN it returns the (first) NaN, unless ignoring NaNs
    if jnp.issubdtype(x.dtype, jnp.floating):
        nans = jnp.sum(jnp.isnan(x), axis=dim)
    else:
        nans = jnp.zeros(tuple(s for a, s in enumerate(x.shape) if a != dim), jnp.int32)
    n = x.shape[dim]
    if ignore_nan:
        return jnp.maximum((n - nans - 1) // 2, 0)
    return jnp.where(nans > 0, n - nans, (n - 1) // 2)


def _median(x, dim, keepdim, ignore_nan):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = dim % x.ndim
    return _nth_sorted(x, dim, keepdim, _median_position(x, dim, ignore_nan))


@lowers(aten.median.default)
def median(ctx, x):
    return _median(x.reshape(-1), 0, False, False)[0]


@lowers(aten.nanmedian.default)
def nanmedian(ctx, x):
    return _median(x.reshape(-1), 0, False, True)[0]


@lowers(aten.median.dim)
def median_dim(ctx, x, dim, keepdim=False):
    return _median(x, dim, keepdim, False)


@lowers(aten.nanmedian.dim)
def nanmedian_dim(ctx, x, dim, keepdim=False):
    return _median(x, dim, keepdim, True)


@lowers(aten.kthvalue.default)
def kthvalue(ctx, x, k, dim=-1, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = dim % x.ndim
    shape = tuple(s for a, s in enumerate(x.shape) if a != dim)
    return _nth_sorted(x, dim, keepdim, jnp.full(shape, k - 1, jnp.int32))


@lowers(aten.mode.default)
def mode(ctx, x, dim=-1, keepdim=False):
    # torch: the smallest of the most frequent values, and the last index where it occurs
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = dim % x.ndim
    xt = jnp.moveaxis(x, dim, -1)
    eq = xt[..., :, None] == xt[..., None, :]
    counts = jnp.sum(eq, axis=-1)
    best = jnp.max(counts, axis=-1, keepdims=True)
    big = jnp.array(jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).max, x.dtype)
    value = jnp.min(jnp.where(counts == best, xt, big), axis=-1, keepdims=True)
    n = xt.shape[-1]
    index = jnp.max(jnp.where(xt == value, jnp.arange(n), -1), axis=-1, keepdims=True)
    value, index = jnp.moveaxis(value, -1, dim), jnp.moveaxis(index, -1, dim)
    return (value, index) if keepdim else (jnp.squeeze(value, dim), jnp.squeeze(index, dim))


def _cum_extreme(x, dim, better):
    """cummax/cummin: running extreme and the last index reaching it; NaN wins and propagates, like torch."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = dim % x.ndim
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    idx = jnp.broadcast_to(jnp.arange(x.shape[dim], dtype=jnp.int32).reshape(shape), x.shape)
    floating = jnp.issubdtype(x.dtype, jnp.floating)

    def combine(left, right):
        (lv, li), (rv, ri) = left, right
        take = better(rv, lv) | (rv == lv)
        if floating:
            take = jnp.isnan(rv) | (~jnp.isnan(lv) & take)
        return jnp.where(take, rv, lv), jnp.where(take, ri, li)

    return lax.associative_scan(combine, (x, idx), axis=dim)


@lowers(aten.cummax.default)
def cummax(ctx, x, dim):
    return _cum_extreme(x, dim, jnp.greater)


@lowers(aten.cummin.default)
def cummin(ctx, x, dim):
    return _cum_extreme(x, dim, jnp.less)


@lowers(aten.logcumsumexp.default)
def logcumsumexp(ctx, x, dim):
    x = ctx.cast(x, ctx.out_dtype())
    return lax.cumlogsumexp(x, axis=dim % x.ndim) if x.ndim else x


@lowers(aten.histc.default)
def histc(ctx, x, bins=100, min=0, max=0):
    x = x.reshape(-1)
    lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    if min == max and x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    b = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int32)
    b = jnp.clip(b, 0, bins - 1)  # x == max falls in the last bin
    return jnp.zeros((bins,), x.dtype).at[b].add(inside.astype(x.dtype))


@lowers(aten.dist.default)
def dist(ctx, a, b, p=2):
    dt = ctx.out_dtype()
    return linalg_vector_norm(ctx, ctx.cast(a, dt) - ctx.cast(b, dt), p)


def _histogram(x, edges, weight, density):
    """torch.histogram's counts over ascending ``edges``: bins are [e_i, e_i+1), the last one closed."""
    x = x.reshape(-1)
    bins = edges.shape[0] - 1
    pos = jnp.searchsorted(edges, x, side="right") - 1
    pos = jnp.where(x == edges[-1], bins - 1, pos)
    inside = (x >= edges[0]) & (x <= edges[-1])
    w = jnp.ones_like(x) if weight is None else weight.reshape(-1).astype(x.dtype)
    hist = jnp.zeros((bins,), x.dtype).at[jnp.clip(pos, 0, bins - 1)].add(jnp.where(inside, w, 0))
    if density:
        hist = hist / (jnp.sum(hist) * jnp.diff(edges))
    return hist, edges


@lowers(aten.histogram.bin_ct)
def histogram(ctx, x, bins=100, *, range=None, weight=None, density=False):
    if range is not None:
        lo, hi = jnp.asarray(range[0], x.dtype), jnp.asarray(range[1], x.dtype)
    elif x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    else:
        lo, hi = jnp.zeros((), x.dtype), jnp.zeros((), x.dtype)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    return _histogram(x, jnp.linspace(lo, hi, bins + 1, dtype=x.dtype), weight, density)


@lowers(aten.histogram.bins_tensor)
def histogram_edges(ctx, x, bins, *, weight=None, density=False):
    return _histogram(x, bins.astype(x.dtype), weight, density)


@lowers(aten.segment_reduce.default)
def segment_reduce(ctx, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None):
    """Reduces consecutive segments of ``data`` along ``axis`` (given by lengths or offsets), like torch."""
    if lengths is None:
        if offsets is None:
            raise NotImplementedError("segment_reduce needs lengths or offsets")
        lengths = offsets[..., 1:] - offsets[..., :-1]
    if lengths.ndim != 1:
        raise NotImplementedError("segment_reduce with per-row (batched) lengths")
    axis = axis % data.ndim
    x = jnp.moveaxis(data, axis, 0)
    n_seg = lengths.shape[0]
    ends = jnp.cumsum(lengths)
    seg = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")  # segment of every row
    count = lengths.astype(x.dtype).reshape((n_seg,) + (1,) * (x.ndim - 1))
    empty = count == 0
    init = None if initial is None else jnp.asarray(initial, x.dtype)
    if reduce in ("sum", "mean"):
        out = jax.ops.segment_sum(x, seg, n_seg)
        if init is not None:
            out = out + init
        if reduce == "mean":
            out = jnp.where(empty, jnp.nan if init is None else init, out / jnp.where(empty, 1, count))
    elif reduce == "prod":
        out = jax.ops.segment_prod(x, seg, n_seg)
        out = out if init is None else out * init
    elif reduce in ("max", "min"):
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = fn(x, seg, n_seg)  # empty segments: -inf / inf
        if init is not None:
            out = (jnp.maximum if reduce == "max" else jnp.minimum)(out, init)
    else:
        raise ValueError(f"unknown reduce {reduce!r}")
    return jnp.moveaxis(out, 0, axis)


@lowers(aten.hash_tensor.default)
def hash_tensor(ctx, x, dim=(), *, keepdim=False, mode=0):
    """torch's hash (mode 0): the XOR of every element's 64-bit pattern over ``dim`` (floats as float64
    bits, integers and bools sign-extended to int64), as uint64."""
    if mode != 0:
        raise NotImplementedError(f"hash_tensor mode {mode} (torch defines mode 0, an XOR reduction)")
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise NotImplementedError("hash_tensor of a complex tensor")
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(x.astype(jnp.float64), jnp.uint64)
    else:
        bits = lax.bitcast_convert_type(x.astype(jnp.int64), jnp.uint64)
    ax = axes(x, dim)
    ax = tuple(range(x.ndim)) if ax is None else ax
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, ax)
    if keepdim:
        out = jnp.expand_dims(out, ax) if x.ndim else out
    return out
