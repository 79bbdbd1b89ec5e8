"""Converters: one sub-package per target. They never import runtimes.

Every converter package meets one contract, :class:`Converter`, as module-level names:
``KEEP_WHOLE`` (composite ops capture must not decompose), ``lowerable(op)`` (whether the
target takes an op as capture found it, so capture can skip decomposing when it takes them
all) and ``convert(captures, **options)``, which turns captured programs (name ->
``CapturedProgram``) into the target's artifact: an object with ``save(path)``, read back by
the target's format module (``tpu_format``, ``litert_format``, ``onnx_format``); the
``torchtpu_export.targets`` table names each target's converter package. Running an
artifact is the runtimes' business; ``torchtpu_export.api`` joins the two. Anything a
converter needs to run (LiteRT for int8 calibration) is handed to it as an option.
"""
from __future__ import annotations

import importlib
from typing import Mapping, Protocol, Sequence

class Converter(Protocol):
    KEEP_WHOLE: Sequence

    def lowerable(self, op) -> bool:
        ...

    def convert(self, captures: Mapping[str, object], **options):
        ...


def converter(package: str) -> Converter:
    """A converter package (a target's ``converter``), imported on first use (each pulls in its toolchain)."""
    return importlib.import_module(f"{__name__}.{package}")
