"""Neural-network ops: convolution, pooling, resampling, matmuls, normalisation, softmax, attention.

Convolutions, pools and resizes are channels-last in TFLite: their builders
read NCHW tensors through ``ctx.to_channels_last`` and give results back with
``ctx.from_channels_last``; the layout pass removes the transposes between them.
Explicit PAD ops are emitted for torch's padding; the padding pass turns
PAD + VALID into SAME where the two agree.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from torchtpu_export.converters.torch_semantics import antialiased_linear_resize_matrix, linear_resize_matrix

from .composite import inline
from .dims import all_static, broadcast_shapes, is_static
from .ir import Tensor
from .ops_composite import attention_with_dropout
from .registry import BOOL, I32, BuildContext, Missing, builds
from . import schema

aten = torch.ops.aten


def _tuple(v, n: int) -> tuple:
    if isinstance(v, (list, tuple)):
        v = tuple(int(x) for x in v)
        return v * n if len(v) == 1 else v
    return (int(v),) * n


def _channels_last_op(ctx: BuildContext, code: str, inputs: list, shape_ncx, dtype, **options) -> Tensor:
    out = ctx.channels_last_tensor(shape_ncx, dtype)
    ctx.op(code, inputs, outputs=[out], **options)
    return out


def _pad_channels_last(ctx: BuildContext, xl: Tensor, pads, value=0.0) -> Tensor:
    # Pads the spatial dims of a channels-last tensor; ``pads`` is ((before, after), ...) per spatial dim.
    if not any(b or a for b, a in pads):
        return xl
    spec = np.asarray([(0, 0), *pads, (0, 0)], np.int32)
    shape = tuple(d + int(spec[i].sum()) for i, d in enumerate(xl.shape))
    out = ctx.tensor(shape, xl.dtype, channels_last=True)
    if value == 0:
        ctx.op("PAD", [xl, spec], outputs=[out])
    else:
        ctx.op("PADV2", [xl, spec, ctx.const(np.asarray(value, xl.dtype))], outputs=[out])
    return out


# ---- convolution ---------------------------------------------------------------------------

@builds(aten.convolution.default)
def convolution(ctx, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    nd = w.rank - 2
    if x.rank == nd + 1:  # unbatched
        y = convolution(ctx, ctx.reshape(x, (1,) + x.shape), w, b, stride, padding, dilation, transposed,
                        output_padding, groups)
        return ctx.reshape(y, y.shape[1:])
    stride, dilation = _tuple(stride, nd), _tuple(dilation, nd)
    if isinstance(padding, str):
        padding = _string_padding(padding, x.shape[2:], w.shape[2:], stride, dilation)
    padding = _tuple(padding, nd)
    if transposed:
        return _conv_transpose(ctx, x, w, b, stride, padding, dilation, _tuple(output_padding, nd), groups)
    if nd == 1:
        # a 1-D convolution is a 2-D one over a height of 1
        x2 = ctx.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        w2 = ctx.reshape(w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        y = _conv2d(ctx, x2, w2, b, (1,) + stride, (0,) + padding, (1,) + dilation, groups)
        return ctx.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))
    if nd == 2:
        return _conv2d(ctx, x, w, b, stride, padding, dilation, groups)
    if nd == 3:
        return _conv3d(ctx, x, w, b, stride, padding, dilation, groups)
    raise ctx.unsupported(f"{nd}-D convolutions have no TFLite builtin")


def _string_padding(mode, spatial, kernel, stride, dilation):
    if mode == "valid":
        return [0] * len(spatial)
    # "same" (stride 1): torch pads the extra element at the end; asymmetric cases are PADs anyway
    return [d * (k - 1) // 2 for k, d in zip(kernel, dilation)]


def _conv_pads(spatial, kernel, stride, padding, dilation):
    # Per spatial dim (before, after) so that a VALID conv gives torch's output size.
    # torch's own symmetric padding: the rows a stride skips at the end cost nothing, and the
    # PAD then matches what other converters emit (and what XNNPACK folds into the convolution)
    return [(p, p) for p in padding]


def _bias(ctx, b, n: int, dtype) -> Tensor:
    if b is None:
        return ctx.const(np.zeros(n, dtype))  # XNNPACK wants a bias on every conv
    return ctx.cast(b, dtype)


def _filter(ctx, w: Tensor, perm) -> Tensor:
    if w.is_const:
        return ctx.const(np.require(np.transpose(w.data, perm), requirements="C"))
    return ctx.transpose(w, perm)


def _conv2d(ctx, x, w, b, stride, padding, dilation, groups):
    n, c, h, wd = x.shape
    o = w.shape[0]
    out_shape = ctx.out_shape() if len(ctx.out_shape()) == 4 else None
    pads = _conv_pads((h, wd), w.shape[2:], stride, padding, dilation)
    xl = _pad_channels_last(ctx, ctx.to_channels_last(x), pads)
    ho = (xl.shape[1] - dilation[0] * (w.shape[2] - 1) - 1) // stride[0] + 1
    wo = (xl.shape[2] - dilation[1] * (w.shape[3] - 1) - 1) // stride[1] + 1
    if out_shape is not None and all_static(out_shape) and out_shape != (n, o, ho, wo):
        raise ValueError(f"convolution output {out_shape} != computed {(n, o, ho, wo)}")
    filt = _filter(ctx, w, (0, 2, 3, 1))  # OIHW -> OHWI (grouped: I is C / groups)
    y = _channels_last_op(ctx, "CONV_2D", [xl, filt, _bias(ctx, b, o, x.dtype)], (n, o, ho, wo), x.dtype,
                          padding=schema.VALID, strideH=stride[0], strideW=stride[1],
                          dilationHFactor=dilation[0], dilationWFactor=dilation[1])
    return ctx.from_channels_last(y)


def _conv3d(ctx, x, w, b, stride, padding, dilation, groups):
    if groups != 1:
        raise ctx.unsupported("grouped 3-D convolutions have no TFLite builtin")
    n, c = x.shape[:2]
    o = w.shape[0]
    pads = _conv_pads(x.shape[2:], w.shape[2:], stride, padding, dilation)
    xl = _pad_channels_last(ctx, ctx.to_channels_last(x), pads)
    outs = [(xl.shape[1 + i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1 for i in range(3)]
    filt = _filter(ctx, w, (2, 3, 4, 1, 0))  # OIDHW -> DHWIO
    y = _channels_last_op(ctx, "CONV_3D", [xl, filt, _bias(ctx, b, o, x.dtype)], (n, o, *outs), x.dtype,
                          padding=schema.VALID, strideD=stride[0], strideH=stride[1], strideW=stride[2],
                          dilationDFactor=dilation[0], dilationHFactor=dilation[1], dilationWFactor=dilation[2])
    return ctx.from_channels_last(y)


def _dense_transposed_weight(w: np.ndarray, groups: int, dilation) -> np.ndarray:
    # (Cin, Cout/g, *k) grouped, dilated weights as one (Cin, Cout, *k') weight of zeros outside the
    # groups and between the dilated taps: TRANSPOSE_CONV has neither groups nor dilation.
    cin, cout_g, *k = w.shape
    kd = [d * (kk - 1) + 1 for kk, d in zip(k, dilation)]
    dense = np.zeros((cin, cout_g * groups, *kd), w.dtype)
    step = cin // groups
    taps = tuple(slice(None, None, d) for d in dilation)
    for g in range(groups):
        dense[(slice(g * step, (g + 1) * step), slice(g * cout_g, (g + 1) * cout_g)) + taps] = \
            w[g * step:(g + 1) * step]
    return dense


def _dense_transposed_weight_ops(ctx, w: Tensor, groups: int, dilation) -> Tensor:
    # ``_dense_transposed_weight`` for a weight computed at run time: a placement matmul spreads the
    # taps, a 0/1 mask lays the groups out block-diagonally.
    cin, cout_g, *k = w.shape
    kd = [d * (kk - 1) + 1 for kk, d in zip(k, dilation)]
    taps, dtaps = int(np.prod(k)), int(np.prod(kd))
    place = np.zeros((taps, dtaps), w.dtype)
    for t, pos in enumerate(np.ndindex(*k)):
        place[t, np.ravel_multi_index(tuple(p * d for p, d in zip(pos, dilation)), kd)] = 1
    flat = ctx.reshape(w, (cin * cout_g, taps))
    spread = ctx.op("FULLY_CONNECTED", [flat, ctx.const(np.require(place.T, requirements="C")), None],
                    shape=(cin * cout_g, dtaps), dtype=w.dtype)
    mask = np.zeros((cin, groups, 1, 1), w.dtype)
    for g in range(groups):
        mask[g * (cin // groups):(g + 1) * (cin // groups), g] = 1
    blocks = ctx.op("MUL", [ctx.reshape(spread, (cin, 1, cout_g, dtaps)), ctx.const(mask)],
                    shape=(cin, groups, cout_g, dtaps), dtype=w.dtype)
    return ctx.reshape(blocks, (cin, groups * cout_g, *kd))


def _conv_transpose(ctx, x, w, b, stride, padding, dilation, output_padding, groups):
    nd = x.rank - 2
    if nd == 3:
        return inline(ctx, _conv_transpose3d, (x, w, b, stride, padding, dilation, output_padding, groups), {})
    if groups != 1 or any(d != 1 for d in dilation):
        w = ctx.const(_dense_transposed_weight(w.data, groups, dilation)) if w.is_const else \
            _dense_transposed_weight_ops(ctx, w, groups, dilation)
        groups, dilation = 1, (1,) * nd
    if nd == 1:
        x2 = ctx.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        w2 = ctx.reshape(w, (w.shape[0], w.shape[1], 1, w.shape[2]))
        y = _conv_transpose2d(ctx, x2, w2, b, (1,) + stride, (0,) + padding, (0,) + output_padding)
        return ctx.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))
    if nd != 2:
        raise ctx.unsupported(f"{nd}-D transposed convolutions are not supported (TFLite has 2-D)")
    return _conv_transpose2d(ctx, x, w, b, stride, padding, output_padding)


def _conv_transpose3d(x, w, b, stride, padding, dilation, output_padding, groups):
    """A 3-D transposed convolution as the convolution it is the adjoint of, traced in torch ops: the
    input with stride - 1 zeros between its elements, padded by dilation (k - 1) - padding (plus
    output_padding at the end), convolved with the flipped kernel, its in/out channels swapped."""
    for i, s in enumerate(stride):
        if s > 1:  # zeros between the elements of dim 2 + i
            d = 2 + i
            n = x.shape[d]
            x = torch.nn.functional.pad(x.unsqueeze(d + 1), [0, 0] * (x.dim() - d - 1) + [0, s - 1])
            x = x.flatten(d, d + 1).narrow(d, 0, (n - 1) * s + 1)
    k = w.shape[2:]
    pads = []
    for i in reversed(range(3)):
        edge = dilation[i] * (k[i] - 1) - padding[i]
        pads += [edge, edge + output_padding[i]]
    x = torch.nn.functional.pad(x, pads)
    cin, cout_g = w.shape[0], w.shape[1]
    w = w.reshape(groups, cin // groups, cout_g, *k).transpose(1, 2).flip(3, 4, 5)
    # one convolution per group (TFLite's CONV_3D has no groups)
    xs = x.chunk(groups, 1)
    bs = b.chunk(groups) if b is not None else [None] * groups
    ys = [torch.nn.functional.conv3d(xs[g], w[g], bs[g], 1, 0, dilation) for g in range(groups)]
    return ys[0] if groups == 1 else torch.cat(ys, 1)


def _conv_transpose2d(ctx, x, w, b, stride, padding, output_padding):
    n, c, h, wd = x.shape
    o, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    full = ((h - 1) * stride[0] + kh, (wd - 1) * stride[1] + kw)
    want = tuple(f - 2 * p + op for f, p, op in zip(full, padding, output_padding))
    filt = _filter(ctx, w, (1, 2, 3, 0))  # (I, O, kh, kw) -> (O, kh, kw, I)
    xl = ctx.to_channels_last(x)
    bias = _bias(ctx, b, o, x.dtype)
    # TFLite's SAME transposed conv crops total//2 before: torch's padding when the two agree
    same = tuple(h_ * s for h_, s in zip((h, wd), stride))
    if want == same and all(p == (f - s_) // 2 for p, f, s_ in zip(padding, full, same)):
        y = _channels_last_op(ctx, "TRANSPOSE_CONV", [ctx.vector([n, *want, o]), filt, xl, bias],
                              (n, o, *want), x.dtype, padding=schema.SAME, strideH=stride[0], strideW=stride[1])
        return ctx.from_channels_last(y)
    extra = [max(p + w_ - f, 0) for p, w_, f in zip(padding, want, full)]
    # positions past the full output (output_padding > padding) hold just the bias: add it after padding
    conv_bias = ctx.const(np.zeros(o, x.dtype)) if any(extra) else bias
    y = _channels_last_op(ctx, "TRANSPOSE_CONV", [ctx.vector([n, *full, o]), filt, xl, conv_bias],
                          (n, o, *full), x.dtype, padding=schema.VALID, strideH=stride[0], strideW=stride[1])
    if any(extra):
        y = _pad_channels_last(ctx, y, [(0, e) for e in extra])
        y2 = ctx.tensor(y.shape, y.dtype, channels_last=True)
        ctx.op("ADD", [y, bias], outputs=[y2])
        y = y2
    if want != full or any(padding):
        out = ctx.channels_last_tensor((n, o, *want), x.dtype)
        begin = np.asarray([0, padding[0], padding[1], 0], np.int32)
        size = ctx.vector([-1 if not is_static(n) else n, want[0], want[1], o])
        ctx.op("SLICE", [y, begin, size], outputs=[out])
        y = out
    return ctx.from_channels_last(y)


@builds(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
        aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)
def conv_nd(ctx, x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    nd = w.rank - 2
    return convolution(ctx, x, w, bias, _tuple(stride, nd), padding if isinstance(padding, str) else _tuple(padding, nd),
                       _tuple(dilation, nd), False, (0,) * nd, groups)


@builds(aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input)
def conv_transpose_nd(ctx, x, w, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    nd = w.rank - 2
    return convolution(ctx, x, w, bias, _tuple(stride, nd), _tuple(padding, nd), _tuple(dilation, nd), True,
                       _tuple(output_padding, nd), groups)


# ---- pooling -------------------------------------------------------------------------------

def _pool_geometry(spatial, kernel, stride, padding, ceil_mode):
    outs, pads = [], []
    for n, k, s, p in zip(spatial, kernel, stride, padding):
        span = n + 2 * p - k
        out = (-(-span // s) if ceil_mode else span // s) + 1
        if ceil_mode and (out - 1) * s >= n + p:
            out -= 1  # torch drops a last window that would start in the right padding
        after = max((out - 1) * s + k - n - p, p)  # at least torch's own padding, more for ceil_mode
        outs.append(out)
        pads.append((p, after))
    return outs, pads


def _max_pool2d(ctx, x, kernel, stride, padding, dilation, ceil_mode):
    kernel = _tuple(kernel, 2)
    stride = _tuple(stride, 2) if stride else kernel
    padding, dilation = _tuple(padding, 2), _tuple(dilation, 2)
    if dilation != (1, 1):
        raise ctx.unsupported("dilated max pooling has no TFLite builtin")
    n, c, h, w = x.shape
    outs, pads = _pool_geometry((h, w), kernel, stride, padding, ceil_mode)
    lowest = np.finfo(x.dtype).min if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    xl = _pad_channels_last(ctx, ctx.to_channels_last(x), pads, value=lowest)
    y = _channels_last_op(ctx, "MAX_POOL_2D", [xl], (n, c, *outs), x.dtype, padding=schema.VALID,
                          strideH=stride[0], strideW=stride[1], filterHeight=kernel[0], filterWidth=kernel[1])
    return ctx.from_channels_last(y)


_POOLS_2D = {aten.max_pool2d_with_indices.default, aten.max_pool2d.default, aten.avg_pool2d.default}


def _indices_used(ctx) -> bool:
    return any(u.args[1] != 0 for u in ctx.node.users)


@builds(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    if _indices_used(ctx):
        return _max_pool_taps(ctx, x, 2, kernel_size, stride, padding, dilation, ceil_mode)
    y = _pool_nd(ctx, x, kernel_size, stride, padding, dilation, ceil_mode, _max_pool2d)
    return y, Missing("max pooling indices")


def _max_pool_taps(ctx, x, nd, kernel, stride, padding, dilation, ceil_mode):
    # Max pooling with torch's indices: every window tap as a strided slice, the max and its first
    # position over the taps (TFLite's MAX_POOL_2D gives no indices).
    if x.rank == nd + 1:
        y, i = _max_pool_taps(ctx, ctx.reshape(x, (1,) + x.shape), nd, kernel, stride, padding, dilation, ceil_mode)
        return ctx.reshape(y, y.shape[1:]), ctx.reshape(i, i.shape[1:])
    kernel = _tuple(kernel, nd)
    stride = _tuple(stride, nd) if stride else kernel
    padding, dilation = _tuple(padding, nd), _tuple(dilation, nd)
    spatial, lead = x.shape[-nd:], x.shape[:-nd]
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    outs, pads = _pool_geometry(spatial, span, stride, padding, ceil_mode)
    lowest = np.finfo(x.dtype).min if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    spec = np.asarray([(0, 0)] * len(lead) + pads, np.int32)
    xp = ctx.op("PADV2", [x, spec, ctx.const(np.asarray(lowest, x.dtype))],
                shape=tuple(n + int(a + b) for n, (a, b) in zip(x.shape, spec)), dtype=x.dtype)
    taps, offsets = [], []
    for tap in np.ndindex(*kernel):
        begin = [0] * len(lead) + [t * d for t, d in zip(tap, dilation)]
        # the leading (batch, channel) dims are taken whole: end_mask, so they may be dynamic
        end = [0] * len(lead) + [b + (o - 1) * s + 1 for b, o, s in zip(begin[len(lead):], outs, stride)]
        strides = [1] * len(lead) + list(stride)
        t = ctx.op("STRIDED_SLICE", [xp, np.asarray(begin, np.int32), np.asarray(end, np.int32),
                                     np.asarray(strides, np.int32)], shape=lead + tuple(outs), dtype=x.dtype,
                   endMask=(1 << len(lead)) - 1)
        taps.append(ctx.reshape(t, t.shape + (1,)))
        offsets.append(sum(t_ * d * int(np.prod(spatial[i + 1:])) for i, (t_, d) in enumerate(zip(tap, dilation))))
    stacked = taps[0] if len(taps) == 1 else ctx.op("CONCATENATION", taps, shape=lead + tuple(outs) + (len(taps),),
                                                      dtype=x.dtype, axis=len(lead) + nd)
    last = np.asarray([stacked.rank - 1], np.int32)
    out_shape = lead + tuple(outs)
    values = ctx.op("REDUCE_MAX", [stacked, last], shape=out_shape, dtype=x.dtype, keepDims=False)
    axis = np.asarray(stacked.rank - 1, np.int32)
    which = ctx.op("ARG_MAX", [stacked, axis], shape=out_shape, dtype=I32, outputType=2)
    if x.dtype.kind == "f":  # a NaN wins its window, like torch
        nan = ctx.op("NOT_EQUAL", [stacked, stacked], shape=stacked.shape, dtype=BOOL)
        any_nan = ctx.op("REDUCE_ANY", [nan, last], shape=out_shape, dtype=BOOL, keepDims=False)
        first_nan = ctx.op("ARG_MAX", [ctx.cast(nan, I32), axis], shape=out_shape, dtype=I32, outputType=2)
        which = ctx.op("SELECT_V2", [any_nan, first_nan, which], shape=out_shape, dtype=I32)
        values = ctx.op("SELECT_V2", [any_nan, ctx.const(np.asarray(np.nan, x.dtype)), values], shape=out_shape,
                        dtype=x.dtype)
    # flat index of each window's first tap in the unpadded input, plus the chosen tap's offset
    base = np.zeros(outs, np.int64)
    for i, (o, s_, p_) in enumerate(zip(outs, stride, padding)):
        shape = [1] * nd
        shape[i] = o
        base = base + ((np.arange(o) * s_ - p_) * int(np.prod(spatial[i + 1:]))).reshape(shape)
    tap_offset = ctx.op("GATHER", [ctx.const(np.asarray(offsets, np.int32)), which], shape=which.shape, dtype=I32,
                        axis=0)
    index = ctx.op("ADD", [tap_offset, ctx.const(base.astype(np.int32))], shape=which.shape, dtype=I32)
    return values, index


@builds(aten.max_pool2d.default, aten.max_pool1d.default)
def max_pool(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _pool_nd(ctx, x, kernel_size, stride, padding, dilation, ceil_mode, _max_pool2d)


def _pool_nd(ctx, x, kernel, stride, padding, dilation, ceil_mode, pool2d):
    nd = 2 if ctx.node.target in _POOLS_2D else 1
    if x.rank == nd + 1:  # unbatched
        y = _pool_nd(ctx, ctx.reshape(x, (1,) + x.shape), kernel, stride, padding, dilation, ceil_mode, pool2d)
        return ctx.reshape(y, y.shape[1:])
    if nd == 1:  # 1-D pooling over a height of 1
        x2 = ctx.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        y = pool2d(ctx, x2, (1,) + _tuple(kernel, 1), (1,) + _tuple(stride, 1) if stride else (1,) + _tuple(kernel, 1),
                   (0,) + _tuple(padding, 1), (1,) + _tuple(dilation, 1), ceil_mode)
        return ctx.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))
    return pool2d(ctx, x, kernel, stride, padding, dilation, ceil_mode)


@builds(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    if _indices_used(ctx):
        return _max_pool_taps(ctx, x, 3, kernel_size, stride, padding, dilation, ceil_mode)
    return _pool3d(ctx, x, kernel_size, stride, padding, dilation, ceil_mode, "max"), Missing("max pooling indices")


def _pool3d(ctx, x, kernel, stride, padding, dilation, ceil_mode, kind, count_include_pad=True):
    # separable: a 2-D pool over (H, W), then one over D (max and average both factor)
    kernel = _tuple(kernel, 3)
    stride = _tuple(stride, 3) if stride else kernel
    padding, dilation = _tuple(padding, 3), _tuple(dilation, 3)
    if x.rank == 4:
        x = ctx.reshape(x, (1,) + x.shape)
        squeeze = True
    else:
        squeeze = False
    n, c, d, h, w = x.shape
    x1 = ctx.reshape(x, (n, c * d, h, w))
    if kind == "max":
        y1 = _max_pool2d(ctx, x1, kernel[1:], stride[1:], padding[1:], dilation[1:], ceil_mode)
    else:
        y1 = _avg_pool2d(ctx, x1, kernel[1:], stride[1:], padding[1:], ceil_mode, count_include_pad, None)
    ho, wo = y1.shape[2:]
    x2 = ctx.reshape(y1, (n, c, d, ho * wo))
    if kind == "max":
        y2 = _max_pool2d(ctx, x2, (kernel[0], 1), (stride[0], 1), (padding[0], 0), (dilation[0], 1), ceil_mode)
    else:
        y2 = _avg_pool2d(ctx, x2, (kernel[0], 1), (stride[0], 1), (padding[0], 0), ceil_mode, count_include_pad, None)
    y = ctx.reshape(y2, (n, c, y2.shape[2], ho, wo))
    return ctx.reshape(y, y.shape[1:]) if squeeze else y


def _avg_divisors(spatial, kernel, stride, padding, ceil_mode, count_include_pad, outs):
    # torch's divisor of each output position (as avg_pool2d computes it), per spatial dim.
    per_dim = []
    for n, k, s, p, o in zip(spatial, kernel, stride, padding, outs):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        size = end - start
        if not count_include_pad:
            size = np.minimum(end, n) - np.maximum(start, 0)
        per_dim.append(size.astype(np.float64))
    return per_dim


def _avg_pool2d(ctx, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel = _tuple(kernel, 2)
    stride = _tuple(stride, 2) if stride else kernel
    padding = _tuple(padding, 2)
    n, c, h, w = x.shape
    outs, pads = _pool_geometry((h, w), kernel, stride, padding, ceil_mode)
    xl = _pad_channels_last(ctx, ctx.to_channels_last(x), pads)
    y = _channels_last_op(ctx, "AVERAGE_POOL_2D", [xl], (n, c, *outs), x.dtype, padding=schema.VALID,
                          strideH=stride[0], strideW=stride[1], filterHeight=kernel[0], filterWidth=kernel[1])
    # AVERAGE_POOL_2D divides by the kernel area; torch may divide by something else
    if divisor_override is None and not any(padding) and not ceil_mode:
        return ctx.from_channels_last(y)  # every window is whole
    ctx.static((h, w), "its divisors (the window sizes at the borders) are a table built at conversion time")
    dh, dw = _avg_divisors((h, w), kernel, stride, padding, ceil_mode, count_include_pad, outs)
    div = np.outer(dh, dw) if divisor_override is None else np.full(outs, float(divisor_override))
    factor = (kernel[0] * kernel[1]) / div
    if not np.allclose(factor, 1.0, rtol=0, atol=1e-12):
        scale = ctx.const(factor.reshape(1, outs[0], outs[1], 1).astype(x.dtype))
        y2 = ctx.channels_last_tensor((n, c, *outs), x.dtype)
        ctx.op("MUL", [y, scale], outputs=[y2])
        y = y2
    return ctx.from_channels_last(y)


@builds(aten.avg_pool2d.default, aten.avg_pool1d.default)
def avg_pool(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
             divisor_override=None):
    def pool2d(ctx_, x_, k, s, p, _dilation, ceil):
        return _avg_pool2d(ctx_, x_, k, s, p, ceil, count_include_pad, divisor_override)
    return _pool_nd(ctx, x, kernel_size, stride, padding, 1, ceil_mode, pool2d)


@builds(aten.avg_pool3d.default)
def avg_pool3d(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    if divisor_override is None:
        return _pool3d(ctx, x, kernel_size, stride, padding, 1, ceil_mode, "avg", count_include_pad)
    # the window sum over the given divisor: the average that counts padding times its window's size
    # (smaller than the kernel where ceil_mode windows run past the padded input)
    y = _pool3d(ctx, x, kernel_size, stride, padding, 1, ceil_mode, "avg", True)
    kernel = _tuple(kernel_size, 3)
    spatial = ctx.static(x.shape[2:], "its window sizes at the borders are a table built at conversion time")
    sizes = _avg_divisors(spatial, kernel, _tuple(stride, 3) if stride else kernel, _tuple(padding, 3), ceil_mode,
                          True, y.shape[2:])
    factor = np.einsum("i,j,k->ijk", *sizes) / divisor_override
    return ctx.op("MUL", [y, ctx.const(factor.reshape((1,) * (y.rank - 3) + factor.shape).astype(x.dtype))],
                  shape=y.shape, dtype=x.dtype)


def _adaptive_matrix(n: int, out: int) -> np.ndarray:
    # (out, n) averaging matrix of adaptive pooling along one dim (torch's start/end rule).
    m = np.zeros((out, n))
    for i in range(out):
        start, end = (i * n) // out, -(-((i + 1) * n) // out)
        m[i, start:end] = 1.0 / (end - start)
    return m


def _adaptive_avg(ctx, x, out_sizes):
    spatial = x.shape[2:]
    nd = len(spatial)
    out_sizes = tuple(s if o is None else int(o) for s, o in zip(spatial, out_sizes))
    if all(o == 1 for o in out_sizes):
        return ctx.op("MEAN", [x, np.arange(2, 2 + nd, dtype=np.int32)], keepDims=True)
    if out_sizes == spatial:
        return x
    spatial = ctx.static(spatial, "its pooling windows depend on the input size and are fixed at conversion")
    if nd == 2 and all(s % o == 0 for s, o in zip(spatial, out_sizes)):
        k = tuple(s // o for s, o in zip(spatial, out_sizes))
        return _avg_pool2d(ctx, x, k, k, (0, 0), False, True, None)
    # general case: a constant averaging matrix per spatial dim, applied on the last axis in turn
    y = x
    for i in range(nd):
        axis = 2 + i
        perm = list(range(y.rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        yt = ctx.transpose(y, perm)
        m = _adaptive_matrix(spatial[i], out_sizes[i]).astype(x.dtype)
        yt = ctx.op("FULLY_CONNECTED", [yt, ctx.const(m), None], shape=yt.shape[:-1] + (out_sizes[i],),
                    dtype=x.dtype, keepNumDims=True)
        y = ctx.transpose(yt, perm)
    return y


@builds(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool1d.default,
        aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool3d.default)
def adaptive_avg_pool(ctx, x, output_size):
    nd = len(output_size)
    if x.rank == nd + 1:  # unbatched
        y = _adaptive_avg(ctx, ctx.reshape(x, (1,) + x.shape), output_size)
        return ctx.reshape(y, y.shape[1:])
    return _adaptive_avg(ctx, x, output_size)


# ---- resampling ----------------------------------------------------------------------------

def _resize_size(x, output_size, scale_factors):
    if output_size is not None:
        return tuple(int(s) for s in output_size), None
    scales = tuple(float(s) for s in scale_factors)
    return tuple(int(math.floor(n * s)) for n, s in zip(x.shape[2:], scales)), scales


def _nearest_index(n_in, n_out, scale):
    # torch "nearest": src = floor(dst * scale), scale = in/out or 1/scale_factor
    s = (n_in / n_out) if scale is None else 1.0 / scale
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float64) * np.float32(s)).astype(np.int64), n_in - 1)


def _integer_factors(ctx, output_size, scale_factors) -> tuple:
    # A dynamic image is resized exactly like torch only by integer factors: other sizes sample at
    # positions that torch computes from each size (tables built at conversion time).
    if output_size is not None or scale_factors is None or any(float(f) != int(f) or f < 1 for f in scale_factors):
        raise ctx.unsupported("resizing an image of dynamic size needs integer scale factors: the sampling "
                              "positions of other resizes are tables built at conversion time")
    return tuple(int(f) for f in scale_factors)


def _resize_dynamic(ctx, x, code, size, **options):
    y = _channels_last_op(ctx, code, [ctx.to_channels_last(x), ctx.vector(size)], (*x.shape[:2], *size), x.dtype,
                          **options)
    return ctx.from_channels_last(y)


@builds(aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default)
def upsample_nearest2d(ctx, x, output_size, scale_factors=None, *rest):
    if isinstance(scale_factors, (int, float)) and rest:  # .default: (output_size, scales_h, scales_w)
        scale_factors = (scale_factors, rest[0])
    if not all_static(x.shape[2:]):
        fh, fw = _integer_factors(ctx, output_size, scale_factors)
        if fh == fw and 1 < fh <= 4:
            return _depth_to_space_upscale(ctx, x, fh)
        # RESIZE_NEAREST_NEIGHBOR reads floor(dst * float32(in / out)): torch's dst // f when that float is not below 1/f
        if any(Fraction(float(np.float32(1 / f))) < Fraction(1, f) for f in (fh, fw)):
            raise ctx.unsupported(f"nearest resizing of a dynamic size by {fh}x{fw}: TFLite's float scale would "
                                  "round some positions differently from torch's")
        return _resize_dynamic(ctx, x, "RESIZE_NEAREST_NEIGHBOR", (x.shape[2] * fh, x.shape[3] * fw))
    size, scales = _resize_size(x, output_size, scale_factors)
    idx = [_nearest_index(n, o, None if scales is None else s)
           for n, o, s in zip(x.shape[2:], size, scales or (None, None))]
    tflite = [np.minimum(np.floor(np.arange(o) * (n / o)).astype(np.int64), n - 1) for n, o in zip(x.shape[2:], size)]
    n, c = x.shape[:2]
    factor = size[0] // x.shape[2] if x.shape[2] else 0
    if factor > 1 and size == (x.shape[2] * factor, x.shape[3] * factor) and factor <= 4 and \
            all(np.array_equal(a, np.arange(o) // factor) for a, o in zip(idx, size)):
        return _depth_to_space_upscale(ctx, x, factor)
    if all(np.array_equal(a, b) for a, b in zip(idx, tflite)):
        y = _channels_last_op(ctx, "RESIZE_NEAREST_NEIGHBOR", [ctx.to_channels_last(x), np.asarray(size, np.int32)],
                              (n, c, *size), x.dtype)
        return ctx.from_channels_last(y)
    y = x
    for axis, ix in ((2, idx[0]), (3, idx[1])):
        shape = list(y.shape)
        shape[axis] = len(ix)
        y = ctx.op("GATHER", [y, ix.astype(np.int32)], shape=tuple(shape), dtype=x.dtype, axis=axis)
    return y


def _depth_to_space_upscale(ctx, x, factor):
    # an integer upscale: the channels copied factor^2 times, then DEPTH_TO_SPACE (both run on
    # XNNPACK, RESIZE_NEAREST_NEIGHBOR does not)
    n, c, h, w = x.shape
    xl = ctx.to_channels_last(x)
    copies = _channels_last_op(ctx, "CONCATENATION", [xl] * factor ** 2, (n, c * factor ** 2, h, w), x.dtype, axis=3)
    y = _channels_last_op(ctx, "DEPTH_TO_SPACE", [copies], (n, c, h * factor, w * factor), x.dtype, blockSize=factor)
    return ctx.from_channels_last(y)


@builds(aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default)
def upsample_bilinear2d(ctx, x, output_size, align_corners, scale_factors=None, *rest):
    if isinstance(scale_factors, (int, float)) and rest:
        scale_factors = (scale_factors, rest[0])
    if not all_static(x.shape[2:]):
        fh, fw = _integer_factors(ctx, output_size, scale_factors)
        opts = {"alignCorners": True} if align_corners else {"halfPixelCenters": True}
        return _resize_dynamic(ctx, x, "RESIZE_BILINEAR", (x.shape[2] * fh, x.shape[3] * fw), **opts)
    size, scales = _resize_size(x, output_size, scale_factors)
    n, c = x.shape[:2]
    consistent = scales is None or all(o == n_ * s for n_, o, s in zip(x.shape[2:], size, scales))
    if consistent:
        opts = {"alignCorners": True} if align_corners else {"halfPixelCenters": True}
        y = _channels_last_op(ctx, "RESIZE_BILINEAR", [ctx.to_channels_last(x), np.asarray(size, np.int32)],
                              (n, c, *size), x.dtype, **opts)
        return ctx.from_channels_last(y)
    return _resize_by_matrices(ctx, x, size, scales, align_corners, linear_resize_matrix)


@builds(aten._upsample_bilinear2d_aa.default, aten._upsample_bilinear2d_aa.vec)
def upsample_bilinear2d_aa(ctx, x, output_size, align_corners, *scales):
    """Antialiased bilinear resize: a constant (out, in) weight matrix per spatial axis."""
    scale_factors = scales[0] if len(scales) == 1 else (None if all(s is None for s in scales) else scales)
    size, factors = _resize_size(x, output_size, scale_factors) if output_size is None or scale_factors is None \
        else (tuple(int(v) for v in output_size), tuple(float(v) for v in scale_factors))
    return _resize_by_matrices(ctx, x, size, factors, align_corners, antialiased_linear_resize_matrix)


def _resize_by_matrices(ctx, x, size, scales, align_corners, matrix):
    ctx.static(x.shape[2:], "the resize weights are computed for the sizes at conversion")
    y = x
    for i, axis in enumerate((2, 3)):
        m = matrix(x.shape[axis], size[i], align_corners, None if scales is None else scales[i])
        perm = list(range(4))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        yt = ctx.transpose(y, perm)
        yt = ctx.op("FULLY_CONNECTED", [yt, ctx.const(m.astype(x.dtype)), None],
                    shape=yt.shape[:-1] + (size[i],), dtype=x.dtype, keepNumDims=True)
        y = ctx.transpose(yt, perm)
    return y


# ---- matmuls -------------------------------------------------------------------------------

def fully_connected(ctx, x: Tensor, weight: np.ndarray, bias: np.ndarray | None, out_shape) -> Tensor:
    """``x @ weight.T + bias`` with a constant ``weight`` (out, in): TFLite's FULLY_CONNECTED."""
    ins = [x, ctx.const(np.require(weight, dtype=x.dtype, requirements="C"))]
    if bias is not None:
        ins.append(ctx.const(np.asarray(bias, x.dtype)))
    opts = {"keepNumDims": True} if x.rank > 2 else {}
    return ctx.op("FULLY_CONNECTED", ins, shape=out_shape, dtype=x.dtype, **opts)


