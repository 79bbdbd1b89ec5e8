"""What the TFLite schema says about each builtin we emit: options table, dtype codes, op versions.

Versions follow TFLite's ``op_version.cc``: an op that uses a feature added in
version N must say N, so that an older runtime refuses the model instead of
running it wrongly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from ai_edge_litert import schema_py_generated as fb

BUILTIN = {name: value for name, value in vars(fb.BuiltinOperator).items() if not name.startswith("_")}

TENSOR_TYPE = {
    np.dtype(np.float32): fb.TensorType.FLOAT32, np.dtype(np.float16): fb.TensorType.FLOAT16,
    np.dtype(np.int32): fb.TensorType.INT32, np.dtype(np.uint8): fb.TensorType.UINT8,
    np.dtype(np.int64): fb.TensorType.INT64, np.dtype(np.bool_): fb.TensorType.BOOL,
    np.dtype(np.int16): fb.TensorType.INT16, np.dtype(np.int8): fb.TensorType.INT8,
    np.dtype(np.float64): fb.TensorType.FLOAT64, np.dtype(np.complex64): fb.TensorType.COMPLEX64,
    np.dtype(np.uint32): fb.TensorType.UINT32, np.dtype(np.uint16): fb.TensorType.UINT16,
    np.dtype(np.uint64): fb.TensorType.UINT64, np.dtype(ml_dtypes.int4): fb.TensorType.INT4,
}
INT4 = np.dtype(ml_dtypes.int4)  # one value per byte in memory; two per byte in the file (low nibble first)

# Padding codes.
SAME, VALID = fb.Padding.SAME, fb.Padding.VALID

# builtin -> its options table (only ops whose options carry fields, or whose parser needs the table).
_OPTIONS = {
    "ADD": "AddOptions", "SUB": "SubOptions", "MUL": "MulOptions", "DIV": "DivOptions",
    "CONV_2D": "Conv2DOptions", "DEPTHWISE_CONV_2D": "DepthwiseConv2DOptions", "CONV_3D": "Conv3DOptions",
    "TRANSPOSE_CONV": "TransposeConvOptions",
    "AVERAGE_POOL_2D": "Pool2DOptions", "MAX_POOL_2D": "Pool2DOptions", "L2_POOL_2D": "Pool2DOptions",
    "FULLY_CONNECTED": "FullyConnectedOptions", "SOFTMAX": "SoftmaxOptions",
    "CONCATENATION": "ConcatenationOptions", "RESHAPE": "ReshapeOptions",
    "GATHER": "GatherOptions", "MEAN": "ReducerOptions", "SUM": "ReducerOptions",
    "REDUCE_MAX": "ReducerOptions", "REDUCE_MIN": "ReducerOptions", "REDUCE_PROD": "ReducerOptions",
    "REDUCE_ANY": "ReducerOptions", "REDUCE_ALL": "ReducerOptions", "SQUEEZE": "SqueezeOptions",
    "STRIDED_SLICE": "StridedSliceOptions", "CAST": "CastOptions", "BATCH_MATMUL": "BatchMatMulOptions",
    "GELU": "GeluOptions", "LEAKY_RELU": "LeakyReluOptions", "SPLIT": "SplitOptions", "SPLIT_V": "SplitVOptions",
    "PACK": "PackOptions", "UNPACK": "UnpackOptions", "ARG_MAX": "ArgMaxOptions", "ARG_MIN": "ArgMinOptions",
    "CUMSUM": "CumsumOptions", "MIRROR_PAD": "MirrorPadOptions", "ONE_HOT": "OneHotOptions",
    "RESIZE_BILINEAR": "ResizeBilinearOptions", "RESIZE_NEAREST_NEIGHBOR": "ResizeNearestNeighborOptions",
    "SPACE_TO_DEPTH": "SpaceToDepthOptions", "DEPTH_TO_SPACE": "DepthToSpaceOptions",
    "SHAPE": "ShapeOptions", "LOCAL_RESPONSE_NORMALIZATION": "LocalResponseNormalizationOptions",
    "L2_NORMALIZATION": "L2NormOptions", "REVERSE_SEQUENCE": "ReverseSequenceOptions",
    "RANDOM_UNIFORM": "RandomOptions", "RANDOM_STANDARD_NORMAL": "RandomOptions",
    "BUCKETIZE": "BucketizeOptions", "UNIQUE": "UniqueOptions",
}


def options_table(code: str, options: dict):
    """``(BuiltinOptions enum value, packed-object factory)`` for an op's options, or ``(0, None)``."""
    name = _OPTIONS.get(code)
    if name is None:
        if options:
            raise ValueError(f"{code} takes no builtin options, got {sorted(options)}")
        return 0, None
    cls = getattr(fb, name + "T")
    obj = cls(**options)
    return getattr(fb.BuiltinOptions, name), obj


