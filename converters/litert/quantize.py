"""Quantization passes of the edge target: the ``quant_config`` recipes, and models quantized with pt2e.

- ``fp16``: float weights stored as float16, each read through a DEQUANTIZE that LiteRT
  computes once, at load (XNNPACK folds it into the weights of its operators).
- ``dynamic_int8``: the weights of FULLY_CONNECTED, CONV_2D, BATCH_MATMUL and
  EMBEDDING_LOOKUP are int8 with one symmetric scale per output channel; activations stay
  float, and LiteRT's hybrid kernels quantize them on the fly, per run and asymmetrically
  (``asymmetric_quantize_inputs``). DEPTHWISE_CONV_2D and TRANSPOSE_CONV weights and GATHER
  tables are int8 too, read through a DEQUANTIZE (no hybrid kernel, or one slower than float on XNNPACK).
  Mixture-of-experts tables that a step gathers a few experts of stay int8 in memory: one scale per expert
  and output column, the gathered experts cast to float and the scales applied to the matmul's columns.
- ``int4_blockwise``: FULLY_CONNECTED weights and embedding tables int4 in blocks; mixture-of-experts
  weights (batched matmuls and gathered experts, which LiteRT's int4 kernels do not take) int8 as above.
- ``int8``: weights and activations int8, after TFLite's quantization spec: activations per
  tensor and asymmetric, their scales from the float graph run on the user's calibration
  samples; weights symmetric per output channel; biases int32 at input scale x weight scale;
  fixed output scales where the kernel has them (SOFTMAX, LOGISTIC, TANH), shared scales where
  the kernel needs them (pools, RESHAPE, CONCATENATION, ...). Ops without an int8 kernel run in
  float between DEQUANTIZE and QUANTIZE. Inputs and outputs stay float unless ``integer_io``.
- pt2e (no recipe): the QUANTIZE -> DEQUANTIZE pairs that ``ops_quant`` made of the model's own
  quantize/dequantize ops give the activation scales; then the same int8 rewrite.

Everything here runs after the layout and fusion passes, on the graph they made: quantization
never changes a layout, so those passes see float graphs (and pt2e's pairs as elementwise ops).
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from torchtpu_export.errors import ArtifactError, ConversionError, InputError
from torchtpu_export.quant import per_channel_int8
from torchtpu_export.specs import coerce_input

from .ir import Graph, Op, Quant, Tensor, derived
from .schema import INT4

F32, F16, I8, I32 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8), np.dtype(np.int32)

# Weights with fewer values stay float (as in TensorFlow's converter): they save next to nothing,
# and each would cost an op or a less accurate result.
MIN_ELEMENTS = 1024
# int4_blockwise: the block sizes LiteRT's blockwise kernels (XNNPACK's qb4w) take
BLOCK_SIZES = (32, 64, 128, 256)
# Values this large are the -inf / float-min fills of attention masks: int8 cannot keep their meaning
# next to ordinary activations, so tensors holding them (and the ops reading them) stay float.
MASK_MAGNITUDE = 1e9
_F16_MAX = float(np.finfo(np.float16).max)


@dataclasses.dataclass
class GraphQuant:
    """What the quantization passes do to one graph.

    ``recipe``: ``fp16``, ``dynamic_int8``, ``int8`` or ``pt2e``. ``samples``: for ``int8``, the
    calibration inputs, one list of arrays (the graph's inputs, in order) per sample.
    ``ranges`` maps each activation (``id`` of a float tensor) to its int8 parameters, filled by
    ``calibrate_activations`` or ``fold_quantize_dequantize``. ``float_constants`` records the
    float graph's constants (digest -> bytes) for the size report.
    """

    recipe: str
    samples: list = dataclasses.field(default_factory=list)
    integer_io: bool = False
    block_size: int = 32  # int4_blockwise: weights per scale, along the input dimension
    ranges: dict = dataclasses.field(default_factory=dict)
    float_constants: dict | None = None
    observer: object = None  # int8: a runtime factory, flatbuffer bytes -> run(inputs) / tensor(index)


def graph_quants(quant_config, captures: dict, io_dtypes: str, observer=None) -> dict:
    """Per signature, the GraphQuant of ``quant_config`` (None for float), its options checked.

    Options: ``int8`` takes ``calibration`` (an iterable of samples, each the positional arguments
    as a tuple, one tensor, or ``{"args": ..., "kwargs": ...}``; with several signatures, a dict of
    such iterables by signature name) and ``integer_io`` (int8 inputs and outputs, default False).
    The other recipes take no option.
    """
    from torchtpu_export import quant

    from .registry import io_dtype
    cfg = quant.parse(quant_config, "litert")
    if cfg is None:
        return {name: None for name in captures}
    allowed = {"int8": {"calibration", "integer_io"}, "int4_blockwise": {"block_size"}}.get(cfg.recipe, set())
    unknown = sorted(set(cfg.options) - allowed)
    if unknown:
        raise InputError(f"unknown option(s) for the {cfg.recipe} recipe: {', '.join(unknown)}",
                         hint="int8 takes calibration= and integer_io=, int4_blockwise block_size=; "
                              "fp16 and dynamic_int8 take none")
    if cfg.recipe == "int4_blockwise":
        block = cfg.options.get("block_size", 32)
        if block not in BLOCK_SIZES:
            raise InputError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, not {block!r}")
        return {name: GraphQuant(cfg.recipe, block_size=block) for name in captures}
    if cfg.recipe != "int8":
        return {name: GraphQuant(cfg.recipe) for name in captures}
    integer_io = cfg.options.get("integer_io", False)
    if not isinstance(integer_io, bool):
        raise InputError(f"integer_io must be True or False, not {integer_io!r}")
    if integer_io and io_dtypes == "web":
        raise InputError("integer_io=True makes int8 inputs and outputs, which LiteRT.js (io_dtypes='web') "
                         "does not take")
    calibration = cfg.options.get("calibration")
    if calibration is None:
        raise InputError("the int8 recipe needs calibration samples to choose its activation scales",
                         hint='quant_config={"recipe": "int8", "calibration": [sample_args, ...]} '
                              "with inputs like the ones the model will see")
    if isinstance(calibration, dict):
        missing = sorted(set(captures) - set(calibration))
        if missing:
            raise InputError(f"calibration has no samples for signature(s) {', '.join(missing)}")
    elif len(captures) > 1:
        raise InputError("with several signatures, calibration is a dict of samples by signature name")
    out = {}
    for name, cap in captures.items():
        samples = calibration[name] if isinstance(calibration, dict) else calibration
        flat = []
        try:
            items = list(samples)
        except TypeError:
            raise InputError(f"calibration must be an iterable of samples, not {type(samples).__name__}") from None
        for n, sample in enumerate(items):
            if isinstance(sample, dict) and set(sample) <= {"args", "kwargs"}:
                args, kwargs = tuple(sample.get("args", ())), dict(sample.get("kwargs", {}))
            else:
                args, kwargs = (tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)), {}
            try:
                leaves = cap.flatten_inputs(args, kwargs)
                arrays = [coerce_input(spec, x, dtype=io_dtype(getattr(torch, spec.dtype), io_dtypes).name)
                          for spec, x in zip(cap.inputs, leaves)]
            except InputError as e:
                raise InputError(f"calibration sample {n}: {e}") from None
            flat.append(arrays)
        if not flat:
            raise InputError("calibration is empty; pass at least one sample (a few dozen are better)")
        out[name] = GraphQuant("int8", flat, integer_io, observer=observer)
    return out


def constant_bytes(graphs) -> dict[str, int]:
    """The constants of ``graphs`` as the writer stores them: each distinct content once (digest -> bytes)."""
    out: dict[str, int] = {}
    for g in graphs:
        for t in g.tensors():
            if t.is_const and t.data.size:
                raw = np.asarray(t.data, order="C").reshape(-1).view(np.uint8)
                out[hashlib.blake2b(raw, digest_size=16).hexdigest()] = \
                    (raw.nbytes + 1) // 2 if t.dtype == INT4 else raw.nbytes  # int4: two per byte in the file
    return out


def _begin(g: Graph) -> GraphQuant | None:
    q = g.quant
    if q is not None and q.float_constants is None:
        q.float_constants = constant_bytes([g])
    return q


def activation_quant(lo: float, hi: float) -> Quant:
    """Asymmetric int8 parameters covering [lo, hi] (widened to hold 0 exactly, as padding and ReLU need)."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if hi - lo < 1e-12:
        hi = lo + 1e-12
    scale = (hi - lo) / 255.0
    zero_point = int(np.clip(np.round(-128 - lo / scale), -128, 127))
    return Quant(scale, zero_point)


def _real_range(q: Quant) -> tuple[float, float]:
    s, z = float(q.scale[0]), int(q.zero_point[0])
    return (-128 - z) * s, (127 - z) * s


def _quantize_values(data: np.ndarray, q: Quant) -> np.ndarray:
    return np.clip(np.rint(data / q.scale[0]) + q.zero_point[0], -128, 127).astype(np.int8)


def _const_int8(t: Tensor, q: Quant | None = None) -> Tensor:
    # A float constant as int8, with ``q`` or parameters covering its own values.
    data = t.data.astype(np.float32)
    finite = data[np.isfinite(data)] if data.size else data
    if q is None:
        q = activation_quant(finite.min() if finite.size else 0.0, finite.max() if finite.size else 0.0)
    clipped = np.clip(np.nan_to_num(data, nan=0.0), *_real_range(q))
    return Tensor(t.name, t.shape, I8, _quantize_values(clipped, q), quant=q)


def _is_activation(t) -> bool:
    return t is not None and not t.is_const and t.dtype == F32


# ---- pt2e: quantize/dequantize pairs ---------------------------------------------------------

def _resolve(alias: dict, t):
    while t is not None and id(t) in alias:
        t = alias[id(t)]
    return t


def fold_quantize_dequantize(g: Graph) -> Graph:
    """pt2e's QUANTIZE -> DEQUANTIZE pairs vanish: their scales become those of the float tensors
    they bracketed, which ``quantize_activations`` turns into int8 tensors."""
    producer = g.producers()
    pairs = []
    for op in g.ops:
        if op.code == "DEQUANTIZE" and op.inputs[0].dtype == I8:
            src = producer.get(id(op.inputs[0]))
            if src is not None and src.code == "QUANTIZE" and src.inputs[0].dtype == F32:
                pairs.append((src, op))
    if not pairs:
        return g
    if g.quant is not None:
        raise InputError("this model is already quantized (it has pt2e quantize/dequantize pairs)",
                         hint="convert it without quant_config: its own scales are used")
    g.quant = GraphQuant("pt2e")
    _begin(g)
    alias: dict[int, Tensor] = {}
    for q_op, dq in pairs:
        x = _resolve(alias, q_op.inputs[0])
        g.quant.ranges.setdefault(id(x), q_op.outputs[0].quant)
        alias[id(dq.outputs[0])] = x
    dropped = {id(dq) for _, dq in pairs}
    g.ops = [op for op in g.ops if id(op) not in dropped]
    for op in g.ops:
        op.inputs = [_resolve(alias, t) for t in op.inputs]
    g.outputs = [_resolve(alias, t) for t in g.outputs]
    # a layout move between a pair and the op it feeds shares the pair's scales (pt2e shares them too)
    _share_through_moves(g)
    return g


def _share_through_moves(g: Graph) -> None:
    ranges = g.quant.ranges
    changed = True
    while changed:
        changed = False
        for op in g.ops:
            spec = INT8_OPS.get(op.code)
            if spec is None or spec.out != "same":
                continue
            src = op.inputs[spec.data[0]]
            outs = [y for y in op.outputs if y.dtype == F32]
            if not _is_activation(src) or not outs:
                continue
            if id(src) in ranges and any(id(y) not in ranges for y in outs):
                for y in outs:
                    ranges.setdefault(id(y), ranges[id(src)])
                changed = True
            elif id(src) not in ranges and all(id(y) in ranges for y in outs):
                ranges[id(src)] = ranges[id(outs[0])]
                changed = True


# ---- int8: calibration ------------------------------------------------------------------------

def calibrate_activations(g: Graph) -> Graph:
    """``int8``: the range of every float tensor over the calibration samples, measured by running
    this very graph (float) on LiteRT's reference kernels, becomes its int8 scale and zero point."""
    q = _begin(g)
    if q is None or q.recipe != "int8":
        return g
    # The calibrator runs the model as conversion's own step (TensorFlow's converter does the same),
    # on LiteRT's reference kernels with every intermediate kept: the runtime is handed in (q.observer).
    from .writer import serialize
    tensors = list(g.tensors())
    index = {id(t): i for i, t in enumerate(tensors)}
    watch = [i for i, t in enumerate(tensors) if _is_activation(t)]
    if q.observer is None:
        raise ConversionError("the int8 recipe calibrates on LiteRT: convert through tte.convert, or pass "
                              "observer= (runtimes.litert.TensorObserver)")
    try:
        observer = q.observer(serialize([g]))
    except ArtifactError as e:
        raise ConversionError(f"LiteRT cannot run the float graph to calibrate it: {e}") from e
    lo = np.full(len(tensors), np.inf)
    hi = np.full(len(tensors), -np.inf)
    masked = np.zeros(len(tensors), bool)
    for n, sample in enumerate(q.samples):
        try:  # 0-d inputs stay 0-d
            observer.run({index[id(t)]: np.asarray(a, dtype=t.dtype, order="C") for t, a in zip(g.inputs, sample)})
        except InputError as e:
            raise InputError(f"calibration sample {n} does not run: {e}") from e
        for i in watch:
            v = observer.tensor(i)
            if not v.size:
                continue
            big = ~np.isfinite(v) | (np.abs(v) >= MASK_MAGNITUDE)
            if big.any():
                masked[i] = True
                continue
            lo[i] = min(lo[i], float(v.min()))
            hi[i] = max(hi[i], float(v.max()))
    for i in watch:
        if not masked[i] and np.isfinite(lo[i]):
            q.ranges[id(tensors[i])] = activation_quant(lo[i], hi[i])
    _symmetric_matmul_operands(g, q.ranges)
    return g


def symmetric_quant(q: Quant) -> Quant:
    """Zero point 0 and a scale covering what ``q`` covers."""
    lo, hi = _real_range(q)
    return Quant(max(-lo, hi, 1e-12) / 127.0, 0)


def _symmetric_matmul_operands(g: Graph, ranges: dict) -> None:
    # XNNPACK runs an int8 BATCH_MATMUL only when its right operand has zero point 0 (LiteRT's kernel
    # runs any): the operand, and the layout moves it comes through, get symmetric scales.
    producer = g.producers()
    for op in g.ops:
        if op.code != "BATCH_MATMUL":
            continue
        t = op.inputs[1]
        while _is_activation(t) and id(t) in ranges:
            ranges[id(t)] = symmetric_quant(ranges[id(t)])
            p = producer.get(id(t))
            spec = INT8_OPS.get(p.code) if p is not None else None
            if spec is None or spec.out != "same":
                break
            t = p.inputs[spec.data[0]]


# ---- int8: the rewrite ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Int8Op:
    """How an op's int8 kernel reads and writes (TFLite quantization spec and kernels).

    ``out``: ``"free"`` (the output's own scale), ``"same"`` (the output has input ``data[0]``'s
    scale), ``"joint"`` (the ``data`` inputs and the output share one scale), or a fixed
    ``(scale, zero_point)``. ``data``: inputs holding int8 values (None: all of them).
    ``weight`` / ``weight_axis``: the input holding int8 weights, one scale per slice along the
    axis; ``bias``: the input holding the int32 bias.
    """

    out: object = "free"
    data: tuple | None = (0,)
    weight: int | None = None
    weight_axis: int = 0
    bias: int | None = None


_FREE, _BINARY, _SAME, _JOINT2 = Int8Op(), Int8Op(data=(0, 1)), Int8Op("same"), Int8Op("joint", data=(0, 1))
INT8_OPS: dict[str, Int8Op] = {
    "CONV_2D": Int8Op(weight=1, bias=2),
    "DEPTHWISE_CONV_2D": Int8Op(weight=1, weight_axis=3, bias=2),
    "FULLY_CONNECTED": Int8Op(weight=1, bias=2),
    "TRANSPOSE_CONV": Int8Op(data=(2,), weight=1, bias=3),
    "BATCH_MATMUL": _BINARY,
    "ADD": _BINARY, "SUB": _BINARY, "MUL": _BINARY, "SQUARED_DIFFERENCE": _BINARY,
    "MEAN": _FREE, "SUM": _FREE, "RSQRT": _FREE,
    "RELU": _FREE, "RELU6": _FREE, "RELU_N1_TO_1": _FREE, "LEAKY_RELU": _FREE, "HARD_SWISH": _FREE,
    "ELU": _FREE, "GELU": _FREE, "PRELU": _BINARY,
    "LOGISTIC": Int8Op((1 / 256, -128)), "SOFTMAX": Int8Op((1 / 256, -128)), "TANH": Int8Op((1 / 128, 0)),
    "LOG_SOFTMAX": Int8Op((16 / 256, 127)), "L2_NORMALIZATION": Int8Op((1 / 128, 0)),
    **{code: _SAME for code in (
        "RESHAPE", "TRANSPOSE", "SQUEEZE", "EXPAND_DIMS", "MAX_POOL_2D", "AVERAGE_POOL_2D", "PAD", "GATHER",
        "SLICE", "STRIDED_SLICE", "SPACE_TO_DEPTH", "DEPTH_TO_SPACE", "RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR",
        "BROADCAST_TO", "TILE", "MIRROR_PAD", "REVERSE_V2", "BATCH_TO_SPACE_ND", "SPACE_TO_BATCH_ND",
        "REDUCE_MAX", "REDUCE_MIN", "UNPACK", "SPLIT_V")},
    "SPLIT": Int8Op("same", data=(1,)),
    "PADV2": Int8Op("same", data=(0, 2)),
    "EMBEDDING_LOOKUP": Int8Op("same", data=(1,)),
    "CONCATENATION": Int8Op("joint", data=None), "PACK": Int8Op("joint", data=None),
    "MAXIMUM": _JOINT2, "MINIMUM": _JOINT2, "SELECT_V2": Int8Op("joint", data=(1, 2)),
    **{code: _BINARY for code in ("LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL")},
    "ARG_MAX": _FREE, "ARG_MIN": _FREE,
}


def _data_inputs(op: Op, spec: Int8Op) -> list[int]:
    idx = range(len(op.inputs)) if spec.data is None else spec.data
    return [i for i in idx if i < len(op.inputs) and op.inputs[i] is not None and op.inputs[i].dtype == F32]


# Walks the ops in order, keeping each activation as int8, float, or both (a QUANTIZE or DEQUANTIZE
# is made where a consumer first needs the other form, right before it).
class _Int8Rewrite:

    def __init__(self, g: Graph, q: GraphQuant):
        self.g, self.ranges, self.q = g, q.ranges, q
        self.ops: list[Op] = []
        self.int8: dict[int, Tensor] = {}  # id(float tensor) -> the int8 tensor holding it
        self.floats: set[int] = set()  # float tensors available as float
        self.requantized: dict[tuple, Tensor] = {}

    def as_float(self, t: Tensor) -> Tensor:
        if id(t) not in self.floats:
            self.ops.append(Op("DEQUANTIZE", [self.int8[id(t)]], [t]))
            self.floats.add(id(t))
        return t

    def as_int8(self, t: Tensor, want: Quant | None = None) -> Tensor:
        have = self.int8.get(id(t))
        if have is None:
            have = Tensor(t.name, t.shape, I8, quant=want or self.ranges[id(t)])
            self.ops.append(Op("QUANTIZE", [self.as_float(t)], [have]))
            self.int8[id(t)] = have
        if want is None or have.quant == want:
            return have
        key = (id(t), float(want.scale[0]), int(want.zero_point[0]))
        if key not in self.requantized:
            out = Tensor(f"{t.name}/requantized", t.shape, I8, quant=want)
            self.ops.append(Op("QUANTIZE", [have], [out]))
            self.requantized[key] = out
        return self.requantized[key]

    def known(self, t: Tensor) -> bool:
        return id(t) in self.int8 or id(t) in self.ranges

    def quantizable(self, op: Op, spec: Int8Op) -> bool:
        data = _data_inputs(op, spec)
        if not data or any(not (op.inputs[i].is_const or self.known(op.inputs[i])) for i in data):
            return False
        if any(t is not None and t.dtype == F32 and i not in data and i != spec.weight and i != spec.bias
               for i, t in enumerate(op.inputs)):
            return False  # a float operand the int8 kernel would not read as int8
        if spec.weight is not None:
            w = op.inputs[spec.weight]
            if w is None or not w.is_const or w.dtype != F32:
                return False
        if spec.bias is not None and spec.bias < len(op.inputs):
            b = op.inputs[spec.bias]
            if b is not None and (not b.is_const or b.dtype != F32):
                return False
        outs = [y for y in op.outputs if y.dtype == F32]
        if spec.out == "same" and op.inputs[data[0]].is_const:
            return True
        if spec.out in ("free", "joint") and any(id(y) not in self.ranges for y in outs):
            return False
        # where the model itself said which tensors are int8 (pt2e), every output must be one of them
        return self.q.recipe != "pt2e" or all(id(y) in self.ranges for y in outs)

    def emit_int8(self, op: Op, spec: Int8Op) -> None:
        data = _data_inputs(op, spec)
        ins = list(op.inputs)
        if spec.out == "same":
            src = op.inputs[data[0]]
            ins[data[0]] = _const_int8(src) if src.is_const else self.as_int8(src)
            out_q = ins[data[0]].quant
        elif spec.out == "joint":
            spans = [_real_range(self.ranges[id(t)]) for t in op.outputs if t.dtype == F32]
            spans += [_real_range(self.int8[id(op.inputs[i])].quant if id(op.inputs[i]) in self.int8
                                  else self.ranges[id(op.inputs[i])]) for i in data if not op.inputs[i].is_const]
            out_q = activation_quant(min(s[0] for s in spans), max(s[1] for s in spans))
        elif isinstance(spec.out, tuple):
            out_q = Quant(*spec.out)
        else:
            out_q = None
        shared = out_q if spec.out in ("same", "joint") else None
        for i in data:
            x = op.inputs[i]
            if spec.out == "same" and i == data[0]:
                continue
            if x.is_const and op.code == "BATCH_MATMUL" and i == 1:
                ins[i] = _const_int8(x, symmetric_quant(_const_int8(x).quant))  # see _symmetric_matmul_operands
            else:
                ins[i] = _const_int8(x, shared) if x.is_const else \
                    self.as_int8(x, shared if spec.out == "joint" else None)
        if spec.weight is not None:
            w = op.inputs[spec.weight]
            qw, sw = per_channel_int8(w.data, spec.weight_axis)
            ins[spec.weight] = Tensor(w.name, w.shape, I8, qw, quant=Quant(sw, 0, spec.weight_axis))
            b = op.inputs[spec.bias] if spec.bias is not None and spec.bias < len(op.inputs) else None
            if b is not None:
                bias_scale = float(ins[data[0]].quant.scale[0]) * sw.astype(np.float64)
                qb = np.clip(np.rint(b.data.astype(np.float64) / bias_scale), -2**31, 2**31 - 1).astype(np.int32)
                ins[spec.bias] = Tensor(b.name, b.shape, I32, qb, quant=Quant(bias_scale, 0, 0))
        outs = []
        for y in op.outputs:
            if y.dtype != F32:
                outs.append(y)
                continue
            yq = Tensor(y.name, y.shape, I8, quant=out_q or self.ranges[id(y)])
            self.int8[id(y)] = yq
            outs.append(yq)
        self.ops.append(Op(op.code, ins, outs, op.options))

    def run(self) -> None:
        g = self.g
        inputs = []
        for t in g.inputs:
            if self.q.integer_io and _is_activation(t) and id(t) in self.ranges:
                ti = Tensor(t.name, t.shape, I8, quant=self.ranges[id(t)])
                self.int8[id(t)] = ti
                inputs.append(ti)
            else:
                self.floats.add(id(t))
                inputs.append(t)
        for op in g.ops:
            spec = INT8_OPS.get(op.code)
            if spec is not None and self.quantizable(op, spec):
                self.emit_int8(op, spec)
                continue
            op.inputs = [self.as_float(x) if _is_activation(x) and id(x) not in self.floats else x
                         for x in op.inputs]
            self.ops.append(op)
            self.floats.update(id(y) for y in op.outputs if y.dtype == F32)
        outputs = []
        for t in g.outputs:
            if not _is_activation(t):
                outputs.append(t)
            elif self.q.integer_io and self.known(t):
                outputs.append(self.as_int8(t))
            else:
                outputs.append(self.as_float(t))
        g.inputs, g.ops, g.outputs = inputs, self.ops, outputs


def quantize_activations(g: Graph) -> Graph:
    """``int8`` and pt2e: every op with an int8 kernel whose activations have scales computes in int8
    (int8 per-channel weights, int32 biases); the others compute in float between DEQUANTIZE and QUANTIZE."""
    q = _begin(g)
    if q is None or q.recipe not in ("int8", "pt2e"):
        return g
    _Int8Rewrite(g, q).run()
    return g


# ---- weight-only recipes ----------------------------------------------------------------------

def _hybrid_weight(op: Op) -> tuple[int, int] | None:
    # (input index, channel axis) of the weight a hybrid kernel of ``op`` reads as int8
    x = op.inputs[0] if op.inputs else None
    if op.code in ("FULLY_CONNECTED", "CONV_2D") and x is not None and x.dtype == F32:
        return 1, 0
    if op.code == "BATCH_MATMUL" and x is not None and x.dtype == F32 and op.inputs[1].rank >= 2:
        # the channels are the columns of the result: rhs [..., K, N], or [..., N, K] when adjoint
        return 1, op.inputs[1].rank - (2 if op.options.get("adjY") else 1)
    if op.code == "EMBEDDING_LOOKUP":
        return 1, 0
    return None


# Weights of ops with no hybrid kernel, or one XNNPACK does not run (LiteRT's own is slower than
# float): stored int8 per channel and read through a DEQUANTIZE, which LiteRT computes once, at load.
def _weight_only(op: Op) -> tuple[int, int] | None:
    if op.code == "DEPTHWISE_CONV_2D":
        return 1, 3
    if op.code == "TRANSPOSE_CONV":
        return 1, 0
    if op.code == "GATHER" and op.inputs[0].rank:  # tables (embedding bags), one scale per gathered slice
        return 0, op.options.get("axis", 0) % op.inputs[0].rank
    return None


def _expert_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [experts, in, out]`` as int8 with one scale per expert and output column: (values, scales
    ``[experts, 1, out]``)."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def _expert_gathers(g: Graph) -> set[int]:
    """Mixture-of-experts tables read a few experts at a time (a GATHER of whole experts ``[experts, in,
    out]`` feeding a BATCH_MATMUL: the litert target's decode form) become int8, one scale per expert
    and output column, dequantized where used: the gathered int8 experts cast to float, the gathered
    scales multiplying the matmul's columns. The table stays int8 in memory (a DEQUANTIZE of the
    constant would hold it all in float) and a step reads only its experts' int8 values. Returns the ids of
    the scale tables it made (float, to stay so)."""
    users: dict[int, list] = {}
    for op in g.ops:
        for t in op.inputs:
            if t is not None:
                users.setdefault(id(t), []).append(op)
    rewrite: dict[int, Op] = {}  # id of a BATCH_MATMUL -> the GATHER that feeds its right-hand side
    for op in g.ops:
        if op.code != "GATHER" or op.options.get("axis", 0) != 0 or op.options.get("batchDims", 0):
            continue
        table, out = op.inputs[0], op.outputs[0]
        mm = users.get(id(out), [])
        if not (table.is_const and table.dtype == F32 and table.rank == 3 and table.size >= MIN_ELEMENTS
                and op.inputs[1].rank == 1 and len(mm) == 1 and mm[0].code == "BATCH_MATMUL"
                and mm[0].inputs[1] is out and not mm[0].options.get("adjY")):
            continue
        rewrite[id(mm[0])] = op
    if not rewrite:
        return set()
    gathers = {id(op) for op in rewrite.values()}
    made: dict[int, tuple] = {}
    ops: list[Op] = []
    for op in g.ops:
        if id(op) in gathers:
            continue  # emitted with its matmul
        gather = rewrite.get(id(op))
        if gather is None:
            ops.append(op)
            continue
        table, idx = gather.inputs
        if id(table) not in made:
            q, scale = derived("expert-int8", table.data, None, lambda: _expert_int8(table.data))
            made[id(table)] = (Tensor(f"{table.name}/int8", table.shape, I8, q),
                               Tensor(f"{table.name}/scales", scale.shape, F32, scale))
        q_t, scale_t = made[id(table)]
        rows = (idx.shape[0],)
        picked = Tensor(f"{gather.outputs[0].name}/int8", rows + table.shape[1:], I8)
        as_float = Tensor(f"{gather.outputs[0].name}/float", rows + table.shape[1:], F32)
        scales = Tensor(f"{gather.outputs[0].name}/scales", rows + scale_t.shape[1:], F32)
        result = op.outputs[0]
        raw = Tensor(f"{result.name}/unscaled", result.shape, F32)
        ops += [Op("GATHER", [q_t, idx], [picked], {"axis": 0}), Op("CAST", [picked], [as_float]),
                Op("BATCH_MATMUL", [op.inputs[0], as_float], [raw], dict(op.options)),
                Op("GATHER", [scale_t, idx], [scales], {"axis": 0}), Op("MUL", [raw, scales], [result])]
    g.ops = ops
    return {id(scale_t) for _, scale_t in made.values()}


def _dynamic_int8(g: Graph, only=None, keep: set[int] = frozenset()) -> None:
    done: dict[tuple, Tensor] = {}
    dequantized: dict[tuple, Tensor] = {}
    ops: list[Op] = []
    for op in g.ops:
        if only is not None and not only(op):
            ops.append(op)
            continue
        hybrid = _hybrid_weight(op)
        where = hybrid or _weight_only(op)
        w = op.inputs[where[0]] if where is not None and where[0] < len(op.inputs) else None
        if w is None or not w.is_const or w.dtype != F32 or w.size < MIN_ELEMENTS or id(w) in keep:
            ops.append(op)
            continue
        i, axis = where
        key = (id(w), axis)
        if key not in done:
            qw, scale = derived("int8", w.data, axis, lambda: per_channel_int8(w.data, axis))
            done[key] = Tensor(f"{w.name}/int8" if hybrid is None else w.name, w.shape, I8, qw,
                               quant=Quant(scale, 0, axis))
        if hybrid is None:
            if key not in dequantized:
                dequantized[key] = Tensor(w.name, w.shape, F32)
                ops.append(Op("DEQUANTIZE", [done[key]], [dequantized[key]]))
            op.inputs[i] = dequantized[key]
        else:
            op.inputs[i] = done[key]
        if op.code in ("FULLY_CONNECTED", "BATCH_MATMUL"):
            op.options["asymmetricQuantizeInputs"] = True
        ops.append(op)
    g.ops = ops


def _int4_blockwise(g: Graph, block: int) -> None:
    """FULLY_CONNECTED weights and EMBEDDING_LOOKUP tables ``[rows, cols]`` (cols a multiple of ``block``)
    become symmetric int4, one float16 scale per ``block`` values of a row: LiteRT's blockwise int4,
    which its CPU kernels (XNNPACK) compute with dynamically quantized activations."""
    done: dict[int, Tensor] = {}
    for op in g.ops:
        where = {"FULLY_CONNECTED": 1, "EMBEDDING_LOOKUP": 1}.get(op.code)
        if where is None or where >= len(op.inputs):
            continue
        w = op.inputs[where]
        if w is None or not w.is_const or w.dtype != F32 or w.rank != 2 or w.shape[1] % block \
                or w.size < MIN_ELEMENTS:
            continue
        if id(w) not in done:
            q, scales = derived("int4", w.data, block, lambda: blockwise_int4(w.data, block))
            scale_t = Tensor(f"{w.name}/scales", scales.shape, F16, scales)
            done[id(w)] = Tensor(f"{w.name}/int4", w.shape, INT4, q, quant=Quant(1.0, 0, 0, block, scale_t))
        op.inputs[where] = done[id(w)]
        if op.code == "FULLY_CONNECTED":
            op.options["asymmetricQuantizeInputs"] = False


def blockwise_int4(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``w [rows, cols]`` as int4 values and float16 scales ``[rows, cols / block]`` (symmetric:
    the largest magnitude of a block maps to 7), rounded against the float16 scale that is stored."""
    rows, cols = w.shape
    q = np.empty((rows, cols), INT4)
    scales = np.empty((rows, cols // block), np.float16)
    step = max(1, (16 << 20) // max(1, cols * 4))  # rows at a time: temporaries of ~16 MB, not of the weight
    for r in range(0, rows, step):
        blocks = w[r:r + step].reshape(-1, cols // block, block).astype(np.float32)
        scale = (np.abs(blocks).max(axis=-1) / 7.0).astype(np.float16)
        scale = np.where(scale == 0, np.float16(1.0), scale)
        scales[r:r + step] = scale
        q[r:r + step] = np.clip(np.rint(blocks / scale.astype(np.float32)[..., None]), -8, 7).reshape(-1, cols)
    return q, scales


def _fp16(g: Graph) -> None:
    ops: list[Op] = []
    done: dict[int, Tensor] = {}
    for op in g.ops:
        for i, x in enumerate(op.inputs):
            if x is None or not x.is_const or x.dtype != F32 or x.size < MIN_ELEMENTS:
                continue
            if id(x) not in done:
                if np.abs(x.data).max() > _F16_MAX:
                    continue  # beyond float16's range: stays float32 rather than become inf
                half = Tensor(f"{x.name}/fp16", x.shape, F16, x.data.astype(np.float16))
                done[id(x)] = Tensor(x.name, x.shape, F32)
                ops.append(Op("DEQUANTIZE", [half], [done[id(x)]]))
            op.inputs[i] = done[id(x)]
        ops.append(op)
    g.ops = ops


def quantize_weights(g: Graph) -> Graph:
    """``fp16``: float weights become float16 read through DEQUANTIZE. ``dynamic_int8``: the weights of
    FULLY_CONNECTED, CONV_2D, BATCH_MATMUL and EMBEDDING_LOOKUP become int8 per output channel (hybrid
    kernels); those of DEPTHWISE_CONV_2D, TRANSPOSE_CONV and GATHER tables int8 read through DEQUANTIZE."""
    q = _begin(g)
    if q is not None and q.recipe == "fp16":
        _fp16(g)
    elif q is not None and q.recipe == "dynamic_int8":
        _dynamic_int8(g, keep=_expert_gathers(g))
    elif q is not None and q.recipe == "int4_blockwise":
        # LiteRT's blockwise int4 kernels are FULLY_CONNECTED's: mixture-of-experts weights (batched matmuls,
        # gathered experts) go int8
        _expert_gathers(g)
        _dynamic_int8(g, only=_expert_matmul)
        _int4_blockwise(g, q.block_size)
    return g


def _expert_matmul(op: Op) -> bool:
    """A batched matmul over constant experts ``[experts, in, out]`` (the litert target's prefill form)."""
    return op.code == "BATCH_MATMUL" and op.inputs[1] is not None and op.inputs[1].is_const \
        and op.inputs[1].rank == 3

