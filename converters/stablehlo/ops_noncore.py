"""Non-core ATen ops (torch's "composite" ops) lowered whole, as they appear in torch.export's graph.

(Not the litert converter's ``@composite`` builders: those are ops written in torch ops and traced.)

When every op of an exported graph has a rule, capture skips the decomposition to core ATen,
a full retrace that costs more than the export itself; the rules here cover the ops common
models produce (conv2d, linear, batch_norm, layer_norm, ...). Each reads like the op's
definition and reuses the core rules.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import torch

from . import ops_nn, ops_shape
from .registry import lowers

aten = torch.ops.aten


def _tuple(v, n):
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


def _same_padding(x, w, stride, dilation):
    nd = x.ndim - 2
    pads = []
    for k, d in zip(w.shape[2:], _tuple(dilation, nd)):
        total = d * (k - 1)
        pads.append((total // 2, total - total // 2))
    return pads


@lowers(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
        aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)
def conv_nd(ctx, x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    nd = w.ndim - 2
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    if isinstance(padding, str):
        if padding == "valid":
            out = ops_nn.conv(x, w, bias, _tuple(stride, nd), [0] * nd, _tuple(dilation, nd), False, [0], groups)
        else:  # "same" (stride 1): torch pads the extra element on the right
            pads = _same_padding(x, w, stride, dilation)
            x = jnp.pad(x, [(0, 0), (0, 0)] + pads)
            out = ops_nn.conv(x, w, bias, _tuple(stride, nd), [0] * nd, _tuple(dilation, nd), False, [0], groups)
    else:
        out = ops_nn.conv(x, w, bias, _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd), False, [0],
                          groups)
    return out[0] if unbatched else out


@lowers(aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
def conv_transpose_nd(ctx, x, w, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    nd = w.ndim - 2
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    out = ops_nn.conv(x, w, bias, _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd), True,
                      _tuple(output_padding, nd), groups)
    return out[0] if unbatched else out


@lowers(aten.linear.default)
def linear(ctx, x, w, bias=None):
    out = jnp.matmul(x, w.T, preferred_element_type=ops_nn.acc_dtype(x.dtype)).astype(x.dtype)
    return out if bias is None else out + bias


@lowers(aten.batch_norm.default)
def batch_norm(ctx, x, w, b, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    if training or running_mean is None:
        mean, var = ops_nn.batch_stats(x)
    else:
        mean, var = running_mean, running_var
    return ops_nn.normalize_batch(x, w, b, mean, var, eps)


@lowers(aten.layer_norm.default)
def layer_norm(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return ops_nn.native_layer_norm(ctx, x, normalized_shape, weight, bias, eps)[0]


@lowers(aten.group_norm.default)
def group_norm(ctx, x, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    return ops_nn.native_group_norm(ctx, x, weight, bias, x.shape[0], x.shape[1], None, num_groups, eps)[0]


@lowers(aten.max_pool2d.default)
def max_pool2d(ctx, x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return ops_nn.max_pool_values(x, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lowers(aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default)
def adaptive_avg_pool(ctx, x, output_size):
    return ops_nn.adaptive_avg_pool(x, list(output_size))


# ---- activations ---------------------------------------------------------------------------

@lowers(aten.silu.default)
def silu(ctx, x):
    return jax.nn.silu(x)


@lowers(aten.hardswish.default)
def hardswish(ctx, x):
    return x * jnp.clip(x + 3, 0, 6) / 6


@lowers(aten.hardsigmoid.default)
def hardsigmoid(ctx, x):
    return jnp.clip(x + 3, 0, 6) / 6


@lowers(aten.relu6.default)
def relu6(ctx, x):
    return jnp.clip(x, 0, 6)


@lowers(aten.softmax.int)
def softmax(ctx, x, dim, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    return jax.nn.softmax(x, axis=dim % max(x.ndim, 1)) if x.ndim else jnp.ones_like(x)


@lowers(aten.log_softmax.int)
def log_softmax(ctx, x, dim, dtype=None):
    x = ctx.cast(x, ctx.out_dtype())
    return jax.nn.log_softmax(x, axis=dim % max(x.ndim, 1)) if x.ndim else jnp.zeros_like(x)


@lowers(aten.rsub.Scalar, aten.rsub.Tensor)
def rsub(ctx, x, other, alpha=1):
    dt = ctx.promoted_dtype()
    x, other = ctx.cast(jnp.asarray(x), dt), ctx.cast(jnp.asarray(other), dt)
    return other - (x if alpha == 1 else x * jnp.asarray(alpha, dt))


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(ctx, x, mask, value):
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


# ---- shapes --------------------------------------------------------------------------------

@lowers(aten.reshape.default)
def reshape(ctx, x, shape):
    return jnp.reshape(x, tuple(shape))


@lowers(aten.flatten.using_ints)
def flatten(ctx, x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return x.reshape(1)
    start, end = start_dim % x.ndim, end_dim % x.ndim
    return jnp.reshape(x, x.shape[:start] + (-1,) + x.shape[end + 1:])


@lowers(aten.unflatten.int)
def unflatten(ctx, x, dim, sizes):
    dim = dim % x.ndim
    return jnp.reshape(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1:])


@lowers(aten.transpose.int)
def transpose(ctx, x, dim0, dim1):
    return jnp.swapaxes(x, dim0, dim1) if x.ndim else x


@lowers(aten.t.default)
def t(ctx, x):
    return x.T


@lowers(aten.contiguous.default, aten.lift_fresh_copy.default)
def identity(ctx, x, *args, **kwargs):
    return x


@lowers(aten.split.Tensor)
def split(ctx, x, split_size, dim=0):
    dim = dim % x.ndim
    n = x.shape[dim]
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] or [0]
    return ops_shape.split_with_sizes(ctx, x, sizes, dim)


@lowers(aten.chunk.default)
def chunk(ctx, x, chunks, dim=0):
    n = x.shape[dim % x.ndim]
    return split(ctx, x, -(-n // chunks), dim)


@lowers(aten.unbind.int)
def unbind(ctx, x, dim=0):
    dim = dim % x.ndim
    return [lax.index_in_dim(x, i, axis=dim, keepdims=False) for i in range(x.shape[dim])]


@lowers(aten.stack.default)
def stack(ctx, tensors, dim=0):
    dt = ctx.out_dtype()
    return jnp.stack([ctx.cast(t, dt) for t in tensors], axis=dim % (tensors[0].ndim + 1))


@lowers(aten.repeat_interleave.self_int)
def repeat_interleave(ctx, x, repeats, dim=None, *, output_size=None):
    if dim is None:
        return jnp.repeat(x.reshape(-1), repeats)
    return jnp.repeat(x, repeats, axis=dim % x.ndim)


@lowers(aten.expand_as.default)
def expand_as(ctx, x, other):
    return jnp.broadcast_to(x, other.shape)


@lowers(aten.matmul.default)
def matmul(ctx, a, b):
    return jnp.matmul(a, b, preferred_element_type=ops_nn.acc_dtype(a.dtype)).astype(ctx.out_dtype())


@lowers(aten.index_copy.default)
def index_copy(ctx, x, dim, index, source):
    if x.ndim == 0:  # a 0-d tensor is its one element: the only valid index (0) replaces it
        return source.astype(x.dtype).reshape(())
    dim = dim % x.ndim
    idx = [slice(None)] * x.ndim
    idx[dim] = index
    return x.at[tuple(idx)].set(source.astype(x.dtype))


@lowers(aten.pad.default)
def pad(ctx, x, pad, mode="constant", value=None):
    if mode == "constant":
        return ops_shape.constant_pad_nd(ctx, x, pad, 0 if value is None else value)
    n = len(pad) // 2
    widths = [(0, 0)] * (x.ndim - n) + [(pad[2 * (n - 1 - i)], pad[2 * (n - 1 - i) + 1]) for i in range(n)]
    if mode == "replicate" and any(lo < 0 or hi < 0 for lo, hi in widths):
        # a negative width crops, and jnp.pad takes none: output i reads input clip(i - lo) along each dim
        for d, (lo, hi) in enumerate(widths):
            if lo or hi:
                x = jnp.take(x, np.clip(np.arange(x.shape[d] + lo + hi) - lo, 0, x.shape[d] - 1), axis=d)
        return x
    return jnp.pad(x, widths, mode={"reflect": "reflect", "replicate": "edge", "circular": "wrap"}[mode])


# ---- creation and casts --------------------------------------------------------------------

@lowers(aten.arange.default, aten.arange.start)
def arange(ctx, *args, **kwargs):
    start, end = (0, args[0]) if len(args) == 1 else args[:2]
    return ops_shape.arange(ctx, start, end, 1)


@lowers(aten.to.dtype, aten.to.dtype_layout, aten.type_as.default)
def to_dtype(ctx, x, *args, **kwargs):
    return ctx.cast(x, ctx.out_dtype())


@lowers(aten.zeros.default, aten.ones.default)
def zeros_ones(ctx, size, **kwargs):
    fill = 1 if ctx.node.target is aten.ones.default else 0
    return jnp.full(tuple(size), fill, ctx.out_dtype())


@lowers(aten.zeros_like.default, aten.ones_like.default)
def zeros_ones_like(ctx, x, **kwargs):
    fill = 1 if ctx.node.target is aten.ones_like.default else 0
    return jnp.full(x.shape, fill, ctx.out_dtype())


@lowers(aten.sum.default)
def sum_all(ctx, x, *, dtype=None):
    return jnp.sum(ctx.cast(x, ctx.out_dtype()))


@lowers(aten._trilinear.default)
def trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over ``sumdim`` of i1 * i2 * i3, each first unsqueezed at its ``expand`` dims (bilinear's kernel)."""
    def unsqueeze(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x
    dt = ctx.out_dtype()
    prod = unsqueeze(ctx.cast(i1, dt), expand1) * unsqueeze(ctx.cast(i2, dt), expand2) * unsqueeze(ctx.cast(i3, dt), expand3)
    return jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod
