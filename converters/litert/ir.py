"""The small graph IR between the ATen graph and the flatbuffer: tensors, operators, graphs.

A :class:`Graph` is one TFLite subgraph with one SignatureDef. Tensors are
values; a constant tensor carries its data (a numpy array), which the writer
stores once per distinct content. Operators are TFLite builtins named as in
the schema (``"CONV_2D"``) with their builtin options as keyword arguments of
the schema's ``<Name>OptionsT`` class (``strideW=2``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import numpy as np

from .dims import is_static, normalize


class Quant:
    """Affine quantization of a tensor: ``real = (q - zero_point) * scale``, one scale for the whole
    tensor or one per slice along ``axis`` (the schema's QuantizationParameters). Blockwise
    (``block_size`` > 0, the schema's BlockwiseQuantization): symmetric, one scale per ``block_size``
    elements along the last axis, read from ``scales``, a float16 constant tensor ``[rows, cols / block]``."""

    __slots__ = ("scale", "zero_point", "axis", "block_size", "scales")

    def __init__(self, scale, zero_point=0, axis: int = 0, block_size: int = 0, scales: "Tensor | None" = None):
        self.scale = np.asarray(scale, np.float32).reshape(-1)
        self.zero_point = np.broadcast_to(np.asarray(zero_point, np.int64).reshape(-1), self.scale.shape).copy()
        self.axis = int(axis)
        self.block_size, self.scales = int(block_size), scales

    @property
    def per_channel(self) -> bool:
        return self.scale.size > 1

    def __eq__(self, other) -> bool:
        return isinstance(other, Quant) and self.axis == other.axis and np.array_equal(self.scale, other.scale) \
            and np.array_equal(self.zero_point, other.zero_point) and self.block_size == other.block_size \
            and self.scales is other.scales

    __hash__ = None

    def __repr__(self) -> str:
        if self.per_channel:
            return f"Quant({self.scale.size} scales, axis {self.axis})"
        return f"Quant({float(self.scale[0]):.4g}, {int(self.zero_point[0])})"


class Tensor:
    """A value of a graph: shape, numpy dtype, and data when constant.

    A dim is an ``int``, or a sympy expression when it is dynamic (see :mod:`.dims`).
    ``channels_last`` marks tensors that a builder laid out NHWC on purpose
    (the activations around CONV_2D and friends): the layout pass never
    changes their layout. ``quant`` is set on quantized (int8, int32 bias)
    tensors.
    """

    __slots__ = ("name", "shape", "dtype", "data", "channels_last", "quant")

    def __init__(self, name: str, shape, dtype, data: np.ndarray | None = None, channels_last: bool = False,
                 quant: Quant | None = None):
        self.name = name
        self.shape = tuple(normalize(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.data = data
        self.channels_last = channels_last
        self.quant = quant

    @property
    def is_const(self) -> bool:
        return self.data is not None

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self):
        """The element count: an int, or a sympy expression when a dim is dynamic."""
        if all(is_static(d) for d in self.shape):
            return int(np.prod(self.shape, dtype=np.int64))
        return math.prod(self.shape)

    @property
    def dynamic(self) -> bool:
        return not all(is_static(d) for d in self.shape)

    def __repr__(self) -> str:
        kind = "const " if self.is_const else ""
        q = f" {self.quant!r}" if self.quant is not None else ""
        return f"<{kind}{self.name}: {self.dtype.name}{list(self.shape)}{q}>"


class Op:
    """One TFLite builtin operator. ``None`` in ``inputs`` is an omitted optional input."""

    __slots__ = ("code", "inputs", "outputs", "options")

    def __init__(self, code: str, inputs: list, outputs: list, options: dict | None = None):
        self.code = code
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.options = dict(options or {})

    def __repr__(self) -> str:
        ins = ", ".join("-" if t is None else t.name for t in self.inputs)
        outs = ", ".join(t.name for t in self.outputs)
        opts = f" {self.options}" if self.options else ""
        return f"{outs} = {self.code}({ins}){opts}"


class Graph:
    """One subgraph and its signature: named inputs and outputs, operators in execution order."""

    def __init__(self, name: str):
        self.name = name
        self.inputs: list[Tensor] = []
        self.outputs: list[Tensor] = []
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self.ops: list[Op] = []
        self.quant = None  # what the quantization passes do to it (quantize.GraphQuant); None keeps it float
        # dynamic dims: symbol -> its size in the sample inputs (the sizes the flatbuffer's shapes show)
        self.hints: dict = {}
        self.ranges: dict = {}  # symbol -> (min, max or None) it was exported for

    def producers(self) -> dict[int, Op]:
        """id(tensor) -> the op that computes it."""
        return {id(t): op for op in self.ops for t in op.outputs}

    def consumers(self) -> dict[int, list[Op]]:
        """id(tensor) -> the ops that read it (an op reading a tensor twice appears once)."""
        users: dict[int, list[Op]] = {}
        for op in self.ops:
            seen = set()
            for t in op.inputs:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    users.setdefault(id(t), []).append(op)
        return users

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor the graph uses, each once, in a deterministic order."""
        seen: set[int] = set()
        for t in self._all():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield t

    def _all(self) -> Iterable:
        yield from self.inputs
        for op in self.ops:
            for t in op.inputs:
                if t is not None and t.quant is not None and t.quant.scales is not None:
                    yield t.quant.scales  # a blockwise weight's scales: a tensor no op reads
                yield t
            yield from op.outputs
        yield from self.outputs

    def __repr__(self) -> str:
        lines = [f"graph {self.name}({', '.join(map(repr, self.inputs))}):"]
        lines += [f"  {op!r}" for op in self.ops]
        lines.append(f"  return {', '.join(t.name for t in self.outputs)}")
        return "\n".join(lines)


def shape_input(shape, src: Tensor | None = None):
    """``(operand, ops)``: the int32 shape operand of a RESHAPE to ``shape`` and the ops that compute it.

    A constant when ``shape`` is static or has one dynamic dim (RESHAPE's -1); otherwise the
    dynamic dims are gathered from ``SHAPE(src)``, which must have each of them as a dim.
    None when neither works.
    """
    shape = tuple(normalize(d) for d in shape)
    dynamic = [d for d in shape if not is_static(d)]
    if not dynamic or (len(dynamic) == 1 and 0 not in shape):
        data = np.asarray([d if is_static(d) else -1 for d in shape], np.int32)
        return Tensor("shape", data.shape, np.int32, data), []
    if src is None or any(d not in src.shape for d in dynamic):
        return None
    statics = [d for d in shape if is_static(d)]
    index = []
    for d in shape:
        index.append(src.shape.index(d) if not is_static(d) else src.rank + statics.index(d))
    ops = []
    table = Tensor(f"{src.name}/shape", (src.rank,), np.int32)
    ops.append(Op("SHAPE", [src], [table], {"outType": 2}))
    if statics:
        extended = Tensor(f"{src.name}/shape_ext", (src.rank + len(statics),), np.int32)
        ops.append(Op("CONCATENATION", [table, Tensor("dims", (len(statics),), np.int32,
                                                       np.asarray(statics, np.int32))], [extended], {"axis": 0}))
        table = extended
    if index == list(range(src.rank)) and not statics:
        return table, ops
    out = Tensor(f"{src.name}/reshape_to", (len(shape),), np.int32)
    ops.append(Op("GATHER", [table, Tensor("index", (len(index),), np.int32, np.asarray(index, np.int32))], [out],
                  {"axis": 0}))
    return out, ops


# ---- what one conversion's graphs share ---------------------------------------------------------------
# Passes that make new weights from old ones (folding a norm's scale in, quantizing) make each once per
# conversion, keyed by the source array, so a decoder's prefill and decode signatures share one copy.
_MEMO: dict | None = None


@contextlib.contextmanager
def conversion_memo():
    """Within it, :func:`derived` results are shared by every graph converted."""
    global _MEMO
    _MEMO = {}
    try:
        yield
    finally:
        _MEMO = None


def array_key(a: np.ndarray) -> tuple:
    """Identifies an array's memory (address, shape, strides, dtype): views of one weight agree."""
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)


def derived(kind: str, source: np.ndarray, extra, make):
    """``make()``, made once per (kind, source array, extra) within :func:`conversion_memo` (always outside)."""
    if _MEMO is None:
        return make()
    table = _MEMO.setdefault(kind, {})
    key = (array_key(source), extra)
    if key not in table:
        table[key] = (source, make())  # the source is held too: its address stays its own while the key lives
    return table[key][1]


def derived_bytes(kind: str) -> int:
    """Bytes of the arrays ``kind`` has made so far in this conversion."""
    table = (_MEMO or {}).get(kind, {})
    return sum(sum(a.nbytes for a in (v[1] if isinstance(v[1], tuple) else (v[1],)) if isinstance(a, np.ndarray))
               for v in table.values())
