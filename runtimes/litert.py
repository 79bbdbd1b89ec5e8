"""Runs ``.tflite`` flatbuffers on LiteRT: the Interpreter (signature runners) and the CompiledModel API.

Both load a model from its bytes or, better for large models, from its path.
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
from torchtpu_export.specs import TensorSpec, bind_dims, coerce_input, eval_dim

# "qnn_htp": a file compiled for a Qualcomm NPU, on QNN's HTP simulator (runtimes/qnn_htp.py)
RUNTIMES = ("interpreter", "compiled_model", "qnn_htp")
NPU_HINT = ("the file is compiled for a phone NPU (DISPATCH_OP): run it on that SoC; one compiled for a Qualcomm "
            "NPU also runs on QNN's HTP simulator (runtime='qnn_htp', or run --runtime qnn_htp)")


class InterpreterRunner:
    """One signature of a flatbuffer on ``ai_edge_litert.interpreter.Interpreter`` (XNNPACK by default)."""

    name = "litert"

    def __init__(self, content, signature: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 *, num_threads: int | None = None, interpreter=None):
        from ai_edge_litert.interpreter import Interpreter
        try:
            # a path: LiteRT maps the file itself, so a large model is not held twice
            source = {"model_path": content} if isinstance(content, str) else {"model_content": content}
            self.interpreter = interpreter or Interpreter(**source, num_threads=num_threads)
            self._runner = self.interpreter.get_signature_runner(signature)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT cannot load signature {signature!r}: {str(e).strip()[:300]}",
                                hint="the flatbuffer is corrupt or needs a newer LiteRT runtime") from e
        details = self._runner.get_input_details()
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        missing = [s.name for s in self.inputs if s.name not in details]
        if missing:
            raise ArtifactError(f"LiteRT's signature {signature!r} has no input {missing[0][:80]!r}",
                                hint="the flatbuffer's signature and tensors disagree: convert it again")
        self._input_dtypes = [np.dtype(details[s.name]["dtype"]).name for s in self.inputs]

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs ({', '.join(str(s) for s in self.inputs)}), "
                             f"got {len(inputs)}")
        feed = {s.name: coerce_input(s, x, dtype=dt) for s, x, dt in zip(self.inputs, inputs, self._input_dtypes)}
        try:
            # the signature runner resizes its inputs to these arrays' shapes and allocates before invoking
            # (ResizeInputTensor + AllocateTensors): dynamic dims take the size they are given
            out = self._runner(**feed)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT failed to run the model: {str(e).strip()[:300]}",
                                hint=NPU_HINT if "DISPATCH_OP" in str(e) else None) from e
        missing = [s.name for s in self.outputs if s.name not in out]
        if missing:
            raise ArtifactError(f"LiteRT gave no output {missing[0][:80]!r}",
                                hint="the flatbuffer's signature and tensors disagree: convert it again")
        return [np.asarray(out[s.name]) for s in self.outputs]


class TensorObserver:
    """Runs a flatbuffer on LiteRT's reference kernels keeping every tensor, to read intermediates
    (what int8 calibration measures: the converter is handed this class, it does not import it)."""

    def __init__(self, content: bytes):
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
        try:
            self._interp = Interpreter(model_content=content, num_threads=1,
                                       experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
                                       experimental_preserve_all_tensors=True)
            self._interp.allocate_tensors()
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT cannot run the model: {str(e).strip()[:300]}") from e

    def run(self, inputs: dict[int, np.ndarray]) -> None:
        """Sets tensor index -> value and invokes; InputError when LiteRT refuses the values."""
        for index, value in inputs.items():
            self._interp.set_tensor(index, value)
        try:
            self._interp.invoke()
        except (ValueError, RuntimeError) as e:
            raise InputError(str(e).strip()[:300]) from e

    def tensor(self, index: int) -> np.ndarray:
        return self._interp.get_tensor(index)


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

    def __init__(self, content, signature: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 *, num_threads: int | None = None):
        from ai_edge_litert.compiled_model import CompiledModel, CpuOptions, HardwareAccelerator, Options
        options = Options(hardware_accelerators=HardwareAccelerator.CPU,
                          cpu_options=CpuOptions(num_threads=num_threads or 1))
        try:
            if isinstance(content, str):  # a path, as for the Interpreter
                self.model = CompiledModel.from_file(content, environment=_environment(), options=options)
            else:
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
        self._dynamic = any(isinstance(d, str) for s in self.inputs for d in s.shape)
        if self._dynamic:
            self._host: list[np.ndarray] = []
            self._resize([np.zeros(shape, dt) for dt, shape in self._in])
        else:
            self._in_buffers = self.model.create_input_buffers(self.signature_index)
            self._out_buffers = self.model.create_output_buffers(self.signature_index)

    def _resize(self, arrays: list[np.ndarray]) -> None:
        # New input sizes. LiteRT resizes the inputs (strictly: only dims that are -1 in their
        # shape_signature), but sizes output buffers for the old shapes until it has run; so the
        # outputs' sizes come from their symbolic shapes, and their buffers wrap arrays held here.
        from ai_edge_litert.tensor_buffer import TensorBuffer
        sizes = bind_dims(self.inputs, arrays)
        out_shapes = [tuple(d if isinstance(d, int) else eval_dim(d, sizes, f"output {spec.name}") for d in spec.shape)
                      for spec in self.outputs]
        for i, (a, (dt, shape)) in enumerate(zip(arrays, self._in)):
            if a.shape != shape:
                try:
                    self.model.resize_input_tensor(i, a.shape, self.signature_index, strict=True)
                except (ValueError, RuntimeError) as e:
                    raise InputError(f"input {self.inputs[i].name}: LiteRT cannot resize it to {list(a.shape)}: "
                                     f"{str(e).strip()[:200]}") from e
                self._in[i] = (dt, a.shape)
        self._out = [(dt, shape) for (dt, _), shape in zip(self._out, out_shapes)]
        self._in_buffers = self.model.create_input_buffers(self.signature_index)
        self._host = [_aligned(shape, dt) for dt, shape in self._out]
        self._out_buffers = [TensorBuffer.create_from_host_memory(h) for h in self._host]

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs, got {len(inputs)}")
        arrays = [coerce_input(spec, x, dtype=dt.name) for spec, x, (dt, _) in zip(self.inputs, inputs, self._in)]
        if self._dynamic:
            if any(a.shape != shape for a, (_, shape) in zip(arrays, self._in)):
                self._resize(arrays)
        for buf, a in zip(self._in_buffers, arrays):
            buf.write(a)
        try:
            self.model.run_by_index(self.signature_index, self._in_buffers, self._out_buffers)
        except (ValueError, RuntimeError) as e:
            raise ArtifactError(f"LiteRT CompiledModel failed to run the model: {str(e).strip()[:300]}") from e
        if self._dynamic:
            return [h.copy() for h in self._host]
        return [buf.read(int(np.prod(shape, dtype=np.int64)), dt).reshape(shape)
                for buf, (dt, shape) in zip(self._out_buffers, self._out)]


_ALIGN = 64  # what LiteRT's host-memory buffers need


def _aligned(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.zeros(n * dtype.itemsize + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)


def _np_dtype(d) -> np.dtype:
    if isinstance(d, str):
        return np.dtype({"float32": np.float32, "int32": np.int32, "bool": np.bool_, "int8": np.int8,
                         "uint8": np.uint8, "float16": np.float16, "int64": np.int64}.get(d, d))
    return np.dtype(d)
