"""Indexing: advanced indexing, gathers, scatters, index_put and KV-cache updates, embedding bags."""
from __future__ import annotations

import numpy as np
import torch

from .common import strided_slice
from .dims import broadcast_shapes, is_static
from .ir import Tensor
from .registry import BOOL, I32, builds

aten = torch.ops.aten


def _strides(shape) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def _index_i32(ctx, idx: Tensor, n: int) -> Tensor:
    # An index tensor as int32; constant negative indices wrap like torch's.
    if idx.is_const and (is_static(n) or not (idx.data < 0).any()):
        wrapped = idx.data.astype(np.int64) % max(n, 1) if is_static(n) else idx.data
        return ctx.const(wrapped.astype(np.int32))
    i = ctx.cast(idx, I32)
    return ctx.op("FLOOR_MOD", [i, ctx.const(max(n, 1) if not is_static(n) else np.asarray(max(n, 1), np.int32))],
                  shape=i.shape, dtype=I32)


def _combine(ctx, parts: list, shape) -> Tensor:
    # sum of (index tensor or constant array) * stride terms, broadcast to ``shape``, as int32.
    const_part = np.zeros((), np.int64)
    dyn = None
    for t, stride in parts:
        if isinstance(t, np.ndarray):
            const_part = const_part + t.astype(np.int64) * stride
        elif t.is_const:
            const_part = const_part + t.data.astype(np.int64) * stride
        else:
            term = t if stride == 1 else ctx.op("MUL", [t, ctx.const(np.asarray(stride, np.int32))], shape=t.shape,
                                                dtype=I32)
            dyn = term if dyn is None else ctx.op("ADD", [dyn, term], shape=broadcast_shapes(dyn.shape, term.shape),
                                                  dtype=I32)
    if dyn is None:
        return ctx.const(np.broadcast_to(const_part, shape).astype(np.int32))
    if const_part.any() or const_part.shape != ():
        dyn = ctx.op("ADD", [dyn, ctx.const(const_part.astype(np.int32))],
                     shape=broadcast_shapes(dyn.shape, const_part.shape), dtype=I32)
    return ctx.broadcast_to(dyn, tuple(shape))


@builds(aten.index.Tensor)
def index(ctx, x, indices):
    indices = list(indices) + [None] * (x.rank - len(indices))
    if any(i is not None and i.dtype == BOOL for i in indices):
        raise ctx.unsupported("boolean-mask indexing has a data-dependent shape")
    dims = [d for d, i in enumerate(indices) if i is not None]
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    if not adjacent:
        # torch puts the broadcast index dims first: bring the indexed dims to the front
        rest = [d for d in range(x.rank) if d not in dims]
        x = ctx.transpose(x, dims + rest)
        indices = [indices[d] for d in dims] + [None] * len(rest)
        dims = list(range(len(dims)))
    d0, k = dims[0], len(dims)
    idx = [_index_i32(ctx, indices[d], x.shape[d]) for d in dims]
    bshape = broadcast_shapes(*(i.shape for i in idx))
    merged = x.shape[d0:d0 + k]
    if k == 1:
        flat_idx, xm = idx[0], x
    else:
        ctx.static(merged, "indexing several dims at once flattens them with constant strides")
        xm = ctx.reshape(x, x.shape[:d0] + (int(np.prod(merged)),) + x.shape[d0 + k:])
        flat_idx = _combine(ctx, list(zip(idx, _strides(merged))), bshape)
    out_shape = x.shape[:d0] + tuple(flat_idx.shape) + x.shape[d0 + k:]
    return ctx.op("GATHER", [xm, flat_idx], shape=out_shape, dtype=x.dtype, axis=d0)


@builds(aten.index_select.default)
def index_select(ctx, x, dim, idx):
    dim = dim % x.rank if x.rank else 0
    if x.rank == 0:
        return x
    i = _index_i32(ctx, idx, x.shape[dim])
    return ctx.op("GATHER", [x, i], axis=dim)


