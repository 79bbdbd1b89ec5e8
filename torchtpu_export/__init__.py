"""torchtpu-export: PyTorch models to TPU StableHLO executables and LiteRT flatbuffers.

    import torchtpu_export as tte
    edge = tte.convert(module, sample_args)              # LiteRT (.tflite)
    prog = tte.export(module, sample_args, target="tpu")  # StableHLO (.tpu)
    bundle = tte.export_llm("hf_folder", target="litertlm")  # an LLM for LiteRT-LM (.litertlm)

Importing the package only defines names: a target's toolchain (jax and libtpu, LiteRT, ONNX
Runtime) is set up when that target is first used.
"""
from ._version import __version__
from .api import SignatureSet, convert, experimental_add_compilation_backend, export, export_llm, load, signature
from .capture import abstract_weights
from .debugger import DebugReport, debug
from .errors import (ArtifactError, CaptureError, ConversionError, InputError, NumericsError, OutputError, TteError,
                     UnsafeInputError, UnsupportedOpError)
from .targets.litert.target import EdgeModel, to_channel_last_io
from .targets.litertlm.target import LitertLmBundle
from .targets.onnx.target import OnnxProgram
from .targets.tpu.target import TpuProgram

# litert-torch's names for the same things, so that `import torchtpu_export as litert_torch` works
Converter = SignatureSet
Model = EdgeModel

__all__ = [
    "__version__", "abstract_weights", "convert", "experimental_add_compilation_backend", "export", "export_llm", "load", "signature", "to_channel_last_io", "SignatureSet", "TpuProgram",
    "EdgeModel", "OnnxProgram", "LitertLmBundle", "Converter", "Model", "debug", "DebugReport",
    "TteError", "InputError", "UnsafeInputError", "CaptureError", "UnsupportedOpError", "ArtifactError",
    "NumericsError", "OutputError", "ConversionError",
]
