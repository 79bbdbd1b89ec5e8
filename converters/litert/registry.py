"""The table of TFLite builders, keyed by ATen overload, and what a builder may use.

A builder is ``rule(ctx, *args, **kwargs)``: the node's arguments with every
fx.Node replaced by its :class:`~.ir.Tensor` (constants included). It emits
TFLite ops through ``ctx`` and returns the result tensor (or a tuple)::

    @builds(aten.gelu.default)
    def gelu(ctx, x, approximate="none"):
        return ctx.op("GELU", [x], approximate=approximate == "tanh")

Builders work in torch's own layout (NCHW): an op that TFLite only has
channels-last (CONV_2D, pools, resizes) is wrapped in TRANSPOSEs by
:meth:`BuildContext.channels_last`, and the layout pass removes them.
"""
from __future__ import annotations

import functools

from typing import Callable, Sequence

import numpy as np
import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from torchtpu_export.core_ops import rewritten_core_ops
from torchtpu_export.errors import UnsupportedOpError

from .dims import all_static, canon, is_static, normalize, source_of
from .ir import Graph, Op, Tensor

from .. import OpRules  # noqa: E402

BUILDERS: OpRules = OpRules()  # op (or its name) -> rule

# Ops with no builder, and why. Kept explicit so the coverage table can say so.
NOT_SUPPORTED: dict[object, str] = {}


def builds(*ops):
    """Registers ``rule`` as the TFLite builder of ``ops``."""
    def register(rule):
        for op in ops:
            BUILDERS[op] = rule
        return rule
    return register


def not_supported(reason: str, *ops) -> None:
    for op in ops:
        NOT_SUPPORTED[op] = reason


class Missing:
    """A result a builder cannot produce (e.g. max-pool indices); an error only if something reads it."""

    def __init__(self, what: str):
        self.what = what


# Inside the model, 64-bit values are computed in 32 bits: most TFLite kernels (and every
# delegate) have no int64/float64 path. Inputs and outputs keep torch's dtypes.
# Half floats compute in float32 too (few TFLite kernels take them); bfloat16 inputs and
# outputs are float32, as numpy and most runtimes have no bfloat16.
# Integers narrower than 32 bits compute in int32 too: TFLite's arithmetic kernels take 8- and
# 16-bit integers only as quantized values (some abort on them); casting back wraps like torch.
_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.float32),
           np.dtype(np.uint64): np.dtype(np.uint32), np.dtype(np.float16): np.dtype(np.float32),
           np.dtype(np.int8): np.dtype(np.int32), np.dtype(np.uint8): np.dtype(np.int32),
           np.dtype(np.int16): np.dtype(np.int32), np.dtype(np.uint16): np.dtype(np.int32)}
_IO_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.float32),
              np.dtype(np.uint64): np.dtype(np.uint32)}
# io_dtypes="web": LiteRT.js tensors are float32, int32 or uint8 only (it refuses the rest at load)
_IO_WEB = {**_IO_NARROW, np.dtype(np.uint64): np.dtype(np.int32), np.dtype(np.uint32): np.dtype(np.int32),
           np.dtype(np.bool_): np.dtype(np.int32), np.dtype(np.int8): np.dtype(np.int32),
           np.dtype(np.int16): np.dtype(np.int32), np.dtype(np.uint16): np.dtype(np.int32),
           np.dtype(np.float16): np.dtype(np.float32), np.dtype(np.complex64): None}
