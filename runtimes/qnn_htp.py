"""Runs a ``.tflite`` compiled for a Qualcomm NPU on QNN's HTP simulator, on an x86-64 host.

The file's signature must be one ``DISPATCH_OP`` (the whole graph on the NPU, as the AOT compiler
makes it when the NPU takes every op). Its QNN context binary is wrapped in an ONNX ``EPContext``
node and run by ONNX Runtime's QNN execution provider (the ``onnxruntime-qnn`` wheel) with QNN's
HTP backend, ``libQnnHtp.so``, which on x86-64 simulates the Hexagon NPU: the same fp16 and
quantized arithmetic the phone does, slowly. A check of numerics, not of speed.

QNN loads the context binary without checking it (two changed bytes can crash the simulator), so
the file's torchtpu-export digest (``npu.require_digest``) is checked first, on the very bytes that
are then handed over; a file without one runs only with ``allow_unverified``.
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.specs import TensorSpec, coerce_input

_REGISTER = threading.Lock()
_REGISTERED: list = []
EP = "QNNExecutionProvider"



def available() -> str | None:
    """None when the simulator can run here, else why not."""
    try:
        import onnxruntime  # noqa: F401
        import onnxruntime_qnn  # noqa: F401
    except ImportError as e:
        return f"QNN's HTP simulator needs the onnxruntime-qnn wheel ({e})"
    import platform
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"QNN's HTP simulator runs on x86-64 hosts, not {platform.machine()}"
    return None


def _session_options():
    import onnxruntime as ort
    import onnxruntime_qnn
    with _REGISTER:
        if not _REGISTERED:
            try:
                ort.register_execution_provider_library(EP, onnxruntime_qnn.get_library_path())
            except Exception as e:  # noqa: BLE001 - already registered by someone else in this process
                if "already" not in str(e).lower():
                    raise
            _REGISTERED.append(True)
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP]
    if not devices:
        raise InputError("ONNX Runtime lists no QNN device: the onnxruntime-qnn wheel did not load")
    so = ort.SessionOptions()
    so.add_provider_for_devices(devices, {"backend_path": onnxruntime_qnn.get_qnn_htp_path()})
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # all of it on the NPU, or fail
    so.log_severity_level = 3
    return so


class QnnHtpRunner:
    """One signature of an NPU-compiled flatbuffer on QNN's HTP simulator."""

    name = "qnn-htp-simulator"

    def __init__(self, content, signature: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], *,
                 allow_unverified: bool = False):
        import onnxruntime as ort
        from onnx import helper

        from torchtpu_export.targets.litert import npu
        from torchtpu_export.targets.litert.artifact import op_histogram, signature_io, type_name, validate
        from torchtpu_export.specs import numpy_dtype

        why = available()
        if why:
            raise InputError(why, hint="pip install onnxruntime-qnn (the [test] extra has it)")
        # one copy of the bytes: what the digest is checked on is what the simulator gets
        if isinstance(content, str):
            with open(content, "rb") as f:
                content = f.read()
        elif not isinstance(content, bytes):
            content = bytes(content)
        model = validate(content)
        digest = npu.digest_state(content, model)
        npu.require_digest(digest, allow_unverified=True)  # a changed file, whatever changed in it
        io = signature_io(model)[signature]
        sub = model.Subgraphs(io["subgraph"])
        ops = op_histogram(model, [io["subgraph"]])
        if "CUSTOM:DISPATCH_OP" not in ops:
            raise InputError(f"signature {signature!r} is not compiled for an NPU: QNN's HTP simulator runs files "
                             f"compiled for a Qualcomm SoC", hint="torchtpu-export compile model.tflite --soc "
                                                                  "qualcomm:SM8650 writes one")
        if ops != {"CUSTOM:DISPATCH_OP": 1}:
            cpu = sorted(o for o in ops if o != "CUSTOM:DISPATCH_OP")
            raise InputError(f"signature {signature!r} is not one NPU partition (ops: {', '.join(cpu) or 'none'} "
                             f"besides {ops['CUSTOM:DISPATCH_OP']} DISPATCH_OP): the simulator runs "
                             f"whole-graph NPU files only")
        npu.require_digest(digest, allow_unverified=allow_unverified)  # QNN trusts the context binary
        stamp = npu.soc_stamp(content, model)
        if stamp and stamp[0] != "Qualcomm":
            raise InputError(f"this file is compiled for {stamp[0]} {stamp[1]}, not a Qualcomm NPU")
        (dispatch,) = [d for d in npu.dispatch_ops(model, content) if d["subgraph"] == io["subgraph"]]
        blob = content[dispatch["bytecode_offset"]:dispatch["bytecode_offset"] + dispatch["bytecode_size"]]

        def tensor(i):  # (numpy dtype, ONNX element type, shape) of a partition input or output
            t = sub.Tensors(int(i))
            try:
                dtype = numpy_dtype(type_name(t.Type()))
                onnx_type = helper.np_dtype_to_tensor_dtype(dtype)
            except (InputError, KeyError, TypeError, ValueError):
                raise ArtifactError(f"NPU partition tensor {t.Name()!r} has a type the simulator does not take") \
                    from None
            return dtype, onnx_type, [int(d) for d in t.ShapeAsNumpy()] if t.ShapeLength() else []

        # the partition's inputs and outputs are the signature's, in the subgraph's order
        ins = [tensor(i) for i in dispatch["inputs"]]
        outs = [tensor(i) for i in dispatch["outputs"]]
        names = [f"in_{k}" for k in range(len(ins))], [f"out_{k}" for k in range(len(outs))]
        node = helper.make_node("EPContext", names[0], names[1], name=dispatch["name"], domain="com.microsoft",
                                embed_mode=1, main_context=1, ep_cache_context=blob, source="Qnn")
        graph = helper.make_graph(
            [node], "npu_partition",
            [helper.make_tensor_value_info(n, t[1], t[2]) for n, t in zip(names[0], ins)],
            [helper.make_tensor_value_info(n, t[1], t[2]) for n, t in zip(names[1], outs)])
        onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                             helper.make_opsetid("com.microsoft", 1)])
        try:
            self.session = ort.InferenceSession(onnx_model.SerializeToString(), _session_options())
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's errors are one class per failure kind
            raise ArtifactError(f"QNN's HTP simulator cannot load the NPU partition: {str(e).strip()[:300]}") from e
        # signature order -> partition order, by tensor index
        sig_def = next(model.SignatureDefs(i) for i in range(model.SignatureDefsLength())
                       if model.SignatureDefs(i).SignatureKey().decode() == signature)
        sig_in = [sig_def.Inputs(j).TensorIndex() for j in range(sig_def.InputsLength())]
        sig_out = [sig_def.Outputs(j).TensorIndex() for j in range(sig_def.OutputsLength())]
        if sorted(sig_in) != sorted(int(i) for i in dispatch["inputs"]) or \
                sorted(sig_out) != sorted(int(i) for i in dispatch["outputs"]):
            raise ArtifactError("the NPU partition's inputs and outputs are not the signature's")
        self._feed_order = [sig_in.index(int(i)) for i in dispatch["inputs"]]
        self._out_order = [[int(i) for i in dispatch["outputs"]].index(t) for t in sig_out]
        self._names = names
        self._dtypes = [t[0] for t in ins]
        self.inputs, self.outputs = list(inputs), list(outputs)

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs, got {len(inputs)}")
        arrays = [coerce_input(s, x) for s, x in zip(self.inputs, inputs)]
        feed = {name: np.ascontiguousarray(arrays[k], dtype=dt)
                for name, k, dt in zip(self._names[0], self._feed_order, self._dtypes)}
        try:
            outs = self.session.run(self._names[1], feed)
        except Exception as e:  # noqa: BLE001
            raise ArtifactError(f"QNN's HTP simulator failed to run: {str(e).strip()[:300]}") from e
        return [outs[k] for k in self._out_order]
