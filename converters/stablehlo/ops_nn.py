"""Neural-network ops: matmuls, convolution, normalisation, pooling, resampling, embeddings."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import torch

from torchtpu_export.converters.torch_semantics import antialiased_linear_resize_matrix, linear_resize_matrix

from .registry import lowers

aten = torch.ops.aten


# ---- matmuls -------------------------------------------------------------------------------

@lowers(aten.mm.default, aten.bmm.default)
def matmul(ctx, a, b):
    return jnp.matmul(a, b, preferred_element_type=acc_dtype(a.dtype)).astype(ctx.out_dtype())


@lowers(aten.addmm.default)
def addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    out = jnp.matmul(a, b, preferred_element_type=acc_dtype(a.dtype))
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out.astype(ctx.out_dtype())
    return (out + (bias if beta == 1 else bias * beta)).astype(ctx.out_dtype())


def acc_dtype(dtype):
    """The dtype ``dtype`` math accumulates in: low-precision floats in f32, like torch's CPU and XLA's
    TPU kernels."""
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def half_rounding(dtype):
    """``r(v)``: a float32 value rounded to ``dtype`` when that is float16/bfloat16 (identity
    otherwise), for lowerings that follow torch kernels which round every step to the half type.
    ``reduce_precision`` is an op of its own, so XLA keeps each rounding (excess precision does not
    remove it)."""
    if acc_dtype(dtype) == dtype:
        return lambda v: v
    finfo = jnp.finfo(dtype)
    return lambda v: lax.reduce_precision(v, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)


# ---- convolution ---------------------------------------------------------------------------

def _dimension_numbers(nd: int):
    spatial = "DHW"[3 - nd:] if nd <= 3 else None
    return (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")


def conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    stride, padding, dilation = (list(v) * nd if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    if not transposed:
        out = lax.conv_general_dilated(x, w, window_strides=stride, padding=[(p, p) for p in padding],
                                       rhs_dilation=dilation, dimension_numbers=_dimension_numbers(nd),
                                       feature_group_count=groups, preferred_element_type=acc_dtype(x.dtype))
    else:
        output_padding = list(output_padding) * nd if len(output_padding) == 1 else list(output_padding)
        # (Cin, Cout/g, *k) -> (Cout, Cin/g, *k), spatially flipped: a transposed conv is a conv over
        # the input dilated by the stride.
        cin, cout_g = w.shape[:2]
        k = w.shape[2:]
        w = w.reshape((groups, cin // groups, cout_g) + k)
        w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
        w = jnp.flip(w, axis=tuple(range(2, 2 + nd)))
        pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op) for kk, d, p, op in zip(k, dilation, padding, output_padding)]
        out = lax.conv_general_dilated(x, w, window_strides=[1] * nd, padding=pads, lhs_dilation=stride,
                                       rhs_dilation=dilation, dimension_numbers=_dimension_numbers(nd),
                                       feature_group_count=groups, preferred_element_type=acc_dtype(x.dtype))
    out = out.astype(x.dtype)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nd)
    return out


@lowers(aten.convolution.default)
def convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    return conv(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)


# ---- normalisation -------------------------------------------------------------------------

def _bcast_channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def normalize_batch(x, w, b, mean, var, eps):
    """Batch norm of NC... ``x`` with the given per-channel statistics (and optional affine ``w``, ``b``)."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    inv = lax.rsqrt(var.astype(acc) + eps)
    out = (xf - _bcast_channel(mean.astype(acc), x.ndim)) * _bcast_channel(inv, x.ndim)
    if w is not None:
        out = out * _bcast_channel(w.astype(acc), x.ndim)
    if b is not None:
        out = out + _bcast_channel(b.astype(acc), x.ndim)
    return out.astype(x.dtype)