IO_DTYPES = ("auto", "web")
_TORCH_NP = {
    torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16, torch.int8: np.int8,
    torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64, torch.uint8: np.uint8,
    torch.bool: np.bool_, torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64,
    torch.complex64: np.complex64, torch.bfloat16: np.float32,
}
F32, I32, BOOL = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.bool_)
# NCHW -> NHWC (and NCL -> NLC, NCDHW -> NDHWC) by rank
TO_CHANNELS_LAST = {3: (0, 2, 1), 4: (0, 2, 3, 1), 5: (0, 2, 3, 4, 1)}
# A broadcast that copies along one or two axes, at most this many times each, is written as CONCATENATION:
# XNNPACK does not run BROADCAST_TO, and LiteRT's own kernel is slow (a GQA repeat of a [1, 4, 1024, 64]
# cache 8 times: BROADCAST_TO 25 ms, CONCATENATION 2.2 ms on 2 x86-64 cores).
CONCAT_COPIES = 16


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype as stored in the model (64-bit narrowed to 32)."""
    try:
        d = np.dtype(_TORCH_NP[dtype])
    except KeyError:
        raise UnsupportedOpError(str(dtype), target="litert", reason="TFLite has no such tensor type") from None
    return _NARROW.get(d, d)


def io_dtype(dtype: torch.dtype, io_dtypes: str = "auto") -> np.dtype:
    """The numpy dtype of a model input or output in the flatbuffer.

    64-bit values are 32-bit (CompiledModel buffers and most delegates have no int64);
    float16 stays float16; bfloat16 is float32. With ``io_dtypes="web"`` every input and
    output is float32, int32 or uint8, the types LiteRT.js takes. The signature metadata
    keeps torch's dtype, and the runtime converts at the boundary (checking that values fit).
    """
    try:
        d = np.dtype(_TORCH_NP[dtype])
    except KeyError:
        raise UnsupportedOpError(str(dtype), target="litert", reason="TFLite has no such tensor type") from None
    table = _IO_WEB if io_dtypes == "web" else _IO_NARROW
    out = table.get(d, d)
    if out is None:
        raise UnsupportedOpError(str(dtype), target="litert (io_dtypes='web')",
                                 reason="LiteRT.js tensors are float32, int32 or uint8")
    return out


def inverse(perm: Sequence[int]) -> tuple:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _meta(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


class BuildContext:
    """Emits the ops of one graph; ``node`` is the ATen node being built."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.node: torch.fx.Node | None = None
        self._count = 0
        self._dims: dict = {}  # dynamic dim -> its run-time value
        self._shapes: dict = {}  # id(input) -> its SHAPE
        # values computed at run time from the dynamic sizes alone (shape vectors, masks), made once
        # per graph: ops run in the order they are emitted, so an earlier result serves later nodes
        self.cache: dict = {}
        self.env: dict = {}  # fx node -> its value, for builders that look at how an argument was made

    def value(self, node):
        """The value built for ``node`` (an argument's producer), or None if it has none yet."""
        return self.env.get(node)

    # ---- what torch says about the node ------------------------------------------------

    @property
    def out(self):
        """The node's output as a FakeTensor (or a tuple of them)."""
        return self.node.meta.get("val")

    def out_dtype(self, index: int | None = None) -> np.dtype:
        val = self.out if index is None else self.out[index]
        return numpy_dtype(val.dtype)

    def out_shape(self, index: int | None = None) -> tuple:
        val = self.out if index is None else self.out[index]
        return ir_shape(val.shape)

    def arg_dtype(self, i: int) -> np.dtype | None:
        v = _meta(self.node.args[i]) if i < len(self.node.args) else None
        return numpy_dtype(v.dtype) if isinstance(v, torch.Tensor) else None

    def promoted_dtype(self, kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT) -> np.dtype:
        """torch's computation dtype for an elementwise op over the node's tensor and number arguments."""
        vals = [_meta(a) for a in self.node.args]
        vals = [v for v in vals if isinstance(v, (torch.Tensor, bool, int, float))]
        compute, _ = elementwise_dtypes(*vals, type_promotion_kind=kind)
        return numpy_dtype(compute)

    def unsupported(self, reason: str) -> UnsupportedOpError:
        from torchtpu_export.fxnodes import op_name, user_source_line
        return UnsupportedOpError(op_name(self.node.target), target="litert", reason=reason,
                                  source=user_source_line(self.node))

    def static(self, values, why: str):
        """``values`` (a dim or a sequence of dims) as ints; UnsupportedOpError saying ``why`` if one is dynamic."""
        seq = values if isinstance(values, (tuple, list)) else (values,)
        dynamic = list(dict.fromkeys(d for d in seq if not is_static(d)))
        if dynamic:
            raise self.unsupported(f"it cannot have a dynamic size in LiteRT ({', '.join(map(str, dynamic))}): {why}")
        return tuple(int(d) for d in seq) if isinstance(values, (tuple, list)) else int(values)

    # ---- making tensors and ops ------------------------------------------------------

    def _name(self, suffix: str = "") -> str:
        self._count += 1
        base = self.node.name if self.node is not None else "t"
        return f"{base}/{suffix or self._count}"

    def tensor(self, shape, dtype, *, name: str | None = None, channels_last: bool = False) -> Tensor:
        return Tensor(name or self._name(), shape, dtype, channels_last=channels_last)

    def const(self, value, dtype=None, *, name: str | None = None) -> Tensor:
        """A constant tensor holding ``value`` (a number, list or array).

        A dynamic dim (a sympy expression) as ``value`` gives its value at run time instead.
        """
        if isinstance(value, sympy.Basic):
            value = normalize(value)
        if isinstance(value, sympy.Basic):
            v = self.reshape(self.dim(value), ())
            return self.cast(v, dtype if dtype is not None else np.int32)
        a = np.asarray(value, dtype=dtype)
        a = a.astype(_NARROW.get(a.dtype, a.dtype), copy=False)
        return Tensor(name or self._name("const"), a.shape, a.dtype, np.require(a, requirements="C"))

    def scalar_like(self, value, x: Tensor) -> Tensor:
        return self.const(np.asarray(value, dtype=x.dtype))

    def op(self, code: str, inputs: Sequence, *, shape=None, dtype=None, outputs: Sequence | None = None,
           **options):
        """Emits ``code`` and returns its output tensor (or list, when ``outputs`` is given).

        Inputs that are numbers or arrays become constants. The output takes ``shape``
        and ``dtype``; without ``shape`` it is the node's result (torch's shape and dtype),
        with ``shape`` but no ``dtype`` an intermediate of its first input's dtype.
        """
        ins = [x if x is None or isinstance(x, Tensor) else self.const(x) for x in inputs]
        if outputs is None:
            if dtype is None:
                # an intermediate (shape given) has its first input's dtype; the node's result, torch's
                first = ins[1] if code in ("SELECT", "SELECT_V2") else next((t for t in ins if t is not None), None)
                dtype = first.dtype if shape is not None and first is not None else self.out_dtype()
            out = self.tensor(self.out_shape() if shape is None else shape, dtype)
            self.graph.ops.append(Op(code, ins, [out], options))
            return out
        self.graph.ops.append(Op(code, ins, list(outputs), options))
        return list(outputs)

    # ---- helpers many builders share --------------------------------------------------

    def cast(self, x: Tensor, dtype) -> Tensor:
        dtype = np.dtype(dtype)
        dtype = _NARROW.get(dtype, dtype)
        if x.dtype == dtype:
            return x
        if x.is_const:
            return self.const(x.data.astype(dtype))
        return self.op("CAST", [x], shape=x.shape, dtype=dtype)

    def reshape(self, x: Tensor, shape) -> Tensor:
        shape = tuple(normalize(d) for d in shape)
        if x.shape == shape:
            return x
        if x.is_const and all_static(shape):
            return self.const(x.data.reshape(shape))
        return self.op("RESHAPE", [x, self.shape_operand(shape, infer=True)], shape=shape, dtype=x.dtype)

    # ---- dynamic dims --------------------------------------------------------------------

    def dim(self, d) -> Tensor:
        """The value of dim ``d`` at run time: an int32 tensor of shape (1,), computed from the inputs' SHAPE."""
        d = normalize(d)
        if is_static(d):
            return self.const(np.asarray([d], np.int32))
        if d not in self._dims:
            self._dims[d] = self._emit_dim(d)
        return self._dims[d]

    def shape_operand(self, shape, *, infer: bool = False):
        """``shape`` as the int32 vector an op reads (RESHAPE, BROADCAST_TO, FILL, SLICE sizes).

        Constant when every dim is static, or when ``infer`` and one dim is dynamic (RESHAPE's -1);
        otherwise computed at run time from the dynamic dims' values.
        """
        shape = [normalize(d) for d in shape]
        dynamic = [i for i, d in enumerate(shape) if not is_static(d)]
        if infer and dynamic and 0 not in shape:
            shape[dynamic[0]] = -1  # RESHAPE infers it from the element count
        return self.vector(shape)

    def vector(self, values):
        """An int32 vector of ``values`` (ints and dynamic dims): a numpy constant when all are ints,
        else a tensor computed at run time."""
        values = tuple(normalize(v) for v in values)
        if all(is_static(v) for v in values):
            return np.asarray(values, np.int32)
        if values in self.cache:
            return self.cache[values]
        pieces, run = [], []
        for v in values:
            if is_static(v):
                run.append(v)
                continue
            if run:
                pieces.append(self.const(np.asarray(run, np.int32)))
                run = []
            pieces.append(self.dim(v))
        if run:
            pieces.append(self.const(np.asarray(run, np.int32)))
        out = pieces[0] if len(pieces) == 1 else \
            self.op("CONCATENATION", pieces, shape=(len(values),), dtype=I32, axis=0)
        self.cache[values] = out
        return out

    def bounds(self, d) -> tuple:
        """(min, max) of a dim over the exported ranges of its symbols; max is None when unbounded."""
        if is_static(d):
            return int(d), int(d)
        from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy
        ranges = {s: ValueRanges(lo, hi if hi is not None else sympy.oo)
                  for s, (lo, hi) in self.graph.ranges.items() if s in d.free_symbols}
        r = bound_sympy(d, ranges)
        lo = int(r.lower) if r.lower.is_finite else None
        hi = int(r.upper) if r.upper.is_finite else None
        return lo, hi

    def negative(self, d) -> bool:
        """Whether a dim or index is negative; TypeError when that depends on the sizes in the exported ranges."""
        lo, hi = self.bounds(d)
        if lo is not None and lo >= 0:
            return False
        if hi is not None and hi < 0:
            return True
        raise TypeError(f"the sign of {d} depends on the dynamic sizes")

    def _source(self, sym) -> Tensor:
        # ``sym`` from a graph input's dim that is ``sym`` itself, or else ``a*sym + b``, as a (1,) int32 tensor
        found = source_of(sym, self.graph.inputs)
        if found is None:
            raise self.unsupported(f"the dynamic dim {sym} is not a dim of any input, so LiteRT cannot know its size")
        t, axis, a, b = found
        if id(t) not in self._shapes:
            self._shapes[id(t)] = self.op("SHAPE", [t], shape=(t.rank,), dtype=I32, outType=2)
        # GATHER, not SLICE: LiteRT computes a GATHER of a SHAPE when it prepares the model (so do
        # CONCATENATION and RESHAPE after it), and the shapes it feeds stay static
        n = self.op("GATHER", [self._shapes[id(t)], np.asarray([axis], np.int32)], shape=(1,), dtype=I32, axis=0)
        if b:
            n = self.op("SUB", [n, np.asarray([b], np.int32)], shape=(1,), dtype=I32)
        if a != 1:
            n = self.op("FLOOR_DIV", [n, np.asarray([a], np.int32)], shape=(1,), dtype=I32)
        return n

    def _emit_dim(self, e) -> Tensor:
        # Integer arithmetic over the symbols, as int32 ops on (1,) tensors.
        emit = self.dim

        def bad():
            return self.unsupported(f"the dynamic dim {e} is not an integer expression TFLite ops can compute")

        def binary(code, a, b):
            return self.op(code, [a, b], shape=(1,), dtype=I32)

        if e.is_Symbol:
            return self._source(e)
        if isinstance(e, sympy.Add):
            terms = [emit(a) for a in e.args]
            out = terms[0]
            for t in terms[1:]:
                out = binary("ADD", out, t)
            return out
        if isinstance(e, sympy.Mul):
            coeff, rest = e.as_coeff_Mul()
            if not coeff.is_Integer:
                raise bad()
            out = emit(rest) if not isinstance(rest, sympy.Mul) else None
            if out is None:
                factors = [emit(a) for a in rest.args]
                out = factors[0]
                for f in factors[1:]:
                    out = binary("MUL", out, f)
            return out if coeff == 1 else binary("MUL", out, self.const(np.asarray([int(coeff)], np.int32)))
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            base = emit(e.base)
            out = base
            for _ in range(int(e.exp) - 1):
                out = binary("MUL", out, base)
            return out
        if isinstance(e, (sympy.floor, sympy.ceiling)):
            num, den = sympy.fraction(sympy.together(e.args[0]))
            if not den.is_Integer or den <= 0:
                raise bad()
            if isinstance(e, sympy.ceiling):
                num = num + den - 1
            return binary("FLOOR_DIV", emit(sympy.expand(num)), self.const(np.asarray([int(den)], np.int32)))
        if isinstance(e, sympy.Mod):
            return binary("FLOOR_MOD", emit(e.args[0]), emit(e.args[1]))
        if isinstance(e, (sympy.Max, sympy.Min)):
            args = [emit(a) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = binary("MAXIMUM" if isinstance(e, sympy.Max) else "MINIMUM", out, a)
            return out
        raise bad()

    def transpose(self, x: Tensor, perm, *, channels_last: bool = False) -> Tensor:
        perm = tuple(int(p) for p in perm)
        if perm == tuple(range(len(perm))):
            return x
        if x.is_const:
            return self.const(np.transpose(x.data, perm))
        out = self.tensor(tuple(x.shape[p] for p in perm), x.dtype, channels_last=channels_last)
        return self.op("TRANSPOSE", [x, np.asarray(perm, np.int32)], outputs=[out])[0]

    def to_channels_last(self, x: Tensor) -> Tensor:
        """``x`` (NC...) as an N...C tensor that native channels-last ops read."""
        return self.transpose(x, TO_CHANNELS_LAST[x.rank], channels_last=True)

    def from_channels_last(self, y: Tensor) -> Tensor:
        """A channels-last result back in torch's layout."""
        if not y.channels_last:
            raise ValueError("from_channels_last expects a channels-last tensor")
        return self.transpose(y, inverse(TO_CHANNELS_LAST[y.rank]))

    def channels_last_tensor(self, shape_ncx, dtype) -> Tensor:
        """A new channels-last output for an NC... result of ``shape_ncx``."""
        perm = TO_CHANNELS_LAST[len(shape_ncx)]
        return self.tensor(tuple(shape_ncx[p] for p in perm), dtype, channels_last=True)

    def broadcast_to(self, x: Tensor, shape) -> Tensor:
        shape = tuple(normalize(d) for d in shape)
        if x.shape == shape:
            return x
        grown = [d for d, (a, b) in enumerate(zip(x.shape, shape)) if a != b] if x.rank == len(shape) else None
        if not all_static(shape) and not (grown and all_static(shape[d] for d in grown) and not x.is_const):
            return self.op("BROADCAST_TO", [x, self.shape_operand(shape)], shape=shape, dtype=x.dtype)
        if x.is_const:
            return self.const(np.broadcast_to(x.data, shape))
        if grown is not None and len(grown) <= 2 and all(shape[d] <= CONCAT_COPIES for d in grown):
            # a few copies side by side (CONCAT_COPIES)
            for d in grown:
                out_shape = x.shape[:d] + (shape[d],) + x.shape[d + 1:]
                x = self.op("CONCATENATION", [x] * shape[d], shape=out_shape, dtype=x.dtype, axis=d)
            return x
        return self.op("BROADCAST_TO", [x, np.asarray(shape, np.int32)], shape=shape, dtype=x.dtype)


def ir_shape(shape) -> tuple:
    """A torch shape (ints and SymInts) as an IR shape: ints, and sympy expressions for dynamic dims."""
    return tuple(canon(d) for d in shape)


aten = torch.ops.aten

# Composite ops this target lowers whole instead of letting torch decompose them: each maps
# to a TFLite builtin (or a short sequence) better than its decomposition does, and a graph
# made only of these and core ops skips torch's second, full retrace.
_KEPT = [
    aten.linear.default, aten.matmul.default, aten.t.default,
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
    aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding,
    aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input,
    aten.batch_norm.default, aten.layer_norm.default, aten.group_norm.default, aten.rms_norm.default,
    aten.scaled_dot_product_attention.default, aten.softmax.int, aten.log_softmax.int,
    aten.silu.default, aten.hardswish.default, aten.hardsigmoid.default, aten.relu6.default, aten.mish.default,
    aten.max_pool2d.default, aten.max_pool1d.default, aten.adaptive_avg_pool2d.default,
    aten.dropout.default, aten.feature_dropout.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.reshape.default, aten.transpose.int, aten.contiguous.default,
    aten.split.Tensor, aten.chunk.default, aten.unbind.int, aten.stack.default, aten.narrow.default,
    aten.expand_as.default, aten.type_as.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.rsub.Scalar, aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.arange.default, aten.arange.start,
    aten.repeat_interleave.self_int, aten.index_copy.default, aten.embedding_bag.padding_idx,
    aten.pad.default, aten.square.default, aten.zeros_like.default, aten.ones_like.default, aten.roll.default,
    aten.logsumexp.default, aten.std.correction, aten.var_mean.correction, aten.baddbmm.default,
]


@functools.cache
def keep_whole() -> list:
    """The composite ops kept whole (``_KEPT``), and the core ops torch's table would still rewrite
    that have a builder: what capture (and a composite's trace) must not decompose. Called once
    every op family has registered its builders."""
    return _KEPT + [op for op in rewritten_core_ops() if op in BUILDERS and op not in _KEPT]
