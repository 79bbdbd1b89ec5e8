"""The ``.tpu`` artifact: one uncompressed zip (entries stay mmap-able).

Entries::

    manifest.json                          versions, platforms, programs, I/O, kernels, weights
    programs/<program>/<platform>.jaxexport  a serialized jax.export.Exported
    stablehlo/<platform>.mlir              the module as text (one program), or
    stablehlo/<program>/<platform>.mlir    (several programs)
    weights.safetensors                    every weight, shared by all programs
    executables/<topology>/<program>.bin   optional: a TPU executable compiled ahead of time
                                           (``manifest["compiled"]`` says for which libtpu, jax
                                           and chips, with its sha256 and the compiler's stats)

Weights are arguments of every program, never constants inside it. The
manifest names the files, so readers never guess paths. Writing is
deterministic: the same artifact gives the same bytes.
"""
from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
import zipfile
import zlib
from typing import Mapping

import numpy as np

from . import progress, safetensors_io
from .errors import ArtifactError, InputError
from .fileio import atomic_open

FORMAT = "torchtpu-export.tpu"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


@dataclasses.dataclass
class TpuArtifact:
    """The parts of a ``.tpu`` file held in memory (weights may be mmap views)."""

    manifest: dict
    programs: dict[str, dict[str, bytes]]  # program -> platform -> serialized Exported
    mlir: dict[str, dict[str, str]]  # program -> platform -> StableHLO text
    weights: Mapping[str, np.ndarray]
    _keepalive: object = None  # the mmap the weights point into
    executables: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)  # topology -> program -> bytes

    def program_path(self, program: str, platform: str) -> str:
        return f"programs/{program}/{platform}.jaxexport"

    def mlir_path(self, program: str, platform: str) -> str:
        return f"stablehlo/{platform}.mlir" if len(self.programs) == 1 else f"stablehlo/{program}/{platform}.mlir"

    def executable_path(self, topology: str, program: str) -> str:
        return f"executables/{topology.replace(':', '_')}/{program}.bin"

    def save(self, path) -> None:
        files = {}
        for topology, per_program in sorted(self.executables.items()):
            for prog, blob in sorted(per_program.items()):
                files[self.executable_path(topology, prog)] = blob
        for prog, per_platform in sorted(self.programs.items()):
            spec = self.manifest["programs"][prog]
            spec["files"] = {p: self.program_path(prog, p) for p in sorted(per_platform)}
            spec["stablehlo"] = {p: self.mlir_path(prog, p) for p in sorted(self.mlir.get(prog, {}))}
            for p, blob in sorted(per_platform.items()):
                files[self.program_path(prog, p)] = blob
            for p, text in sorted(self.mlir.get(prog, {}).items()):
                files[self.mlir_path(prog, p)] = text.encode()
        self.manifest["weights"] = {"file": WEIGHTS, "count": len(self.weights),
                                    "bytes": int(sum(w.nbytes for w in self.weights.values()))}
        manifest = json.dumps(self.manifest, indent=1, sort_keys=True).encode()
        with progress.stage("write"), atomic_open(path) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            _write_entry(zf, MANIFEST, manifest)
            for name in sorted(files):
                _write_entry(zf, name, files[name])
            info = _zipinfo(WEIGHTS)
            with zf.open(info, "w", force_zip64=True) as w:
                safetensors_io.write(w, self.weights)


