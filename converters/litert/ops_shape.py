"""Shape and data-movement ops: views, permutes, concatenation, slicing, padding, casts, copies."""
from __future__ import annotations

import numpy as np
import torch

from .common import strided_slice
from .composite import inline
from .dims import all_static, is_static, normalize
from .ops_composite import feature_dropout, native_dropout, view_as_complex, view_as_real
from .registry import builds

aten = torch.ops.aten


def _dims(dims, rank) -> list[int]:
    if isinstance(dims, int):
        dims = [dims]
    return [d % rank if rank else 0 for d in dims]


@builds(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def view(ctx, x, shape):
    return ctx.reshape(x, ctx.out_shape())


@builds(aten.flatten.using_ints)
def flatten(ctx, x, start_dim=0, end_dim=-1):
    return ctx.reshape(x, ctx.out_shape())


@builds(aten.unflatten.int)
def unflatten(ctx, x, dim, sizes):
    return ctx.reshape(x, ctx.out_shape())


@builds(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default, aten.squeeze_copy.default)
def squeeze(ctx, x, *dims):
    return ctx.reshape(x, ctx.out_shape())


@builds(aten.permute.default)
def permute(ctx, x, dims):
    return ctx.transpose(x, _dims(dims, x.rank))


@builds(aten.transpose.int)
def transpose(ctx, x, a, b):
    perm = list(range(x.rank))
    a, b = _dims([a, b], x.rank)
    perm[a], perm[b] = perm[b], perm[a]
    return ctx.transpose(x, perm)


@builds(aten.t.default)
def t(ctx, x):
    return ctx.transpose(x, (1, 0)) if x.rank == 2 else x


@builds(aten.expand.default, aten.expand_copy.default)
def expand(ctx, x, size, *, implicit=False):
    shape = ctx.out_shape()
    if x.rank < len(shape):
        x = ctx.reshape(x, (1,) * (len(shape) - x.rank) + x.shape)
    return ctx.broadcast_to(x, shape)


@builds(aten.expand_as.default)
def expand_as(ctx, x, other):
    return expand(ctx, x, other.shape)


@builds(aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default, aten.lift_fresh_copy.default,
        aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default)
def identity(ctx, x, *args, **kwargs):
    if ctx.node.target in (aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default) \
            and len(args) > 1 and args[1] and args[0]:
        if ctx.node.target is aten.alpha_dropout.default:
            raise ctx.unsupported("alpha dropout in training mode (call model.eval() before converting)")
        p = args[0]
        if ctx.node.target is aten.feature_dropout.default:
            return inline(ctx, lambda t: feature_dropout(t, p), (x,), {})
        return inline(ctx, lambda t: native_dropout(t, p, True)[0], (x,), {})
    return x


@builds(aten.copy.default)
def copy(ctx, dst, src, non_blocking=False):
    return ctx.broadcast_to(ctx.cast(src, ctx.out_dtype()), ctx.out_shape())


@builds(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.type_as.default)
def to_copy(ctx, x, *args, **kwargs):
    return ctx.cast(x, ctx.out_dtype())


@builds(aten.cat.default, aten.concat.default, aten.concatenate.default)
def cat(ctx, tensors, dim=0):
    tensors = [t for t in tensors if t.size or t.rank != 1]  # torch skips legacy empty (0,) inputs
    dt = ctx.out_dtype()
    tensors = [ctx.cast(t, dt) for t in tensors]
    if len(tensors) == 1:
        return tensors[0]
    if all(t.is_const for t in tensors):
        return ctx.const(np.concatenate([t.data for t in tensors], axis=dim))
    return ctx.op("CONCATENATION", tensors, axis=dim % tensors[0].rank)


@builds(aten.stack.default)
def stack(ctx, tensors, dim=0):
    dim = dim % (tensors[0].rank + 1)
    parts = [ctx.reshape(t, t.shape[:dim] + (1,) + t.shape[dim:]) for t in tensors]
    return cat(ctx, parts, dim)


def _wrap(ctx, i, n):
    # a possibly negative index into a dim of size n, as torch reads it
    return i + n if ctx.negative(i) else i


@builds(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(ctx, x, dim=0, start=None, end=None, step=1):
    dim = dim % x.rank
    n = x.shape[dim]
    if all(v is None or is_static(v) for v in (n, start, end)):
        start, end, _ = slice(start, end, step).indices(n) if step > 0 else (0, 0, 0)
        end = max(end, start)
        return strided_slice(ctx, x, {dim: (start, end, step)})
    # a dynamic size or bound: torch's result size (clamping included) says how far the slice reaches
    begin = 0 if start is None else _wrap(ctx, start, n)
    size = ctx.out_shape()[dim]
    return strided_slice(ctx, x, {dim: (begin, begin + (size - 1) * step + 1, step)})


@builds(aten.select.int, aten.select_copy.int)
def select(ctx, x, dim, index):
    dim = dim % x.rank
    index = index % x.shape[dim] if is_static(x.shape[dim]) else _wrap(ctx, index, x.shape[dim])
    y = strided_slice(ctx, x, {dim: (index, index + 1, 1)})
    return ctx.reshape(y, x.shape[:dim] + x.shape[dim + 1:])


@builds(aten.narrow.default, aten.narrow_copy.default)
def narrow(ctx, x, dim, start, length):
    dim = dim % x.rank
    start = _wrap(ctx, start, x.shape[dim])
    return strided_slice(ctx, x, {dim: (start, start + length, 1)})


@builds(aten.split_with_sizes.default, aten.split.Tensor, aten.split_with_sizes_copy.default, aten.split.sizes,
        aten.split_copy.Tensor)
def split(ctx, x, sizes, dim=0):
    dim = dim % x.rank
    n = x.shape[dim]
    if isinstance(sizes, int) and is_static(n):
        sizes = [min(sizes, n - i) for i in range(0, n, sizes)] or [0]
    elif isinstance(sizes, int):
        sizes = [ctx.out_shape(i)[dim] for i in range(len(ctx.out))]  # torch's split of a dynamic dim
    outs, pos = [], 0
    for s in sizes:
        outs.append(strided_slice(ctx, x, {dim: (pos, pos + s, 1)}))
        pos += s
    return outs


@builds(aten.unfold.default, aten.unfold_copy.default)
def unfold(ctx, x, dim, size, step):
    """Windows of ``size`` every ``step`` along ``dim``, as a new last dim: one GATHER of constant
    indices (window w, element k reads w * step + k), then the element axis moved last."""
    dim = dim % x.rank if x.rank else 0
    n = ctx.static(x.shape[dim] if x.rank else 1, "its windows are counted at conversion")
    windows = (n - size) // step + 1
    if x.rank == 0:  # a 0-d tensor unfolds to one window of itself
        return ctx.reshape(x, (1,))
    index = (np.arange(windows)[:, None] * step + np.arange(size)[None, :]).astype(np.int32)
    g = ctx.op("GATHER", [x, ctx.const(index)], shape=x.shape[:dim] + (windows, size) + x.shape[dim + 1:],
               dtype=x.dtype, axis=dim)
    if dim == x.rank - 1:
        return g
    perm = list(range(dim + 1)) + list(range(dim + 2, x.rank + 1)) + [dim + 1]
    return ctx.transpose(g, perm)


@builds(aten.unbind.int, aten.unbind_copy.int)
def unbind(ctx, x, dim=0):
    dim = dim % x.rank
    return [select(ctx, x, dim, i) for i in range(x.shape[dim])]


@builds(aten.chunk.default)
def chunk(ctx, x, chunks, dim=0):
    dim = dim % x.rank
    n = x.shape[dim]
    if not is_static(n):
        return split(ctx, x, [ctx.out_shape(i)[dim] for i in range(len(ctx.out))], dim)
    size = -(-n // chunks)
    return split(ctx, x, size, dim)


@builds(aten.flip.default)
def flip(ctx, x, dims):
    dims = sorted(set(_dims(dims, x.rank)))
    if not dims or x.rank == 0:
        return x
    # REVERSE_V2 takes one run of adjacent axes at a time
    runs = [[dims[0]]]
    for d in dims[1:]:
        if d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    for run in runs:
        x = ctx.op("REVERSE_V2", [x, np.asarray(run, np.int32)], shape=x.shape, dtype=x.dtype)
    return x


@builds(aten.roll.default)
def roll(ctx, x, shifts, dims=()):
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = list(dims) if dims else []
    if not dims:
        flat = ctx.reshape(x, (x.size,))
        return ctx.reshape(roll(ctx, flat, shifts, [0]), x.shape)
    for s, d in zip(shifts, dims):
        d = d % x.rank
        n = x.shape[d]
        if not is_static(n):
            x = _roll_dynamic(ctx, x, s, d)
            continue
        if n == 0:  # an empty dim has nothing to move (and no modulus)
            continue
        s = s % n
        if s:
            idx = (np.arange(n) - s) % n
            shape = x.shape
            x = ctx.op("GATHER", [x, idx.astype(np.int32)], shape=shape, dtype=x.dtype, axis=d)
    return x


def _roll_dynamic(ctx, x, shift, d):
    # a roll along a dynamic dim: its last k items, then the rest (k = shift mod n)
    n = x.shape[d]
    lo, _ = ctx.bounds(n)
    if lo is None or abs(shift) >= lo:
        raise ctx.unsupported(f"a roll by {shift} along a dynamic dim ({n}) of sizes down to {lo}: the wrap-around "
                              "point depends on the size")
    k = shift if shift >= 0 else n + shift
    if is_static(k) and k == 0:
        return x
    return ctx.op("CONCATENATION", [strided_slice(ctx, x, {d: (n - k, n, 1)}), strided_slice(ctx, x, {d: (0, n - k, 1)})],
                  shape=x.shape, dtype=x.dtype, axis=d)


@builds(aten.repeat.default)
def repeat(ctx, x, repeats):
    repeats = list(repeats)
    if x.rank < len(repeats):
        x = ctx.reshape(x, (1,) * (len(repeats) - x.rank) + x.shape)
    if all(r == 1 for r in repeats):
        return x
    return ctx.op("TILE", [x, np.asarray(repeats, np.int32)])


@builds(aten.repeat_interleave.self_int)
def repeat_interleave(ctx, x, repeats, dim=None, *, output_size=None):
    if dim is None:
        x = ctx.reshape(x, (x.size,))
        dim = 0
    dim = dim % x.rank
    shape = x.shape
    if all(is_static(d) for d in shape):
        # (p..., n, r...) -> (P, n, 1, R) -> broadcast (P, n, r, R) -> (p..., n * r, r...): 4-D whatever the
        # rank, as GPU delegates need (LiteRT.js's WebGPU takes no 5-D tensor: GQA's k/v repeat made one)
        outer, inner = int(np.prod(shape[:dim], dtype=np.int64)), int(np.prod(shape[dim + 1:], dtype=np.int64))
        x4 = ctx.reshape(x, (outer, shape[dim], 1, inner))
        return ctx.reshape(ctx.broadcast_to(x4, (outer, shape[dim], repeats, inner)), ctx.out_shape())
    # (..., n, ...) -> (..., n, 1, ...) -> broadcast (..., n, r, ...) -> (..., n * r, ...)
    x5 = ctx.reshape(x, shape[:dim + 1] + (1,) + shape[dim + 1:])
    x5 = ctx.broadcast_to(x5, shape[:dim + 1] + (repeats,) + shape[dim + 1:])
    return ctx.reshape(x5, ctx.out_shape())


def _torch_pads(pad, rank):
    # torch's pad list (last dim first, before/after) as ((before, after), ...) for every dim.
    pads = [(0, 0)] * rank
    for i in range(len(pad) // 2):
        pads[rank - 1 - i] = (normalize(pad[2 * i]), normalize(pad[2 * i + 1]))
    return pads


def _crop_negative(ctx, x, pads):
    ranges = {}
    negative = [(ctx.negative(b), ctx.negative(a)) for b, a in pads]
    for d, ((b, a), (nb, na)) in enumerate(zip(pads, negative)):
        if nb or na:
            ranges[d] = (-b if nb else 0, x.shape[d] + a if na else x.shape[d], 1)
    if ranges:
        x = strided_slice(ctx, x, ranges)
    return x, [(0 if nb else b, 0 if na else a) for (b, a), (nb, na) in zip(pads, negative)]


@builds(aten.constant_pad_nd.default)
def constant_pad_nd(ctx, x, pad, value=0):
    x, pads = _crop_negative(ctx, x, _torch_pads(pad, x.rank))
    if all(is_static(v) and v == 0 for p in pads for v in p):
        return x
    if x.dtype == np.complex64:  # TFLite's PAD has no complex kernel: pad the (re, im) float pairs
        if value != 0 or not all(is_static(v) for p in pads for v in p):
            raise ctx.unsupported("a complex padding with a nonzero or dynamic fill")
        padded = ctx.op("PAD", [view_as_real(ctx, x), np.asarray(pads + [(0, 0)], np.int32)],
                        shape=ctx.out_shape() + (2,), dtype=np.float32)
        return view_as_complex(ctx, padded)
    # a dynamic padding (e.g. up to a fixed cache length) is computed at run time
    spec = np.asarray(pads, np.int32) if all(is_static(v) for p in pads for v in p) else \
        ctx.reshape(ctx.vector([v for p in pads for v in p]), (x.rank, 2))
    if value == 0:
        return ctx.op("PAD", [x, spec])
    return ctx.op("PADV2", [x, spec, ctx.const(np.asarray(value).astype(x.dtype))])


@builds(aten.pad.default)
def pad(ctx, x, pad, mode="constant", value=None):
    if mode == "constant":
        return constant_pad_nd(ctx, x, pad, 0 if value is None else value)
    if mode == "reflect":
        return _mirror(ctx, x, pad, 0)
    if mode == "replicate":
        return _replicate(ctx, x, pad)
    if mode == "circular":
        return _circular(ctx, x, pad)
    raise ctx.unsupported(f"padding mode {mode!r}")


def _mirror(ctx, x, pad, mode):
    spec = np.asarray(_torch_pads(pad, x.rank), np.int32)
    return ctx.op("MIRROR_PAD", [x, spec], mode=mode)


@builds(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def reflection_pad(ctx, x, padding):
    return _mirror(ctx, x, padding, 0)  # MirrorPadMode.REFLECT


def _gather_pad(ctx, x, pad, index_fn):
    for d, (b, a) in enumerate(_torch_pads(pad, x.rank)):
        if b or a:
            n, b, a = ctx.static((x.shape[d], b, a), "the padded positions are an index table built at conversion "
                                                   "time")
            idx = index_fn(np.arange(-b, n + a), n)
            shape = x.shape[:d] + (len(idx),) + x.shape[d + 1:]
            x = ctx.op("GATHER", [x, idx.astype(np.int32)], shape=shape, dtype=x.dtype, axis=d)
    return x


def _replicate(ctx, x, pad):
    if not all_static(x.shape):
        # the edge items repeated: broadcasts of one-item slices on each side
        def edges(x, d, b, a, n):
            first = strided_slice(ctx, x, {d: (0, 1, 1)})
            last = strided_slice(ctx, x, {d: (n - 1, n, 1)})
            return [ctx.broadcast_to(first, x.shape[:d] + (b,) + x.shape[d + 1:])] if b else [], \
                [ctx.broadcast_to(last, x.shape[:d] + (a,) + x.shape[d + 1:])] if a else []
        return _pad_by_concatenation(ctx, x, pad, edges)
    return _gather_pad(ctx, x, pad, lambda i, n: np.clip(i, 0, n - 1))


def _circular(ctx, x, pad):
    if not all_static(x.shape):
        # the other end's items: slices of the tensor itself
        def ends(x, d, b, a, n):
            if max(b, a) > (ctx.bounds(n)[0] or 0):
                raise ctx.unsupported("circular padding wider than the smallest size of a dynamic dim")
            return [strided_slice(ctx, x, {d: (n - b, n, 1)})] if b else [], \
                [strided_slice(ctx, x, {d: (0, a, 1)})] if a else []
        return _pad_by_concatenation(ctx, x, pad, ends)
    return _gather_pad(ctx, x, pad, lambda i, n: i % n)


def _pad_by_concatenation(ctx, x, pad, sides):
    for d, (b, a) in enumerate(_torch_pads(pad, x.rank)):
        b, a = ctx.static((b, a), "the padding amounts of a dynamic tensor must be constants")
        if b < 0 or a < 0:
            raise ctx.unsupported("negative replicate or circular padding")
        if b or a:
            before, after = sides(x, d, b, a, x.shape[d])
            shape = x.shape[:d] + (x.shape[d] + b + a,) + x.shape[d + 1:]
            x = ctx.op("CONCATENATION", before + [x] + after, shape=shape, dtype=x.dtype, axis=d)
    return x


@builds(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def replication_pad(ctx, x, padding):
    return _replicate(ctx, x, padding)


@builds(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    d1, d2 = _dims([dim1, dim2], x.rank)
    ctx.static((x.shape[d1], x.shape[d2]), "the diagonal's positions are an index table built at conversion time")
    rest = [d for d in range(x.rank) if d not in (d1, d2)]
    xt = ctx.transpose(x, rest + [d1, d2])
    n1, n2 = x.shape[d1], x.shape[d2]
    i = np.arange(max(0, -offset), min(n1, n2 - offset))
    lead = tuple(x.shape[d] for d in rest)
    flat = ctx.reshape(xt, lead + (n1 * n2,))
    idx = (i * n2 + i + offset).astype(np.int32)
    return ctx.op("GATHER", [flat, idx], shape=lead + (len(idx),), dtype=x.dtype, axis=len(lead))


@builds(aten.as_strided.default, aten.as_strided_copy.default)
def as_strided(ctx, x, size, stride, storage_offset=None):
    # a static view: the flat positions it reads are known now
    size = ctx.static(list(size) + list(x.shape), "the positions it reads are a table built at conversion time")
    size, stride = size[:len(stride)], [int(s) for s in stride]
    pos = np.full(size, int(storage_offset or 0), np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        pos = pos + (np.arange(n) * s).reshape(shape)
    flat = ctx.reshape(x, (x.size,))
    return ctx.op("GATHER", [flat, pos.astype(np.int32)], shape=tuple(size), dtype=x.dtype, axis=0)


@builds(aten.alias_copy.default, aten.permute_copy.default, aten.transpose_copy.int, aten.unsqueeze_copy.default,
        aten.squeeze_copy.dim, aten.squeeze_copy.dims, aten.t_copy.default, aten.detach_copy.default)
def view_copies(ctx, x, *args):
    out = ctx.out_shape()
    target = ctx.node.target
    if target is aten.permute_copy.default:
        return permute(ctx, x, args[0])
    if target is aten.transpose_copy.int:
        return transpose(ctx, x, *args)
    if target is aten.t_copy.default:
        return t(ctx, x)
    return ctx.reshape(x, out)