def batch_matmul(ctx, a: Tensor, b: Tensor, out_shape, adj_y=False) -> Tensor:
    dt = ctx.out_dtype()
    return ctx.op("BATCH_MATMUL", [ctx.cast(a, dt), ctx.cast(b, dt)], shape=out_shape, dtype=dt, adjY=adj_y)


@builds(aten.linear.default)
def linear(ctx, x, w, b=None):
    if x.rank == 1:
        y = linear(ctx, ctx.reshape(x, (1,) + x.shape), w, b)
        return ctx.reshape(y, ctx.out_shape())
    if x.shape[-1] == 0:
        return _empty_product(ctx, b)
    shape = x.shape[:-1] + (w.shape[0],)
    if w.is_const and (b is None or b.is_const) and x.dtype.kind == "f":
        return fully_connected(ctx, x, w.data, None if b is None else b.data, shape)
    y = batch_matmul(ctx, x, w, shape, adj_y=True)
    return y if b is None else ctx.op("ADD", [y, b], shape=shape)


def _empty_product(ctx, bias=None) -> Tensor:
    # A product over an empty inner dim: zeros (plus the bias).
    zeros = ctx.const(np.zeros(ctx.out_shape(), ctx.out_dtype()))
    return zeros if bias is None else ctx.op("ADD", [zeros, bias])


