"""torchtpu-export: PyTorch models to TPU StableHLO executables and LiteRT flatbuffers.

    import torchtpu_export as tte
    edge = tte.convert(module, sample_args)              # LiteRT (.tflite)
    prog = tte.export(module, sample_args, target="tpu")  # StableHLO (.tpu)
"""
__version__ = "0.1.0"

from . import tpu_compile as _tpu_compile  # noqa: E402

_tpu_compile.prepare_environment()  # before jax loads libtpu on a host without TPU chips

from .api import SignatureSet, TpuProgram, convert, export, load, signature, to_channel_last_io  # noqa: E402
from .debugger import DebugReport, debug  # noqa: E402
from .edge import EdgeModel  # noqa: E402

# litert-torch's names for the same things, so that `import torchtpu_export as litert_torch` works
Converter = SignatureSet
Model = EdgeModel
from .errors import (ArtifactError, CaptureError, ConversionError, InputError, NumericsError,  # noqa: E402
                     OutputError, TteError, UnsafeInputError, UnsupportedOpError)

__all__ = [
    "convert", "export", "load", "signature", "to_channel_last_io", "SignatureSet", "TpuProgram", "EdgeModel",
    "Converter", "Model", "debug", "DebugReport",
    "TteError", "InputError", "UnsafeInputError", "CaptureError", "UnsupportedOpError", "ArtifactError",
    "NumericsError", "OutputError", "ConversionError",
]
