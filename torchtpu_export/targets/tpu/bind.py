"""Values for a ``.tpu`` exported with abstract weights (``tte.abstract_weights()``).

The programs were traced and compiled against shapes and dtypes only; here each abstract weight is
found in safetensors files (a Hugging Face checkpoint's shards) or a mapping, checked against the shape
the program takes, cast to its dtype as it is read (:class:`CastOnRead`), and quantized the way export
would have (int8 weight-only: one scale per output channel, computed here from the whole weight). Files
are read through ``safetensors_io`` (bounds checked, memory-mapped).
"""
from __future__ import annotations

import copy
import mmap
import os
from typing import Mapping

import numpy as np

from . import artifact as tpu_format
from ...errors import ArtifactError, InputError
from ...quant import per_channel_int8
from ...safetensors_io import read as read_safetensors
from ...safetensors_io import CastOnRead, to_numpy


def _open(path: str) -> tuple[dict, mmap.mmap | None]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    try:
        return (read_safetensors(mm) if mm is not None else {}), mm
    except (ValueError, TypeError, KeyError) as e:
        raise ArtifactError(f"{path} is not a valid safetensors file ({str(e)[:200]})") from e


def tensors_of(source) -> tuple[dict[str, object], list]:
    """name -> array from a ``.safetensors`` file, a folder of them, or a mapping; and what keeps them mapped."""
    if isinstance(source, Mapping):
        return dict(source), []
    if not isinstance(source, (str, os.PathLike)):
        raise InputError(f"weights come from a .safetensors file, a folder of them or a mapping, "
                         f"not {type(source).__name__}")
    path = os.fspath(source)
    if os.path.isdir(path):  # a checkpoint folder: its own regular files only (links out refused)
        from ...llm.hf_folder import file_path
        files = sorted(file_path(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise InputError(f"{path} holds no .safetensors files")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise InputError(f"{path} does not exist")
    found: dict[str, object] = {}
    keep = []
    for file in files:
        arrays, mm = _open(file)
        keep.append(mm)
        twice = sorted(set(arrays) & set(found))
        if twice:
            raise InputError(f"weight {twice[0]!r} is in more than one file of {path}")
        found.update(arrays)
    return found, keep


def _floating(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def _candidates(name: str, prefix: str | None):
    """The names a weight may have in a checkpoint: its own, without ``prefix``, and without each leading
    module path in turn (``model.model.layers.0...`` of an LLM's wrapper -> ``model.layers.0...``)."""
    yield name
    if prefix and name.startswith(prefix):
        yield name[len(prefix):]
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        yield ".".join(parts[i:])


def bind(artifact: tpu_format.TpuArtifact, source, prefix: str | None = None) -> tpu_format.TpuArtifact:
    abstract = {n: w for n, w in artifact.weights.items() if isinstance(w, tpu_format.AbstractWeight)}
    if not abstract:
        raise InputError("this program's weights already have values", hint="bind_weights is for programs "
                         "exported from a model built under tte.abstract_weights()")
    quantized = {}  # weight -> (scale name, axis)
    for spec in artifact.manifest["programs"].values():
        for n, q in spec.get("quantization", {}).get("weights", {}).items():
            quantized[n] = (q["scale"], int(q["axis"]))
    scales = {s for s, _ in quantized.values()}
    tensors, keep = tensors_of(source)
    weights = dict(artifact.weights)
    missing = []
    for name, want in abstract.items():
        if name in scales:
            continue  # computed with its weight
        key = next((c for c in _candidates(name, prefix) if c in tensors), None)
        if key is None:
            missing.append(name)
            continue
        value = to_numpy(tensors[key])
        if tuple(value.shape) != tuple(want.shape):
            raise InputError(f"weight {key!r} is {list(value.shape)} in the checkpoint; the program takes "
                             f"{list(want.shape)} for {name!r}", hint="the checkpoint belongs to another config")
        if name in quantized:
            scale_name, axis = quantized[name]
            weights[name], weights[scale_name] = per_channel_int8(value, axis)
            continue
        target = np.dtype(want.dtype)
        if value.dtype != target:
            if not (_floating(value.dtype) and _floating(target)):
                raise InputError(f"weight {key!r} is {value.dtype.name} in the checkpoint; the program takes "
                                 f"{target.name}")
            value = CastOnRead(value, target)
        weights[name] = value
    if missing:
        raise InputError(f"{len(missing)} of the program's weights are not in the checkpoint: "
                         f"{', '.join(repr(m) for m in missing[:3])}{' ...' if len(missing) > 3 else ''}",
                         hint="pass prefix= for names the checkpoint stores under another module path")
    return tpu_format.TpuArtifact(copy.deepcopy(artifact.manifest), artifact.programs, artifact.mlir, weights,
                                  (artifact.keepalive, keep), artifact.executables, artifact.extras)
