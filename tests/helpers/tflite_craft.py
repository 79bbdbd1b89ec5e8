"""Hand-built .tflite files for the hostile-input tests: a sparse constant densified by DENSIFY, and a
STRING constant returned as a signature output, each with its buffers as the caller gives them."""
import numpy as np
import flatbuffers
from ai_edge_litert import schema_py_generated as fb


def _tensor(name, shape, ttype, buffer):
    t = fb.TensorT()
    t.name, t.shape, t.type, t.buffer = name.encode(), np.array(shape, np.int32), ttype, buffer
    return t


def _buffer(data=None):
    b = fb.BufferT()
    b.data = None if data is None else np.frombuffer(bytes(data), np.uint8)
    return b


def _model(tensors, buffers, ops, codes, inputs, outputs):
    sub = fb.SubGraphT()
    sub.tensors, sub.operators = tensors, ops
    sub.inputs, sub.outputs = np.array(inputs, np.int32), np.array(outputs, np.int32)
    sig = fb.SignatureDefT()
    sig.signatureKey = b"serving_default"
    sig.subgraphIndex = 0
    def tmap(i):
        m = fb.TensorMapT(); m.name = tensors[i].name; m.tensorIndex = i; return m
    sig.inputs, sig.outputs = [tmap(i) for i in inputs], [tmap(i) for i in outputs]
    m = fb.ModelT()
    m.version, m.subgraphs, m.buffers, m.operatorCodes, m.signatureDefs = 3, [sub], buffers, codes, [sig]
    b = flatbuffers.Builder(0)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _code(op):
    c = fb.OperatorCodeT()
    c.builtinCode = op
    c.deprecatedBuiltinCode = min(op, 127)
    c.version = 1
    return c


def _op(code_index, inputs, outputs):
    o = fb.OperatorT()
    o.opcodeIndex, o.inputs, o.outputs = code_index, np.array(inputs, np.int32), np.array(outputs, np.int32)
    return o


def sparse_model(indices=(0, 1, 2, 3), segments=(0, 1, 2, 3, 4), values=(1.0, 2.0, 3.0, 4.0)):
    """x[4,4] + densify(sparse w): w's rows hold one value each, at column indices[row]."""
    w = _tensor("w", [4, 4], fb.TensorType.FLOAT32, 1)
    sp = fb.SparsityParametersT()
    sp.traversalOrder = np.array([0, 1], np.int32)
    d0, d1 = fb.DimensionMetadataT(), fb.DimensionMetadataT()
    d0.format, d0.denseSize = fb.DimensionType.DENSE, 4
    d1.format = fb.DimensionType.SPARSE_CSR
    seg, idx = fb.Int32VectorT(), fb.Int32VectorT()
    seg.values, idx.values = np.array(segments, np.int32), np.array(indices, np.int32)
    d1.arraySegmentsType, d1.arraySegments = fb.SparseIndexVector.Int32Vector, seg
    d1.arrayIndicesType, d1.arrayIndices = fb.SparseIndexVector.Int32Vector, idx
    sp.dimMetadata = [d0, d1]
    w.sparsity = sp
    tensors = [_tensor("x", [4, 4], fb.TensorType.FLOAT32, 0), w,
               _tensor("w_dense", [4, 4], fb.TensorType.FLOAT32, 0), _tensor("y", [4, 4], fb.TensorType.FLOAT32, 0)]
    buffers = [_buffer(), _buffer(np.array(values, np.float32).tobytes())]
    codes = [_code(fb.BuiltinOperator.DENSIFY), _code(fb.BuiltinOperator.ADD)]
    ops = [_op(0, [1], [2]), _op(1, [0, 2], [3])]
    return _model(tensors, buffers, ops, codes, [0], [3])


def string_model(data):
    """x[1] -> y = x + 0, and a STRING constant s[2] as a second output, its buffer ``data``."""
    tensors = [_tensor("x", [1], fb.TensorType.FLOAT32, 0), _tensor("zero", [1], fb.TensorType.FLOAT32, 1),
               _tensor("y", [1], fb.TensorType.FLOAT32, 0), _tensor("s", [2], fb.TensorType.STRING, 2)]
    buffers = [_buffer(), _buffer(np.zeros(1, np.float32).tobytes()), _buffer(data)]
    ops = [_op(0, [0, 1], [2])]
    return _model(tensors, buffers, ops, [_code(fb.BuiltinOperator.ADD)], [0], [2, 3])


def strings(*items: bytes) -> bytes:
    n = len(items)
    offsets = [4 * (n + 2)]
    for s in items:
        offsets.append(offsets[-1] + len(s))
    return np.array([n, *offsets], "<u4").tobytes() + b"".join(items)
