"""Tiny .tflite test fixtures written with flatbuffers, for the browser tests.

They let the LiteRT.js harness be tested without the torch->LiteRT converter: a float
MLP (FULLY_CONNECTED, RELU, ADD), an int32 embedding lookup (GATHER, int32 ADD), a
two-input difference (SUB) whose signature order is not alphabetical, image
classifiers in NHWC and NCHW layout (MEAN, FULLY_CONNECTED), and one-op CAST models
used to find which tensor dtypes LiteRT.js accepts. Weights are seeded.
"""
from __future__ import annotations

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as fb

_TYPES = {np.dtype(np.float32): fb.TensorType.FLOAT32, np.dtype(np.int32): fb.TensorType.INT32,
          np.dtype(np.int64): fb.TensorType.INT64, np.dtype(np.uint8): fb.TensorType.UINT8,
          np.dtype(np.int8): fb.TensorType.INT8, np.dtype(np.int16): fb.TensorType.INT16,
          np.dtype(np.bool_): fb.TensorType.BOOL, np.dtype(np.float16): fb.TensorType.FLOAT16,
          np.dtype(np.float64): fb.TensorType.FLOAT64}


class _Graph:
    """One subgraph with a ``serving_default`` signature; tensors are named, constants get buffers."""

    def __init__(self):
        self.tensors: list = []
        self.buffers = [fb.BufferT()]  # buffer 0 is the empty buffer by convention
        self.ops: list = []
        self.opcodes: list[int] = []

    def tensor(self, name: str, shape, dtype, data=None) -> int:
        t = fb.TensorT()
        t.name, t.shape, t.type = name, list(shape), _TYPES[np.dtype(dtype)]
        t.buffer = 0
        if data is not None:
            buf = fb.BufferT()
            buf.data = np.frombuffer(np.ascontiguousarray(data, dtype=dtype).tobytes(), np.uint8)
            self.buffers.append(buf)
            t.buffer = len(self.buffers) - 1
        self.tensors.append(t)
        return len(self.tensors) - 1

    def op(self, code: int, inputs, outputs, options_type=None, options=None) -> None:
        if code not in self.opcodes:
            self.opcodes.append(code)
        o = fb.OperatorT()
        o.opcodeIndex, o.inputs, o.outputs = self.opcodes.index(code), list(inputs), list(outputs)
        if options is not None:
            o.builtinOptionsType, o.builtinOptions = options_type, options
        self.ops.append(o)

    def finish(self, inputs: list[int], outputs: list[int]) -> bytes:
        sg = fb.SubGraphT()
        sg.tensors, sg.inputs, sg.outputs, sg.operators, sg.name = self.tensors, inputs, outputs, self.ops, "main"
        sig = fb.SignatureDefT()
        sig.signatureKey, sig.subgraphIndex = "serving_default", 0
        sig.inputs = [self._tensor_map(i) for i in inputs]
        sig.outputs = [self._tensor_map(i) for i in outputs]
        model = fb.ModelT()
        model.version, model.description = 3, "torchtpu-export test fixture"
        model.subgraphs, model.buffers, model.signatureDefs = [sg], self.buffers, [sig]
        model.operatorCodes = []
        for code in self.opcodes:
            oc = fb.OperatorCodeT()
            oc.builtinCode, oc.deprecatedBuiltinCode, oc.version = code, min(code, 127), 1
            model.operatorCodes.append(oc)
        builder = flatbuffers.Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    def _tensor_map(self, index: int):
        m = fb.TensorMapT()
        m.name, m.tensorIndex = self.tensors[index].name, index
        return m


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def mlp_model(batch: int = 2, features: int = 8, units: int = 4) -> bytes:
    """x -> (relu(x @ W.T + b) + c, x @ W.T + b): float32 in, two float32 outputs."""
    r = _rng(0)
    g = _Graph()
    x = g.tensor("x", (batch, features), np.float32)
    w = g.tensor("w", (units, features), np.float32, r.standard_normal((units, features)))
    b = g.tensor("b", (units,), np.float32, r.standard_normal(units))
    c = g.tensor("c", (units,), np.float32, r.standard_normal(units))
    fc = g.tensor("output_1", (batch, units), np.float32)
    relu = g.tensor("relu", (batch, units), np.float32)
    out = g.tensor("output_0", (batch, units), np.float32)
    g.op(fb.BuiltinOperator.FULLY_CONNECTED, [x, w, b], [fc], fb.BuiltinOptions.FullyConnectedOptions,
         fb.FullyConnectedOptionsT())
    g.op(fb.BuiltinOperator.RELU, [fc], [relu])
    g.op(fb.BuiltinOperator.ADD, [relu, c], [out], fb.BuiltinOptions.AddOptions, fb.AddOptionsT())
    return g.finish([x], [out, fc])


