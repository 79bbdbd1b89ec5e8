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


class OpRules(dict):
    """Rules by op. A rule registered under an op's name (``"transformers.grouped_mm_fallback.default"``)
    serves that op without its library imported at registration (the op exists once the model's library
    defines it): lookups try the op itself, then its name."""

    def _key(self, op):
        return op if dict.__contains__(self, op) else str(op)

    def __contains__(self, op) -> bool:
        return dict.__contains__(self, op) or dict.__contains__(self, str(op))

    def __getitem__(self, op):
        return dict.__getitem__(self, self._key(op))

    def get(self, op, default=None):
        return dict.get(self, self._key(op), default)

    def ops(self) -> list:
        """The registered ops that are op objects (names of ops not defined yet left out)."""
        return [op for op in self if not isinstance(op, str)]


def converter(package: str) -> Converter:
    """A converter package (a target's ``converter``), imported on first use (each pulls in its toolchain)."""
    return importlib.import_module(f"{__name__}.{package}")