def _flat_positions(ctx, shape, dim: int, idx: Tensor, n_dim: int) -> Tensor:
    # For an index tensor along ``dim`` (torch.gather/scatter), the flat position in a tensor of shape ``shape``.
    #
    # ``shape`` is the indexed tensor's shape; positions follow ``idx``'s shape.
    ctx.static(tuple(shape) + tuple(idx.shape), "the flat positions it reads or writes are an index table built at "
               "conversion time")
    strides = _strides(shape)
    offset = np.zeros(idx.shape, np.int64)
    for d, n in enumerate(idx.shape):
        if d != dim:
            s = [1] * idx.rank
            s[d] = n
            offset = offset + np.arange(n).reshape(s) * strides[d]
    return _combine(ctx, [(_index_i32(ctx, idx, n_dim), strides[dim]), (offset, 1)], idx.shape)


@builds(aten.gather.default)
def gather(ctx, x, dim, idx, *, sparse_grad=False):
    if x.rank == 0:
        return x
    dim = dim % x.rank
    pos = _flat_positions(ctx, x.shape, dim, idx, x.shape[dim])
    flat = ctx.reshape(x, (x.size,))
    return ctx.op("GATHER", [flat, pos], shape=idx.shape, dtype=x.dtype, axis=0)


def _segment(ctx, code: str, values: Tensor, pos: Tensor, n: int) -> Tensor:
    # ``code`` (UNSORTED_SEGMENT_SUM/MAX/...) of flat ``values`` into ``n`` slots at ``pos``.
    v = ctx.reshape(values, (values.size,))
    p = ctx.reshape(pos, (pos.size,))
    return ctx.op(code, [v, p, ctx.const(np.asarray([n], np.int32))], shape=(n,), dtype=values.dtype)


def scatter_flat(ctx, x: Tensor, pos: Tensor, values: Tensor, reduce: str | None, include_self: bool = True):
    """``x`` with ``values`` written at flat positions ``pos`` (``reduce``: None=replace, sum, prod, mean, amax, amin)."""
    n = ctx.static(x.size, "TFLite's segment ops that scatter it take the element count as a constant")
    flat = ctx.reshape(x, (n,))
    values = ctx.cast(values, x.dtype)
    if reduce is None:
        # replace: where positions repeat, the last update wins, as in torch's sequential CPU kernels
        # (a segment sum would add them): each slot's last writer is the max update ordinal there
        m = ctx.static(pos.size, "the update ordinals are a constant")
        if m == 0:
            return x
        last = _segment(ctx, "UNSORTED_SEGMENT_MAX", ctx.const(np.arange(m, dtype=np.int32).reshape(pos.shape)),
                        pos, n)  # slots nobody writes get int32's lowest value
        hit = ctx.op("GREATER_EQUAL", [last, ctx.const(np.zeros((), np.int32))], shape=(n,), dtype=BOOL)
        last = ctx.op("MAXIMUM", [last, ctx.const(np.zeros((), np.int32))], shape=(n,), dtype=I32)
        seg = ctx.op("GATHER", [ctx.reshape(values, (m,)), last], shape=(n,), dtype=x.dtype, axis=0)
        return ctx.reshape(ctx.op("SELECT_V2", [hit, seg, flat], shape=(n,), dtype=x.dtype), x.shape)
    hit = _segment(ctx, "UNSORTED_SEGMENT_SUM", ctx.const(np.ones(pos.shape, np.float32)), pos, n)
    hit = ctx.op("GREATER", [hit, ctx.const(np.zeros((), np.float32))], shape=(n,), dtype=BOOL)
    if reduce in ("sum", "add", "mean"):
        seg = _segment(ctx, "UNSORTED_SEGMENT_SUM", values, pos, n)
    elif reduce in ("prod", "multiply"):
        seg = _segment(ctx, "UNSORTED_SEGMENT_PROD", values, pos, n)
    elif reduce == "amax":
        seg = _segment(ctx, "UNSORTED_SEGMENT_MAX", values, pos, n)
    elif reduce == "amin":
        seg = _segment(ctx, "UNSORTED_SEGMENT_MIN", values, pos, n)
    else:
        raise ctx.unsupported(f"scatter reduce={reduce!r}")
    if reduce == "mean":
        cnt = _segment(ctx, "UNSORTED_SEGMENT_SUM", ctx.const(np.ones(pos.shape, x.dtype)), pos, n)
        if include_self:
            cnt = ctx.op("ADD", [cnt, ctx.const(np.ones((), x.dtype))], shape=(n,), dtype=x.dtype)
            seg = ctx.op("ADD", [seg, flat], shape=(n,), dtype=x.dtype)
        cnt = ctx.op("MAXIMUM", [cnt, ctx.const(np.ones((), x.dtype))], shape=(n,), dtype=x.dtype)
        if x.dtype.kind == "f":
            m = ctx.op("DIV", [seg, cnt], shape=(n,), dtype=x.dtype)
        else:
            m = ctx.op("FLOOR_DIV", [seg, cnt], shape=(n,), dtype=x.dtype)
        out = ctx.op("SELECT_V2", [hit, m, flat], shape=(n,), dtype=x.dtype)
    else:
        combine = {"sum": "ADD", "add": "ADD", "prod": "MUL", "multiply": "MUL", "amax": "MAXIMUM",
                   "amin": "MINIMUM"}[reduce]
        merged = ctx.op(combine, [seg, flat], shape=(n,), dtype=x.dtype) if include_self else seg
        out = ctx.op("SELECT_V2", [hit, merged, flat], shape=(n,), dtype=x.dtype)
    return ctx.reshape(out, x.shape)