@builds(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul(ctx, a, b):
    if a.shape[-1] == 0:
        return _empty_product(ctx)
    if b.is_const and b.rank == 2 and a.dtype.kind == "f" and a.rank >= 2:
        return fully_connected(ctx, a, b.data.T, None, ctx.out_shape())
    if a.rank == 1 or b.rank == 1:
        a2 = ctx.reshape(a, (1,) + a.shape) if a.rank == 1 else a
        b2 = ctx.reshape(b, b.shape + (1,)) if b.rank == 1 else b
        shape = broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1])
        return ctx.reshape(batch_matmul(ctx, a2, b2, shape), ctx.out_shape())
    return batch_matmul(ctx, a, b, ctx.out_shape())


@builds(aten.addmm.default)
def addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    vector_bias = (bias.rank if isinstance(bias, Tensor) else 0) <= 1  # a 2-d bias is an ADD after the product
    if b.is_const and (bias.is_const if isinstance(bias, Tensor) else True) and a.dtype.kind == "f" \
            and vector_bias and beta != 0:
        w = b.data.T * alpha if alpha != 1 else b.data.T
        bv = np.broadcast_to(bias.data if isinstance(bias, Tensor) else np.asarray(bias, a.dtype), (b.shape[1],))
        return fully_connected(ctx, a, w, bv * beta if beta != 1 else bv, ctx.out_shape())
    return _beta_alpha(ctx, bias, matmul(ctx, a, b), beta, alpha)


