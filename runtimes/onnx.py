"""Runs an ONNX model on ONNX Runtime (CPU execution provider)."""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.specs import TensorSpec, coerce_input


class OnnxRunner:
    """An InferenceSession over a serialized model; inputs and outputs as numpy, in the specs' order.

    torch.onnx carries complex tensors as real ones with a trailing dim of 2; the runner converts
    to and from numpy complex where the torch-side spec is complex.
    """

    name = "onnx"

    def __init__(self, model: bytes | str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]):
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.log_severity_level = 3
        threads = os.environ.get("TTE_ONNX_THREADS")
        if threads:
            options.intra_op_num_threads = int(threads)
        try:
            self.session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own Fail / NotImplemented / InvalidGraph classes
            missing = "NOT_IMPLEMENTED" in str(e) or type(e).__name__ == "NotImplemented"
            raise ArtifactError(f"ONNX Runtime cannot load the model: {_first_line(e)}",
                                hint="ONNX Runtime's CPU provider has no kernel for this op in this dtype "
                                     "(it has few bfloat16/float16 kernels): export the model in float32 for "
                                     "--target onnx, or use --target tpu or litert" if missing else None) from e
        self.inputs, self.outputs = list(inputs), list(outputs)
        self._names = [i.name for i in self.session.get_inputs()]
        if len(self._names) != len(self.inputs):
            raise ArtifactError(f"the model has {len(self._names)} inputs, its metadata lists {len(self.inputs)}")

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs ({', '.join(str(s) for s in self.inputs)}), "
                             f"got {len(inputs)}")
        feed = {}
        for name, spec, x in zip(self._names, self.inputs, inputs):
            a = coerce_input(spec, x)
            feed[name] = np.stack([a.real, a.imag], axis=-1) if a.dtype.kind == "c" else a
        try:
            outs = self.session.run(None, feed)
        except Exception as e:
            raise ArtifactError(f"ONNX Runtime failed to run the model: {_first_line(e)}") from e
        return [_as_spec(o, s) for o, s in zip(outs, self.outputs)] + list(outs[len(self.outputs):])


def _as_spec(out: np.ndarray, spec: TensorSpec) -> np.ndarray:
    if spec.dtype.startswith("complex") and out.dtype.kind == "f" and out.shape[-1:] == (2,):
        return (out[..., 0] + 1j * out[..., 1]).astype(spec.dtype)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"
