"""Views, layout, concatenation, padding and tensor creation."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import torch

from torchtpu_export.fxnodes import op_name, user_source_line
from torchtpu_export.errors import UnsupportedOpError

from .registry import lookup, lowers

aten = torch.ops.aten


def _shape(size) -> tuple:
    return tuple(size)


@lowers(aten.view.default)
def view(ctx, x, size):
    return jnp.reshape(x, _shape(size))


@lowers(aten.permute.default)
def permute(ctx, x, dims):
    return jnp.transpose(x, [d % x.ndim for d in dims]) if x.ndim else x


@lowers(aten.expand.default)
def expand(ctx, x, size, *, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if (s == -1 and i >= lead) else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@lowers(aten.unsqueeze.default)
def unsqueeze(ctx, x, dim):
    return jnp.expand_dims(x, dim % (x.ndim + 1))


@lowers(aten.squeeze.dim)
def squeeze_dim(ctx, x, dim):
    return squeeze_dims(ctx, x, [dim])


@lowers(aten.squeeze.dims)
def squeeze_dims(ctx, x, dims):
    if x.ndim == 0:
        return x
    axes = tuple(sorted({d % x.ndim for d in dims if x.shape[d % x.ndim] == 1}))
    return jnp.squeeze(x, axes) if axes else x


@lowers(aten.cat.default)
def cat(ctx, tensors, dim=0):
    # torch skips legacy empty 1-d tensors next to higher-rank ones
    ranked = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors)
    dt = ctx.out_dtype()
    ranked = [ctx.cast(t, dt) for t in ranked]
    return jnp.concatenate(ranked, axis=dim % ranked[0].ndim)


def _slice_bounds(size, start, end, step):
    start = 0 if start is None else start
    end = size if end is None else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, step


@lowers(aten.slice.Tensor)
def slice_(ctx, x, dim=0, start=None, end=None, step=1):
    if isinstance(start, jax.core.Tracer) or isinstance(end, jax.core.Tracer):
        raise UnsupportedOpError(op_name(ctx.node.target), target="stablehlo", source=user_source_line(ctx.node),
                                 reason="its bounds come from tensor values, so its shape depends on the data")
    dim = dim % x.ndim
    size = x.shape[dim]
    if isinstance(size, int) and (start is None or isinstance(start, int)) and (end is None or isinstance(end, int)):
        start, end, step = _slice_bounds(size, start, end, step)
        if start == 0 and end == size and step == 1:
            return x
        return lax.slice_in_dim(x, start, end, step, axis=dim)
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


@lowers(aten.select.int)
def select(ctx, x, dim, index):
    dim = dim % x.ndim
    return lax.index_in_dim(x, index % x.shape[dim] if isinstance(index, int) else index, axis=dim, keepdims=False)


@lowers(aten.split_with_sizes.default)
def split_with_sizes(ctx, x, split_sizes, dim=0):
    dim = dim % x.ndim
    offsets = np.cumsum([0] + list(split_sizes))
    return [lax.slice_in_dim(x, int(a), int(b), axis=dim) for a, b in zip(offsets[:-1], offsets[1:])]


@lowers(aten.repeat.default)
def repeat(ctx, x, repeats):
    x = jnp.reshape(x, (1,) * (len(repeats) - x.ndim) + x.shape)
    return jnp.tile(x, tuple(repeats))


@lowers(aten.flip.default)
def flip(ctx, x, dims):
    return jnp.flip(x, [d % x.ndim for d in dims]) if dims and x.ndim else x


@lowers(aten.diagonal.default)
def diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, dim1 % x.ndim, dim2 % x.ndim)


@lowers(aten.as_strided.default)
def as_strided(ctx, x, size, stride, storage_offset=None):
    # Our tensors are contiguous: read element (offset + sum(i_k * stride_k)) of the flat input.
    return jnp.take(jnp.reshape(x, (-1,)), jnp.asarray(_strided_index(size, stride, storage_offset)), axis=0)


lowers(aten.as_strided_copy.default)(as_strided)


def _strided_index(size, stride, storage_offset) -> np.ndarray:
    """The flat element index of every entry of an as_strided view of a contiguous tensor."""
    index = np.full(tuple(size), storage_offset or 0, dtype=np.int64)
    for axis, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = n
        index = index + (np.arange(n) * s).reshape(shape)
    return index.astype(np.int32)


@lowers(aten.as_strided_scatter.default)
def as_strided_scatter(ctx, x, src, size, stride, storage_offset=None):
    index = jnp.asarray(_strided_index(size, stride, storage_offset))
    flat = jnp.reshape(x, (-1,)).at[index].set(ctx.cast(src, x.dtype).reshape(index.shape))
    return flat.reshape(x.shape)


@lowers(aten.diagonal_scatter.default)
def diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    index = np.diagonal(np.arange(x.size, dtype=np.int32).reshape(x.shape), offset, dim1 % x.ndim, dim2 % x.ndim)
    flat = jnp.reshape(x, (-1,)).at[jnp.asarray(index)].set(ctx.cast(src, x.dtype).reshape(index.shape))
    return flat.reshape(x.shape)


@lowers(aten.alias.default, aten.clone.default)
def identity(ctx, x, **kwargs):
    return x


@lowers(aten.copy.default)
def copy(ctx, x, src, non_blocking=False):
    return jnp.broadcast_to(ctx.cast(src, x.dtype), x.shape)


@lowers(aten._to_copy.default, torch.ops.prims.convert_element_type.default)
def to_copy(ctx, x, *args, **kwargs):
    # prims.convert_element_type(x, dtype): what some decompositions (renorm's, in bfloat16) leave
    return ctx.cast(x, ctx.out_dtype())


@lowers(aten.constant_pad_nd.default)
def constant_pad_nd(ctx, x, pad, value=0):
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        axis = x.ndim - 1 - i
        config[axis] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(x, jnp.asarray(value, x.dtype), config)


def _mode_pad(mode):
    def rule(ctx, x, padding):
        n = len(padding) // 2
        widths = [(0, 0)] * (x.ndim - n) + [(padding[2 * (n - 1 - i)], padding[2 * (n - 1 - i) + 1]) for i in range(n)]
        # like torch: pad by the positive widths, then crop by the negative ones
        out = jnp.pad(x, [(max(lo, 0), max(hi, 0)) for lo, hi in widths], mode=mode)
        crop = tuple(slice(-min(lo, 0), out.shape[d] + min(hi, 0)) for d, (lo, hi) in enumerate(widths))
        return out[crop]
    return rule


lowers(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)(_mode_pad("reflect"))
lowers(aten.replication_pad2d.default, aten.replication_pad3d.default)(_mode_pad("edge"))


@lowers(aten.full.default)
def full(ctx, size, fill_value, **kwargs):
    return jnp.full(_shape(size), fill_value, ctx.out_dtype())


@lowers(aten.full_like.default)
def full_like(ctx, x, fill_value, **kwargs):
    return jnp.full(x.shape, fill_value, ctx.out_dtype())


@lowers(aten.fill.Scalar)
def fill(ctx, x, value):
    return jnp.full(x.shape, value, x.dtype)


@lowers(aten.empty.memory_format)
def empty(ctx, size, **kwargs):
    return jnp.zeros(_shape(size), ctx.out_dtype())


@lowers(aten.empty_strided.default)
def empty_strided(ctx, size, stride, **kwargs):
    return jnp.zeros(_shape(size), ctx.out_dtype())


@lowers(aten.new_empty_strided.default)
def new_empty_strided(ctx, x, size, stride, **kwargs):
    return jnp.zeros(_shape(size), ctx.out_dtype())


@lowers(aten.scalar_tensor.default)
def scalar_tensor(ctx, s, **kwargs):
    return jnp.asarray(s, ctx.out_dtype())


@lowers(aten.arange.start_step)
def arange(ctx, start, end, step=1, **kwargs):
    dt = ctx.out_dtype()
    n = ctx.out_shape()[0]
    if not isinstance(n, int):
        return jnp.arange(start, end, step, dtype=dt)
    # like torch: start + i * step, accumulated in double for floating outputs
    acc = jnp.float64 if jnp.issubdtype(dt, jnp.floating) and not ctx.narrow_64bit else dt
    return (jnp.asarray(start, acc) + jnp.arange(n, dtype=acc) * jnp.asarray(step, acc)).astype(dt)


@lowers(aten.resize_.default, aten.resize.default)
def resize_(ctx, x, size, memory_format=None):
    # new elements are uninitialised memory in torch; here they are zeros
    n = math.prod(size)
    flat = jnp.reshape(x, (-1,))
    flat = flat[:n] if flat.shape[0] >= n else jnp.concatenate([flat, jnp.zeros((n - flat.shape[0],), x.dtype)])
    return jnp.reshape(flat, _shape(size))


@lowers(aten.unfold.default)
def unfold(ctx, x, dimension, size, step):
    """Windows of ``size`` every ``step`` along ``dimension``, as a new last dim (Tensor.unfold)."""
    if x.ndim == 0:
        return x.reshape((1,))
    dim = dimension % x.ndim
    n = (x.shape[dim] - size) // step + 1
    index = (np.arange(n)[:, None] * step + np.arange(size)[None, :]).astype(np.int32)
    windows = jnp.take(x, jnp.asarray(index.reshape(-1)), axis=dim)
    windows = windows.reshape(x.shape[:dim] + (n, size) + x.shape[dim + 1:])
    return jnp.moveaxis(windows, dim + 1, -1)


# ---- the *_copy variants of views: without aliasing, a view and its copy are the same value -----

def _as(view_op):
    """The rule of ``view_op``, wherever it is registered (looked up when the copy is lowered)."""
    def rule(ctx, *args, **kwargs):
        return lookup(view_op, ctx.platform)(ctx, *args, **kwargs)
    return rule


lowers(aten.view_copy.default)(view)
lowers(aten.permute_copy.default)(permute)
for _copy, _view in ((aten.select_copy.int, aten.select.int), (aten.slice_copy.Tensor, aten.slice.Tensor),
                     (aten.split_copy.Tensor, aten.split.Tensor),
                     (aten.split_with_sizes_copy.default, aten.split_with_sizes.default),
                     (aten.squeeze_copy.dim, aten.squeeze.dim), (aten.squeeze_copy.dims, aten.squeeze.dims),
                     (aten.t_copy.default, aten.t.default), (aten.transpose_copy.int, aten.transpose.int),
                     (aten.unsqueeze_copy.default, aten.unsqueeze.default), (aten.expand_copy.default, aten.expand.default),
                     (aten.diagonal_copy.default, aten.diagonal.default), (aten.alias_copy.default, aten.alias.default),
                     (aten.unfold_copy.default, aten.unfold.default)):
    lowers(_copy)(_as(_view))


@lowers(aten.squeeze.default, aten.squeeze_copy.default)
def squeeze_all(ctx, x):
    return jnp.reshape(x, tuple(d for d in x.shape if d != 1))


@lowers(aten.detach.default, aten.detach_copy.default)
def detach(ctx, x):
    return x


@lowers(aten.narrow_copy.default)
def narrow_copy(ctx, x, dim, start, length):
    dim = dim % x.ndim
    start = start % x.shape[dim] if start < 0 else start
    return lax.slice_in_dim(x, start, start + length, axis=dim)


@lowers(aten.unbind_copy.int)
def unbind_copy(ctx, x, dim=0):
    dim = dim % x.ndim
    return [lax.index_in_dim(x, i, axis=dim, keepdims=False) for i in range(x.shape[dim])]


@lowers(aten.empty_permuted.default)
def empty_permuted(ctx, size, physical_layout, **kwargs):
    # the layout is a memory order only; values are uninitialised in torch, zeros here
    return jnp.zeros(_shape(size), ctx.out_dtype())


def _tri_indices(np_fn):
    def rule(ctx, row, col, offset=0, **kwargs):
        r, c = np_fn(row, offset, col)
        return jnp.asarray(np.stack([r, c]).reshape(2, -1), ctx.out_dtype())
    return rule


lowers(aten.tril_indices.default)(_tri_indices(np.tril_indices))
lowers(aten.triu_indices.default)(_tri_indices(np.triu_indices))