@lowers(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference(ctx, x, w, b, running_mean, running_var, momentum, eps):
    empty = jnp.zeros((0,), x.dtype)
    return normalize_batch(x, w, b, running_mean, running_var, eps), empty, empty


def batch_stats(x):
    """The per-channel mean and (biased) variance of NC... ``x``, in its accumulation dtype."""
    axes = (0,) + tuple(range(2, x.ndim))
    xf = x.astype(acc_dtype(x.dtype))
    return jnp.mean(xf, axis=axes), jnp.var(xf, axis=axes)


@lowers(aten._native_batch_norm_legit.default)
def batch_norm_training(ctx, x, w, b, running_mean, running_var, training, momentum, eps):
    if not training:
        return batch_norm_inference(ctx, x, w, b, running_mean, running_var, momentum, eps)
    mean, var = batch_stats(x)
    return normalize_batch(x, w, b, mean, var, eps), mean, lax.rsqrt(var + eps)


@lowers(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(ctx, x, w, b, running_mean, running_var, training, momentum, eps):
    """Batch norm that returns the updated running stats (torch.export's form of training-mode batch norm)."""
    if not training:
        out, save_mean, save_rstd = batch_norm_inference(ctx, x, w, b, running_mean, running_var, momentum, eps)
        return out, save_mean, save_rstd, running_mean, running_var
    mean, var = batch_stats(x)
    n = x.size // x.shape[1]
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean.astype(running_mean.dtype)
    new_var = (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype)
    return normalize_batch(x, w, b, mean, var, eps), mean, lax.rsqrt(var + eps), new_mean, new_var


@lowers(aten._batch_norm_with_update_functional.default)
def batch_norm_with_update(ctx, x, w, b, running_mean, running_var, momentum, eps):
    """Training batch norm, the form torch's _batch_norm_with_update takes: no reserve on this backend."""
    out, mean, rstd, new_mean, new_var = batch_norm_functional(ctx, x, w, b, running_mean, running_var, True,
                                                               momentum, eps)
    return out, mean, rstd, jnp.zeros((0,), jnp.uint8), new_mean, new_var


@lowers(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(ctx, x, w, b, training, momentum, eps):
    mean, var = batch_stats(x)
    return normalize_batch(x, w, b, mean, var, eps), mean, lax.rsqrt(var + eps)


@lowers(aten.native_layer_norm.default)
def native_layer_norm(ctx, x, normalized_shape, w, b, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(acc_dtype(x.dtype))
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = (xf - mean) * rstd
    if w is not None:
        out = out * w.astype(out.dtype)
    if b is not None:
        out = out + b.astype(out.dtype)
    return out.astype(x.dtype), mean, rstd


@lowers(aten.native_group_norm.default)
def native_group_norm(ctx, x, w, b, n, c, hxw, group, eps):
    xf = x.astype(acc_dtype(x.dtype)).reshape((x.shape[0], group, -1))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    rstd = lax.rsqrt(var + eps)
    out = ((xf - mean) * rstd).reshape(x.shape)
    if w is not None:
        out = out * _bcast_channel(w, x.ndim)
    if b is not None:
        out = out + _bcast_channel(b, x.ndim)
    return out.astype(x.dtype), mean.reshape((x.shape[0], group)), rstd.reshape((x.shape[0], group))


# ---- pooling -------------------------------------------------------------------------------

def pool_output_size(size, k, s, p, d, ceil_mode):
    eff = d * (k - 1) + 1
    num = size + 2 * p - eff
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:  # the last window must start inside the input or left pad
        out -= 1
    return out


def _expand(v, nd, default=None):
    v = list(v) if v is not None and len(v) else list(default)
    return v * nd if len(v) == 1 else v


def _window_geometry(x, nd, kernel, stride, padding, dilation, ceil_mode):
    kernel = _expand(kernel, nd)
    stride = _expand(stride, nd, kernel)
    padding = _expand(padding, nd, [0])
    dilation = _expand(dilation, nd, [1])
    spatial = x.shape[-nd:]
    out = [pool_output_size(n, k, s, p, d, ceil_mode) for n, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)]
    # right padding that covers the last (ceil-mode) window
    hi = [max((o - 1) * s + d * (k - 1) + 1 - n - p, 0) for o, s, d, k, n, p in
          zip(out, stride, dilation, kernel, spatial, padding)]
    return kernel, stride, padding, dilation, out, hi


def max_pool_values(x, nd, kernel, stride, padding, dilation, ceil_mode):
    """The values of an N-d max pool: one reduce_window (fast), for graphs that never read the indices."""
    kernel, stride, padding, dilation, out, hi = _window_geometry(x, nd, kernel, stride, padding, dilation, ceil_mode)
    lead = x.ndim - nd
    low = jnp.array(-jnp.inf, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else \
        jnp.array(jnp.iinfo(x.dtype).min, x.dtype)
    return lax.reduce_window(x, low, lax.max, (1,) * lead + tuple(kernel), (1,) * lead + tuple(stride),
                             [(0, 0)] * lead + [(p, h) for p, h in zip(padding, hi)],
                             window_dilation=(1,) * lead + tuple(dilation))


def max_pool(x, nd, kernel, stride, padding, dilation, ceil_mode):
    """Values and flat indices (within each spatial plane) of an N-d max pool, like torch."""
    kernel, stride, padding, dilation, out, hi = _window_geometry(x, nd, kernel, stride, padding, dilation, ceil_mode)
    spatial = x.shape[-nd:]
    # Static gather: for each output position and window offset, the input position (or -1 for padding).
    grids = np.meshgrid(*[np.arange(o) for o in out], indexing="ij")
    offs = np.meshgrid(*[np.arange(k) for k in kernel], indexing="ij")
    flat = np.zeros((int(np.prod(out)), int(np.prod(kernel))), np.int64)
    valid = np.ones_like(flat, dtype=bool)
    for axis in range(nd):
        pos = grids[axis].reshape(-1, 1) * stride[axis] - padding[axis] + offs[axis].reshape(1, -1) * dilation[axis]
        valid &= (pos >= 0) & (pos < spatial[axis])
        flat = flat * spatial[axis] + np.clip(pos, 0, spatial[axis] - 1)
    lead = x.shape[:-nd]
    xs = x.reshape(lead + (-1,))
    gathered = jnp.take(xs, jnp.asarray(flat.reshape(-1).astype(np.int32)), axis=-1).reshape(lead + flat.shape)
    low = jnp.array(-jnp.inf, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    gathered = jnp.where(jnp.asarray(valid), gathered, low)
    # NaN wins, as in torch
    arg = jnp.argmax(jnp.where(jnp.isnan(gathered), jnp.inf, gathered) if jnp.issubdtype(x.dtype, jnp.floating)
                     else gathered, axis=-1)
    values = jnp.take_along_axis(gathered, arg[..., None], axis=-1)[..., 0]
    index = jnp.asarray(flat)[jnp.arange(flat.shape[0]), arg]
    shape = lead + tuple(out)
    return values.reshape(shape), index.reshape(shape)


def _max_pool_rule(nd):
    def rule(ctx, x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
        if 1 not in ctx.used_outputs():
            values = max_pool_values(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
            return values, jnp.zeros(values.shape, ctx.out_dtype(1))  # indices: never read
        return max_pool(x, nd, kernel_size, stride, padding, dilation, ceil_mode)
    return rule


lowers(aten.max_pool2d_with_indices.default)(_max_pool_rule(2))
lowers(aten.max_pool3d_with_indices.default)(_max_pool_rule(3))


def avg_pool(x, nd, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel, stride, padding, _, out, hi = _window_geometry(x, nd, kernel, stride, padding, [1], ceil_mode)
    lead = x.ndim - nd
    window = (1,) * lead + tuple(kernel)
    strides = (1,) * lead + tuple(stride)
    pads = [(0, 0)] * lead + [(p, h) for p, h in zip(padding, hi)]
    acc = acc_dtype(x.dtype)
    sums = lax.reduce_window(x.astype(acc), np.array(0, acc), lax.add, window, strides, pads)
    if divisor_override:
        div = jnp.asarray(divisor_override, acc)
    else:
        spatial = x.shape[lead:]
        if count_include_pad:
            # padded positions count, positions past the padding (ceil mode) do not
            ones = jnp.ones(tuple(n + 2 * p for n, p in zip(spatial, padding)), acc)
            cpads = [(0, max(h - p, 0)) for p, h in zip(padding, hi)]
        else:
            ones = jnp.ones(spatial, acc)
            cpads = [(p, h) for p, h in zip(padding, hi)]
        div = lax.reduce_window(ones, np.array(0, acc), lax.add, tuple(kernel), tuple(stride), cpads)
    return (sums / div).astype(x.dtype)


@lowers(aten.avg_pool2d.default)
def avg_pool2d(ctx, x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowers(aten.avg_pool3d.default)
def avg_pool3d(ctx, x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lowers(aten.avg_pool1d.default)
def avg_pool1d(ctx, x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True):
    return avg_pool(x, 1, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


def adaptive_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) averaging matrix of adaptive average pooling along one axis."""
    m = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        start = (i * n_in) // n_out
        end = -((-(i + 1) * n_in) // n_out)
        m[i, start:end] = 1.0 / (end - start)
    return m


def adaptive_avg_pool(x, output_size):
    nd = len(output_size)
    out = x.astype(acc_dtype(x.dtype))
    for i, n_out in enumerate(output_size):
        axis = x.ndim - nd + i
        m = jnp.asarray(adaptive_matrix(x.shape[axis], n_out), out.dtype)
        out = jnp.moveaxis(jnp.tensordot(out, m, axes=[[axis], [1]]), -1, axis)
    return out.astype(x.dtype)


@lowers(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool1d.default)
def adaptive_avg_pool_nd(ctx, x, output_size):
    return adaptive_avg_pool(x, list(output_size))


# ---- resampling ----------------------------------------------------------------------------

def _out_sizes(x, nd, output_size, scale_factors):
    if output_size is not None:
        return list(output_size), [None] * nd
    sizes = [int(math.floor(n * s)) for n, s in zip(x.shape[-nd:], scale_factors)]
    return sizes, list(scale_factors)


@lowers(aten.upsample_bilinear2d.vec)
def upsample_bilinear2d(ctx, x, output_size, align_corners, scale_factors=None):
    return _resize_by_matrices(x, output_size, align_corners, scale_factors, linear_resize_matrix)


@lowers(aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa.vec)
def upsample_bilinear2d_aa(ctx, x, output_size, align_corners, *scales):
    """Antialiased bilinear resize (torch's and PIL's triangle filter, widened when downscaling)."""
    factors = scales[0] if len(scales) == 1 else (None if all(s is None for s in scales) else scales)
    if output_size is not None and factors is not None:
        sizes = list(output_size)
        return _resize_by_matrices(x, sizes, align_corners, factors, antialiased_linear_resize_matrix, sizes)
    return _resize_by_matrices(x, output_size, align_corners, factors, antialiased_linear_resize_matrix)


def _resize_by_matrices(x, output_size, align_corners, scale_factors, matrix, sizes=None):
    if sizes is None:
        sizes, scales = _out_sizes(x, 2, output_size, scale_factors)
    else:
        scales = list(scale_factors)
    out = x.astype(acc_dtype(x.dtype))
    for i, (n_out, s) in enumerate(zip(sizes, scales)):
        axis = x.ndim - 2 + i
        m = jnp.asarray(matrix(x.shape[axis], n_out, align_corners, s), out.dtype)
        out = jnp.moveaxis(jnp.tensordot(out, m, axes=[[axis], [1]]), -1, axis)
    return out.astype(x.dtype)


@lowers(aten.upsample_nearest2d.vec)
def upsample_nearest2d(ctx, x, output_size, scale_factors=None):
    sizes, scales = _out_sizes(x, 2, output_size, scale_factors)
    out = x
    for i, (n_out, s) in enumerate(zip(sizes, scales)):
        axis = x.ndim - 2 + i
        n_in = x.shape[axis]
        r = 1.0 / s if s else n_in / n_out
        src = np.minimum(np.floor(np.arange(n_out) * r).astype(np.int64), n_in - 1)
        out = jnp.take(out, jnp.asarray(src.astype(np.int32)), axis=axis)
    return out


# ---- embeddings ----------------------------------------------------------------------------

@lowers(aten.embedding.default)
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@lowers(aten.addmv.default)
def addmv(ctx, bias, mat, vec, *, beta=1, alpha=1):
    out = jnp.matmul(mat, vec, preferred_element_type=acc_dtype(mat.dtype))
    out = out * alpha if alpha != 1 else out
    return (out if beta == 0 else out + (bias if beta == 1 else bias * beta)).astype(ctx.out_dtype())


@lowers(aten.addbmm.default)
def addbmm(ctx, bias, batch1, batch2, *, beta=1, alpha=1):
    dtype = ctx.out_dtype()
    if acc_dtype(dtype) != dtype and batch1.shape[0]:
        # torch's CPU kernel is a chain of addmm over the batches: each step adds one product to the
        # half-precision result in float32 and rounds it, so the rounding of every step is torch's too
        acc = jnp.broadcast_to(bias, batch1.shape[1:2] + batch2.shape[2:]).astype(jnp.float32)
        first = jnp.zeros_like(acc) if beta == 0 else acc * beta

        def step(c, ab):
            prod = jnp.matmul(ab[0], ab[1], preferred_element_type=jnp.float32)
            return (c.astype(jnp.float32) + (prod * alpha if alpha != 1 else prod)).astype(dtype), None
        head = step(first, (batch1[0], batch2[0]))[0]
        return lax.scan(step, head, (batch1[1:], batch2[1:]))[0]
    out = jnp.einsum("bij,bjk->ik", batch1, batch2, preferred_element_type=acc_dtype(batch1.dtype))
    out = out * alpha if alpha != 1 else out
    return (out if beta == 0 else out + (bias if beta == 1 else bias * beta)).astype(dtype)


@lowers(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(ctx, x, kernel_size, output_size, random_samples):
    """torch's fractional max pooling at the given ``random_samples`` (one per plane and spatial dim):
    window starts ``int((i + u) * alpha) - int(u * alpha)``, alpha = (in - pool) / (out - 1), the last
    window at the end; the max of each window and its flat index in the plane (the first maximum,
    or the last NaN, as torch's loop finds them)."""
    k = len(kernel_size)
    batched = x.ndim == k + 2
    if not batched:
        x = x[None]
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    u = random_samples.astype(jnp.float32).reshape((n, c, k))
    r = half_rounding(x.dtype)  # torch's kernel does this arithmetic in the input's type
    # torch reads the samples W, H for 2-D planes and T, H, W for 3-D ones
    order = [1, 0] if k == 2 else list(range(k))
    flat_index = None
    strides = [int(np.prod(spatial[d + 1:])) for d in range(k)]
    for d in range(k):
        size_in, size_out, pool = spatial[d], output_size[d], kernel_size[d]
        ud = u[..., order[d]][..., None]  # (n, c, 1)
        if size_out > 1:
            alpha = r(r(jnp.float32(size_in - pool)) / r(jnp.float32(size_out - 1)))
            i = jnp.arange(size_out, dtype=jnp.float32)
            starts = (jnp.trunc(r(r(i + ud) * alpha)) - jnp.trunc(r(ud * alpha))).astype(jnp.int32)
            starts = starts.at[..., -1].set(size_in - pool)
        else:
            starts = jnp.full((n, c, 1), size_in - pool, jnp.int32)
        pos = starts[..., :, None] + jnp.arange(pool, dtype=jnp.int32)  # (n, c, out_d, pool_d)
        # on the axes (n, c, out_0.., out_{k-1}, pool_0.., pool_{k-1}): this dim's positions, the rest 1
        term = pos.reshape((n, c) + tuple(size_out if j == d else 1 for j in range(k))
                           + tuple(pool if j == d else 1 for j in range(k))) * strides[d]
        flat_index = term if flat_index is None else flat_index + term
    outs, pools = tuple(output_size), tuple(kernel_size)
    flat_index = jnp.broadcast_to(flat_index, (n, c) + outs + pools).reshape((n, c) + outs + (-1,))
    plane = x.reshape((n, c, -1))
    vals = jnp.take_along_axis(plane, flat_index.reshape((n, c, -1)), axis=2).reshape(flat_index.shape)
    nan = jnp.isnan(vals)
    window = vals.shape[-1]
    last_nan = window - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    pick = jnp.where(nan.any(-1), last_nan, jnp.argmax(jnp.where(nan, -jnp.inf, vals), axis=-1))
    out = jnp.take_along_axis(vals, pick[..., None], axis=-1)[..., 0]
    idx = jnp.take_along_axis(flat_index, pick[..., None], axis=-1)[..., 0].astype(ctx.out_dtype(1))
    if not batched:
        out, idx = out[0], idx[0]
    return out.astype(x.dtype), idx


@lowers(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def adaptive_max_pool(ctx, x, output_size):
    """Max over torch's adaptive windows [floor(i*n/out), ceil((i+1)*n/out)), and its flat spatial index."""
    k = len(output_size)
    spatial = x.shape[-k:]
    lead = x.ndim - k
    vals = x
    flat = jnp.zeros((), jnp.int32)
    valid = jnp.ones((), jnp.bool_)
    for a, (n_in, n_out) in enumerate(zip(spatial, output_size)):
        starts = [(i * n_in) // n_out for i in range(n_out)]
        ends = [-(-((i + 1) * n_in) // n_out) for i in range(n_out)]
        width = max(e - s for s, e in zip(starts, ends))
        pos = np.array([[min(s + j, e - 1) for j in range(width)] for s, e in zip(starts, ends)], np.int32)
        ok = np.array([[s + j < e for j in range(width)] for s, e in zip(starts, ends)])
        axis = lead + 2 * a  # each earlier spatial axis has become (out, window)
        vals = jnp.take(vals, jnp.asarray(pos.reshape(-1)), axis=axis)
        vals = vals.reshape(vals.shape[:axis] + pos.shape + vals.shape[axis + 1:])
        # the flat input index (row-major over the spatial dims) and the window mask, (out, window) per axis
        stride = int(np.prod(spatial[a + 1:], dtype=np.int64))
        shape = [1] * (2 * k)
        shape[2 * a], shape[2 * a + 1] = pos.shape
        flat = flat + jnp.asarray(pos * stride).reshape(shape)
        valid = valid & jnp.asarray(ok).reshape(shape)
    # (..., o1, w1, o2, w2, ...) -> (..., o1, o2, ..., w1 * w2 * ...)
    order = list(range(lead)) + [lead + 2 * a for a in range(k)] + [lead + 2 * a + 1 for a in range(k)]
    vals = jnp.transpose(vals, order)
    vals = vals.reshape(vals.shape[:lead + k] + (-1,))
    perm = [2 * a for a in range(k)] + [2 * a + 1 for a in range(k)]
    flat = jnp.transpose(jnp.broadcast_to(flat, valid.shape), perm).reshape(tuple(output_size) + (-1,))
    valid = jnp.transpose(valid, perm).reshape(tuple(output_size) + (-1,))
    low = -jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).min
    vals = jnp.where(valid, vals, jnp.asarray(low, x.dtype))
    best = jnp.argmax(vals, axis=-1)
    out = jnp.take_along_axis(vals, best[..., None], axis=-1)[..., 0]
    index = jnp.take_along_axis(jnp.broadcast_to(flat, vals.shape), best[..., None], axis=-1)[..., 0]
    return out, index


# ---- torch.nn.functional.linear_cross_entropy's chunked custom ops (torch 2.13) -----------------

def _linear_cross_entropy_ops():
    try:
        from torch.nn.modules import linear_cross_entropy  # noqa: F401  (registers the torch_nn ops)
        ns = torch.ops.torch_nn
        return ns._linear_cross_entropy_batch_chunked.default, ns._linear_cross_entropy_batch_chunked_no_reduction.default
    except (ImportError, AttributeError):  # a torch without them
        return ()


def _linear_cross_entropy(x, w, target, bias, weight, reduction, ignore_index, label_smoothing):
    """cross_entropy(x @ w.T + bias, target) with class weights, ignore_index and label smoothing, in
    float32 for half inputs (the chunked op's float32 accumulation; its chunks are a memory schedule)."""
    acc = acc_dtype(x.dtype)
    logits = jnp.matmul(x.astype(acc), w.astype(acc).T, preferred_element_type=acc)
    if bias is not None:
        logits = logits + bias.astype(acc)
    logp = jax.nn.log_softmax(logits, axis=-1)
    n_classes = logits.shape[-1]
    keep = target != ignore_index
    safe = jnp.where(keep, target, 0).astype(jnp.int32)
    cw = jnp.ones((n_classes,), acc) if weight is None else weight.astype(acc)
    w_t = jnp.where(keep, cw[safe], 0)
    nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0] * w_t
    loss = nll
    if label_smoothing:
        smooth = jnp.where(keep, -(logp * cw).sum(-1) / n_classes, 0)
        loss = (1 - label_smoothing) * nll + label_smoothing * smooth
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / w_t.sum()
    return loss


def _lce_chunked(ctx, x, w, target, bias, weight, reduction, ignore_index, label_smoothing, *rest):
    if ctx.used_outputs() - {0}:
        raise NotImplementedError("linear_cross_entropy's precomputed gradients (a training graph)")
    loss = _linear_cross_entropy(x, w, target, bias, weight, reduction, ignore_index, label_smoothing)
    grads = [jnp.zeros(ctx.out_shape(i), ctx.out_dtype(i)) for i in (1, 2, 3)]
    return (loss.astype(ctx.out_dtype(0)), *grads)


def _lce_chunked_none(ctx, x, w, target, bias, weight, ignore_index, *rest):
    return _linear_cross_entropy(x, w, target, bias, weight, "none", ignore_index, 0.0).astype(ctx.out_dtype())


_LCE = _linear_cross_entropy_ops()
if _LCE:
    lowers(_LCE[0])(_lce_chunked)
    lowers(_LCE[1])(_lce_chunked_none)


# transformers' mixture-of-experts dispatch (`grouped_mm` experts, the default of its MoE models): the rows
# of `x` sorted by expert, `offs` the cumulative row count per expert. Registered by name: the op exists
# once transformers' MoE integration is imported, which the model's own import does.
@lowers("transformers.grouped_mm_fallback.default")
def grouped_mm(ctx, x, w, offs):
    """``x [S, in]`` rows grouped by expert, ``w [E, in, out]``, ``offs [E]`` cumulative group ends ->
    ``[S, out]``: one ragged matmul (``jax.lax.ragged_dot``, which XLA and the TPU compiler lower as a
    grouped matmul: each expert's weights read once for its rows)."""
    offs = offs.astype(jnp.int32)
    axis = ctx.expert_axis
    if axis and ctx.mesh_axes.get(axis, 1) > 1 and w.shape[0] % ctx.mesh_axes[axis] == 0:
        return _expert_parallel_mm(ctx, x, w, offs, axis)
    sizes = jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))
    out = lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=acc_dtype(x.dtype))
    return out.astype(ctx.out_dtype())


def _expert_parallel_mm(ctx, x, w, offs, axis: str):
    """The grouped matmul with the experts split over a mesh axis (the sharding plan's): each chip takes
    the rows of its own experts from the replicated rows (contiguous, as they are sorted by expert), one
    ragged matmul over its experts' weights, and an all-reduce of the rows (each row is one chip's, the
    others add zeros). XLA alone would all-gather every expert's weights to partition a ragged matmul."""
    from jax.sharding import PartitionSpec as P
    out_dtype = ctx.out_dtype()

    def local(x, w, offs):
        n = w.shape[0]  # this chip's experts: [first, first + n)
        first = lax.axis_index(axis) * n
        ends = lax.dynamic_slice(offs, (first,), (n,))
        start = jnp.where(first > 0, offs[jnp.maximum(first - 1, 0)], 0)
        rows = jnp.arange(x.shape[0])
        if n == 1:  # one expert per chip: a plain matmul of the rows (the TPU compiler's ragged dot
            # rejects a single group of few rows)
            y = jnp.dot(x, w[0].astype(x.dtype), preferred_element_type=acc_dtype(x.dtype))
            y = jnp.where(((rows >= start) & (rows < ends[-1]))[:, None], y, 0).astype(out_dtype)
            return lax.psum(y, axis)
        sizes = jnp.diff(ends, prepend=start[None])
        y = lax.ragged_dot(jnp.roll(x, -start, axis=0), w.astype(x.dtype), sizes,
                           preferred_element_type=acc_dtype(x.dtype))
        y = jnp.where((rows < ends[-1] - start)[:, None], y, 0).astype(out_dtype)
        return lax.psum(jnp.roll(y, start, axis=0), axis)

    spec = P(axis, *([None] * (w.ndim - 1)))
    return jax.shard_map(local, mesh=ctx.shard_mesh(), in_specs=(P(), spec, P()), out_specs=P(),
                         check_vma=False)(x, w, offs)
