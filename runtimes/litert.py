"""Runs ``.tflite`` flatbuffers on LiteRT: the Interpreter (signature runners) and the CompiledModel API.

Both take the flat list of input arrays in the signature's input order and
return the outputs in the signature's output order. Arrays are converted to
the dtypes the flatbuffer declares (64-bit values travel as 32-bit ones);
callers convert outputs back to the dtypes they expect.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.specs import TensorSpec, coerce_input

RUNTIMES = ("interpreter", "compiled_model")


class InterpreterRunner:
    """One signature of a flatbuffer on ``ai_edge_litert.interpreter.Interpreter`` (XNNPACK by default)."""

    name = "litert"

    def __init__(self, content: bytes, signature: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 *, num_threads: int | None = None, interpreter=None):
        from ai_edge_litert.interpreter import Interpreter
        try:
            self.interpreter = interpreter or Interpreter(model_content=content, num_threads=num_threads)
            self._runner = self.interpreter.get_signature_runner(signature)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT cannot load signature {signature!r}: {str(e).strip()[:300]}",
                                hint="the flatbuffer is corrupt or needs a newer LiteRT runtime") from e
        details = self._runner.get_input_details()
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self._input_dtypes = [np.dtype(details[s.name]["dtype"]).name for s in self.inputs]

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs ({', '.join(str(s) for s in self.inputs)}), "
                             f"got {len(inputs)}")
        feed = {s.name: coerce_input(s, x, dtype=dt) for s, x, dt in zip(self.inputs, inputs, self._input_dtypes)}
        try:
            out = self._runner(**feed)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT failed to run the model: {str(e).strip()[:300]}") from e
        return [np.asarray(out[s.name]) for s in self.outputs]


_ENV = None
_ENV_LOCK = threading.Lock()


def _environment():
    # One LiteRT environment per process: creating one loads the accelerator plugins.
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            from ai_edge_litert.compiled_model import _create_default_environment
            _ENV = _create_default_environment()
        return _ENV


class CompiledModelRunner:
    """One signature of a flatbuffer on LiteRT's ``CompiledModel`` API (CPU accelerator)."""

    name = "litert-compiled"

    def __init__(self, content: bytes, signature: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 *, num_threads: int | None = None):
        from ai_edge_litert.compiled_model import CompiledModel, CpuOptions, HardwareAccelerator, Options
        options = Options(hardware_accelerators=HardwareAccelerator.CPU,
                          cpu_options=CpuOptions(num_threads=num_threads or 1))
        try:
            self.model = CompiledModel.from_buffer(content, environment=_environment(), options=options)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT CompiledModel cannot load the flatbuffer: {str(e).strip()[:300]}") from e
        self.signature_index = self.model.get_signature_index(signature)
        if self.signature_index < 0:
            raise InputError(f"no signature {signature!r} in the model")
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        in_details = self.model.get_input_tensor_details(signature)
        out_details = self.model.get_output_tensor_details(signature)
        self._in = [(_np_dtype(in_details[s.name]["dtype"]), tuple(in_details[s.name]["shape"])) for s in self.inputs]
        self._out = [(_np_dtype(out_details[s.name]["dtype"]), tuple(out_details[s.name]["shape"]))
                     for s in self.outputs]
        self._in_buffers = self.model.create_input_buffers(self.signature_index)
        self._out_buffers = self.model.create_output_buffers(self.signature_index)

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs, got {len(inputs)}")
        for buf, spec, x, (dt, _) in zip(self._in_buffers, self.inputs, inputs, self._in):
            buf.write(coerce_input(spec, x, dtype=dt.name))
        try:
            self.model.run_by_index(self.signature_index, self._in_buffers, self._out_buffers)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT CompiledModel failed to run the model: {str(e).strip()[:300]}") from e
        return [buf.read(int(np.prod(shape, dtype=np.int64)), dt).reshape(shape)
                for buf, (dt, shape) in zip(self._out_buffers, self._out)]


def _np_dtype(d) -> np.dtype:
    if isinstance(d, str):
        return np.dtype({"float32": np.float32, "int32": np.int32, "bool": np.bool_, "int8": np.int8,
                         "uint8": np.uint8, "float16": np.float16, "int64": np.int64}.get(d, d))
    return np.dtype(d)