@builds(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce)
def scatter(ctx, x, dim, idx, src, *, reduce=None):
    dim = dim % x.rank
    if not isinstance(src, Tensor):
        src = ctx.const(np.full(idx.shape, src, x.dtype))
    elif src.shape != idx.shape:
        src = _crop(ctx, src, idx.shape)
    pos = _flat_positions(ctx, x.shape, dim, idx, x.shape[dim])
    return scatter_flat(ctx, x, pos, src, {None: None, "add": "sum", "multiply": "prod"}[reduce])


def _crop(ctx, t: Tensor, shape) -> Tensor:
    return strided_slice(ctx, t, {d: (0, n, 1) for d, n in enumerate(shape) if n != t.shape[d]})


@builds(aten.scatter_add.default)
def scatter_add(ctx, x, dim, idx, src):
    dim = dim % x.rank
    if src.shape != idx.shape:
        src = _crop(ctx, src, idx.shape)
    return scatter_flat(ctx, x, _flat_positions(ctx, x.shape, dim, idx, x.shape[dim]), src, "sum")


@builds(aten.scatter_reduce.two)
def scatter_reduce(ctx, x, dim, idx, src, reduce, *, include_self=True):
    dim = dim % x.rank
    if src.shape != idx.shape:
        src = _crop(ctx, src, idx.shape)
    return scatter_flat(ctx, x, _flat_positions(ctx, x.shape, dim, idx, x.shape[dim]), src, reduce, include_self)


def _single_index_update(ctx, x, dim, idx, values, block: bool = False):
    # ``x`` with ``values`` written at a runtime position along ``dim`` (a block of them from there with
    # ``block``): DYNAMIC_UPDATE_SLICE.
    key = ("update_start", id(idx), x.rank, dim)  # the same start for every cache a step writes: built once
    start_t = ctx.cache.get(key)
    if start_t is None:
        start = []
        for d in range(x.rank):
            start.append(ctx.reshape(ctx.cast(idx, I32), (1,)) if d == dim else ctx.const(np.zeros((1,), np.int32)))
        start_t = ctx.cache[key] = ctx.op("CONCATENATION", start, shape=(x.rank,), dtype=I32, axis=0)
    upd_shape = x.shape[:dim] + (values.shape[dim] if block else 1,) + x.shape[dim + 1:]
    values = ctx.broadcast_to(ctx.cast(values, x.dtype), upd_shape) if values.shape != upd_shape else \
        ctx.cast(values, x.dtype)
    return ctx.op("DYNAMIC_UPDATE_SLICE", [x, values, start_t], shape=x.shape, dtype=x.dtype)