def embedding_model(seq: int = 6, vocab: int = 16, dim: int = 4) -> bytes:
    """int32 token ids -> (embedding rows, ids + 1): an int32 input and an int32 output."""
    g = _Graph()
    ids = g.tensor("tokens", (1, seq), np.int32)
    table = g.tensor("table", (vocab, dim), np.float32, _rng(1).standard_normal((vocab, dim)))
    one = g.tensor("one", (1,), np.int32, np.array([1]))
    emb = g.tensor("output_0", (1, seq, dim), np.float32)
    nxt = g.tensor("output_1", (1, seq), np.int32)
    opts = fb.GatherOptionsT()
    opts.axis = 0
    g.op(fb.BuiltinOperator.GATHER, [table, ids], [emb], fb.BuiltinOptions.GatherOptions, opts)
    g.op(fb.BuiltinOperator.ADD, [ids, one], [nxt], fb.BuiltinOptions.AddOptions, fb.AddOptionsT())
    return g.finish([ids], [emb, nxt])


def difference_model(n: int = 4) -> bytes:
    """(zeta, alpha) -> zeta - alpha: two inputs whose signature order is not alphabetical."""
    g = _Graph()
    zeta = g.tensor("zeta", (n,), np.float32)
    alpha = g.tensor("alpha", (n,), np.float32)
    out = g.tensor("output_0", (n,), np.float32)
    g.op(fb.BuiltinOperator.SUB, [zeta, alpha], [out], fb.BuiltinOptions.SubOptions, fb.SubOptionsT())
    return g.finish([zeta, alpha], [out])


def image_classifier(size: int = 32, classes: int = 10, layout: str = "NHWC") -> bytes:
    """An image (NHWC or NCHW float32) -> logits: global mean over H, W then a linear layer."""
    g = _Graph()
    shape = (1, size, size, 3) if layout == "NHWC" else (1, 3, size, size)
    axes = (1, 2) if layout == "NHWC" else (2, 3)
    x = g.tensor("x", shape, np.float32)
    ax = g.tensor("axes", (2,), np.int32, np.array(axes))
    pooled = g.tensor("pooled", (1, 3), np.float32)
    w = g.tensor("w", (classes, 3), np.float32, _rng(2).standard_normal((classes, 3)))
    b = g.tensor("b", (classes,), np.float32, _rng(3).standard_normal(classes) * 0.1)
    out = g.tensor("output_0", (1, classes), np.float32)
    g.op(fb.BuiltinOperator.MEAN, [x, ax], [pooled], fb.BuiltinOptions.ReducerOptions, fb.ReducerOptionsT())
    g.op(fb.BuiltinOperator.FULLY_CONNECTED, [pooled, w, b], [out], fb.BuiltinOptions.FullyConnectedOptions,
         fb.FullyConnectedOptionsT())
    return g.finish([x], [out])


def cast_model(in_dtype, out_dtype, shape=(2, 3)) -> bytes:
    """One CAST op from ``in_dtype`` to ``out_dtype``: probes which I/O dtypes a runtime accepts."""
    g = _Graph()
    x = g.tensor("x", shape, in_dtype)
    y = g.tensor("output_0", shape, out_dtype)
    g.op(fb.BuiltinOperator.CAST, [x], [y])
    return g.finish([x], [y])
