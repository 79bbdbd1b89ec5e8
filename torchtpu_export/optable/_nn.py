"""Neural-network ops: matmuls, convolution, normalisation, pooling, resampling, embeddings,
distances, FFTs and dropout."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..numerics import Agreement
from ._entry import EXACT, F32_ACCUM, S, aten, entry

_MATMUL = "float32 dot products: the accumulation order differs (blocked kernels)"
_NORM = "float32 mean/variance over the normalised dims: the summation order differs"


def _mm(g):
    return [S(g.f(3, 4), g.f(4, 5), desc="3x4 @ 4x5"), S(g.t(g.f(3, 4)), g.f(4, 2), desc="transposed lhs"),
            S(g.f(1, 8), g.t(g.f(8, 3)), desc="transposed rhs"), S(g.f(3, 0), g.f(0, 2), desc="empty inner dim"),
            S(g.f(16, 32), g.f(32, 8), desc="16x32 @ 32x8")]


entry(aten.mm.default, _mm, tol=F32_ACCUM, why=_MATMUL)
entry(aten.bmm.default, lambda g: [S(g.f(2, 3, 4), g.f(2, 4, 5), desc="batch 2"),
                                   S(g.t(g.f(3, 5, 4)), g.f(3, 4, 2), desc="transposed lhs"),
                                   S(g.f(1, 16, 32), g.f(1, 32, 8), desc="16x32 @ 32x8")], tol=F32_ACCUM, why=_MATMUL)


def _addmm(g):
    return [S(g.f(5), g.f(3, 4), g.f(4, 5), desc="1-d bias"), S(g.f(3, 5), g.f(3, 4), g.f(4, 5), desc="2-d bias"),
            S(g.f(1, 5), g.f(3, 4), g.f(4, 5), beta=0.5, alpha=2.0, desc="beta=0.5, alpha=2"),
            S(torch.full((3, 5), math.nan), g.f(3, 4), g.f(4, 5), beta=0, desc="beta=0 ignores a nan bias", lowp=False),
            S(g.f(2), g.t(g.f(4, 3)), g.f(3, 2), desc="transposed lhs")]


entry(aten.addmm.default, _addmm, tol=F32_ACCUM, why=_MATMUL)


def _conv(g):
    def w(*s):
        return g.f(*s, lo=-0.5, hi=0.5)
    return [
        S(g.f(2, 3, 8, 8), w(4, 3, 3, 3), g.f(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, desc="2-d 3x3 pad 1"),
        S(g.f(1, 4, 9, 7), w(6, 2, 3, 2), None, [2, 1], [0, 1], [1, 2], False, [0, 0], 2,
          desc="2-d stride 2x1, dilation, groups 2, no bias"),
        S(g.f(2, 4, 6, 6), w(4, 1, 3, 3), g.f(4), [1, 1], [1, 1], [1, 1], False, [0, 0], 4, desc="depthwise"),
        S(g.f(2, 3, 10), w(5, 3, 3), g.f(5), [2], [1], [1], False, [0], 1, desc="1-d stride 2"),
        S(g.f(1, 2, 4, 5, 5), w(3, 2, 2, 3, 3), g.f(3), [1, 2, 1], [0, 1, 1], [1, 1, 1], False, [0, 0, 0], 1,
          desc="3-d"),
        S(g.f(2, 4, 5, 5), w(4, 3, 3, 3), g.f(3), [2, 2], [1, 1], [1, 1], True, [1, 1], 1,
          desc="2-d transposed, stride 2, output_padding 1"),
        S(g.f(1, 4, 5, 4), w(4, 2, 2, 3), None, [1, 2], [0, 1], [2, 1], True, [0, 1], 2,
          desc="2-d transposed, groups 2, dilation"),
        S(g.f(2, 3, 7), w(3, 2, 4), g.f(2), [3], [1], [1], True, [2], 1, desc="1-d transposed"),
        S(g.t(g.f(1, 2, 6, 5)), w(3, 2, 3, 3), g.f(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
          desc="transposed (non-contiguous) input"),
    ]


entry(aten.convolution.default, _conv, tol=F32_ACCUM, why=_MATMUL)


# ---- normalisation -------------------------------------------------------------------------

def _bn_no_training(g):
    return [S(g.f(2, 3, 4, 4), g.f(3), g.f(3), g.f(3), g.f(3, lo=0.5, hi=2), 0.1, 1e-5, desc="NCHW with affine"),
            S(g.f(4, 3), None, None, g.f(3), g.f(3, lo=0.5, hi=2), 0.1, 1e-3, desc="NC, no affine"),
            S(g.f(2, 3, 5), g.f(3), None, g.f(3), g.f(3, lo=0.5, hi=2), 0.1, 1e-5, desc="NCL, weight only"),
            S(g.t(g.f(2, 3, 4, 4)), g.f(3), g.f(3), g.f(3), g.f(3, lo=0.5, hi=2), 0.1, 1e-5, desc="transposed")]


entry(aten._native_batch_norm_legit_no_training.default, _bn_no_training, tol=F32_ACCUM, compared=(0,),
      why=_NORM + "; outputs 1 and 2 (saved stats for a backward that inference never runs) are not compared")


def _bn_no_stats(g):
    return [S(g.f(2, 3, 4, 4), g.f(3), g.f(3), True, 0.1, 1e-5, desc="NCHW with affine"),
            S(g.f(4, 3), None, None, True, 0.1, 1e-5, desc="NC"),
            S(g.f(2, 3, 5) * 10 + 5, g.f(3), None, True, 0.1, 1e-5, desc="large mean")]


entry(aten._native_batch_norm_legit.no_stats, _bn_no_stats, tol=F32_ACCUM, why=_NORM)


def _bn_legit(g):
    return [S(g.f(2, 3, 4, 4), g.f(3), g.f(3), g.f(3), g.f(3, lo=0.5, hi=2), True, 0.1, 1e-5, desc="training"),
            S(g.f(4, 3), None, None, g.f(3), g.f(3, lo=0.5, hi=2), True, 0.3, 1e-3, desc="NC training, no affine"),
            S(g.f(2, 3, 5), g.f(3), g.f(3), g.f(3), g.f(3, lo=0.5, hi=2), False, 0.1, 1e-5, desc="eval")]


def _bn_legit_call(x, w, b, running_mean, running_var, training, momentum, eps):
    # the running stats are updated in place: give the op its own copies
    return aten._native_batch_norm_legit.default(x, w, b, running_mean.clone(), running_var.clone(), training,
                                                  momentum, eps)


def _bn_legit_rewrite(gm):
    """torch.export captures the in-place op as its functional twin (which also returns the new stats)."""
    from ._rewrite import retarget
    retarget(gm, aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default)


entry(aten._native_batch_norm_legit.default, _bn_legit, call=_bn_legit_call, rewrite=_bn_legit_rewrite,
      tol=F32_ACCUM, why=_NORM,
      note="torch.export captures it as _native_batch_norm_legit_functional; the harness puts the op back")
entry(aten._native_batch_norm_legit_functional.default, _bn_legit, tol=F32_ACCUM, why=_NORM, lowp=(),
      note="what torch.export makes of batch norm with batch statistics (F.batch_norm(training=True)); "
           "no half samples: torch's meta function says float32 running stats where eager returns the half type")


def _layer_norm(g):
    return [S(g.f(2, 3, 8), [8], g.f(8), g.f(8), 1e-5, desc="last dim with affine"),
            S(g.f(2, 3, 4), [3, 4], None, None, 1e-5, desc="last two dims, no affine"),
            S(g.f(4, 6) * 100 + 50, [6], g.f(6), None, 1e-6, desc="large mean, weight only"),
            S(g.t(g.f(2, 5, 6)), [6], g.f(6), g.f(6), 1e-5, desc="transposed"),
            S(g.f(3, 1), [1], None, None, 1e-5, desc="single element (zero variance)", lowp=False)]


entry(aten.native_layer_norm.default, _layer_norm, tol=F32_ACCUM, why=_NORM)


def _group_norm(g):
    return [S(g.f(2, 4, 3, 3), g.f(4), g.f(4), 2, 4, 9, 2, 1e-5, desc="2 groups of 2 with affine"),
            S(g.f(2, 6, 5), None, None, 2, 6, 5, 3, 1e-5, desc="NCL, 3 groups, no affine"),
            S(g.f(1, 4, 2, 2) * 10 + 3, g.f(4), None, 1, 4, 4, 4, 1e-5, desc="instance-norm-like, large mean"),
            S(g.f(2, 4, 4) , g.f(4), g.f(4), 2, 4, 4, 1, 1e-5, desc="one group")]


entry(aten.native_group_norm.default, _group_norm, tol=F32_ACCUM, why=_NORM)


# ---- pooling -------------------------------------------------------------------------------

def _max_pool2d(g):
    x = g.f(1, 2, 5, 5)
    x[0, 0, 1, 1] = math.nan
    return [S(g.f(2, 3, 6, 6), [2, 2], desc="2x2"), S(g.f(1, 2, 7, 6), [3, 3], [2, 2], [1, 1], desc="3x3 stride 2 pad 1"),
            S(g.f(1, 2, 7, 7), [3, 2], [2, 1], [1, 0], [2, 1], True, desc="dilation, ceil_mode"),
            S(g.f(2, 5, 5), [2, 2], [2, 2], [0, 0], [1, 1], True, desc="unbatched, ceil_mode"),
            S(x, [2, 2], [1, 1], desc="nan wins", lowp=False), S(g.t(g.f(1, 2, 6, 5)), [2, 2], desc="transposed")]


entry(aten.max_pool2d_with_indices.default, _max_pool2d, tol=EXACT, why="selects inputs; indices")


def _max_pool3d(g):
    return [S(g.f(1, 2, 4, 4, 4), [2, 2, 2], desc="2x2x2"),
            S(g.f(1, 2, 5, 6, 5), [3, 2, 3], [2, 2, 1], [1, 0, 1], [1, 2, 1], True, desc="pad, dilation, ceil_mode"),
            S(g.f(2, 4, 4, 4), [2, 2, 2], desc="unbatched")]


entry(aten.max_pool3d_with_indices.default, _max_pool3d, tol=EXACT, why="selects inputs; indices")


def _avg_pool(nd: int):
    def samples(g):
        sp = (6, 5, 4)[:nd]
        k, s, p = [3] * nd, [2] * nd, [1] * nd
        out = [S(g.f(2, 3, *sp), [2] * nd, desc="kernel 2"),
               S(g.f(1, 2, *sp), k, s, p, desc="kernel 3 stride 2 pad 1"),
               S(g.f(1, 2, *sp), k, s, p, True, desc="ceil_mode"),
               S(g.f(1, 2, *sp), k, s, p, True, False, desc="ceil_mode, count_include_pad=False"),
               S(g.f(2, *sp), k, [1] * nd, p, False, False, desc="unbatched, count_include_pad=False"),
               S(g.t(g.f(1, 2, *sp)), [2] * nd, desc="transposed")]
        if nd > 1:
            out.append(S(g.f(1, 2, *sp), k, s, p, False, True, 5, desc="divisor_override 5"))
        return out
    return samples


_POOL = "float32 window sums: the summation order differs"
entry(aten.avg_pool1d.default, _avg_pool(1), tol=F32_ACCUM, why=_POOL)
entry(aten.avg_pool2d.default, _avg_pool(2), tol=F32_ACCUM, why=_POOL)
entry(aten.avg_pool3d.default, _avg_pool(3), tol=F32_ACCUM, why=_POOL, lowp=())  # torch has no half kernel


def _adaptive(nd: int):
    def samples(g):
        sp = (7, 6, 5)[:nd]
        return [S(g.f(2, 3, *sp), [1] * nd, desc="global"), S(g.f(1, 2, *sp), [3, 4, 2][:nd], desc="uneven windows"),
                S(g.f(1, 2, *sp), list(sp), desc="identity size"), S(g.f(2, *sp), [2] * nd, desc="unbatched"),
                S(g.t(g.f(1, 2, *sp)), [2] * nd, desc="transposed")]
    return samples


entry(aten.adaptive_avg_pool1d.default, _adaptive(1), tol=F32_ACCUM, why=_POOL)
entry(aten._adaptive_avg_pool2d.default, _adaptive(2), tol=F32_ACCUM, why=_POOL)
entry(aten._adaptive_avg_pool3d.default, _adaptive(3), tol=F32_ACCUM, why=_POOL)


# ---- resampling ----------------------------------------------------------------------------

def _bilinear(g):
    return [S(g.f(1, 2, 4, 5), [8, 10], False, None, desc="2x up"),
            S(g.f(1, 2, 4, 5), [8, 10], True, None, desc="align_corners"),
            S(g.f(2, 1, 6, 6), [3, 4], False, None, desc="down"),
            S(g.f(1, 2, 3, 4), None, False, [2.5, 1.5], desc="scale factors 2.5, 1.5"),
            S(g.f(1, 1, 1, 3), [4, 5], True, None, desc="size-1 dim, align_corners"),
            S(g.t(g.f(1, 2, 4, 5)), [7, 9], False, None, desc="transposed")]


entry(aten.upsample_bilinear2d.vec, _bilinear, tol=F32_ACCUM, why="float32 interpolation weights; sums of two")


def _nearest(g):
    return [S(g.f(1, 2, 3, 4), [6, 8], None, desc="2x up"), S(g.f(1, 2, 6, 6), [4, 3], None, desc="down"),
            S(g.f(1, 2, 3, 4), None, [2.0, 1.5], desc="scale factors"),
            S(g.t(g.f(1, 2, 3, 4)), [5, 7], None, desc="transposed")]


entry(aten.upsample_nearest2d.vec, _nearest, tol=EXACT, why="selects inputs")


def _grid(g, n, h, w, lo=-1.2, hi=1.2):
    return g.f(n, h, w, 2, lo=lo, hi=hi)


def _grid_sampler(g):
    out = []
    for mode, mname in ((0, "bilinear"), (1, "nearest"), (2, "bicubic")):
        for pad, pname in ((0, "zeros"), (1, "border"), (2, "reflection")):
            align = (mode + pad) % 2 == 1
            out.append(S(g.f(2, 3, 5, 6), _grid(g, 2, 4, 3), mode, pad, align,
                         desc=f"{mname}, {pname}, align_corners={align}"))
    out += [S(g.f(1, 2, 5, 4), _grid(g, 1, 3, 3), 0, 2, False, desc="bilinear, reflection, align_corners=False"),
            S(g.f(1, 2, 5, 4), _grid(g, 1, 3, 3), 1, 0, True, desc="nearest, zeros, align_corners=True"),
            S(g.f(1, 2, 5, 4), _grid(g, 1, 3, 3), 2, 1, False, desc="bicubic, border, align_corners=False")]
    out.append(S(g.f(1, 2, 4, 4), _grid(g, 1, 3, 3, lo=-3, hi=3), 2, 2, False, desc="bicubic reflection far outside"))
    out.append(S(g.t(g.f(1, 2, 5, 4)), _grid(g, 1, 2, 2), 0, 0, False, desc="transposed input"))
    return out


entry(aten.grid_sampler_2d.default, _grid_sampler, tol=F32_ACCUM * 3, lowp_tol=1e-2,
      why="float32 coordinate arithmetic and weighted sums of up to 16 taps; in float16/bfloat16 the "
          "lowering rounds every step to the half type in the order of torch's CPU kernel (bfloat16 "
          "bit for bit; float16 within an ulp)")


def _col2im(g):
    return [S(g.f(1, 12, 9), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1], desc="2x2 stride 1"),
            S(g.f(2, 8, 4), [4, 4], [2, 2], [1, 1], [0, 0], [2, 2], desc="2x2 stride 2 (no overlap)"),
            S(g.f(18, 6), [5, 4], [3, 3], [1, 1], [1, 1], [2, 2], desc="unbatched, padding"),
            S(g.f(1, 8, 6), [6, 5], [2, 2], [2, 1], [0, 1], [2, 2], desc="dilation, padding"),
            S(g.t(g.f(1, 9, 6)), [5, 4], [3, 1], [1, 1], [0, 0], [1, 2], desc="transposed")]


entry(aten.col2im.default, _col2im, tol=F32_ACCUM, why="overlapping patches add in some order")


# ---- embeddings, distances, FFT, dropout ---------------------------------------------------

def _embedding_bag(g):
    w = g.f(8, 3)
    idx = torch.tensor([0, 2, 1, 5, 5, 3, 4, 7, 6])
    offs = torch.tensor([0, 3, 3, 5])
    last = torch.tensor([0, 3, 3, 5, 9])
    psw = g.f(9, lo=0, hi=2)
    out = []
    for mode, name in ((0, "sum"), (1, "mean"), (2, "max")):
        out += [S(w, idx, offs, False, mode, desc=f"{name}, an empty bag"),
                S(w, idx, offs, False, mode, False, None, False, 5, desc=f"{name}, padding_idx 5"),
                S(w, idx, last, False, mode, False, None, True, desc=f"{name}, include_last_offset")]
    out += [S(w, idx, offs, False, 0, False, psw, desc="sum, per_sample_weights"),
            S(w, idx, last, False, 0, False, psw, True, 3, desc="per_sample_weights, include_last_offset, padding_idx"),
            S(w, idx.to(torch.int32), offs.to(torch.int32), False, 1, desc="int32 indices and offsets")]
    return out


entry(aten._embedding_bag.default, _embedding_bag, tol=F32_ACCUM, why="float32 sums over each bag",
      lowp=())


def _cdist(g):
    return [S(g.f(4, 3), g.f(5, 3), 2.0, None, desc="p=2"), S(g.f(2, 4, 3), g.f(2, 5, 3), 1.0, None, desc="batched p=1"),
            S(g.f(3, 4), g.f(2, 4), 0.0, None, desc="p=0"), S(g.f(3, 4), g.f(2, 4), math.inf, None, desc="p=inf"),
            S(g.f(3, 4), g.f(2, 4), 3.0, None, desc="p=3"),
            S(g.f(30, 4), g.f(6, 4), 2.0, None, desc="p=2, 30 rows (matmul form)"),
            S(g.f(4, 3), g.f(5, 3), 2.0, 1, desc="compute_mode 1 (matmul form)"),
            S(g.f(30, 3), g.f(5, 3), 2.0, 2, desc="compute_mode 2 (direct)"),
            S(g.f(1, 4, 3), g.f(2, 5, 3), 2.0, None, desc="broadcast batch")]


entry(aten._cdist_forward.default, _cdist, tol=F32_ACCUM * 3,
      why="float32 sums of powers; the matmul form subtracts nearly equal terms", lowp=())


def _pdist(g):
    return [S(g.f(5, 3), 2.0, desc="p=2"), S(g.f(4, 6), 1.0, desc="p=1"), S(g.f(4, 3), 0.0, desc="p=0"),
            S(g.f(4, 3), math.inf, desc="p=inf"), S(g.f(6, 2), 1.5, desc="p=1.5"), S(g.f(1, 3), 2.0, desc="one row (empty)")]


entry(aten._pdist_forward.default, _pdist, tol=F32_ACCUM, why="float32 sums of powers", lowp=())


def _fft_r2c(g):
    return [S(g.f(4, 8), [1], 0, True, desc="last dim, onesided"), S(g.f(4, 6), [0, 1], 2, True, desc="2-d, by_n"),
            S(g.f(3, 5), [0], 1, False, desc="dim 0, full, ortho"), S(g.f(2, 4, 6), [1, 2], 0, True, desc="last two of three dims"),
            S(g.t(g.f(4, 8)), [1], 0, True, desc="transposed")]


def _fft_c2r(g):
    def c(*shape):
        return torch.complex(g.f(*shape), g.f(*shape))
    return [S(c(4, 5), [1], 0, 8, desc="last dim to 8"), S(c(4, 4), [0, 1], 2, 6, desc="2-d, by_n, to 6"),
            S(c(3, 3), [0], 1, 4, desc="dim 0, ortho, to 4"), S(c(2, 4, 5), [2], 2, 9, desc="odd size 9")]


_FFT = "float32 FFTs: different factorisations (pocketfft vs XLA's)"
entry(aten._fft_r2c.default, _fft_r2c, tol=F32_ACCUM, why=_FFT, lowp=())
entry(aten._fft_c2r.default, _fft_c2r, tol=F32_ACCUM, why=_FFT, lowp=())


def _dropout_check(outs, refs, sample):
    """Random: the mask keeps about 1-p of the elements, and kept ones are scaled by 1/(1-p)."""
    x = sample.args[0]
    x = x.base if hasattr(x, "base") else x
    p, train = sample.args[1], sample.args[2]
    out, mask = np.asarray(outs[0], np.float64), np.asarray(outs[1])
    xin = np.asarray(refs[0], np.float64) if not train else None
    if not train or p == 0:
        ok = np.array_equal(out, np.asarray(refs[0], np.float64)) and mask.all()
        return Agreement(ok=bool(ok), detail="" if ok else "dropout off must be the identity")
    xin = x.numpy().astype(np.float64)
    kept = mask.mean()
    scaled_ok = np.allclose(out[mask], xin[mask] / (1 - p), rtol=1e-6) and np.all(out[~mask] == 0)
    # 4096 Bernoulli draws: the kept fraction is within 5 standard deviations of 1-p
    sd = math.sqrt(p * (1 - p) / mask.size)
    frac_ok = abs(kept - (1 - p)) < 5 * sd
    ok = bool(scaled_ok and frac_ok)
    return Agreement(ok=ok, max_rel_err=abs(kept - (1 - p)),
                     detail="" if ok else f"kept {kept:.3f}, expected {1 - p:.3f}; scaled ok {scaled_ok}")


entry(aten.native_dropout.default, lambda g: [
    S(g.f(64, 64), 0.3, True, desc="train, p=0.3", lowp=False), S(g.f(64, 64), 0.5, False, desc="eval (identity)"),
    S(g.f(64, 64), 0.0, True, desc="train, p=0", lowp=False)],
    compare=_dropout_check, tol=EXACT, why="random: the kept fraction and the 1/(1-p) scaling are compared")