_I64, _I32, _BOOL, _I16, _I8 = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.bool_), np.dtype(np.int16),
                                np.dtype(np.int8))
_F16, _F64, _U32, _U16 = np.dtype(np.float16), np.dtype(np.float64), np.dtype(np.uint32), np.dtype(np.uint16)


def _broadcast_gt4(op) -> bool:
    a, b = op.inputs[0], op.inputs[1]
    return a.shape != b.shape and max(a.rank, b.rank) > 4


def op_version(op) -> int:
    """The builtin version this op needs, after TFLite's op_version.cc.

    Versions add features, so an op using several (int8 and a 5-D input, say) needs the highest.
    """
    return max(_plain_version(op), _quantized_version(op))


# int8 kernels (full integer), by the version that added them
_INT8_VERSION = {
    **dict.fromkeys((
        "ADD", "SUB", "MUL", "MAX_POOL_2D", "AVERAGE_POOL_2D", "TRANSPOSE", "SLICE", "STRIDED_SLICE",
        "RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR", "MAXIMUM", "MINIMUM", "PACK", "UNPACK", "SPLIT", "SPLIT_V",
        "CONCATENATION", "PAD", "PADV2", "SOFTMAX", "MEAN", "MIRROR_PAD", "REDUCE_MAX", "REDUCE_MIN", "RELU6",
        "RSQRT", "SUM", "LOG_SOFTMAX", "GREATER", "LESS_EQUAL", "SQUARED_DIFFERENCE", "DEPTH_TO_SPACE",
        "SPACE_TO_DEPTH", "LESS", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL", "TANH", "LOGISTIC", "EXP", "LOG",
        "REDUCE_PROD", "RELU", "ABS", "GELU", "L2_NORMALIZATION", "ARG_MAX", "ARG_MIN", "SPACE_TO_BATCH_ND",
        "BATCH_TO_SPACE_ND", "SELECT", "GATHER", "BATCH_MATMUL"), 2),
    "BROADCAST_TO": 3, "TILE": 3, "REVERSE_V2": 3, "CONV_2D": 3, "DEPTHWISE_CONV_2D": 3, "FULLY_CONNECTED": 4,
}


def _quantized_version(op) -> int:
    code = op.code
    ins = [t for t in op.inputs if t is not None]
    if not ins:
        return 1
    t0 = ins[1].dtype if code == "SPLIT" else ins[0].dtype
    w = op.inputs[1] if len(op.inputs) > 1 and op.inputs[1] is not None else None
    hybrid = t0 == np.float32 and w is not None and w.dtype == _I8
    per_channel = w is not None and w.quant is not None and w.quant.per_channel
    if code == "DEQUANTIZE":
        return 3 if t0 == _F16 else (5 if _per_channel(ins[0]) else 2) if t0 == _I8 else 1
    if code == "QUANTIZE":
        return 3 if _per_channel(op.outputs[0]) else 1
    if code == "EMBEDDING_LOOKUP":
        return 4 if _per_channel(op.inputs[1]) else 1
    if hybrid:
        if code == "FULLY_CONNECTED":
            return 12 if per_channel else 9 if op.options.get("asymmetricQuantizeInputs") else 3
        if code == "CONV_2D":
            return 5 if per_channel else 2
        if code == "DEPTHWISE_CONV_2D":
            return 6 if per_channel else 4
        if code == "BATCH_MATMUL":
            return 4 if op.options.get("asymmetricQuantizeInputs") else 1
    if code == "TRANSPOSE_CONV" and w is not None and w.dtype == _I8:
        return 2
    if code == "MUL" and t0 == _I8:
        a, b, y = op.inputs[0].quant, op.inputs[1].quant, op.outputs[0].quant
        if a is not None and b is not None and y is not None and a.scale[0] * b.scale[0] / y.scale[0] >= 1:
            return 3
    return _INT8_VERSION.get(code, 1) if t0 == _I8 else 1