@builds(aten.index_put.default)
def index_put(ctx, x, indices, values, accumulate=False):
    indices = list(indices) + [None] * (x.rank - len(indices))
    if not isinstance(values, Tensor):
        values = ctx.const(np.asarray(values, x.dtype))
    masks = [i for i in indices if i is not None and i.dtype == BOOL]
    if masks:
        # x[mask] = v with one v for every selected element: a select, no data-dependent shape
        m = masks[0]
        v = ctx.cast(values, x.dtype)
        while v.rank and v.shape[0] == 1 and v.rank > x.rank - m.rank:
            v = ctx.reshape(v, v.shape[1:])
        broadcastable = v.rank <= x.rank - m.rank and all(
            a in (1, b) for a, b in zip(v.shape[::-1], x.shape[::-1]))
        if len(masks) == 1 and indices[0] is m and broadcastable and not accumulate:
            m = ctx.reshape(m, m.shape + (1,) * (x.rank - m.rank))
            return ctx.op("SELECT_V2", [m, v, x], shape=x.shape, dtype=x.dtype)
        raise ctx.unsupported("boolean-mask index_put with per-element values has a data-dependent shape")
    dims = [d for d, i in enumerate(indices) if i is not None]
    if len(dims) == 1 and indices[dims[0]].size == 1 and not indices[dims[0]].is_const and not accumulate:
        d = dims[0]
        v = values
        want = x.shape[:d] + (1,) + x.shape[d + 1:]
        if v.rank < len(want):
            v = ctx.reshape(v, (1,) * (len(want) - v.rank) + v.shape)
        return _single_index_update(ctx, x, d, indices[d], v)
    # general: the flat position of every updated element, from the index tensors and iotas
    ctx.static(x.shape, "the flat positions it writes are an index table built at conversion time")
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    idx = [_index_i32(ctx, indices[d], x.shape[d]) for d in dims]
    bshape = broadcast_shapes(*(i.shape for i in idx))
    rest = [d for d in range(x.rank) if d not in dims]
    if adjacent:
        upd_dims = [("rest", d) for d in rest if d < dims[0]] + [("b", j) for j in range(len(bshape))] + \
                   [("rest", d) for d in rest if d > dims[-1]]
    else:
        upd_dims = [("b", j) for j in range(len(bshape))] + [("rest", d) for d in rest]
    upd_shape = tuple(bshape[j] if kind == "b" else x.shape[j] for kind, j in upd_dims)
    strides = _strides(x.shape)
    parts = []
    b_pos = [i for i, (kind, _) in enumerate(upd_dims) if kind == "b"]
    for k, d in enumerate(dims):
        t = idx[k]
        t = ctx.reshape(t, (1,) * (len(bshape) - t.rank) + t.shape)
        # place the broadcast index dims where the update tensor has them
        full = [1] * len(upd_shape)
        for j, p in enumerate(b_pos):
            full[p] = t.shape[j]
        parts.append((ctx.reshape(t, tuple(full)), strides[d]))
    for p, (kind, d) in enumerate(upd_dims):
        if kind == "rest":
            s = [1] * len(upd_shape)
            s[p] = x.shape[d]
            parts.append((np.arange(x.shape[d]).reshape(s), strides[d]))
    pos = _combine(ctx, parts, upd_shape)
    vals = ctx.broadcast_to(ctx.reshape(values, (1,) * (len(upd_shape) - values.rank) + values.shape)
                            if values.rank < len(upd_shape) else values, upd_shape)
    return scatter_flat(ctx, x, pos, vals, "sum" if accumulate else None)


@builds(aten.index_copy.default)
def index_copy(ctx, x, dim, idx, src):
    if x.rank == 0:  # a 0-d tensor is its one element: the only valid index (0) replaces it
        return ctx.cast(ctx.reshape(src, ()), x.dtype)
    dim = dim % x.rank
    if idx.size == 1 and not idx.is_const:
        return _single_index_update(ctx, x, dim, idx, src)
    start = _contiguous_start(ctx, ctx.node.args[2] if ctx.node is not None else None, idx)
    if start is not None and src.shape[dim] == idx.size:  # a block written from a runtime start (a KV cache)
        return _single_index_update(ctx, x, dim, start, src, block=True)
    indices = [None] * dim + [idx]
    return index_put(ctx, x, indices, src)


