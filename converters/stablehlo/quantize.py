"""TPU quantization recipes: which weights change, and how the program reads them back.

- ``bf16``: every floating weight is stored in bfloat16 and the program computes in bfloat16
  (matmuls and convolutions accumulate in float32); inputs and outputs keep their dtypes.
- ``int8_weight_only``: the weights of matmuls (linear layers, ``mm``/``addmm``/``matmul`` with a
  weight operand) and of convolutions are stored as int8 with one float32 scale per output
  channel; the program multiplies them back inside the consuming op's operand, which XLA fuses.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from torchtpu_export.capture import CapturedProgram
from torchtpu_export.quant import QuantConfig, per_channel_int8
from torchtpu_export.targets.tpu.artifact import AbstractWeight

from .sharding import matmul_weight, weight_of

aten = torch.ops.aten


_CONVS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
          aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding}


def matmul_weights(captured: CapturedProgram) -> dict[str, int]:
    """Captured weight name -> its output-channel axis, for every float weight of a matmul or convolution."""
    found = {}
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _CONVS and not (node.target is aten.convolution.default and node.args[6]):
            w = weight_of(node.args[1], captured)
            if w and not w[1] and captured.weights[w[0]].dtype.is_floating_point:
                found[w[0]] = 0
            continue
        mm = matmul_weight(node, captured)
        if mm is None:
            continue
        _, name, out_first, _ = mm
        w = captured.weights[name]
        if w.dim() == 2 and w.dtype.is_floating_point:
            found[name] = 0 if out_first else 1
    return found


def apply(cfg: QuantConfig, captures: dict[str, CapturedProgram], np_weights: dict, weight_names: dict):
    """Rewrites ``np_weights`` in place; returns (float dtype override, {artifact name: (scale name, axis)})."""
    if cfg.recipe == "bf16":
        for name, a in list(np_weights.items()):
            if a.dtype.kind == "f":
                np_weights[name] = a.astype(ml_dtypes.bfloat16)
        return jnp.bfloat16, {}
    dequantize: dict[str, tuple[str, int]] = {}
    for prog, cap in captures.items():
        renames = dict(zip(cap.weights, weight_names[prog]))
        for name, axis in matmul_weights(cap).items():
            artifact_name = renames[name]
            if artifact_name in dequantize:
                continue
            w = np_weights[artifact_name]
            if isinstance(w, AbstractWeight):  # no values: the scales are computed when values are bound
                q, scale = w.astype(np.int8), AbstractWeight((w.shape[axis],), np.dtype(np.float32))
            else:
                q, scale = per_channel_int8(w, axis)
            scale_name = f"{artifact_name}.scale"
            np_weights[artifact_name] = q
            np_weights[scale_name] = scale
            dequantize[artifact_name] = (scale_name, axis)
    for prog in weight_names:
        weight_names[prog] += [dequantize[n][0] for n in weight_names[prog] if n in dequantize]
    return None, dequantize
