"""Views, layout, concatenation, padding, dtype conversion and tensor creation."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..numerics import Agreement
from ._entry import EXACT, F32_ULPS, S, aten, edge_values, entry

_MOVE = "moves or copies values"


entry(aten.view.default, lambda g: [
    S(g.f(3, 4), [12], desc="flatten"), S(g.f(3, 4), [-1, 2], desc="[-1, 2]"), S(g.f(2, 6), [2, 3, 2], desc="split a dim"),
    S(g.f(), [1, 1], desc="0-d to [1, 1]"), S(g.f(1), [], desc="[1] to 0-d"), S(g.i(4, 3), [3, 4], desc="int32"),
    S(g.b(2, 3), [6], desc="bool"), S(g.f(2, 0, 3), [0, 6], desc="empty")], tol=EXACT, why=_MOVE)

entry(aten.permute.default, lambda g: [
    S(g.f(2, 3, 4), [1, 0, 2], desc="[1, 0, 2]"), S(g.f(2, 3, 4), [-1, 0, 1], desc="negative dims"),
    S(g.f(), [], desc="0-d"), S(g.i(3, 4), [1, 0], desc="int32"), S(g.b(2, 3), [1, 0], desc="bool"),
    S(g.t(g.f(3, 4)), [1, 0], desc="transposed input")], tol=EXACT, why=_MOVE)

entry(aten.expand.default, lambda g: [
    S(g.f(1, 4), [3, 4], desc="1x4 to 3x4"), S(g.f(3, 1), [2, 3, 4], desc="new leading dim"),
    S(g.f(3, 1), [-1, 5], desc="-1 keeps a dim"), S(g.f(), [2, 3], desc="0-d"), S(g.i(1, 3), [2, 3], desc="int32"),
    S(g.b(1), [4], desc="bool")], tol=EXACT, why=_MOVE)

entry(aten.unsqueeze.default, lambda g: [
    S(g.f(3, 4), 0, desc="dim=0"), S(g.f(3, 4), -1, desc="dim=-1"), S(g.f(3, 4), 1, desc="dim=1"),
    S(g.f(), 0, desc="0-d"), S(g.i(3), -2, desc="int32, dim=-2"), S(g.t(g.f(3, 4)), 2, desc="transposed")],
    tol=EXACT, why=_MOVE)

entry(aten.squeeze.dim, lambda g: [
    S(g.f(3, 1, 4), 1, desc="size-1 dim"), S(g.f(3, 1, 4), 0, desc="dim of size 3 (no-op)"),
    S(g.f(3, 4, 1), -1, desc="dim=-1"), S(g.f(), 0, desc="0-d"), S(g.i(1, 3), 0, desc="int32")], tol=EXACT, why=_MOVE)

entry(aten.squeeze.dims, lambda g: [
    S(g.f(1, 3, 1, 4), [0, 2], desc="dims [0, 2]"), S(g.f(1, 3, 1), [-1, 1], desc="[-1, 1] (1 is size 3)"),
    S(g.f(), [0], desc="0-d"), S(g.b(1, 3), [0], desc="bool")], tol=EXACT, why=_MOVE)


def _cat(g):
    return [S([g.f(2, 3), g.f(4, 3)], desc="dim=0"), S([g.f(2, 3), g.f(2, 1), g.f(2, 5)], -1, desc="three, dim=-1"),
            S([g.i(2, 3), g.f(2, 3)], 1, desc="int32 with float32 (promotes)"),
            S([g.f(2, 3), torch.empty(0)], desc="with a legacy empty 1-d tensor"),
            S([g.f(0, 3), g.f(2, 3)], desc="with an empty tensor"), S([g.b(2), g.b(3)], desc="bool"),
            S([g.t(g.f(2, 3)), g.f(2, 3)], desc="transposed")]


entry(aten.cat.default, _cat, tol=EXACT, why=_MOVE)


def _slice(g):
    x = g.f(5, 6)
    return [S(x, 0, 1, 3, desc="[1:3]"), S(x, 1, -4, None, desc="[-4:] on dim 1"), S(x, 1, 0, 100, 2, desc="[0:100:2]"),
            S(x, -1, 4, 2, desc="start > end (empty)"), S(x, 0, None, None, 3, desc="[::3]"),
            S(x, 0, -100, 2, desc="start before 0"), S(g.i(4, 3), 0, 1, 4, 2, desc="int32"),
            S(g.t(g.f(5, 6)), 1, 1, 5, 2, desc="transposed")]


entry(aten.slice.Tensor, _slice, tol=EXACT, why=_MOVE)

entry(aten.select.int, lambda g: [
    S(g.f(3, 4), 0, 1, desc="dim=0"), S(g.f(3, 4, 5), -1, -2, desc="negative dim and index"),
    S(g.f(3), 0, 2, desc="1-d to 0-d"), S(g.i(3, 4), 1, 3, desc="int32"), S(g.t(g.f(3, 4)), 1, 0, desc="transposed")],
    tol=EXACT, why=_MOVE)

entry(aten.split_with_sizes.default, lambda g: [
    S(g.f(4, 3), [1, 2, 1], desc="dim=0"), S(g.f(2, 5), [2, 0, 3], -1, desc="with a zero size, dim=-1"),
    S(g.i(6), [3, 3], desc="int32"), S(g.t(g.f(3, 4)), [2, 2], 1, desc="transposed")], tol=EXACT, why=_MOVE)

entry(aten.repeat.default, lambda g: [
    S(g.f(2, 3), [2, 1], desc="[2, 1]"), S(g.f(2, 3), [2, 1, 3], desc="more dims than the input"),
    S(g.f(), [3], desc="0-d"), S(g.i(3), [0], desc="zero repeats"), S(g.b(2, 2), [1, 2], desc="bool")],
    tol=EXACT, why=_MOVE)

entry(aten.flip.default, lambda g: [
    S(g.f(3, 4), [0], desc="dim 0"), S(g.f(2, 3, 4), [-1, 0], desc="dims [-1, 0]"), S(g.f(), [], desc="0-d"),
    S(g.i(3, 4), [1], desc="int32"), S(g.t(g.f(3, 4)), [1], desc="transposed")], tol=EXACT, why=_MOVE)

entry(aten.diagonal.default, lambda g: [
    S(g.f(4, 4), desc="square"), S(g.f(3, 5), 1, desc="offset 1"), S(g.f(5, 3), -2, desc="offset -2"),
    S(g.f(2, 3, 4), 0, 0, 2, desc="3-d, dims 0 and 2"), S(g.f(2, 3, 4), 1, -1, -2, desc="negative dims"),
    S(g.f(3, 3), 5, desc="offset past the end (empty)"), S(g.i(3, 3), desc="int32"),
    S(g.t(g.f(3, 4)), desc="transposed")], tol=EXACT, why=_MOVE)

entry(aten.as_strided.default, lambda g: [
    S(g.f(3, 4), [3, 2], [1, 1], desc="overlapping windows"), S(g.f(3, 4), [4, 3], [1, 4], desc="transposing strides"),
    S(g.f(12), [2, 2], [3, 1], 2, desc="with a storage offset"), S(g.f(2, 3), [], [], 4, desc="0-d"),
    S(g.i(2, 6), [3, 3], [2, 1], desc="int32")], tol=EXACT, why=_MOVE)

entry(aten.alias.default, lambda g: [S(g.f(3, 4), desc="float32"), S(g.f(), desc="0-d"), S(g.i(2, 3), desc="int32"),
                                     S(g.t(g.f(3, 4)), desc="transposed")], tol=EXACT, why=_MOVE)

entry(aten.clone.default, lambda g: [
    S(g.f(3, 4), desc="float32"), S(g.f(), desc="0-d"), S(g.i(2, 3), desc="int32"), S(g.b(2, 3), desc="bool"),
    S(g.t(g.f(3, 4)), memory_format=torch.contiguous_format, desc="transposed, contiguous_format"),
    S(g.f(1, 3, 2, 2), memory_format=torch.channels_last, desc="channels_last")], tol=EXACT, why=_MOVE)

entry(aten.copy.default, lambda g: [
    S(g.f(3, 4), g.f(3, 4), desc="same shape"), S(g.f(3, 4), g.f(1, 4), desc="broadcast source"),
    S(g.f(3, 4), g.i(3, 4), desc="int32 into float32"), S(g.i(3, 4), g.f(3, 4, lo=-5, hi=5), desc="float32 into int32"),
    S(g.f(), g.f(), desc="0-d"), S(g.f(3, 4), g.t(g.f(3, 4)), desc="transposed source")], tol=EXACT, why=_MOVE)


def _to_copy(g):
    return [S(g.f(3, 4, lo=-100, hi=100), dtype=torch.int32, desc="float32 to int32 (truncates)"),
            S(g.i(3, 4), dtype=torch.float32, desc="int32 to float32"),
            S(g.f(3, 4), dtype=torch.float16, desc="float32 to float16"),
            S(g.f(3, 4), dtype=torch.bfloat16, desc="float32 to bfloat16"),
            S(edge_values(), dtype=torch.bool, desc="edge values to bool"),
            S(g.b(3, 4), dtype=torch.float32, desc="bool to float32"),
            S(g.i(3, 4, dtype=torch.int64), dtype=torch.int32, desc="int64 to int32"),
            S(g.i(3, 4, lo=0, hi=200), dtype=torch.uint8, desc="int32 to uint8"),
            S(g.f(3, 4), dtype=torch.float64, desc="float32 to float64"),
            S(edge_values(), dtype=torch.float16, desc="edge values to float16 (overflow to inf)"),
            S(g.f(), desc="0-d, no dtype"), S(g.t(g.f(3, 4)), dtype=torch.int64, desc="transposed")]


entry(aten._to_copy.default, _to_copy, tol=EXACT, why="conversions round to nearest even on both sides",
      lowp=())


def _pad(g):
    return [S(g.f(2, 3), [1, 2], desc="last dim [1, 2]"), S(g.f(2, 3, 4), [1, 1, 2, 0], desc="two dims"),
            S(g.f(3, 4), [-1, 1, 0, -2], desc="negative pads crop"), S(g.f(2, 3), [1, 1], 2.5, desc="value 2.5"),
            S(g.i(2, 3), [0, 2], 7, desc="int32, value 7"), S(g.b(2, 3), [1, 0], True, desc="bool"),
            S(g.t(g.f(3, 4)), [2, 2], desc="transposed")]


entry(aten.constant_pad_nd.default, _pad, tol=EXACT, why=_MOVE)


def _mode_pad(nd: int):
    def samples(g):
        shape = (3, 4, 5, 6)[:nd]
        pads = [1, 2, 2, 1, 1, 0][:2 * nd]
        return [S(g.f(2, *shape), pads, desc="batched"), S(g.f(2, 3, *shape), pads, desc="batched with channels"),
                S(g.f(2, *shape), [0] * (2 * nd), desc="zero padding"),
                S(g.t(g.f(2, *shape)), pads, desc="transposed")]
    return samples


def _negative_pad(nd: int):
    def samples(g):
        shape = (4, 5, 6)[:nd]
        pads = [-1, 2, 1, -2, 0, -1][:2 * nd]
        return _mode_pad(nd)(g) + [S(g.f(1, 2, *shape), pads, desc="negative widths crop")]
    return samples


entry(aten.reflection_pad1d.default, _mode_pad(1), tol=EXACT, why=_MOVE)
entry(aten.reflection_pad2d.default, _negative_pad(2), tol=EXACT, why=_MOVE)
entry(aten.reflection_pad3d.default, _mode_pad(3), tol=EXACT, why=_MOVE)
entry(aten.replication_pad2d.default, _negative_pad(2), tol=EXACT, why=_MOVE)
entry(aten.replication_pad3d.default, _negative_pad(3), tol=EXACT, why=_MOVE)


# ---- creation ------------------------------------------------------------------------------

entry(aten.full.default, lambda g: [
    S([2, 3], 1.5, desc="float"), S([2, 3], 7, dtype=torch.int32, desc="int32"), S([], -2.0, desc="0-d"),
    S([3], True, dtype=torch.bool, desc="bool"), S([2, 0], 1.0, desc="empty"),
    S([2, 2], math.inf, desc="inf", lowp=False)], tol=EXACT, why="a constant")

entry(aten.full_like.default, lambda g: [
    S(g.f(2, 3), 1.5, desc="float32"), S(g.i(2, 3), 4, desc="int32"), S(g.f(2, 3), 3, dtype=torch.int64, desc="dtype=int64"),
    S(g.f(), -1.0, desc="0-d"), S(g.t(g.f(3, 4)), 0.5, desc="transposed")], tol=EXACT, why="a constant")

entry(aten.fill.Scalar, lambda g: [
    S(g.f(2, 3), 1.5, desc="float32"), S(g.i(2, 3), 4, desc="int32"), S(g.f(), -1.0, desc="0-d"),
    S(g.b(2, 2), True, desc="bool")], tol=EXACT, why="a constant")


def _shape_only(outs, refs, sample):
    """Uninitialised memory: only the shape and dtype (checked before) are defined."""
    return Agreement(ok=True)


entry(aten.empty.memory_format, lambda g: [
    S([2, 3], desc="float32"), S([4], dtype=torch.int32, desc="int32"), S([], desc="0-d"),
    S([2, 0], dtype=torch.bool, desc="empty bool")], compare=_shape_only, tol=EXACT,
    why="values are uninitialised: shape and dtype are compared")

entry(aten.empty_strided.default, lambda g: [
    S([2, 3], [3, 1], desc="contiguous strides"), S([2, 3], [1, 2], desc="transposed strides"),
    S([4], [1], dtype=torch.int64, desc="int64")], compare=_shape_only, tol=EXACT,
    why="values are uninitialised: shape and dtype are compared")

entry(aten.scalar_tensor.default, lambda g: [
    S(2.5, desc="float"), S(3, dtype=torch.int32, desc="int32"), S(True, dtype=torch.bool, desc="bool"),
    S(-1.0, dtype=torch.float64, desc="float64")], tol=EXACT, why="a constant")


def _arange(g):
    return [S(0, 10, 1, desc="ints"), S(-3, 9, 4, desc="step 4"), S(10, 0, -3, desc="negative step"),
            S(0.0, 1.0, 0.1, desc="float step 0.1"), S(1, 2.5, 0.25, dtype=torch.float32, desc="float32"),
            S(0, 5, 1, dtype=torch.float32, desc="ints as float32"), S(0, 0, 1, desc="empty"),
            S(-1.5, 2.5, 0.5, dtype=torch.float64, desc="float64")]


entry(aten.arange.start_step, _arange, tol=F32_ULPS, why="start + i * step, like torch")


def _resize_prefix(outs, refs, sample):
    """Growing exposes uninitialised memory: the old values must lead the flat result."""
    n = math.prod(sample.args[0].shape)
    o, r = np.asarray(outs[0]).reshape(-1)[:n], np.asarray(refs[0]).reshape(-1)[:n]
    diff = float(np.abs(o.astype(np.float64) - r.astype(np.float64)).max()) if n else 0.0
    return Agreement(diff, diff, diff == 0.0, "" if diff == 0.0 else "the old values differ")


def _resize_rewrite(gm):
    """torch.export captures ``x.clone().resize_(size)`` as ``as_strided(clone(x), size, stride)``
    when it shrinks, and as the functional ``resize(clone(x), size)`` when it grows."""
    from ._rewrite import retarget
    for old in {n.target for n in gm.graph.nodes} & {aten.resize.default, aten.as_strided.default}:
        retarget(gm, old, aten.resize_.default, lambda n: ((n.args[0], n.args[1]), {}))


entry(aten.resize_.default, lambda g: [
    S(g.f(3, 4), [2, 3], desc="shrink"), S(g.f(3, 4), [4, 3], desc="same size, new shape"),
    S(g.i(2, 3), [6], desc="int32"), S(g.f(2, 2), [3, 3], desc="grow (old values lead)")],
    call=lambda x, size: x.clone().resize_(size), rewrite=_resize_rewrite, compare=_resize_prefix, tol=EXACT,
    why=_MOVE, note="torch.export rewrites resize_ into as_strided; the harness puts resize_ back into the graph")
