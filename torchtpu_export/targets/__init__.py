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
    kind = sniff(path)
    return get(kind) if kind in NAMES else None


def sniff(path: str) -> str:
    """What the file at ``path`` is: a target's artifact (its name: the record's ``magic`` claims it, or
    no one's magic does and it ends in the record's suffix), or a model file: ``"pt2"``,
    ``"torchscript"``, ``"pickle"``."""
    import os
    import zipfile

    from ..errors import ArtifactError
    from ..fileio import open_regular
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory, not a model file")
    names = None
    with open_regular(path, path) as (f, size):  # a FIFO is refused, not waited on
        if size == 0:
            raise InputError(f"{path} is empty")
        head = f.read(8)
        if head[:2] == b"PK":
            try:
                with zipfile.ZipFile(f) as zf:
                    names = zf.namelist()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
                raise ArtifactError(f"{path} is a damaged zip archive ({e})",
                                    hint="the file is truncated or corrupt: save or export it again") from e
    records = all_targets().values()
    for t in records:
        if t.magic is not None and t.magic(head, names):
            return t.name
    if head[:1] == b"\x80":
        return "pickle"
    if names is not None:
        if any(n.endswith("/models/model.json") or n.endswith("/archive_format") for n in names):
            return "pt2"
        if any("/code/__torch__" in n for n in names):
            return "torchscript"
        if any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
            return "pickle"
        raise ArtifactError(f"{path} is a zip archive but not a .pt2, TorchScript or "
                            f"{'/'.join(t.suffix for t in records if t.magic is not None and t.zipped)} file")
    for t in records:
        if t.magic is None and path.endswith(t.suffix):
            return t.name
    raise ArtifactError(f"{path} is not a model file torchtpu-export reads (unrecognised header)",
                        hint="give a .pt2 from torch.export.save, a TorchScript archive, or package.module:factory")


__all__ = ["NAMES", "Runnable", "Target", "all_targets", "for_file", "get", "sniff"]
