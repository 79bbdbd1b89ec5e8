"""Helpers more than one op family builds with."""
from __future__ import annotations

import numpy as np

from .dims import all_static, is_static
from .ir import Tensor


def strided_slice(ctx, x: Tensor, ranges: dict) -> Tensor:
    if not all_static(x.shape) or not all(is_static(v) for r in ranges.values() for v in r):
        return dynamic_slice(ctx, x, ranges)
    begin = [0] * x.rank
    end = list(x.shape)
    strides = [1] * x.rank
    for d, (b, e, s) in ranges.items():
        begin[d], end[d], strides[d] = b, e, s
    shape = tuple(max(0, -(-(e - b) // s)) for b, e, s in zip(begin, end, strides))
    if shape == x.shape:
        return x
    if x.is_const:
        return ctx.const(x.data[tuple(slice(b, e, s) for b, e, s in zip(begin, end, strides))])
    if all(s == 1 for s in strides):
        return ctx.op("SLICE", [x, np.asarray(begin, np.int32), np.asarray(shape, np.int32)], shape=shape,
                      dtype=x.dtype)
    return ctx.op("STRIDED_SLICE", [x, np.asarray(begin, np.int32), np.asarray(end, np.int32),
                                    np.asarray(strides, np.int32)], shape=shape, dtype=x.dtype)


def dynamic_slice(ctx, x: Tensor, ranges: dict) -> Tensor:
    # Only the sliced dims get bounds (computed at run time where dynamic); the others are taken
    # whole: size -1 in SLICE, end_mask in STRIDED_SLICE. Bounds are in range (torch checked them).
    begin, end, size, strides = [0] * x.rank, [0] * x.rank, [-1] * x.rank, [1] * x.rank
    shape, end_mask = list(x.shape), 0
    for d in range(x.rank):
        if d not in ranges:
            end_mask |= 1 << d
            continue
        b, e, s = ranges[d]
        begin[d], end[d], strides[d] = b, e, s
        shape[d] = size[d] = e - b if s == 1 else (e - b + s - 1) // s
    if tuple(shape) == x.shape:
        return x
    if all(s == 1 for s in strides):
        return ctx.op("SLICE", [x, ctx.vector(begin), ctx.vector(size)], shape=tuple(shape), dtype=x.dtype)
    return ctx.op("STRIDED_SLICE", [x, ctx.vector(begin), ctx.vector(end), ctx.vector(strides)], shape=tuple(shape),
                  dtype=x.dtype, endMask=end_mask)