def _beta_alpha(ctx, bias, y: Tensor, beta, alpha) -> Tensor:
    # ``beta * bias + alpha * y`` as torch's addmm family computes it (beta=0 ignores the bias, NaNs too)
    if alpha != 1:
        y = ctx.op("MUL", [y, ctx.const(np.asarray(alpha, y.dtype))])
    if beta == 0:
        return y
    if beta != 1:
        bias = ctx.op("MUL", [bias, ctx.const(np.asarray(beta, y.dtype))], shape=bias.shape)
    return ctx.op("ADD", [y, bias])


@builds(aten.addmv.default)
def addmv(ctx, bias, mat, vec, *, beta=1, alpha=1):
    return _beta_alpha(ctx, bias, matmul(ctx, mat, vec), beta, alpha)


@builds(aten.addbmm.default)
def addbmm(ctx, bias, b1, b2, *, beta=1, alpha=1):
    # the sum over the batch of b1[i] @ b2[i]
    if b1.shape[-1] == 0 or b1.shape[0] == 0:
        return _beta_alpha(ctx, bias, _empty_product(ctx), beta, alpha)
    products = batch_matmul(ctx, b1, b2, (b1.shape[0], b1.shape[1], b2.shape[2]))
    y = ctx.op("SUM", [products, np.asarray([0], np.int32)], shape=products.shape[1:], dtype=products.dtype)
    return _beta_alpha(ctx, bias, y, beta, alpha)


