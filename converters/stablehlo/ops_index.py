"""Indexing: gather/scatter, index/index_put, select/slice scatter, masked scatter."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import torch

from torchtpu_export.fxnodes import op_name, user_source_line
from torchtpu_export.errors import UnsupportedOpError

from .registry import Ragged, lowers

aten = torch.ops.aten


def _wrap(index, size):
    return jnp.where(index < 0, index + size, index)


def _data_dependent(ctx, what: str):
    return UnsupportedOpError(op_name(ctx.node.target), target="stablehlo", source=user_source_line(ctx.node),
                              reason=f"{what}: the result's shape depends on how many mask entries are true")


@lowers(aten.index.Tensor)
def index(ctx, x, indices):
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        if len(indices) != 1:
            raise _data_dependent(ctx, "indexing with a boolean mask next to other indices")
        # x[mask]: the selected rows padded to mask.size, valid only as a program output
        mask = indices[0]
        rows = jnp.nonzero(mask, size=mask.size, fill_value=0)
        return Ragged(x[rows], jnp.sum(mask, dtype=jnp.int64))
    idx = tuple(slice(None) if i is None else _wrap(i, x.shape[d]) for d, i in enumerate(indices))
    return x[idx]


@lowers(aten.index_put.default)
def index_put(ctx, x, indices, values, accumulate=False):
    values = ctx.cast(values, x.dtype)
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        return _masked_put(ctx, x, indices, values, accumulate)
    idx = tuple(slice(None) if i is None else _wrap(i, x.shape[d]) for d, i in enumerate(indices))
    return x.at[idx].add(values) if accumulate else x.at[idx].set(values)


def _masked_put(ctx, x, indices, values, accumulate):
    """``x[mask] = values`` (or ``+=``) as a select: the mask covers the dims after the leading Nones."""
    lead = 0
    while indices[lead] is None:
        lead += 1
    mask = indices[lead]
    if mask.dtype != jnp.bool_ or any(i is not None for i in indices[lead + 1:]):
        raise _data_dependent(ctx, "index_put mixing a boolean mask with other index tensors")
    rest = x.ndim - lead - mask.ndim
    m = mask.reshape((1,) * lead + mask.shape + (1,) * rest)
    # values broadcast against (x.shape[:lead], number of true entries, x.shape[lead + mask.ndim:])
    if values.ndim <= rest or values.shape[values.ndim - rest - 1] == 1:
        v = values.reshape(values.shape[:values.ndim - rest - 1] + (1,) * mask.ndim + values.shape[values.ndim - rest:]) \
            if values.ndim > rest else values
        v = jnp.broadcast_to(v, x.shape)
    elif lead == 0:
        # one value row per true entry, in order
        pos = jnp.cumsum(mask.reshape(-1).astype(jnp.int32)) - 1
        rows = values.reshape((values.shape[0],) + x.shape[mask.ndim:])
        v = jnp.take(rows, jnp.clip(pos, 0, rows.shape[0] - 1), axis=0).reshape(x.shape)
    else:
        raise _data_dependent(ctx, "index_put with a boolean mask after a slice and per-entry values")
    return jnp.where(m, x + v, x) if accumulate else jnp.where(m, v, x)


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


@lowers(aten.nonzero.default)
def nonzero(ctx, x):
    """Row count depends on the values: padded to x.size rows, valid only as a program output."""
    if x.ndim == 0:
        return Ragged(jnp.zeros((1, 0), ctx.out_dtype()), (x != 0).astype(jnp.int64))
    idx = jnp.nonzero(x, size=x.size, fill_value=0)
    return Ragged(jnp.stack(idx, axis=-1).astype(ctx.out_dtype()), jnp.sum(x != 0, dtype=jnp.int64))


@lowers(aten.nonzero_static.default)
def nonzero_static(ctx, x, *, size, fill_value=-1):
    if x.ndim == 0:
        return jnp.zeros((size, 0), ctx.out_dtype())
    idx = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(idx, axis=-1).astype(ctx.out_dtype())


def _searchsorted(boundaries, values, right, out_dtype):
    side = "right" if right else "left"
    if boundaries.ndim <= 1:
        return jnp.searchsorted(boundaries, values, side=side).astype(out_dtype)
    # one sorted row per leading index of values
    lead = boundaries.shape[:-1]
    rows = jax.vmap(lambda b, v: jnp.searchsorted(b, v, side=side))(
        boundaries.reshape((-1, boundaries.shape[-1])), values.reshape((-1, values.shape[-1])))
    return rows.reshape(lead + values.shape[-1:]).astype(out_dtype)


@lowers(aten.searchsorted.Tensor)
def searchsorted(ctx, sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    return _searchsorted(sorted_sequence, values, right or side == "right", ctx.out_dtype())


@lowers(aten.bucketize.Tensor)
def bucketize(ctx, values, boundaries, *, out_int32=False, right=False):
    return _searchsorted(boundaries, values, right, ctx.out_dtype())


@lowers(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(ctx, x, dim, index, src, *, reduce):
    # the older scatter(reduce=) form: "add" or "multiply" into self
    if x.ndim == 0:
        x1 = scatter_reduce_legacy(ctx, x.reshape(1), 0, index.reshape(-1), jnp.asarray(src).reshape(-1)
                                   if jnp.ndim(src) else src, reduce=reduce)
        return x1.reshape(())
    grid = _grid(_wrap(index, x.shape[dim]), dim)
    src = _src_like(src, index, x.dtype)
    if reduce == "add":
        return x.at[grid].add(src)
    if reduce == "multiply":
        return x.at[grid].multiply(src)
    raise ValueError(f"unknown reduce {reduce!r}")


@lowers(aten.put.default)
def put(ctx, x, index, source, accumulate=False):
    flat = jnp.reshape(x, (-1,))
    index = _wrap(index.reshape(-1), flat.shape[0])
    source = ctx.cast(source, x.dtype).reshape(-1)
    flat = flat.at[index].add(source) if accumulate else flat.at[index].set(source)
    return flat.reshape(x.shape)


@lowers(aten.index_reduce.default)
def index_reduce(ctx, x, dim, index, source, reduce, *, include_self=True):
    # index_reduce is scatter_reduce with the 1-D index spread over the source's other dims
    if x.ndim == 0:
        return scatter_reduce(ctx, x, 0, index.reshape(-1), source.reshape(-1), reduce, include_self=include_self)
    dim = dim % x.ndim
    shape = [1] * source.ndim
    shape[dim] = index.shape[0]
    full_index = jnp.broadcast_to(index.reshape(shape), source.shape)
    return scatter_reduce(ctx, x, dim, full_index, source, reduce, include_self=include_self)


@lowers(aten.masked_select.default)
def masked_select(ctx, x, mask):
    # the selected elements padded to the broadcast size, valid only as a program output (like x[mask])
    x, mask = jnp.broadcast_arrays(x, mask)
    flat, m = x.reshape(-1), mask.reshape(-1)
    rows = jnp.nonzero(m, size=m.size, fill_value=0)
    return Ragged(flat[rows], jnp.sum(m, dtype=jnp.int64))


def _unique_runs(flat, sorted_order):
    """Unique values of runs of equal neighbours in ``flat`` (already in the order to scan), padded to
    flat.size, with each element's run id and each run's length."""
    n = flat.shape[0]
    new = jnp.concatenate([jnp.ones((min(n, 1),), jnp.bool_), flat[1:] != flat[:-1]])
    run = jnp.cumsum(new.astype(jnp.int32)) - 1
    values = jnp.zeros((n,), flat.dtype).at[run].set(flat)
    counts = jnp.zeros((n,), jnp.int32).at[run].add(1)
    inverse = run if sorted_order is None else jnp.zeros((n,), jnp.int32).at[sorted_order].set(run)
    return values, inverse, counts, jnp.sum(new, dtype=jnp.int64)


def _unique_outputs(ctx, x, values, inverse, counts, k, return_inverse, return_counts):
    inverse = inverse.reshape(x.shape) if return_inverse else jnp.zeros(ctx.out_shape(1), jnp.int32)
    counts = Ragged(counts, k) if return_counts else jnp.zeros(ctx.out_shape(2), jnp.int32)
    return Ragged(values, k), inverse, counts


@lowers(aten._unique2.default)
def unique2(ctx, x, sorted=True, return_inverse=False, return_counts=False):
    # sorted ascending whatever ``sorted`` says (torch's CPU kernel sorts too)
    flat = x.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    values, inverse, counts, k = _unique_runs(flat[order], order)
    return _unique_outputs(ctx, x, values, inverse, counts, k, return_inverse, return_counts)


@lowers(aten.unique_consecutive.default)
def unique_consecutive(ctx, x, return_inverse=False, return_counts=False, dim=None):
    if dim is not None:
        raise NotImplementedError("unique_consecutive along a dim")
    values, inverse, counts, k = _unique_runs(x.reshape(-1), None)
    return _unique_outputs(ctx, x, values, inverse, counts, k, return_inverse, return_counts)