def _zipinfo(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


def _write_entry(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    zf.writestr(_zipinfo(name), data)


def _entry_offset(f, info: zipfile.ZipInfo) -> int:
    """Where an uncompressed entry's bytes start in the file."""
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ArtifactError(f"bad local header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def read(path) -> TpuArtifact:
    """Opens a ``.tpu`` file, checking its format and version; weights are mmap'd, not copied."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory, not a .tpu file")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot open {path}: {e.strerror}") from e
    with f:
        try:
            zf = zipfile.ZipFile(f)
            manifest = json.loads(zf.read(MANIFEST))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError,
                zipfile.LargeZipFile, ValueError, NotImplementedError) as e:
            raise ArtifactError(f"{path} is not a valid .tpu artifact ({type(e).__name__}: {e})",
                                hint="the file is corrupt or truncated: export it again") from e
        check_manifest(manifest, path)
        try:
            programs, mlir = {}, {}
            for prog, spec in manifest["programs"].items():
                programs[prog] = {p: zf.read(name) for p, name in spec["files"].items()}
                mlir[prog] = {p: zf.read(name).decode() for p, name in spec.get("stablehlo", {}).items()}
            executables = {}
            for topology, per_program in manifest.get("compiled", {}).items():
                for prog, entry in per_program.items():
                    exe = entry.get("executable")
                    if exe:
                        executables.setdefault(topology, {})[prog] = zf.read(exe["file"])
            info = zf.getinfo(manifest["weights"]["file"])
            if info.compress_type != zipfile.ZIP_STORED:
                raise ArtifactError(f"{path}: weights are compressed; .tpu weights must be stored")
            start = _entry_offset(f, info)
            if start + info.file_size > os.path.getsize(path):
                raise ArtifactError(f"{path}: the weights entry is truncated")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if info.file_size else None
            weights = safetensors_io.read(memoryview(mm)[start:start + info.file_size]) if mm else {}
        except ArtifactError:
            raise
        except (zipfile.BadZipFile, KeyError, ValueError, TypeError, OSError, EOFError, UnicodeDecodeError,
                zlib.error) as e:
            raise ArtifactError(f"{path} is corrupt ({type(e).__name__}: {e})",
                                hint="export the model again") from e
    missing = [w for prog in manifest["programs"].values() for w in prog["weights"] if w not in weights]
    if missing:
        raise ArtifactError(f"{path} is corrupt: weights {missing[:3]} are missing")
    return TpuArtifact(manifest, programs, mlir, weights, mm, executables)


def check_manifest(manifest, path: str = "artifact") -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a torchtpu-export .tpu artifact (manifest format is missing)")
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: manifest has no format_version")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {version}, newer than this torchtpu-export reads ({FORMAT_VERSION})",
            hint="upgrade torchtpu-export to load it")
    programs = manifest.get("programs")
    if not isinstance(programs, dict) or not programs:
        raise ArtifactError(f"{path}: manifest lists no programs")
    for name, spec in programs.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("files"), dict) or "weights" not in spec:
            raise ArtifactError(f"{path}: manifest entry for program {name!r} is incomplete")
        _check_program(spec, f"{path}: program {name!r}")
    if not isinstance(manifest.get("weights"), dict) or "file" not in manifest["weights"]:
        raise ArtifactError(f"{path}: manifest has no weights entry")
    _check_compiled(manifest.get("compiled", {}), programs, path)


def _check_compiled(compiled, programs: dict, path: str) -> None:
    """``compiled``: topology -> program -> {stats, and an executable's file and sha256}."""
    ok = isinstance(compiled, dict) and all(
        isinstance(t, str) and isinstance(per, dict) and all(
            p in programs and isinstance(e, dict) and isinstance(e.get("stats", {}), dict)
            and (e.get("executable") is None or (isinstance(e["executable"], dict)
                                                 and isinstance(e["executable"].get("file"), str)
                                                 and isinstance(e["executable"].get("sha256"), str)))
            for p, e in per.items())
        for t, per in compiled.items())
    if not ok:
        raise ArtifactError(f"{path}: the manifest's compiled executables are malformed", hint="export the model again")


def _check_program(spec: dict, where: str) -> None:
    """The fields a program entry must have, with the types readers rely on."""
    from . import treespec
    ok = (isinstance(spec.get("weights"), list) and all(isinstance(w, str) for w in spec["weights"])
          and all(isinstance(f, str) for f in spec["files"].values()))
    for key in ("inputs", "outputs"):
        items = spec.get(key)
        ok = ok and isinstance(items, list) and all(
            isinstance(d, dict) and isinstance(d.get("name"), str) and isinstance(d.get("dtype"), str)
            and isinstance(d.get("shape"), list) and all(isinstance(x, (int, str)) for x in d["shape"])
            for d in items)
    if not ok:
        raise ArtifactError(f"{where} has malformed fields in the manifest", hint="export the model again")
    for key in ("in_spec", "out_spec"):
        try:
            treespec.loads(spec[key])
        except (ArtifactError, KeyError, TypeError) as e:
            raise ArtifactError(f"{where}: the manifest's {key} is not a valid pytree spec ({type(e).__name__})",
                                hint="export the model again") from e