@builds(aten.baddbmm.default)
def baddbmm(ctx, bias, a, b, *, beta=1, alpha=1):
    return addmm(ctx, bias, a, b, beta=beta, alpha=alpha)


# ---- normalisation -------------------------------------------------------------------------

def _per_channel(ctx, v: np.ndarray, rank: int, dtype) -> Tensor:
    return ctx.const(np.asarray(v, dtype).reshape((-1,) + (1,) * (rank - 2)))


def _affine_norm(ctx, x, w, b, mean, var, eps):
    if all(t is None or t.is_const for t in (w, b, mean, var)):
        scale = 1.0 / np.sqrt(var.data.astype(np.float64) + eps)
        if w is not None:
            scale = scale * w.data
        shift = -mean.data * scale
        if b is not None:
            shift = shift + b.data
        y = ctx.op("MUL", [x, _per_channel(ctx, scale, x.rank, x.dtype)], shape=x.shape, dtype=x.dtype)
        return ctx.op("ADD", [y, _per_channel(ctx, shift, x.rank, x.dtype)], shape=x.shape, dtype=x.dtype)
    c = x.shape[1]
    shape = (c,) + (1,) * (x.rank - 2)
    rstd = ctx.op("RSQRT", [ctx.op("ADD", [ctx.reshape(var, shape), ctx.const(np.asarray(eps, x.dtype))],
                                   shape=shape, dtype=x.dtype)], shape=shape, dtype=x.dtype)
    y = ctx.op("MUL", [ctx.op("SUB", [x, ctx.reshape(mean, shape)], shape=x.shape, dtype=x.dtype), rstd],
               shape=x.shape, dtype=x.dtype)
    if w is not None:
        y = ctx.op("MUL", [y, ctx.reshape(w, shape)], shape=x.shape, dtype=x.dtype)
    if b is not None:
        y = ctx.op("ADD", [y, ctx.reshape(b, shape)], shape=x.shape, dtype=x.dtype)
    return y