def _contiguous_start(ctx, node, idx):
    """The runtime start ``s`` when the index is ``s + arange(n)`` (one DYNAMIC_UPDATE_SLICE writes it), else None."""
    import torch.fx
    if not isinstance(node, torch.fx.Node) or node.target not in (aten.add.Tensor, aten.add.Scalar) or idx.is_const:
        return None
    a, b = (ctx.value(x) if isinstance(x, torch.fx.Node) else None for x in node.args[:2])
    for ramp, start in ((a, b), (b, a)):
        if isinstance(ramp, Tensor) and ramp.is_const and ramp.data.shape == (idx.size,) and \
                np.array_equal(ramp.data, np.arange(idx.size)) and isinstance(start, Tensor) and start.size == 1 \
                and not start.is_const:
            return start
    return None


@builds(aten.index_add.default)
def index_add(ctx, x, dim, idx, src, *, alpha=1):
    dim = dim % x.rank
    if alpha != 1:
        src = ctx.op("MUL", [src, ctx.const(np.asarray(alpha, src.dtype))], shape=src.shape, dtype=src.dtype)
    return index_put(ctx, x, [None] * dim + [idx], src, True)


def _static_scatter(ctx, x, src, dim, positions: np.ndarray):
    # ``x`` with ``src`` written along ``dim`` at the static ``positions`` (one per src index).
    n = x.shape[dim]
    src_index = np.zeros(n, np.int64)
    mask = np.zeros(n, bool)
    src_index[positions] = np.arange(len(positions))
    mask[positions] = True
    if mask.all() and np.array_equal(positions, np.arange(n)):
        return ctx.cast(src, x.dtype)
    g = ctx.op("GATHER", [ctx.cast(src, x.dtype), src_index.astype(np.int32)], shape=x.shape, dtype=x.dtype, axis=dim)
    shape = [1] * x.rank
    shape[dim] = n
    return ctx.op("SELECT_V2", [ctx.const(mask.reshape(shape)), g, x], shape=x.shape, dtype=x.dtype)


@builds(aten.slice_scatter.default)
def slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    dim = dim % x.rank
    start, end, step = slice(start, end, step).indices(x.shape[dim])
    positions = np.arange(start, end, step)[:src.shape[dim]]
    if not len(positions):  # an empty slice writes nothing (a GATHER from an empty src would read past it)
        return ctx.cast(x, ctx.out_dtype()) if x.dtype != ctx.out_dtype() else x
    return _static_scatter(ctx, x, src, dim, positions)


@builds(aten.select_scatter.default)
def select_scatter(ctx, x, src, dim, index):
    dim = dim % x.rank
    index = index % x.shape[dim]
    src = ctx.reshape(src, x.shape[:dim] + (1,) + x.shape[dim + 1:])
    return _static_scatter(ctx, x, src, dim, np.asarray([index]))


