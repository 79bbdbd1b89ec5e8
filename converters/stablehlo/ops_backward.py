"""Backward ops of the core opset: pooling, convolution, embedding and normalisation gradients.

Linear forwards (pooling, convolution) take their gradient from ``jax.vjp`` of the
forward rule, so forward and backward cannot drift apart. The norm backwards use
the mean and rstd they are given, like torch, so they follow torch's formulas.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import torch

from .ops_nn import acc_dtype, adaptive_avg_pool, avg_pool, conv
from .registry import lowers

aten = torch.ops.aten


def _vjp(forward, x, grad):
    _, pullback = jax.vjp(forward, x)
    return pullback(grad.astype(x.dtype))[0]


@lowers(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(ctx, grad, x):
    return _vjp(lambda t: adaptive_avg_pool(t, list(grad.shape[-2:])), x, grad)


@lowers(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(ctx, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override=None):
    return _vjp(lambda t: avg_pool(t, 2, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                   divisor_override), x, grad)


@lowers(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(ctx, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    # each output's gradient goes to the input position its index names (within its spatial plane)
    lead, plane = x.shape[:-2], x.shape[-2] * x.shape[-1]
    g = grad.reshape((-1, grad.shape[-2] * grad.shape[-1]))
    idx = indices.reshape(g.shape)
    out = jax.vmap(lambda gi, ii: jnp.zeros((plane,), grad.dtype).at[ii].add(gi))(g, idx)
    return out.reshape(lead + x.shape[-2:])


@lowers(aten.convolution_backward.default)
def convolution_backward(ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding,
                         groups, output_mask):
    def forward(xx, ww):
        return conv(xx, ww, None, stride, padding, dilation, transposed, output_padding, groups)
    _, pullback = jax.vjp(forward, x, w)
    gx, gw = pullback(grad.astype(x.dtype))
    gb = None
    if output_mask[2]:
        gb = jnp.sum(grad.astype(acc_dtype(grad.dtype)), axis=(0,) + tuple(range(2, grad.ndim))).astype(grad.dtype)
    return (gx if output_mask[0] else None), (gw if output_mask[1] else None), gb


@lowers(aten.embedding_dense_backward.default)
def embedding_dense_backward(ctx, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    dt = ctx.out_dtype()
    idx = indices.reshape(-1)
    g = grad.reshape((idx.shape[0], -1)).astype(dt)
    valid = (idx >= 0) & (idx < num_weights)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), dt).at[idx].add(valid.astype(dt), mode="drop")
        g = g / jnp.take(counts, idx, mode="fill", fill_value=1)[:, None]
    g = jnp.where((valid & (idx != padding_idx))[:, None], g, 0)
    out = jnp.zeros((num_weights, g.shape[1]), dt).at[idx].add(g, mode="drop")
    return out.reshape((num_weights,) + grad.shape[indices.ndim:])


@lowers(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(ctx, grad, x, normalized_shape, mean, rstd, w, b, output_mask):
    acc = acc_dtype(x.dtype)
    axis = x.ndim - len(normalized_shape)
    inner = tuple(range(axis, x.ndim))
    outer = tuple(range(axis))
    n = 1
    for d in x.shape[axis:]:
        n *= d
    g, xf = grad.astype(acc), x.astype(acc)
    x_hat = (xf - mean.astype(acc)) * rstd.astype(acc)
    g_hat = g * w.astype(acc) if w is not None else g
    gx = gw = gb = None
    if output_mask[0]:
        inner_sum = n * g_hat - jnp.sum(g_hat, inner, keepdims=True) \
            - x_hat * jnp.sum(g_hat * x_hat, inner, keepdims=True)
        gx = (rstd.astype(acc) / n * inner_sum).astype(x.dtype)
    if output_mask[1] and w is not None:
        gw = jnp.sum(g * x_hat, outer).astype(w.dtype)
    if output_mask[2] and b is not None:
        gb = jnp.sum(g, outer).astype(b.dtype)
    return gx, gw, gb


@lowers(aten.native_group_norm_backward.default)
def native_group_norm_backward(ctx, grad, x, mean, rstd, w, n, c, hxw, group, output_mask):
    acc = acc_dtype(x.dtype)
    cpg = c // group
    g = grad.astype(acc).reshape((n, c, hxw))
    xf = x.astype(acc).reshape((n, c, hxw))
    mean, rstd = mean.astype(acc), rstd.astype(acc)
    ds = jnp.sum(g * xf, axis=2)  # (n, c)
    db = jnp.sum(g, axis=2)
    gx = gw = gb = None
    if output_mask[0]:
        gamma = w.astype(acc).reshape((1, c)) if w is not None else jnp.ones((1, c), acc)
        ds_val = (ds * gamma).reshape((n, group, cpg)).sum(2)
        db_val = (db * gamma).reshape((n, group, cpg)).sum(2)
        s = 1.0 / (hxw * cpg)
        c1 = rstd[:, :, None] * gamma.reshape((1, group, cpg))
        c2 = (db_val * mean - ds_val) * rstd * rstd * rstd * s
        c3 = -c2 * mean - db_val * rstd * s
        gx = (g.reshape((n, group, cpg, hxw)) * c1[..., None] + xf.reshape((n, group, cpg, hxw)) * c2[..., None, None]
              + c3[..., None, None])
        gx = gx.reshape(x.shape).astype(x.dtype)
    if output_mask[1]:
        gw = ((ds.reshape((n, group, cpg)) - db.reshape((n, group, cpg)) * mean[..., None]) * rstd[..., None])
        gw = gw.sum(0).reshape((c,)).astype(ctx.out_dtype(1))
    if output_mask[2]:
        gb = db.sum(0).astype(ctx.out_dtype(2))
    return gx, gw, gb