def _per_channel(t) -> bool:
    return t.quant is not None and t.quant.per_channel


def _plain_version(op) -> int:
    code, o = op.code, op.options
    t0 = op.inputs[0].dtype if op.inputs and op.inputs[0] is not None else None
    r0 = op.inputs[0].rank if op.inputs and op.inputs[0] is not None else 0
    if code == "CONV_2D":
        return 6 if op.inputs[0].shape[-1] != op.inputs[1].shape[-1] else 1
    if code == "DEPTHWISE_CONV_2D":
        return 2 if o.get("dilationWFactor", 1) != 1 or o.get("dilationHFactor", 1) != 1 else 1
    if code == "FULLY_CONNECTED":
        if len(op.inputs) < 3 or op.inputs[2] is None:
            return 6
        return 5 if o.get("keepNumDims") else 1
    if code == "GATHER":
        if op.inputs[1].dtype == _I16:
            return 6
        if o.get("batchDims", 0):
            return 5
        return 3 if t0 == _BOOL else 1
    if code == "MUL":
        return 5 if t0 == _I64 else (7 if t0 in (_I16, _U32) else 1)
    if code == "TRANSPOSE":
        return 6 if r0 > 5 else 4 if r0 > 4 else 3 if t0 == _BOOL else 1
    if code == "TRANSPOSE_CONV":
        if o.get("fusedActivationFunction", 0):
            return 4
        return 3 if len(op.inputs) == 4 and op.inputs[3] is not None else 1
    if code == "SLICE":
        return 5 if r0 > 4 else 1
    if code == "STRIDED_SLICE":
        if o.get("offset"):
            return 8
        if o.get("ellipsisMask", 0) or o.get("newAxisMask", 0):
            return 6
        return 4 if r0 > 4 else 3 if t0 == _BOOL else 1
    if code in ("RESIZE_BILINEAR", "RESIZE_NEAREST_NEIGHBOR"):
        return 3 if o.get("halfPixelCenters") or o.get("alignCorners") else 1
    if code in ("MAXIMUM", "MINIMUM"):
        return 3 if _broadcast_gt4(op) else 1
    if code == "ADD":
        return 4 if t0 == _I64 else 5 if t0 == _I16 else 1
    if code == "SUB":
        return 4 if t0 == _I64 else 3 if _broadcast_gt4(op) else 1
    if code == "DIV":
        return 2 if _broadcast_gt4(op) else 1
    if code == "SELECT":
        return 3 if any(t.rank == 5 for t in op.inputs) else 1
    if code == "SELECT_V2":
        return 2 if t0 == _U32 else 1
    if code in ("PAD", "PADV2"):
        return 4 if r0 > 4 else 1
    if code == "BROADCAST_TO":
        return 2
    if code == "CAST":
        t_out = op.outputs[0].dtype
        kinds = {t0, t_out}
        if kinds & {_F64, _F16}:
            return 5
        if _U16 in kinds:
            return 4
        if _I8 in kinds:
            return 3
        return 2 if _U32 in kinds else 1
    if code == "WHERE":
        return 1 if t0 == _BOOL else 2
    if code == "ABS":
        return 5 if t0 == _I32 else 1
    if code == "SIGN":
        return 2 if t0 == _I32 else 1
    if code == "RANGE":
        return 2 if t0 == _I64 else 1
    if code == "FILL":
        return 2 if op.inputs[1].dtype == _BOOL else 1
    if code == "SPLIT":
        return 3 if op.inputs[1].dtype == _I32 else 1
    if code == "UNPACK":
        return 3 if t0 == _BOOL else 1
    if code == "ARG_MAX" or code == "ARG_MIN":
        return 3 if t0 == _BOOL else 1
    if code == "SPACE_TO_BATCH_ND" or code == "BATCH_TO_SPACE_ND":
        return 3 if r0 != 4 else 1
    if code == "FLOOR_DIV":
        return 2 if t0 == np.dtype(np.float32) else 1
    return 1