@builds(aten._native_batch_norm_legit_no_training.default)
def batch_norm_inference(ctx, x, w, b, mean, var, momentum, eps):
    empty = ctx.const(np.zeros((0,), x.dtype))
    return _affine_norm(ctx, x, w, b, mean, var, eps), empty, empty


def _moments(ctx, x, axes, eps):
    """(x - mean, mean, 1 / sqrt(var + eps)) over ``axes`` (kept as size-1 dims): the norms' statistics."""
    axes = np.asarray(axes, np.int32)
    stat_shape = tuple(1 if i in set(axes.tolist()) else n for i, n in enumerate(x.shape))
    mean = ctx.op("MEAN", [x, axes], shape=stat_shape, dtype=x.dtype, keepDims=True)
    d = ctx.op("SUB", [x, mean], shape=x.shape, dtype=x.dtype)
    var = ctx.op("MEAN", [ctx.op("MUL", [d, d], shape=x.shape, dtype=x.dtype), axes], shape=stat_shape,
                 dtype=x.dtype, keepDims=True)
    rstd = ctx.op("RSQRT", [ctx.op("ADD", [var, ctx.const(np.asarray(eps, x.dtype))], shape=stat_shape,
                                   dtype=x.dtype)], shape=stat_shape, dtype=x.dtype)
    return d, mean, rstd


@builds(aten._native_batch_norm_legit.default, aten._native_batch_norm_legit.no_stats)
def batch_norm_training(ctx, x, w, b, *rest):
    if len(rest) == 5:  # (running_mean, running_var, training, momentum, eps)
        running_mean, running_var, training, momentum, eps = rest
        if not training:
            empty = ctx.const(np.zeros((0,), x.dtype))
            return _affine_norm(ctx, x, w, b, running_mean, running_var, eps), empty, empty
    else:
        training, momentum, eps = rest
    d, mean, rstd = _moments(ctx, x, [0] + list(range(2, x.rank)), eps)
    y = ctx.op("MUL", [d, rstd], shape=x.shape, dtype=x.dtype)
    shape = (x.shape[1],) + (1,) * (x.rank - 2)
    if w is not None:
        y = ctx.op("MUL", [y, ctx.reshape(w, shape)], shape=x.shape, dtype=x.dtype)
    if b is not None:
        y = ctx.op("ADD", [y, ctx.reshape(b, shape)], shape=x.shape, dtype=x.dtype)
    c = x.shape[1]
    return y, ctx.reshape(mean, (c,)), ctx.reshape(rstd, (c,))


@builds(aten.batch_norm.default)
def batch_norm(ctx, x, w, b, running_mean, running_var, training, momentum, eps, cudnn_enabled=False):
    if training or running_mean is None:
        return batch_norm_training(ctx, x, w, b, True, momentum, eps)[0]
    return _affine_norm(ctx, x, w, b, running_mean, running_var, eps)


def layer_norm_tensor(ctx, x, ndims: int, w, b, eps):
    d, mean, rstd = _moments(ctx, x, range(x.rank - ndims, x.rank), eps)
    y = ctx.op("MUL", [d, rstd], shape=x.shape, dtype=x.dtype)
    if w is not None:
        y = ctx.op("MUL", [y, w], shape=x.shape, dtype=x.dtype)
    if b is not None:
        y = ctx.op("ADD", [y, b], shape=x.shape, dtype=x.dtype)
    return y, mean, rstd


@builds(aten.native_layer_norm.default)
def native_layer_norm(ctx, x, normalized_shape, w, b, eps):
    return layer_norm_tensor(ctx, x, len(normalized_shape), w, b, eps)


@builds(aten.layer_norm.default)
def layer_norm(ctx, x, normalized_shape, w=None, b=None, eps=1e-5, cudnn_enable=True):
    return layer_norm_tensor(ctx, x, len(normalized_shape), w, b, eps)[0]


