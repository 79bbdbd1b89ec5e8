"""Deployment targets: each has one home here, a module holding its :class:`~.base.Target` record
(converter package, artifact format, runtime, runnable class, describer, options) and its runnable
class. Code that differs by target goes through this table, never through ``if target == ...``.

Adding a target: a converter package under ``converters/``, a runtime module under ``runtimes/``,
and a module here whose ``TARGET`` names them, listed in ``NAMES``.
"""
from __future__ import annotations

import importlib

from ..errors import InputError
from .base import Runnable, Target

NAMES = ("tpu", "litert", "onnx", "litertlm")  # in the order the CLI and the docs list them


def get(name: str) -> Target:
    """The target called ``name`` (its module is imported on first use)."""
    if name not in NAMES:
        raise InputError(f"unknown target {name!r}; choose one of {', '.join(NAMES)}")
    return importlib.import_module(f"{__name__}.{name}.target").TARGET


def all_targets() -> dict[str, Target]:
    return {name: get(name) for name in NAMES}


def for_file(path: str) -> Target | None:
    """The target whose artifact the file at ``path`` is (by its content), or None for a model file."""
    from ..models import sniff_model
    kind = sniff_model(path)
    return get(kind) if kind in NAMES else None


__all__ = ["NAMES", "Runnable", "Target", "all_targets", "for_file", "get"]
