"""NCHW -> NHWC layout assignment over the whole graph, with the fewest TRANSPOSE ops.

Builders emit ops in torch's layout and wrap channels-last builtins (CONV_2D,
pools, resizes) in TRANSPOSEs. Here every activation of rank 3-5 gets a layout:
as torch has it (label 0) or channels-last (label 1, the channel dim moved
last). Each op says what its operands' labels cost: a wrapper TRANSPOSE is free
when its input is already channels-last, an elementwise op wants its operands
to agree, a RESHAPE is free when it keeps the bytes in order, an op with no
layout rule wants label 0. Graph inputs and outputs keep torch's layout. The
labelling of least total cost is a minimum s-t cut (the costs are pairwise and
submodular); the graph is then rewritten: constants are permuted, axes
remapped, and a TRANSPOSE is inserted only where a consumer needs a layout its
producer did not give.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .dims import all_static, concrete
from .ir import Graph, Op, Tensor, shape_input
from .registry import TO_CHANNELS_LAST, inverse

ELEMENTWISE = {
    "ADD", "SUB", "MUL", "DIV", "MAXIMUM", "MINIMUM", "POW", "SQUARED_DIFFERENCE", "FLOOR_DIV", "FLOOR_MOD",
    "SELECT_V2", "LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL", "LOGICAL_AND",
    "LOGICAL_OR", "ATAN2", "RELU", "RELU6", "RELU_N1_TO_1", "RELU_0_TO_1", "LOGISTIC", "TANH", "EXP", "LOG",
    "SQRT", "RSQRT", "ABS", "NEG", "SIN", "COS", "CEIL", "FLOOR", "ROUND", "SIGN", "GELU", "HARD_SWISH",
    "LEAKY_RELU", "ELU", "CAST", "LOGICAL_NOT", "SQUARE", "BITWISE_XOR", "QUANTIZE", "DEQUANTIZE",
}
# ops whose first input and output keep the rank, with per-axis parameters we can remap
_AXIS_OPS = {"CONCATENATION", "MEAN", "SUM", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_PROD", "REDUCE_ANY", "REDUCE_ALL",
             "PAD", "PADV2", "MIRROR_PAD", "SLICE", "STRIDED_SLICE", "REVERSE_V2", "TILE", "BROADCAST_TO", "GATHER",
             "CUMSUM"}
REDUCERS = {"MEAN", "SUM", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_PROD", "REDUCE_ANY", "REDUCE_ALL"}

# Cost of one TRANSPOSE: the count matters first, the number of elements moved breaks ties.
_UNIT = 1 << 40


def _cost(t: Tensor, hints: dict) -> int:
    # a dynamic dim counts at its sample size
    return _UNIT + (t.size if not t.dynamic else int(np.prod([concrete(d, hints) for d in t.shape])))


def perm_of(label: int, rank: int) -> tuple:
    return TO_CHANNELS_LAST[rank] if label else tuple(range(rank))


def _compose(p1, p2) -> tuple:
    # The single permutation equal to transposing by ``p1`` and then by ``p2``.
    return tuple(p1[k] for k in p2)


def _is_trivial(perm, shape) -> bool:
    # True when transposing ``shape`` by ``perm`` only moves size-1 dims (the bytes keep their order).
    kept = [p for p in perm if shape[p] != 1]
    return kept == sorted(kept)


def _atoms(shape) -> list | None:
    # Boundaries (suffix products) of a row-major shape's dims, for reshape compatibility.
    out, acc = [], 1
    for d in reversed(shape):
        out.append((acc, acc * d))
        acc *= d
    return out[::-1]


def reshape_keeps_order(in_shape, in_perm, out_shape, out_perm) -> bool:
    """Whether RESHAPE of the physical input (``in_perm`` of ``in_shape``) gives the physical output."""
    if _is_trivial(in_perm, in_shape) and _is_trivial(out_perm, out_shape) or 0 in in_shape:
        return True
    if not all_static(in_shape) or not all_static(out_shape):
        return False  # the digit nesting below needs sizes; a TRANSPOSE is always right
    bounds = sorted({b for lo, hi in _atoms(in_shape) + _atoms(out_shape) for b in (lo, hi)})
    for a, b in zip(bounds, bounds[1:]):
        if b % a:
            return False  # the two shapes split the index into digits that do not nest

    def atom_order(shape, perm):
        spans = _atoms(shape)
        seq = []
        for p in perm:
            lo, hi = spans[p]
            seq += [b for b in reversed(bounds) if lo <= b < hi and b != hi]
        return [a for a in seq if _atom_size(a, bounds) > 1]

    return atom_order(in_shape, in_perm) == atom_order(out_shape, out_perm)


def _atom_size(lo, bounds) -> int:
    i = bounds.index(lo)
    return bounds[i + 1] // lo if i + 1 < len(bounds) else 1


# ---- the min cut ---------------------------------------------------------------------------

class _Cut:
    """A graph for min s-t cut: a variable on the sink side takes label 1."""

    def __init__(self):
        self.n = 2  # 0: source (label 0), 1: sink (label 1)
        self.adj: list[list[int]] = [[], []]
        self.to: list[int] = []
        self.cap: list[int] = []

    def node(self) -> int:
        self.adj.append([])
        self.n += 1
        return self.n - 1

    def edge(self, a: int, b: int, c: int) -> None:
        if c <= 0 or a == b:
            return
        self.adj[a].append(len(self.to))
        self.to.append(b)
        self.cap.append(c)
        self.adj[b].append(len(self.to))
        self.to.append(a)
        self.cap.append(0)

    def unary(self, v: int, cost0: int, cost1: int) -> None:
        self.edge(0, v, cost1)  # cut (paid) when v is on the sink side
        self.edge(v, 1, cost0)

    def pairwise(self, a: int, b: int, e00: int, e01: int, e10: int, e11: int) -> None:
        """E(la, lb) for a submodular table (e01 + e10 >= e00 + e11)."""
        lam = e01 + e10 - e00 - e11
        if lam < 0:  # not submodular: charge the cheaper mixed case on both (an over-estimate)
            e01 = e10 = max(e01, e10, (e00 + e11 + 1) // 2)
            lam = e01 + e10 - e00 - e11
        self._linear(a, e10 - e00)
        self._linear(b, e11 - e10)
        self.edge(a, b, lam)

    def _linear(self, v: int, k: int) -> None:
        if k > 0:
            self.edge(0, v, k)
        elif k < 0:
            self.edge(v, 1, -k)

    def solve(self) -> list[bool]:
        """Dinic's max flow; returns, per node, whether it is on the sink side of a min cut (the smallest one).

        Written here rather than scipy.sparse.csgraph.maximum_flow: scipy counts capacities in int32
        (int64 ones silently give a zero flow), and these costs are lexicographic 64-bit integers
        (transposes x 2**40 + elements moved); scaled into int32 they lose the tie-break, which
        changes layouts (a pt2e model's first conv stops being int8: tests/test_quant_litert.py)."""
        to, cap, adj = self.to, self.cap, self.adj
        while True:
            level = [-1] * self.n
            level[0] = 0
            q = deque([0])
            while q:
                u = q.popleft()
                for e in adj[u]:
                    if cap[e] > 0 and level[to[e]] < 0:
                        level[to[e]] = level[u] + 1
                        q.append(to[e])
            if level[1] < 0:
                break
            it = [0] * self.n
            while self._push(level, it):
                pass
        # the sink side: nodes with a residual path to the sink (so where costs tie, label 0 wins)
        sink_side = [False] * self.n
        sink_side[1] = True
        q = deque([1])
        while q:
            v = q.popleft()
            for e in adj[v]:
                u = to[e]
                if cap[e ^ 1] > 0 and not sink_side[u]:
                    sink_side[u] = True
                    q.append(u)
        return sink_side

    def _push(self, level, it) -> bool:
        # one augmenting path in the level graph, found iteratively
        to, cap, adj = self.to, self.cap, self.adj
        path: list[int] = []
        u = 0
        while True:
            if u == 1:
                f = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= f
                    cap[e ^ 1] += f
                return True
            advanced = False
            while it[u] < len(adj[u]):
                e = adj[u][it[u]]
                v = to[e]
                if cap[e] > 0 and level[v] == level[u] + 1:
                    path.append(e)
                    u = v
                    advanced = True
                    break
                it[u] += 1
            if not advanced:
                if u == 0:
                    return False
                level[u] = -1  # dead end
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1


# ---- the pass ------------------------------------------------------------------------------

def _variable(t: Tensor | None) -> bool:
    return t is not None and not t.is_const and not t.channels_last and t.rank in TO_CHANNELS_LAST


def _reduced_perm(op: Op, x: Tensor, label: int):
    # For a rank-dropping reduction of ``x`` in ``label``: the output's label, or None if none fits.
    axes = _reduction_axes(op, x.rank)
    if axes is None:
        return None
    p = perm_of(label, x.rank)
    kept_phys = [d for d in p if d not in axes]
    kept_log = [d for d in range(x.rank) if d not in axes]
    order = tuple(kept_log.index(d) for d in kept_phys)
    r = len(kept_log)
    if order == tuple(range(r)):
        return 0
    if r in TO_CHANNELS_LAST and order == TO_CHANNELS_LAST[r]:
        return 1
    return None


def _reduction_axes(op: Op, rank: int):
    if op.code in REDUCERS:
        a = op.inputs[1]
        if not a.is_const:
            return None
        return {int(v) % rank for v in np.asarray(a.data).reshape(-1)}
    if op.code in ("ARG_MAX", "ARG_MIN"):
        a = op.inputs[1]
        return {int(np.asarray(a.data).reshape(-1)[0]) % rank} if a.is_const else None
    return None


def _op_kind(op: Op) -> str:
    code = op.code
    if code in ELEMENTWISE:
        return "elementwise"
    if code == "TRANSPOSE" and op.inputs[1].is_const:
        return "transpose"
    if code == "RESHAPE":
        return "reshape"
    if code in ("ARG_MAX", "ARG_MIN") or (code in REDUCERS and not op.options.get("keepDims")):
        return "reduce"
    if code in _AXIS_OPS and all(t is None or t.is_const for t in op.inputs[1:]) or code == "CONCATENATION":
        if code == "GATHER" and op.inputs[1].rank != 1:
            return "fixed"
        if op.inputs[0].rank != op.outputs[0].rank:
            return "fixed"
        if code == "STRIDED_SLICE" and any(op.options.get(k, 0) for k in ("ellipsisMask", "newAxisMask",
                                                                        "shrinkAxisMask", "beginMask", "endMask")):
            return "fixed"
        return "axis"
    return "fixed"


def assign_nhwc_layout(g: Graph) -> Graph:
    """Chooses per activation NCHW or NHWC by min cut, then rewrites the graph (see module doc)."""
    cut = _Cut()
    var: dict[int, int] = {}
    hints = g.hints

    def v(t):
        if not _variable(t):
            return None
        if id(t) not in var:
            var[id(t)] = cut.node()
        return var[id(t)]

    def need0(t, times=1):  # a TRANSPOSE unless t is in torch's layout
        n = v(t)
        if n is not None and not _is_trivial(TO_CHANNELS_LAST[t.rank], t.shape):
            cut.unary(n, 0, _cost(t, hints) * times)

    def need1(t):
        n = v(t)
        if n is not None and not _is_trivial(TO_CHANNELS_LAST[t.rank], t.shape):
            cut.unary(n, _cost(t, hints), 0)

    for t in g.inputs:
        need0(t)
    for t in g.outputs:
        need0(t)
    for op in g.ops:
        kind = _op_kind(op)
        y = op.outputs[0]
        if kind == "elementwise":
            for x in op.inputs:
                if x is None or x.is_const:
                    continue
                if x.rank == y.rank and v(x) is not None and v(y) is not None:
                    cut.pairwise(v(x), v(y), 0, _cost(x, hints), _cost(x, hints), 0)
                elif x.rank == y.rank:
                    need0(x)
                    need0(y)
                elif v(y) is not None:
                    expanded = (1,) * (y.rank - x.rank) + x.shape
                    if not _is_trivial(TO_CHANNELS_LAST[y.rank], expanded):
                        need0(y)
        elif kind == "axis":
            main = [x for x in (op.inputs if op.code == "CONCATENATION" else op.inputs[:1])
                    if x is not None and not x.is_const]
            for x in main:
                if v(x) is not None and v(y) is not None:
                    cut.pairwise(v(x), v(y), 0, _cost(x, hints), _cost(x, hints), 0)
                else:
                    need0(x)
                    need0(y)
        elif kind == "reduce":
            x = op.inputs[0]
            if v(x) is None:
                need0(y)
                continue
            to = _reduced_perm(op, x, 1)
            if to is None:
                need0(x)
                need0(y)
            elif to == 1 and v(y) is not None:
                cut.pairwise(v(x), v(y), 0, _cost(x, hints), _cost(x, hints), 0)
            else:
                need0(y)
        elif kind in ("reshape", "transpose"):
            x = op.inputs[0]
            e = {}
            for lx in (0, 1) if v(x) is not None else (0,):
                for ly in (0, 1) if v(y) is not None else (0,):
                    e[lx, ly] = min(c for _, _, c in _realizations(op, kind, lx, ly, {lx}, hints))
            _add_table(cut, v(x), v(y), e)
        else:
            for x in op.inputs:
                need0(x)
            for t in op.outputs:
                need0(t)
    if not var:
        return g
    side = cut.solve()
    labels = {k: int(side[n]) for k, n in var.items()}
    return _rewrite(g, labels)


def _move_cost(t: Tensor, hints: dict) -> int:
    # What changing ``t``'s layout costs: a TRANSPOSE, or nothing when only size-1 dims move.
    if t.rank not in TO_CHANNELS_LAST or _is_trivial(TO_CHANNELS_LAST[t.rank], t.shape):
        return 0
    return _cost(t, hints)


def _realizations(op: Op, kind: str, lx: int, ly: int, have, hints: dict) -> list:
    # Ways to compute a RESHAPE or TRANSPOSE whose input is available in ``have`` and whose output is
    # wanted in ``ly``: (input label, output label, cost), counting every TRANSPOSE it takes.
    x, y = op.inputs[0], op.outputs[0]
    xs = (0, 1) if _variable(x) else (0,)
    ys = (0, 1) if _variable(y) else (0,)
    out = []
    for a in xs:
        for b in ys:
            cost = (0 if a in have else _move_cost(x, hints)) + (0 if b == ly else _move_cost(y, hints))
            if kind == "reshape":
                if not reshape_keeps_order(x.shape, perm_of(a, x.rank), y.shape, perm_of(b, y.rank)):
                    continue
            else:
                q = tuple(int(p) for p in op.inputs[1].data)
                c = _compose(_compose(inverse(perm_of(a, x.rank)), q), perm_of(b, y.rank))
                if not _is_trivial(c, _phys_shape(x, a)):
                    cost += _cost(x, hints)
            out.append((a, b, cost))
    return out


def _add_table(cut: _Cut, a, b, e: dict) -> None:
    if a is not None and b is not None:
        cut.pairwise(a, b, e[0, 0], e[0, 1], e[1, 0], e[1, 1])
    elif a is not None:
        cut.unary(a, e[0, 0], e[1, 0])
    elif b is not None:
        cut.unary(b, e[0, 0], e[0, 1])


def _phys_shape(t: Tensor, label: int) -> tuple:
    return tuple(t.shape[p] for p in perm_of(label, t.rank))


class _Rewriter:
    def __init__(self, g: Graph, labels: dict[int, int]):
        self.g = g
        self.labels = labels
        self.ops: list[Op] = []
        # id(tensor) -> {label: physical tensor}; label 0's physical tensor is the tensor itself
        self.avail: dict[int, dict[int, Tensor]] = {}

    def label(self, t: Tensor) -> int:
        return self.labels.get(id(t), 0)

    def phys(self, t: Tensor, label: int) -> Tensor:
        """The tensor that holds ``t`` in ``label`` (``t`` itself for label 0), not yet computed."""
        if label == 0:
            return t
        return Tensor(f"{t.name}/nhwc", _phys_shape(t, label), t.dtype, quant=t.quant)

    def produced(self, t: Tensor, label: int, p: Tensor) -> None:
        self.avail.setdefault(id(t), {})[label] = p

    def get(self, t: Tensor, label: int) -> Tensor:
        """``t`` held in ``label``, inserting a TRANSPOSE (or RESHAPE) if no producer gave it so."""
        if t.is_const:
            return _const_in(t, label)
        have = self.avail.get(id(t))
        if not have:
            have = self.avail[id(t)] = {0: t}
        if label in have:
            return have[label]
        src_label, src = next(iter(have.items()))
        out = self.phys(t, label)
        c = _compose(inverse(perm_of(src_label, t.rank)), perm_of(label, t.rank))
        self._move(src, out, c)
        have[label] = out
        return out

    def _move(self, src: Tensor, out: Tensor, perm) -> None:
        shape = shape_input(out.shape, src) if _is_trivial(perm, src.shape) else None
        if shape is not None:
            self.ops += shape[1]
            self.ops.append(Op("RESHAPE", [src, shape[0]], [out]))
        else:
            self.ops.append(Op("TRANSPOSE", [src, Tensor(f"{out.name}/perm", (len(perm),), np.int32,
                                                        np.asarray(perm, np.int32))], [out]))

    def emit(self, op: Op, inputs: list, out_label: int, **options) -> None:
        outs = []
        for t in op.outputs:
            p = self.phys(t, out_label if _variable(t) else 0)
            self.produced(t, out_label if _variable(t) else 0, p)
            outs.append(p)
        self.ops.append(Op(op.code, inputs, outs, {**op.options, **options}))


def _const_in(t: Tensor, label: int, rank: int | None = None) -> Tensor:
    # A constant expanded to ``rank`` (leading 1s) and stored in ``label``.
    data = t.data
    rank = t.rank if rank is None else rank
    if data.ndim < rank:
        data = data.reshape((1,) * (rank - data.ndim) + data.shape)
    if label and rank in TO_CHANNELS_LAST:
        data = np.require(np.transpose(data, TO_CHANNELS_LAST[rank]), requirements="C")
    if data is t.data:
        return t
    return Tensor(t.name, data.shape, t.dtype, data)


def _rewrite_move(rw: _Rewriter, op: Op, kind: str, ly: int) -> None:
    # A RESHAPE or TRANSPOSE computed the cheapest way from the layouts its input has.
    x, y = op.inputs[0], op.outputs[0]
    have = rw.avail.get(id(x)) or {0: x}
    a, b, _ = min(_realizations(op, kind, 0, ly, set(have), rw.g.hints),
                  key=lambda r: (r[2], r[0] != 0, r[1] != ly))
    src = rw.get(x, a)
    if kind == "reshape":
        rw.emit(op, [src, _reshape_target(rw, op, b)], b)
        return
    q = tuple(int(p) for p in op.inputs[1].data)
    c = _compose(_compose(inverse(perm_of(a, x.rank)), q), perm_of(b, y.rank))
    if c == tuple(range(len(c))):
        rw.produced(y, b, src)
    else:
        out = rw.phys(y, b)
        rw._move(src, out, c)
        rw.produced(y, b, out)


def _rewrite(g: Graph, labels: dict[int, int]) -> Graph:
    rw = _Rewriter(g, labels)
    for t in g.inputs:
        rw.produced(t, 0, t)
        if _variable(t) and rw.label(t):
            rw.get(t, 1)
    for op in g.ops:
        kind = _op_kind(op)
        y = op.outputs[0]
        ly = rw.label(y) if _variable(y) else 0
        if kind == "elementwise":
            ins = []
            for x in op.inputs:
                if x is None:
                    ins.append(None)
                elif x.is_const:
                    ins.append(_const_in(x, ly, y.rank) if ly else x)
                elif x.rank == y.rank:
                    ins.append(rw.get(x, ly))
                elif ly:
                    x0 = rw.get(x, 0)
                    expanded = Tensor(f"{x.name}/expanded", (1,) * (y.rank - x.rank) + x.shape, x.dtype)
                    shape, shape_ops = shape_input(expanded.shape, x0)
                    rw.ops += shape_ops
                    rw.ops.append(Op("RESHAPE", [x0, shape], [expanded]))
                    rw.produced(expanded, 0, expanded)
                    ins.append(rw.get(expanded, 1) if _variable(expanded) else expanded)
                else:
                    ins.append(rw.get(x, 0))
            rw.emit(op, ins, ly)
        elif kind == "axis":
            _rewrite_axis_op(rw, op, ly)
        elif kind == "reduce":
            x = op.inputs[0]
            lx = rw.label(x) if _variable(x) else 0
            to = _reduced_perm(op, x, lx) if lx else 0
            if to is None or (to == 1 and not _variable(y)):
                lx, to = 0, 0
            axes = sorted(perm_of(lx, x.rank).index(a) for a in _reduction_axes(op, x.rank))
            axes_t = Tensor(op.inputs[1].name, (len(axes),) if op.inputs[1].rank else (), np.int32,
                            np.asarray(axes if op.inputs[1].rank else axes[0], np.int32))
            rw.emit(op, [rw.get(x, lx), axes_t], to)
        elif kind in ("reshape", "transpose"):
            _rewrite_move(rw, op, kind, ly)
        else:
            rw.emit(op, [x if x is None or x.is_const else rw.get(x, 0) for x in op.inputs], 0)
    outputs = []
    for t in g.outputs:
        outputs.append(rw.get(t, 0))
    g.ops = rw.ops
    g.outputs = outputs
    return g


def _reshape_target(rw: _Rewriter, op: Op, label: int) -> Tensor:
    # The shape operand of a RESHAPE whose output is held in ``label``: a constant, the op's own
    # (run-time) operand, or that operand permuted to the output's physical order.
    y = op.outputs[0]
    target = _phys_shape(y, label)
    found = shape_input(target)
    if found is not None:
        return found[0]
    if label == 0:
        return op.inputs[1]
    perm = perm_of(label, y.rank)
    out = Tensor(f"{y.name}/shape", (y.rank,), np.int32)
    rw.ops.append(Op("GATHER", [op.inputs[1], Tensor(f"{y.name}/perm", (y.rank,), np.int32,
                                                      np.asarray(perm, np.int32))], [out], {"axis": 0}))
    return out


def _rewrite_axis_op(rw: _Rewriter, op: Op, ly: int) -> None:
    y = op.outputs[0]
    r = y.rank
    p = perm_of(ly, r)
    pos = {a: p.index(a) for a in range(r)}  # logical axis -> physical axis
    code = op.code
    data_inputs = op.inputs if code == "CONCATENATION" else op.inputs[:1]
    ins = [(_const_in(x, ly) if x.is_const else rw.get(x, ly)) for x in data_inputs]
    opts = {}
    if code in ("CONCATENATION", "GATHER"):
        opts["axis"] = pos[op.options.get("axis", 0) % r]
    if code != "CONCATENATION":
        for t in op.inputs[1:]:
            if t is None:
                ins.append(None)
                continue
            a = np.asarray(t.data)
            if ly == 0:
                ins.append(t)
            elif code in REDUCERS or code in ("REVERSE_V2", "CUMSUM"):
                mapped = np.asarray([pos[int(v) % r] for v in a.reshape(-1)], np.int32)
                mapped = np.sort(mapped) if code != "CUMSUM" else mapped
                ins.append(Tensor(t.name, t.shape, t.dtype, mapped.reshape(a.shape).astype(a.dtype)))
            elif code == "GATHER":
                ins.append(t)
            elif code == "PADV2" and t.rank == 0 or code == "PADV2" and a.ndim != 2:
                ins.append(t)
            else:
                # per-axis vectors (SLICE begin/size, PAD paddings, TILE multiples, BROADCAST_TO shape)
                ins.append(Tensor(t.name, t.shape, t.dtype, np.require(a[list(p)], requirements="C")))
    rw.emit(op, ins, ly, **opts)
