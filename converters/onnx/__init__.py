"""The ONNX target: the captured program, exported by ``torch.onnx.export(dynamo=True)``.

A peer column of the coverage matrix: what torch.onnx makes of each op is shown as it is.
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings
from typing import Mapping

import torch

from torchtpu_export.capture import CapturedProgram, kept_or_plain_core
from torchtpu_export.errors import ConversionError, InputError, UnsupportedOpError
from torchtpu_export.targets.onnx.artifact import OnnxArtifact, with_metadata

# torch.onnx picks its own decompositions (it keeps the ops it has ONNX functions for), so the
# capture decomposes nothing and hands it the program as torch.export made it.
KEEP_WHOLE: list = list(torch.export.default_decompositions())

_OPTIONS = ("opset_version", "optimize")


lowerable = kept_or_plain_core(KEEP_WHOLE)


def convert(captures: Mapping[str, CapturedProgram], **options) -> OnnxArtifact:
    """Exports one captured program to an ONNX model (ONNX has one graph per model)."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TypeError(f"unknown option(s) for the onnx target: {', '.join(unknown)}")
    if len(captures) != 1:
        raise InputError(f"an ONNX model holds one graph; got {len(captures)} signatures ({', '.join(captures)})",
                         hint="export each signature to its own .onnx file")
    (cap,) = captures.values()
    program = _torch_onnx_export(cap, **options)
    meta = cap.call_metadata()
    artifact = OnnxArtifact(b"", list(cap.inputs), list(cap.outputs), meta["in_spec"], meta["out_spec"],
                            meta["constant_inputs"], cap.op_histogram())
    artifact.model = with_metadata(program.model_proto.SerializeToString(), artifact.metadata())
    return artifact


def _torch_onnx_export(cap: CapturedProgram, opset_version=None, optimize=True):
    quiet = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), \
                _quiet_loggers():
            warnings.simplefilter("ignore")
            core, registry = _exporter(opset_version)
            if core is not None:
                return core.export(cap.exported, registry=registry, optimize=optimize, opset_version=opset_version,
                                   verbose=False, report=False)
            return torch.onnx.export(cap.exported, (), dynamo=True, verbose=False, report=False,
                                     opset_version=opset_version, optimize=optimize)
    except Exception as e:  # torch.onnx wraps the failing node's error in its own classes
        raise _translate(e) from e


@functools.cache
def _exporter(opset_version):
    """torch.onnx's exporter core and its op registry, built once per process.

    ``torch.onnx.export`` rebuilds the registry (about 2 s) on every call; this is what it calls
    after that. If torch's private layout changes, the public entry point is used instead.
    """
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration
        opset = max(opset_version or _constants.TORCHLIB_OPSET, _constants.TORCHLIB_OPSET)
        return _core, _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    except (ImportError, AttributeError, TypeError):
        return None, None


def _translate(e: BaseException) -> Exception:
    """torch.onnx's failure as UnsupportedOpError (no ONNX function for an op) or ConversionError."""
    chain = []
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        if type(err).__name__ == "DispatchError":
            text = str(err)
            op = text.split("op='", 1)[1].split("'", 1)[0] if "op='" in text else "an op"
            overload = text.split("overload='", 1)[1].split("'", 1)[0] if "overload='" in text else "default"
            reason = text.split("Failure message:", 1)[1].strip() if "Failure message:" in text else text
            return UnsupportedOpError(f"{op.replace('::', '.')}.{overload}", target="onnx",
                                      reason=f"torch.onnx has no ONNX function for it ({reason.splitlines()[0]})")
    inner = chain[-1]
    first = next((ln for ln in str(inner).splitlines() if ln.strip()), type(inner).__name__)
    return ConversionError(f"torch.onnx.export failed: {type(inner).__name__}: {first[:300]}",
                           hint="this is torch.onnx's limitation or bug; the model may need another target")


@contextlib.contextmanager
def _quiet_loggers():
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "torch.export", "torch._export")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
