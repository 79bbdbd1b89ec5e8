"""The edge target: captured core ATen -> TFLite builtins + passes -> ``.tflite`` flatbuffer.

No TensorFlow and no MLIR converter: builders (one per ATen overload, split by
op family) emit TFLite ops into a small graph IR, the passes in
:data:`passes.PIPELINE` optimise it, and :mod:`.writer` serialises it with the
``flatbuffers`` package and ``ai_edge_litert``'s schema bindings.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from typing import Mapping

import torch

from torchtpu_export._version import __version__
from torchtpu_export import treespec
from torchtpu_export.capture import CapturedProgram, kept_or_plain_core
from torchtpu_export.errors import InputError
from torchtpu_export.targets.litert.artifact import FORMAT, FORMAT_VERSION, METADATA_NAME, LiteRTArtifact  # noqa: F401

from . import ops_composite, ops_elementwise, ops_index, ops_linalg, ops_misc, ops_nn, ops_quant, ops_reduction, ops_shape  # noqa: F401
from .dims import symbol_ranges
from .lower import AtenProgram, check_supported  # noqa: F401
from .ir import conversion_memo
from .passes import PIPELINE, REQUIRED, run_pipeline
from .quantize import constant_bytes, graph_quants
from .registry import BUILDERS, IO_DTYPES, NOT_SUPPORTED, builds, keep_whole  # noqa: F401
from .writer import serialize, write

log = logging.getLogger("torchtpu_export")
aten = torch.ops.aten

KEEP_WHOLE: list = keep_whole()


# capture decomposes what torch's table would, except the ops kept whole
lowerable = kept_or_plain_core(KEEP_WHOLE)


def convert(captures: Mapping[str, CapturedProgram], *, quant_config=None, observer=None,
            **options) -> LiteRTArtifact:
    """One flatbuffer with a subgraph and SignatureDef per captured program, weights stored once.

    Returns the :class:`~torchtpu_export.targets.litert.artifact.LiteRTArtifact` (its bytes, or a temporary
    file for models past ``IN_MEMORY_LIMIT``; each signature's I/O and pytree specs are also in the
    flatbuffer's ``torchtpu_export`` metadata). ``observer`` is the LiteRT runtime the int8 recipe
    calibrates with (``runtimes.litert.TensorObserver``; converters do not import runtimes).

    Options: ``skip_passes=("fuse_activations", ...)`` leaves optional passes out;
    ``io_dtypes="web"`` makes every input and output float32, int32 or uint8 (what LiteRT.js
    takes: int64 token ids become int32, bool masks int32), ``"auto"`` (default) narrows only
    64-bit types.

    ``quant_config``: ``"fp16"``, ``"dynamic_int8"``, or ``{"recipe": "int8", "calibration":
    [sample_args, ...], "integer_io": False}`` (see :mod:`.quantize`). A model quantized with
    PyTorch's pt2e flow converts to int8 ops without it.
    """
    skip = tuple(options.pop("skip_passes", ()))
    io_dtypes = options.pop("io_dtypes", "auto")
    if io_dtypes not in IO_DTYPES:
        raise InputError(f"io_dtypes must be one of {', '.join(IO_DTYPES)}, not {io_dtypes!r}")
    unknown = sorted(set(options))
    if unknown:
        raise TypeError(f"unknown option(s) for the litert target: {', '.join(unknown)}")
    bad = [s for s in skip if s not in {p.__name__ for p in PIPELINE} or s in {p.__name__ for p in REQUIRED}]
    if bad:
        raise InputError(f"skip_passes names no optional pass: {', '.join(bad)}")
    captures = {name: _signature_names(cap) for name, cap in captures.items()}
    quants = graph_quants(quant_config, captures, io_dtypes, observer)
    graphs, signatures = [], {}
    with conversion_memo():
        graphs = [run_pipeline(AtenProgram.from_capture(name, cap, io_dtypes, quants[name]), skip)
                  for name, cap in captures.items()]
    for name, cap in captures.items():
        signatures[name] = {
            **cap.call_metadata(),
            # dynamic dims -> [min, max or None]: the sizes the model was exported for
            "dims": _dim_ranges(cap),
        }
    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "versions": {"torchtpu_export": __version__, "torch": torch.__version__.split("+")[0]},
        "signatures": signatures,
    }
    quantized = [g.quant for g in graphs if g.quant is not None]
    if quantized:
        float_constants = {k: v for q in quantized for k, v in q.float_constants.items()}
        metadata["quantization"] = {"recipe": quantized[0].recipe,
                                    "float_weight_bytes": sum(float_constants.values()),
                                    "weight_bytes": sum(constant_bytes(graphs).values())}
    quantization = metadata.get("quantization")
    if _weight_bytes(graphs) < IN_MEMORY_LIMIT:
        return LiteRTArtifact(serialize(graphs, metadata), signatures, quantization)
    # a large model goes straight to a file, weights streamed from the graph (no copy in memory)
    fd, path = tempfile.mkstemp(prefix="torchtpu_export.", suffix=".tflite")
    try:
        with os.fdopen(fd, "wb") as f:
            write(graphs, f, metadata)
    except BaseException:
        os.unlink(path)
        raise
    return LiteRTArtifact(None, signatures, quantization, path=path)


# Models with more weight bytes than this are written to a temporary file as they convert.
IN_MEMORY_LIMIT = 64 << 20


def _signature_names(cap: CapturedProgram) -> CapturedProgram:
    """The captured program with its inputs and outputs named as litert-torch names them in a
    SignatureDef (``treespec.input_names``/``output_names``): what Android, iOS and LiteRT.js code
    passes and reads by name, so a file from either tool is called the same way."""
    names = treespec.unique(treespec.input_names(cap.in_spec))
    tensor_names = [n for i, n in enumerate(names) if i not in cap.constant_inputs]
    out_names = treespec.unique(treespec.output_names(cap.out_spec))
    if len(tensor_names) != len(cap.inputs) or len(out_names) != len(cap.outputs):
        return cap  # a structure the names cannot follow: the capture's own names stay
    return dataclasses.replace(
        cap, inputs=[dataclasses.replace(s, name=n) for s, n in zip(cap.inputs, tensor_names)],
        outputs=[dataclasses.replace(s, name=n) for s, n in zip(cap.outputs, out_names)])


def _weight_bytes(graphs) -> int:
    return sum(t.data.nbytes for g in graphs for t in g.tensors() if t.data is not None)


def _dim_ranges(cap: CapturedProgram) -> dict[str, list]:
    # every symbol of the inputs' dims (those inside expressions such as "4*s0" included), and the
    # expressions themselves, as capture reports them
    return {**{k: list(v) for k, v in symbol_ranges(cap).items()}, **{k: list(v) for k, v in cap.dim_ranges.items()}}


__all__ = ["KEEP_WHOLE", "lowerable", "convert", "METADATA_NAME", "FORMAT", "PIPELINE", "BUILDERS", "NOT_SUPPORTED"]
