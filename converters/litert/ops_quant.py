"""PyTorch's quantize/dequantize ops (the pt2e flow: ``prepare_pt2e`` / ``convert_pt2e``) as QUANTIZE and DEQUANTIZE.

A pt2e model says where it is quantized with ``dequantize(quantize(x))`` pairs
around the ops it quantizes, and keeps its weights as int8 tensors read through
``dequantize_per_channel``. Dequantizing a constant gives a float constant here
(the weight passes re-quantize it per channel); the activations' pairs become
QUANTIZE -> DEQUANTIZE, travel through the layout and fusion passes like any
elementwise op, and ``fold_quantize_dequantize`` (quantize.py) turns the ops
between them into int8 ops.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401 (registers torch.ops.quantized_decomposed)

from .ir import Quant, Tensor
from .registry import builds, not_supported

qd = torch.ops.quantized_decomposed
I8 = np.dtype(np.int8)


def _scalar(ctx, v, what: str) -> float:
    if isinstance(v, Tensor):
        if not v.is_const or v.size != 1:
            raise ctx.unsupported(f"its {what} is computed at run time (dynamic quantization)")
        return v.data.reshape(-1)[0].item()
    return float(v)


def _int8_quant(ctx, scale, zero_point, dtype) -> Quant:
    # uint8 values q with zero point z are the int8 values q - 128 with zero point z - 128: same reals
    shift = {torch.int8: 0, torch.uint8: -128}.get(dtype)
    if shift is None:
        raise ctx.unsupported(f"{dtype} quantization (the litert target maps int8 and uint8 to int8)")
    return Quant(_scalar(ctx, scale, "scale"), int(round(_scalar(ctx, zero_point, "zero point"))) + shift)


def _affine(ctx, x, scale, zero_point, axis):
    # (scales, zero points) shaped to broadcast along ``axis`` of ``x``
    s = np.asarray(scale.data if isinstance(scale, Tensor) else scale, np.float64).reshape(-1)
    z = np.asarray(zero_point.data if isinstance(zero_point, Tensor) else zero_point, np.float64).reshape(-1)
    if isinstance(scale, Tensor) and not scale.is_const or isinstance(zero_point, Tensor) and not zero_point.is_const:
        raise ctx.unsupported("its scale is computed at run time (dynamic quantization)")
    shape = [1] * x.rank
    if axis is not None and x.rank:
        shape[axis % x.rank] = -1
    return s.reshape(shape if s.size > 1 else ()), z.reshape(shape if z.size > 1 else ())


@builds(qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor, qd.quantize_per_tensor.tensor2)
def quantize_per_tensor(ctx, x, scale, zero_point, quant_min, quant_max, dtype):
    if x.is_const:  # a weight quantized in the graph: computed now
        s, z = _affine(ctx, x, scale, zero_point, None)
        return ctx.const(np.clip(np.rint(x.data / s) + z, quant_min, quant_max).astype(np.int32))
    out = ctx.tensor(x.shape, I8)
    out.quant = _int8_quant(ctx, scale, zero_point, dtype)
    return ctx.op("QUANTIZE", [ctx.cast(x, np.float32)], outputs=[out])[0]


@builds(qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor, qd.dequantize_per_tensor.tensor2)
def dequantize_per_tensor(ctx, x, scale, zero_point, quant_min, quant_max, dtype, out_dtype=None):
    if x.is_const:
        s, z = _affine(ctx, x, scale, zero_point, None)
        return ctx.const(((x.data - z) * s).astype(ctx.out_dtype()))
    q = _int8_quant(ctx, scale, zero_point, dtype)
    if x.quant is None or x.dtype != I8:
        raise ctx.unsupported("it dequantizes a tensor the model did not quantize itself (an integer input); "
                              "pass float inputs and quantize them in the model")
    if x.quant != q:
        raise ctx.unsupported(f"it dequantizes with {q!r}, but the tensor was quantized with {x.quant!r}")
    out = ctx.op("DEQUANTIZE", [x], shape=x.shape, dtype=np.float32)
    return ctx.cast(out, ctx.out_dtype())


@builds(qd.dequantize_per_channel.default)
def dequantize_per_channel(ctx, x, scales, zero_points, axis, quant_min, quant_max, dtype, out_dtype=None):
    if not x.is_const:
        raise ctx.unsupported("per-channel quantization of activations (pt2e quantizes weights per channel)")
    s, z = _affine(ctx, x, scales, zero_points, axis)
    return ctx.const(((x.data - z) * s).astype(ctx.out_dtype()))


@builds(qd.quantize_per_channel.default)
def quantize_per_channel(ctx, x, scales, zero_points, axis, quant_min, quant_max, dtype):
    if not x.is_const:
        raise ctx.unsupported("per-channel quantization of activations (pt2e quantizes weights per channel)")
    s, z = _affine(ctx, x, scales, zero_points, axis)
    return ctx.const(np.clip(np.rint(x.data / s) + z, quant_min, quant_max).astype(np.int32))


not_supported("dynamic quantization (scales chosen at run time) has no int8 TFLite form here; "
              "quantize the float model with quant_config='dynamic_int8' instead",
              qd.choose_qparams.tensor, qd.choose_qparams_symmetric.tensor)
