"""Composite (non-core) ops that a target may keep whole instead of letting torch decompose them.

Where a target decomposes one, its cell still runs (the decomposition is what a model gets)
and says so in its note.
"""
from __future__ import annotations

import torch

from ._entry import F32_ACCUM, S, aten, entry

_NORM = "float32 mean/variance over the normalised dims: the summation order differs"


def _sdpa(g):
    def qkv(b, h, lq, lk, e, hk=None):
        return g.f(b, h, lq, e), g.f(b, hk or h, lk, e), g.f(b, hk or h, lk, e)
    q, k, v = qkv(2, 2, 5, 5, 8)
    causal_mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = [S(q, k, v, desc="B2 H2 L5 E8"),
           S(*qkv(1, 2, 4, 6, 8), is_causal=True, desc="causal, Lq < Lk"),
           S(q, k, v, causal_mask, desc="bool mask"),
           S(q, k, v, g.f(2, 1, 5, 5), desc="float additive mask, broadcast heads"),
           S(*qkv(1, 2, 3, 7, 16), scale=0.3, desc="scale=0.3"),
           S(*qkv(1, 4, 6, 6, 8, hk=2), enable_gqa=True, desc="grouped-query (4 q heads, 2 kv heads)"),
           S(g.f(2, 8, 4), g.f(2, 6, 4), g.f(2, 6, 4), desc="3-d inputs")]
    return out


entry(aten.scaled_dot_product_attention.default, _sdpa, tol=F32_ACCUM,
      why="float32 dot products and a softmax: the accumulation order differs")


def _rms(g):
    return [S(g.f(2, 3, 8), [8], g.f(8), 1e-6, desc="last dim with weight"),
            S(g.f(2, 3, 4), [3, 4], None, None, desc="two dims, default eps"),
            S(g.f(4, 6) * 100, [6], g.f(6), 1e-5, desc="large values"),
            S(g.t(g.f(2, 5, 6)), [6], g.f(6), 1e-6, desc="transposed")]


entry(aten.rms_norm.default, _rms, tol=F32_ACCUM, why=_NORM)


def _layer_norm(g):
    return [S(g.f(2, 3, 8), [8], g.f(8), g.f(8), 1e-5, desc="last dim with affine"),
            S(g.f(2, 3, 4), [3, 4], desc="two dims, no affine"),
            S(g.f(4, 6) * 100 + 50, [6], g.f(6), None, 1e-6, desc="large mean, weight only"),
            S(g.t(g.f(2, 5, 6)), [6], g.f(6), g.f(6), desc="transposed")]


entry(aten.layer_norm.default, _layer_norm, tol=F32_ACCUM, why=_NORM)


def _group_norm(g):
    return [S(g.f(2, 4, 3, 3), 2, g.f(4), g.f(4), 1e-5, desc="2 groups with affine"),
            S(g.f(2, 6, 5), 3, desc="NCL, 3 groups, no affine"),
            S(g.f(1, 4, 2, 2) * 10 + 3, 4, g.f(4), None, desc="one channel per group")]


entry(aten.group_norm.default, _group_norm, tol=F32_ACCUM, why=_NORM)


def _linear(g):
    return [S(g.f(3, 4), g.f(5, 4), g.f(5), desc="with bias"), S(g.f(2, 3, 4), g.f(5, 4), desc="3-d input, no bias"),
            S(g.f(4), g.f(2, 4), g.f(2), desc="1-d input"), S(g.t(g.f(6, 4)), g.f(3, 4), g.f(3), desc="transposed input")]


entry(aten.linear.default, _linear, tol=F32_ACCUM,
      why="float32 dot products: the accumulation order differs (blocked kernels)")
