"""Backward ops of the core opset (what a training graph exports): pooling, convolution,
embedding and normalisation gradients. Their saved inputs (indices, mean, rstd) come from
torch's own forward on the sample."""
from __future__ import annotations

import torch

from ._entry import F32_ACCUM, S, aten, entry

_GRAD = "float32 gradient sums: the accumulation order differs"


def _adaptive_bw(g):
    out = []
    for shape, size, desc in (((2, 3, 7, 6), (3, 4), "uneven windows"), ((1, 2, 4, 4), (1, 1), "global"),
                              ((2, 5, 5), (2, 3), "unbatched")):
        out.append(S(g.f(*shape[:-2], *size), g.f(*shape), desc=desc))
    return out


entry(aten._adaptive_avg_pool2d_backward.default, _adaptive_bw, tol=F32_ACCUM, why=_GRAD)


def _avg_bw(g):
    cases = [((2, 3, 6, 6), [2, 2], [2, 2], [0, 0], False, True, None, "kernel 2"),
             ((1, 2, 7, 6), [3, 3], [2, 2], [1, 1], True, True, None, "pad, ceil_mode"),
             ((1, 2, 7, 6), [3, 2], [2, 1], [1, 1], True, False, None, "count_include_pad=False"),
             ((1, 2, 5, 5), [3, 3], [1, 1], [1, 1], False, True, 4, "divisor_override")]
    out = []
    for shape, k, s, p, ceil, cip, div, desc in cases:
        x = g.f(*shape)
        y = aten.avg_pool2d.default(x, k, s, p, ceil, cip, div)
        out.append(S(g.f(*y.shape), x, k, s, p, ceil, cip, div, desc=desc))
    return out


entry(aten.avg_pool2d_backward.default, _avg_bw, tol=F32_ACCUM, why=_GRAD)


def _max_bw(g):
    cases = [((2, 3, 6, 6), [2, 2], [2, 2], [0, 0], [1, 1], False, "2x2"),
             ((1, 2, 7, 6), [3, 3], [2, 2], [1, 1], [1, 1], True, "overlapping windows, pad, ceil_mode"),
             ((1, 2, 7, 7), [2, 2], [1, 1], [0, 0], [2, 2], False, "dilation")]
    out = []
    for shape, k, s, p, d, ceil, desc in cases:
        x = g.f(*shape)
        y, idx = aten.max_pool2d_with_indices.default(x, k, s, p, d, ceil)
        out.append(S(g.f(*y.shape), x, k, s, p, d, ceil, idx, desc=desc))
    return out


entry(aten.max_pool2d_with_indices_backward.default, _max_bw, tol=F32_ACCUM, why=_GRAD)


def _conv_bw(g):
    cases = [((2, 3, 6, 6), (4, 3, 3, 3), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True], "2-d"),
             ((1, 4, 7, 6), (4, 2, 3, 2), [2, 1], [0, 1], [1, 2], False, [0, 0], 2, [True, True, False],
              "stride, dilation, groups, no bias grad"),
             ((2, 3, 9), (5, 3, 3), [2], [1], [1], False, [0], 1, [False, True, True], "1-d, no input grad"),
             ((1, 4, 4, 4), (4, 3, 3, 3), [2, 2], [1, 1], [1, 1], True, [1, 1], 1, [True, True, True], "transposed")]
    out = []
    for xs, ws, st, pad, dil, tr, op, groups, mask, desc in cases:
        x, w = g.f(*xs), g.f(*ws, lo=-0.5, hi=0.5)
        y = aten.convolution.default(x, w, None, st, pad, dil, tr, op, groups)
        bias = [w.shape[1] * groups if tr else w.shape[0]]
        out.append(S(g.f(*y.shape), x, w, bias, st, pad, dil, tr, op, groups, mask, desc=desc))
    return out


entry(aten.convolution_backward.default, _conv_bw, tol=F32_ACCUM, why=_GRAD)


def _emb_bw(g):
    idx = torch.tensor([[0, 3, 3], [5, 0, 1]])
    return [S(g.f(2, 3, 4), idx, 7, -1, False, desc="duplicates accumulate"),
            S(g.f(2, 3, 4), idx, 7, 3, False, desc="padding_idx 3 gets no gradient"),
            S(g.f(2, 3, 4), idx, 7, -1, True, desc="scale_grad_by_freq"),
            S(g.f(6, 2), torch.tensor([1, 1, 2, 4, 4, 4]), 5, 2, True, desc="1-d, padding_idx and scaling")]


entry(aten.embedding_dense_backward.default, _emb_bw, tol=F32_ACCUM, why=_GRAD)


def _ln_bw(g):
    out = []
    for shape, norm, affine, mask, desc in (((2, 3, 8), [8], True, [True, True, True], "last dim, affine"),
                                            ((2, 3, 4), [3, 4], False, [True, False, False], "two dims, no affine"),
                                            ((4, 6), [6], True, [False, True, True], "weight and bias grads only")):
        x = g.f(*shape)
        w, b = (g.f(*norm), g.f(*norm)) if affine else (None, None)
        _, mean, rstd = aten.native_layer_norm.default(x, norm, w, b, 1e-5)
        out.append(S(g.f(*shape), x, norm, mean, rstd, w, b, mask, desc=desc))
    return out


entry(aten.native_layer_norm_backward.default, _ln_bw, tol=F32_ACCUM, why=_GRAD)


def _gn_bw(g):
    out = []
    for shape, group, affine, mask, desc in (((2, 4, 3, 3), 2, True, [True, True, True], "2 groups, affine"),
                                             ((2, 6, 5), 3, False, [True, False, False], "NCL, no affine"),
                                             ((1, 4, 2, 2), 4, True, [False, True, True], "weight and bias grads")):
        x = g.f(*shape)
        n, c, hxw = shape[0], shape[1], x[0, 0].numel()
        w, b = (g.f(c), g.f(c)) if affine else (None, None)
        _, mean, rstd = aten.native_group_norm.default(x, w, b, n, c, hxw, group, 1e-5)
        out.append(S(g.f(*shape), x, mean, rstd, w, n, c, hxw, group, mask, desc=desc))
    return out


entry(aten.native_group_norm_backward.default, _gn_bw, tol=F32_ACCUM, why=_GRAD)
