"""Tensor factories (arange, full, ...), random numbers, and ops that only exist with dynamic shapes.

Factories of a static shape are usually folded to constants before lowering;
these builders make the ones too large to store (FILL) or data-dependent.
"""
from __future__ import annotations

import numpy as np
import sympy
import torch

from .dims import all_static, is_static, normalize
from .ir import Tensor
from .registry import builds, not_supported

aten = torch.ops.aten


def fill(ctx, shape, value, dtype) -> Tensor:
    shape = tuple(normalize(d) for d in shape)
    v = value if isinstance(value, Tensor) else ctx.const(value, dtype) if isinstance(value, sympy.Basic) else \
        ctx.const(np.asarray(value).astype(dtype))
    v = ctx.reshape(ctx.cast(v, dtype), ())
    if all_static(shape) and int(np.prod(shape)) <= 16:
        if v.is_const:
            return ctx.const(np.full(shape, v.data, dtype))
    return ctx.op("FILL", [ctx.shape_operand(shape), v], shape=shape, dtype=dtype)


@builds(aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
        aten.empty_strided.default, aten.new_full.default, aten.new_zeros.default, aten.new_ones.default,
        aten.new_empty.default, aten.new_empty_strided.default)
def full(ctx, *args, **kwargs):
    value = {aten.full.default: None, aten.new_full.default: None, aten.ones.default: 1, aten.new_ones.default: 1}.get(
        ctx.node.target, 0)
    if value is None:
        value = args[-1] if ctx.node.target is aten.full.default else args[2]
    return fill(ctx, ctx.out_shape(), value, ctx.out_dtype())


@builds(aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default)
def full_like(ctx, x, *args, **kwargs):
    value = {aten.full_like.default: args[0] if args else kwargs.get("fill_value"), aten.ones_like.default: 1}.get(
        ctx.node.target, 0)
    return fill(ctx, ctx.out_shape(), value, ctx.out_dtype())


@builds(aten.fill.Scalar, aten.fill.Tensor)
def fill_(ctx, x, value):
    return fill(ctx, x.shape, value, ctx.out_dtype())


@builds(aten.scalar_tensor.default)
def scalar_tensor(ctx, value, **kwargs):
    if isinstance(value, sympy.Basic):
        return ctx.cast(ctx.const(value), ctx.out_dtype())  # a dynamic size as a tensor
    return ctx.const(np.asarray(value).astype(ctx.out_dtype()))


@builds(aten.arange.start_step, aten.arange.default, aten.arange.start)
def arange(ctx, *args, **kwargs):
    nums = [a for a in args if isinstance(a, (int, float, sympy.Basic))]
    if len(nums) == 1:
        start, end, step = 0, nums[0], 1
    else:
        start, end, step = (nums + [1])[:3]
    (n,) = ctx.out_shape()
    if is_static(n):
        return ctx.const(np.arange(start, end, step).astype(ctx.out_dtype())[:n])
    # a dynamic length: RANGE at run time, over scalars of the result's type
    dt = ctx.out_dtype()
    bounds = [ctx.cast(ctx.const(v), dt) if isinstance(v, sympy.Basic) else ctx.const(np.asarray(v, dt))
              for v in (start, end, step)]
    return ctx.op("RANGE", bounds, shape=(n,), dtype=dt)


@builds(aten.rand.default, aten.randn.default, aten.rand_like.default, aten.randn_like.default)
def random(ctx, *args, **kwargs):
    # LiteRT draws from its own generator: the values differ from torch's, the distribution is the same
    code = "RANDOM_UNIFORM" if ctx.node.target in (aten.rand.default, aten.rand_like.default) else \
        "RANDOM_STANDARD_NORMAL"
    shape = ctx.out_shape()
    out = ctx.op(code, [ctx.shape_operand(shape)], shape=shape, dtype=np.float32, seed=0, seed2=0)
    return ctx.cast(out, ctx.out_dtype())


not_supported("the output shape depends on the data (TFLite models here have static shapes)",
              aten.nonzero.default, aten._local_scalar_dense.default, aten.masked_select.default,
              aten.unique_consecutive.default, aten._unique2.default)
not_supported("a backward (training) op: export inference code", aten.convolution_backward.default,
              aten.native_layer_norm_backward.default, aten.native_group_norm_backward.default,
              aten.embedding_dense_backward.default, aten.max_pool2d_with_indices_backward.default,
              aten.avg_pool2d_backward.default, aten._adaptive_avg_pool2d_backward.default)
not_supported("TFLite has no such operator", aten.randperm.default, aten.resize_.default,
              aten.col2im.default)