@builds(aten.rms_norm.default)
def rms_norm(ctx, x, normalized_shape, w=None, eps=None):
    n = len(normalized_shape)
    axes = np.arange(x.rank - n, x.rank, dtype=np.int32)
    stat_shape = x.shape[:x.rank - n] + (1,) * n
    eps = float(np.finfo(np.float32).eps) if eps is None else eps
    ms = ctx.op("MEAN", [ctx.op("MUL", [x, x], shape=x.shape, dtype=x.dtype), axes], shape=stat_shape,
                dtype=x.dtype, keepDims=True)
    r = ctx.op("RSQRT", [ctx.op("ADD", [ms, ctx.const(np.asarray(eps, x.dtype))], shape=stat_shape, dtype=x.dtype)],
               shape=stat_shape, dtype=x.dtype)
    y = ctx.op("MUL", [x, r], shape=x.shape, dtype=x.dtype)
    return y if w is None else ctx.op("MUL", [y, w], shape=x.shape, dtype=x.dtype)


def _group_mean(ctx, stat: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    # Per-channel statistics (N, C, 1...) averaged within each of ``groups`` channel groups:
    # broadcast back to (N, C, 1...), and per group (N, G).
    n, c = stat.shape[:2]
    if groups == c:
        return stat, ctx.reshape(stat, (n, c))
    g = ctx.reshape(stat, (n, groups, c // groups))
    m = ctx.op("MEAN", [g, np.asarray([2], np.int32)], shape=(n, groups, 1), dtype=stat.dtype, keepDims=True)
    per_group = ctx.reshape(m, (n, groups))
    m = ctx.op("ADD", [m, ctx.const(np.zeros((1, 1, c // groups), stat.dtype))], shape=(n, groups, c // groups),
               dtype=stat.dtype)
    return ctx.reshape(m, stat.shape), per_group


@builds(aten.native_group_norm.default)
def native_group_norm(ctx, x, w, b, n, c, hw, groups, eps):
    # Per-channel means over the spatial dims, then averaged per group: every op on the full
    # tensor is elementwise or a spatial MEAN, which keeps group norm in NHWC after layout.
    orig = x
    if x.rank == 2:
        x = ctx.reshape(x, x.shape + (1,))
    axes = np.arange(2, x.rank, dtype=np.int32)
    stat_shape = x.shape[:2] + (1,) * (x.rank - 2)
    mean, group_mean = _group_mean(ctx, ctx.op("MEAN", [x, axes], shape=stat_shape, dtype=x.dtype, keepDims=True),
                                   groups)
    d = ctx.op("SUB", [x, mean], shape=x.shape, dtype=x.dtype)
    var = ctx.op("MEAN", [ctx.op("MUL", [d, d], shape=x.shape, dtype=x.dtype), axes], shape=stat_shape,
                 dtype=x.dtype, keepDims=True)
    var, group_var = _group_mean(ctx, var, groups)
    rstd = ctx.op("RSQRT", [ctx.op("ADD", [var, ctx.const(np.asarray(eps, x.dtype))], shape=stat_shape,
                                   dtype=x.dtype)], shape=stat_shape, dtype=x.dtype)
    scale = rstd
    cshape = (x.shape[1],) + (1,) * (x.rank - 2)
    if w is not None:
        scale = ctx.op("MUL", [rstd, ctx.reshape(w, cshape)], shape=stat_shape, dtype=x.dtype)
    y = ctx.op("MUL", [d, scale], shape=x.shape, dtype=x.dtype)
    if b is not None:
        y = ctx.op("ADD", [y, ctx.reshape(b, cshape)], shape=x.shape, dtype=x.dtype)
    group_rstd = ctx.op("RSQRT", [ctx.op("ADD", [group_var, ctx.const(np.asarray(eps, x.dtype))],
                                         shape=group_var.shape, dtype=x.dtype)], shape=group_var.shape, dtype=x.dtype)
    return ctx.reshape(y, orig.shape), group_mean, group_rstd


@builds(aten.group_norm.default)
def group_norm(ctx, x, groups, w=None, b=None, eps=1e-5, cudnn_enabled=True):
    return native_group_norm(ctx, x, w, b, x.shape[0], x.shape[1], 0, groups, eps)[0]


# ---- softmax and attention -----------------------------------------------------------------

def _last_axis_op(ctx, code, x, dim, **options):
    dim = dim % x.rank if x.rank else 0
    if x.rank == 0:
        x1 = ctx.reshape(x, (1,))
        return ctx.reshape(_last_axis_op(ctx, code, x1, 0, **options), ())
    if dim == x.rank - 1:
        return ctx.op(code, [x], shape=x.shape, dtype=x.dtype, **options)
    perm = list(range(x.rank))
    perm[dim], perm[-1] = perm[-1], perm[dim]
    y = ctx.op(code, [ctx.transpose(x, perm)], shape=tuple(x.shape[p] for p in perm), dtype=x.dtype, **options)
    return ctx.transpose(y, perm)


@builds(aten._softmax.default, aten.softmax.int)
def softmax(ctx, x, dim, half_to_float=False):
    return _last_axis_op(ctx, "SOFTMAX", ctx.cast(x, ctx.out_dtype()), dim, beta=1.0)


@builds(aten._log_softmax.default, aten.log_softmax.int)
def log_softmax(ctx, x, dim, half_to_float=False):
    return _last_axis_op(ctx, "LOG_SOFTMAX", ctx.cast(x, ctx.out_dtype()), dim)


@builds(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    if dropout_p:   # training-mode attention dropout: the math attention with a random mask
        return inline(ctx, attention_with_dropout, (q, k, v),
                      dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale))
    e = q.shape[-1]
    lq, sk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    if k.rank >= 3 and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = _repeat_heads(ctx, k, rep), _repeat_heads(ctx, v, rep)
    qs = ctx.op("MUL", [q, ctx.const(np.asarray(scale, q.dtype))], shape=q.shape, dtype=q.dtype)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
    scores = ctx.op("BATCH_MATMUL", [qs, k], shape=batch + (lq, sk), dtype=q.dtype, adjY=True)
    lowest = np.finfo(q.dtype).min
    if is_causal:
        scores = ctx.op("ADD", [scores, _causal_bias(ctx, lq, sk, q.dtype)], shape=scores.shape, dtype=q.dtype)
    if attn_mask is not None:
        shape = broadcast_shapes(scores.shape, attn_mask.shape)
        if attn_mask.dtype == BOOL:
            scores = ctx.op("SELECT_V2", [attn_mask, scores, ctx.const(np.asarray(lowest, q.dtype))],
                            shape=shape, dtype=q.dtype)
        else:
            scores = ctx.op("ADD", [scores, ctx.cast(attn_mask, q.dtype)], shape=shape, dtype=q.dtype)
    p = ctx.op("SOFTMAX", [scores], shape=scores.shape, dtype=q.dtype, beta=1.0)
    if attn_mask is not None and attn_mask.dtype == BOOL:
        # torch attends to nothing (zeros) from a query whose mask row is all False; SOFTMAX would
        # spread it evenly over every key instead
        some = ctx.op("REDUCE_ANY", [attn_mask, np.asarray([-1], np.int32)], shape=attn_mask.shape[:-1] + (1,),
                      dtype=BOOL, keepDims=True)
        p = ctx.op("SELECT_V2", [some, p, ctx.const(np.zeros((), q.dtype))], shape=p.shape, dtype=q.dtype)
    return ctx.op("BATCH_MATMUL", [p, v], dtype=q.dtype)


def _causal_bias(ctx, lq, sk, dtype) -> Tensor:
    # 0 where key j <= query i, the lowest float elsewhere (torch's top-left causal mask)
    lowest = np.finfo(dtype).min
    if is_static(lq) and is_static(sk):
        keep = np.tril(np.ones((lq, sk), bool))
        return ctx.const(np.where(keep, 0.0, lowest).astype(dtype))
    # a dynamic length: the mask from two iotas, at run time (once per graph)
    if ("causal", lq, sk, dtype) in ctx.cache:
        return ctx.cache["causal", lq, sk, dtype]
    zero, one = ctx.const(np.asarray(0, np.int32)), ctx.const(np.asarray(1, np.int32))
    rows = ctx.op("RANGE", [zero, ctx.reshape(ctx.dim(lq), ()), one], shape=(lq,), dtype=I32)
    cols = ctx.op("RANGE", [zero, ctx.reshape(ctx.dim(sk), ()), one], shape=(sk,), dtype=I32)
    keep = ctx.op("LESS_EQUAL", [cols, ctx.reshape(rows, (lq, 1))], shape=(lq, sk), dtype=BOOL)
    bias = ctx.op("SELECT_V2", [keep, ctx.const(np.zeros((), dtype)), ctx.const(np.asarray(lowest, dtype))],
                  shape=(lq, sk), dtype=dtype)
    ctx.cache["causal", lq, sk, dtype] = bias
    return bias


def _repeat_heads(ctx, t: Tensor, rep: int) -> Tensor:
    # (..., h, s, d) -> (..., h * rep, s, d), each head repeated ``rep`` times in place.
    lead, (h, s, d) = t.shape[:-3], t.shape[-3:]
    t5 = ctx.reshape(t, lead + (h, 1, s, d))
    t5 = ctx.broadcast_to(t5, lead + (h, rep, s, d))
    return ctx.reshape(t5, lead + (h * rep, s, d))


# ---- embeddings ----------------------------------------------------------------------------

@builds(aten.embedding.default)
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if weight.rank == 2 and weight.is_const:
        # TFLite's own op for a table lookup: 1-D int32 ids, one row each
        ids = ctx.reshape(ctx.cast(indices, I32), (indices.size,))
        rows = ctx.op("EMBEDDING_LOOKUP", [ids, weight], shape=(indices.size, weight.shape[1]), dtype=weight.dtype)
        return ctx.reshape(rows, ctx.out_shape())
    return ctx.op("GATHER", [weight, ctx.cast(indices, I32)], axis=0)



# ---- grid sampling -------------------------------------------------------------------------

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_BORDER, _REFLECTION = 1, 2


@builds(aten.grid_sampler_2d.default)
def grid_sampler_2d(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    """F.grid_sample: every output point gathers its 1, 4 or 16 input taps from the NHWC input as
    a flat (N*H*W, C) table (GATHER), weighted, with zero weight outside the input."""
    n, c, h, w = ctx.static(x.shape, "its tap positions index a flat table of the input")
    oh, ow = ctx.static(grid.shape[1:3], "its output size is the grid's")
    dt = x.dtype
    pts = (n, oh, ow)

    def f(code, *ins):  # an elementwise op on (n, oh, ow) values
        return ctx.op(code, [i if isinstance(i, Tensor) else ctx.const(np.asarray(i, dt)) for i in ins],
                      shape=pts, dtype=BOOL if code in ("GREATER_EQUAL", "LESS", "LOGICAL_AND", "EQUAL") else dt)

    def coord(axis, size):
        g = ctx.reshape(ctx.op("GATHER", [ctx.cast(grid, dt), ctx.const(np.asarray([axis], np.int32))],
                               shape=pts + (1,), dtype=dt, axis=3), pts)
        scale = (size - 1) / 2 if align_corners else size / 2  # [-1, 1] -> pixel coordinates
        return f("ADD", f("MUL", g, scale), (size - 1) / 2)

    def pad(v, size):
        if padding_mode == _BORDER:
            return f("MINIMUM", f("MAXIMUM", v, 0.0), size - 1.0)
        if padding_mode == _REFLECTION:
            low, high = (0.0, size - 1.0) if align_corners else (-0.5, size - 0.5)
            if high == low:
                return ctx.const(np.zeros(pts, dt))
            span = high - low
            d = f("ABS", f("SUB", v, low))
            extra = f("FLOOR_MOD", d, span)
            even = f("EQUAL", f("FLOOR_MOD", f("FLOOR", f("DIV", d, span)), 2.0), 0.0)
            v = ctx.op("SELECT_V2", [even, f("ADD", extra, low), f("SUB", span + low, extra)], shape=pts, dtype=dt)
            return f("MINIMUM", f("MAXIMUM", v, 0.0), size - 1.0)
        return v

    table = ctx.reshape(ctx.transpose(x, (0, 2, 3, 1)), (n * h * w, c))
    base = ctx.const(np.broadcast_to((np.arange(n) * h * w).reshape(n, 1, 1), pts).astype(dt))

    def tap(ix, iy, weight):
        # weight * x[b, :, iy, ix] as (n, oh, ow, c), zero where (ix, iy) is outside the input
        inside = f("LOGICAL_AND", f("LOGICAL_AND", f("GREATER_EQUAL", ix, 0.0), f("LESS", ix, float(w))),
                   f("LOGICAL_AND", f("GREATER_EQUAL", iy, 0.0), f("LESS", iy, float(h))))
        xi = f("MINIMUM", f("MAXIMUM", ix, 0.0), w - 1.0)
        yi = f("MINIMUM", f("MAXIMUM", iy, 0.0), h - 1.0)
        flat = ctx.cast(f("ADD", base, f("ADD", f("MUL", yi, float(w)), xi)), I32)
        vals = ctx.op("GATHER", [table, flat], shape=pts + (c,), dtype=dt, axis=0)
        wgt = ctx.op("SELECT_V2", [inside, weight, ctx.const(np.zeros((), dt))], shape=pts, dtype=dt)
        return ctx.op("MUL", [vals, ctx.reshape(wgt, pts + (1,))], shape=pts + (c,), dtype=dt)

    def add(a, b):
        return b if a is None else ctx.op("ADD", [a, b], shape=pts + (c,), dtype=dt)

    ix, iy = coord(0, w), coord(1, h)
    out = None
    if interpolation_mode == _BICUBIC:
        x0, y0 = f("FLOOR", ix), f("FLOOR", iy)
        wx, wy = _cubic_weights(f, f("SUB", ix, x0)), _cubic_weights(f, f("SUB", iy, y0))
        for j in range(4):
            yy = pad(f("ADD", y0, j - 1.0), h)
            for i in range(4):
                out = add(out, tap(pad(f("ADD", x0, i - 1.0), w), yy, f("MUL", wx[i], wy[j])))
    else:
        ix, iy = pad(ix, w), pad(iy, h)
        if interpolation_mode == _NEAREST:  # round half to even, like torch's nearbyint
            out = tap(f("ROUND", ix), f("ROUND", iy), ctx.const(np.ones(pts, dt)))
        else:
            x0, y0 = f("FLOOR", ix), f("FLOOR", iy)
            x1, y1 = f("ADD", x0, 1.0), f("ADD", y0, 1.0)
            for xx, yy, wx_, wy_ in ((x0, y0, f("SUB", x1, ix), f("SUB", y1, iy)),
                                     (x1, y0, f("SUB", ix, x0), f("SUB", y1, iy)),
                                     (x0, y1, f("SUB", x1, ix), f("SUB", iy, y0)),
                                     (x1, y1, f("SUB", ix, x0), f("SUB", iy, y0))):
                out = add(out, tap(xx, yy, f("MUL", wx_, wy_)))
    return ctx.transpose(out, (0, 3, 1, 2))


def _cubic_weights(f, t):
    # torch's bicubic convolution weights (A = -0.75) of the 4 taps around a point at fraction t
    a = -0.75

    def near(s):  # |s| <= 1: ((a + 2) s - (a + 3)) s^2 + 1
        return f("ADD", f("MUL", f("MUL", f("SUB", f("MUL", s, a + 2), a + 3), s), s), 1.0)

    def far(s):  # 1 < |s| < 2: ((a s - 5a) s + 8a) s - 4a
        return f("SUB", f("MUL", f("ADD", f("MUL", f("SUB", f("MUL", s, a), 5 * a), s), 8 * a), s), 4 * a)

    one_minus = f("SUB", 1.0, t)
    return far(f("ADD", t, 1.0)), near(t), near(one_minus), far(f("SUB", 2.0, t))