@builds(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(ctx, x, mask, value):
    v = value if isinstance(value, Tensor) else ctx.const(np.asarray(value).astype(x.dtype))
    return ctx.op("SELECT_V2", [ctx.cast(mask, BOOL), ctx.cast(v, x.dtype), x])


@builds(aten.masked_scatter.default)
def masked_scatter(ctx, x, mask, src):
    # the k-th True position (row-major) takes src.flatten()[k]: k is a running count of the mask
    shape = ctx.static(ctx.out_shape(), "it counts positions with constant sizes")
    m = ctx.broadcast_to(mask, shape)
    n = int(np.prod(shape))
    mflat = ctx.cast(ctx.reshape(m, (n,)), I32)
    k = ctx.op("CUMSUM", [mflat, np.asarray(0, np.int32)], shape=(n,), dtype=I32, exclusive=True, reverse=False)
    k = ctx.op("MINIMUM", [k, ctx.const(np.asarray(max(src.size - 1, 0), np.int32))], shape=(n,), dtype=I32)
    g = ctx.op("GATHER", [ctx.reshape(src, (src.size,)), k], shape=(n,), dtype=x.dtype, axis=0)
    xb = ctx.broadcast_to(x, shape)
    return ctx.op("SELECT_V2", [m, ctx.reshape(g, shape), xb], shape=shape, dtype=x.dtype)


ONE_HOT_BAGS = 1 << 16  # bags x indices up to which a bag sum is a matmul with a one-hot matrix


def _bag_sum(ctx, ids: Tensor, n: int, bags: int, dtype):
    """``f(values (n, d), d) -> (bags, d)``: the sum of the rows of each bag (``ids``: the bag of each row).

    Small enough, a BATCH_MATMUL with the (bags, n) one-hot matrix of ``ids``: ops every reader and the
    GPU delegate have (UNSORTED_SEGMENT_SUM is in neither OpenVINO's TFLite frontend nor the GPU's set).
    Past ONE_HOT_BAGS the matrix would cost more than the segment op, which is used instead."""
    if bags * n > ONE_HOT_BAGS:
        num = ctx.const(np.asarray([bags], np.int32))
        return lambda values, d: ctx.op("UNSORTED_SEGMENT_SUM", [values, ids, num], shape=(bags, d), dtype=dtype)
    hot = ctx.op("EQUAL", [ctx.reshape(ids, (1, n)), ctx.const(np.arange(bags, dtype=np.int32).reshape(bags, 1))],
                 shape=(bags, n), dtype=BOOL)
    onehot = ctx.cast(hot, dtype)
    return lambda values, d: ctx.op("BATCH_MATMUL", [onehot, values], shape=(bags, d), dtype=dtype)


@builds(aten._embedding_bag.default, aten.embedding_bag.padding_idx, aten.embedding_bag.default,
        aten._embedding_bag_forward_only.default)
def embedding_bag(ctx, weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=None):
    if indices.rank == 2:  # (bags, per_bag) with no offsets
        b, k = indices.shape
        indices = ctx.reshape(indices, (b * k,))
        offsets = ctx.const(np.arange(0, b * k, k, dtype=np.int32))
    n, dim = indices.shape[0], weight.shape[1]
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    ctx.static((n, bags), "the bag of each index is found against a constant table of positions")
    starts = offsets if not include_last_offset else _crop(ctx, offsets, (bags,))
    # bag of each index: how many bag starts are at or before it, minus one
    if starts.is_const:
        ids = ctx.const((np.searchsorted(starts.data.astype(np.int64), np.arange(n), side="right") - 1)
                        .astype(np.int32))
    else:
        ge = ctx.op("GREATER_EQUAL", [ctx.const(np.arange(n, dtype=np.int32).reshape(n, 1)),
                                      ctx.reshape(ctx.cast(starts, I32), (1, bags))], shape=(n, bags), dtype=BOOL)
        cnt = ctx.op("SUM", [ctx.cast(ge, I32), np.asarray([1], np.int32)], shape=(n,), dtype=I32, keepDims=False)
        ids = ctx.op("SUB", [cnt, ctx.const(np.ones((), np.int32))], shape=(n,), dtype=I32)
    idx = ctx.cast(indices, I32)
    rows = ctx.op("GATHER", [weight, idx], shape=(n, dim), dtype=weight.dtype, axis=0)
    keep = None
    if padding_idx is not None and padding_idx >= 0:
        keep = ctx.op("NOT_EQUAL", [idx, ctx.const(np.asarray(padding_idx, np.int32))], shape=(n,), dtype=BOOL)
        rows = ctx.op("MUL", [rows, ctx.reshape(ctx.cast(keep, weight.dtype), (n, 1))], shape=(n, dim),
                      dtype=weight.dtype)
    if per_sample_weights is not None:
        rows = ctx.op("MUL", [rows, ctx.reshape(per_sample_weights, (n, 1))], shape=(n, dim), dtype=weight.dtype)
    k = n // bags if bags else 0
    if (mode in (0, 1) and keep is None and k and n == bags * k and starts.is_const
            and np.array_equal(starts.data.astype(np.int64), np.arange(0, n, k))):
        # bags of one size, in order (DLRM's (bags, per_bag) indices): a SUM over a reshape, which
        # every reader and delegate has (UNSORTED_SEGMENT_SUM is not in OpenVINO's or the GPU's set)
        out = ctx.op("SUM", [ctx.reshape(rows, (bags, k, dim)), np.asarray([1], np.int32)], shape=(bags, dim),
                     dtype=weight.dtype, keepDims=False)
        if mode == 0:
            zeros = ctx.const(np.zeros((bags,), np.int32))
            return out, ctx.const(np.zeros((0,), np.int32)), zeros, zeros
        out = ctx.op("DIV", [out, ctx.const(np.asarray(k, weight.dtype))], shape=(bags, dim), dtype=weight.dtype)
        size = ctx.const(np.full((bags,), k, np.int32))
        return out, ids, size, size
    ones = ctx.const(np.ones((n,), weight.dtype)) if keep is None else ctx.cast(keep, weight.dtype)
    bag_sum = _bag_sum(ctx, ids, n, bags, weight.dtype)
    if mode == 0:
        out = bag_sum(rows, dim)
        # torch's sum mode leaves its bookkeeping outputs empty or zero
        zeros = ctx.const(np.zeros((bags,), np.int32))
        offset2bag = ids if padding_idx is not None and padding_idx >= 0 else ctx.const(np.zeros((0,), np.int32))
        return out, offset2bag, zeros, zeros
    count = ctx.reshape(bag_sum(ctx.reshape(ones, (n, 1)), 1), (bags,))
    bag_size = ctx.cast(count, I32)
    if mode == 1:
        s = bag_sum(rows, dim)
        c = ctx.op("MAXIMUM", [count, ctx.const(np.ones((), weight.dtype))], shape=(bags,), dtype=weight.dtype)
        out = ctx.op("DIV", [s, ctx.reshape(c, (bags, 1))], shape=(bags, dim), dtype=weight.dtype)
        return out, ids, bag_size, bag_size
    num = ctx.const(np.asarray([bags], np.int32))
    mx = ctx.op("UNSORTED_SEGMENT_MAX", [rows, ids, num], shape=(bags, dim), dtype=weight.dtype)
    nonempty = ctx.op("GREATER", [ctx.reshape(count, (bags, 1)), ctx.const(np.zeros((), weight.dtype))],
                      shape=(bags, 1), dtype=BOOL)
    out = ctx.op("SELECT_V2", [nonempty, mx, ctx.const(np.zeros((), weight.dtype))], shape=(bags, dim),
                 dtype=weight.dtype)
    # the id of each bag's maximum: its first position (largest n - j among equal values), then the id there
    is_max = ctx.op("EQUAL", [rows, ctx.op("GATHER", [mx, ids], shape=(n, dim), dtype=weight.dtype, axis=0)],
                    shape=(n, dim), dtype=BOOL)
    rank = ctx.const((n - np.arange(n, dtype=np.int32)).reshape(n, 1))
    score = ctx.op("SELECT_V2", [is_max, rank, ctx.const(np.zeros((), np.int32))], shape=(n, dim), dtype=I32)
    best = ctx.op("UNSORTED_SEGMENT_MAX", [score, ids, num], shape=(bags, dim), dtype=I32)
    pos = ctx.op("SUB", [ctx.const(np.asarray(n, np.int32)), best], shape=(bags, dim), dtype=I32)
    pos = ctx.op("MINIMUM", [pos, ctx.const(np.asarray(n - 1, np.int32))], shape=(bags, dim), dtype=I32)
    pos = ctx.op("MAXIMUM", [pos, ctx.const(np.zeros((), np.int32))], shape=(bags, dim), dtype=I32)  # empty bags
    arg = ctx.op("GATHER", [idx, pos], shape=(bags, dim), dtype=I32, axis=0)
    arg = ctx.op("SELECT_V2", [nonempty, arg, ctx.const(np.zeros((), np.int32))], shape=(bags, dim), dtype=I32)
    return out, ids, bag_size, arg
