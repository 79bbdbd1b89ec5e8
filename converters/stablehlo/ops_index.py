"""Indexing: gather/scatter, index/index_put, select/slice scatter, masked scatter."""
from __future__ import annotations

import jax.numpy as jnp

import torch

from .registry import lowers

aten = torch.ops.aten


def _wrap(index, size):
    return jnp.where(index < 0, index + size, index)


@lowers(aten.index.Tensor)
def index(ctx, x, indices):
    idx = tuple(slice(None) if i is None else (i if i.dtype == jnp.bool_ else _wrap(i, x.shape[d]))
                for d, i in enumerate(indices))
    return x[idx]


@lowers(aten.index_put.default)
def index_put(ctx, x, indices, values, accumulate=False):
    idx = tuple(slice(None) if i is None else (i if i.dtype == jnp.bool_ else _wrap(i, x.shape[d]))
                for d, i in enumerate(indices))
    values = ctx.cast(values, x.dtype)
    return x.at[idx].add(values) if accumulate else x.at[idx].set(values)


@lowers(aten.index_select.default)
def index_select(ctx, x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, _wrap(index, x.shape[dim]), axis=dim % x.ndim)


def _grid(index, dim):
    """Full index tuple for a scatter/gather along ``dim``: iotas on the other axes."""
    dim = dim % max(index.ndim, 1)
    return tuple(index if d == dim else jnp.broadcast_to(
        jnp.arange(index.shape[d]).reshape([-1 if k == d else 1 for k in range(index.ndim)]), index.shape)
        for d in range(index.ndim))


@lowers(aten.gather.default)
def gather(ctx, x, dim, index, *, sparse_grad=False):
    if x.ndim == 0:
        return jnp.broadcast_to(x, index.shape)
    return x[_grid(_wrap(index, x.shape[dim]), dim)]


def _src_like(src, index, dtype):
    src = jnp.asarray(src, dtype)
    if src.ndim == 0:
        return jnp.broadcast_to(src, index.shape)
    return src[tuple(slice(0, n) for n in index.shape)]


@lowers(aten.scatter.src, aten.scatter.value)
def scatter(ctx, x, dim, index, src):
    if x.ndim == 0:
        return jnp.asarray(src, x.dtype).reshape(()) if index.size else x
    return x.at[_grid(_wrap(index, x.shape[dim]), dim)].set(_src_like(src, index, x.dtype))


@lowers(aten.scatter_add.default)
def scatter_add(ctx, x, dim, index, src):
    if x.ndim == 0:
        return x + jnp.sum(src) if index.size else x
    return x.at[_grid(_wrap(index, x.shape[dim]), dim)].add(_src_like(src, index, x.dtype))


@lowers(aten.scatter_reduce.two)
def scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    squeeze = x.ndim == 0
    if squeeze:
        x, index, src = x.reshape(1), index.reshape(-1), jnp.asarray(src).reshape(-1)
    grid = _grid(_wrap(index, x.shape[dim]), dim)
    src = _src_like(src, index, x.dtype)
    touched = jnp.zeros(x.shape, jnp.int32).at[grid].add(1)
    if reduce in ("sum", "mean"):
        base = x if include_self else jnp.where(touched > 0, jnp.zeros_like(x), x)
        out = base.at[grid].add(src)
        if reduce == "mean":
            count = touched + (1 if include_self else 0)
            count = jnp.maximum(count, 1)
            out = jnp.where(touched > 0, out / count.astype(out.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                            else jnp.floor_divide(out, count.astype(out.dtype)), x)
    elif reduce == "prod":
        base = x if include_self else jnp.where(touched > 0, jnp.ones_like(x), x)
        out = base.at[grid].multiply(src)
    elif reduce in ("amax", "amin"):
        if jnp.issubdtype(x.dtype, jnp.floating):
            ident = -jnp.inf if reduce == "amax" else jnp.inf
        else:
            info = jnp.iinfo(x.dtype)
            ident = info.min if reduce == "amax" else info.max
        base = x if include_self else jnp.where(touched > 0, jnp.full_like(x, ident), x)
        out = base.at[grid].max(src) if reduce == "amax" else base.at[grid].min(src)
    else:
        raise ValueError(f"unknown reduce {reduce!r}")
    return out.reshape(()) if squeeze else out


@lowers(aten.select_scatter.default)
def select_scatter(ctx, x, src, dim, index):
    dim = dim % x.ndim
    idx = [slice(None)] * x.ndim
    idx[dim] = index
    return x.at[tuple(idx)].set(ctx.cast(src, x.dtype))


@lowers(aten.slice_scatter.default)
def slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    dim = dim % x.ndim
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(start, end, step)
    return x.at[tuple(idx)].set(ctx.cast(src, x.dtype))


@lowers(aten.masked_scatter.default)
def masked_scatter(ctx, x, mask, source):
    mask = jnp.broadcast_to(mask, x.shape)
    flat_mask = mask.reshape(-1)
    pos = jnp.cumsum(flat_mask.astype(jnp.int32)) - 1
    src = source.reshape(-1)
    vals = jnp.take(src, jnp.clip(pos, 0, max(src.shape[0] - 1, 0)), axis=0) if src.shape[0] else jnp.zeros_like(pos, x.dtype)
    return jnp.where(flat_mask, vals.astype(x.dtype), x.reshape(-1)).reshape(x.shape)
