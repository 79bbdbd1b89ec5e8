"""The ``.tpu`` artifact: one uncompressed zip (entries stay mmap-able).

Entries::

    manifest.json                          versions, platforms, programs, I/O, kernels, weights
    programs/<program>/<platform>.jaxexport  a serialized jax.export.Exported
    stablehlo/<platform>.mlir              the module as text (one program), or
    stablehlo/<program>/<platform>.mlir    (several programs)
    weights.safetensors                    every weight, shared by all programs (empty when the
                                           weights are abstract: ``manifest["weights"]["abstract"]``
                                           lists each one's dtype and shape; values are bound at load)
    executables/<topology>/<program>.bin   optional: a TPU executable compiled ahead of time
                                           (``manifest["compiled"]`` says for which libtpu, jax
                                           and chips, with its sha256 and the compiler's stats)
    llm/tokenizer.json                     optional: an LLM's tokenizer (``manifest["llm"]``: its chat
                                           template, special tokens, cache and prefill lengths, slots)

Weights are arguments of every program, never constants inside it. The
manifest names the files, so readers never guess paths, and holds the sha256
of every other entry (format version 2); it is written last, after them.
Writing is deterministic: the same artifact gives the same bytes.

Reading trusts nothing: every entry must be stored (never compressed) and lie
inside the file, no name twice, the manifest at most ``MAX_MANIFEST_BYTES``;
every digest is checked before anything is deserialized, in bounded memory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
import struct
import zipfile
import zlib
from typing import Mapping

import numpy as np

from ... import progress, safetensors_io
from ...errors import ArtifactError, InputError
from ...fileio import atomic_open
from ...untrusted import load_json

FORMAT = "torchtpu-export.tpu"
FORMAT_VERSION = 2  # 2: digests of every entry in the manifest (1: none; still read)
MAX_MANIFEST_BYTES = 16 << 20
MANIFEST = "manifest.json"
STATE_PREFIX = "state:"  # the initial value of a program's state (a buffer it changes in place), among the weights
WEIGHTS = "weights.safetensors"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


@dataclasses.dataclass(frozen=True)
class AbstractWeight:
    """A weight known by its shape and dtype only: a model exported without materialising its weights
    (built on the meta device). Programs compile against it; running needs values bound to it."""

    shape: tuple
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def astype(self, dtype) -> "AbstractWeight":
        return AbstractWeight(self.shape, np.dtype(dtype))


@dataclasses.dataclass
class TpuArtifact:
    """The parts of a ``.tpu`` file held in memory (weights may be mmap views)."""

    manifest: dict
    programs: dict[str, dict[str, bytes]]  # program -> platform -> serialized Exported
    mlir: dict[str, dict[str, str]]  # program -> platform -> StableHLO text
    weights: Mapping[str, np.ndarray]
    keepalive: object = None  # the mmap the weights point into
    executables: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)  # topology -> program -> bytes
    extras: dict[str, bytes] = dataclasses.field(default_factory=dict)  # entry -> bytes (an LLM's tokenizer.json)

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
        files.update(self.extras)
        for prog, per_platform in sorted(self.programs.items()):
            spec = self.manifest["programs"][prog]
            spec["files"] = {p: self.program_path(prog, p) for p in sorted(per_platform)}
            spec["stablehlo"] = {p: self.mlir_path(prog, p) for p in sorted(self.mlir.get(prog, {}))}
            for p, blob in sorted(per_platform.items()):
                files[self.program_path(prog, p)] = blob
            for p, text in sorted(self.mlir.get(prog, {}).items()):
                files[self.mlir_path(prog, p)] = text.encode()
        abstract = {n: {"dtype": safetensors_io.dtype_code(w.dtype), "shape": list(w.shape)}
                    for n, w in self.weights.items() if isinstance(w, AbstractWeight)}
        self.manifest["weights"] = {"file": WEIGHTS, "count": len(self.weights),
                                    "bytes": int(sum(w.nbytes for w in self.weights.values()))}
        if abstract:
            self.manifest["weights"]["abstract"] = dict(sorted(abstract.items()))
        self.manifest["format_version"] = FORMAT_VERSION
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        with progress.stage("write"), atomic_open(path) as f, \
                zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name in sorted(files):
                _write_entry(zf, name, files[name])
            with zf.open(_zipinfo(WEIGHTS), "w", force_zip64=True) as w:
                hashing = _Hashing(w)
                safetensors_io.write(hashing, {n: w for n, w in self.weights.items() if n not in abstract})
            digests[WEIGHTS] = hashing.sha256.hexdigest()
            self.manifest["digests"] = dict(sorted(digests.items()))
            _write_entry(zf, MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True).encode())


class _Hashing:
    """A file-like writer that hashes what goes through it."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)


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
    """Opens a ``.tpu`` file, checking its format, version, entries and digests; weights are mmap'd."""
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
        size = os.fstat(f.fileno()).st_size
        try:
            zf = zipfile.ZipFile(f)
            infos = _check_entries(zf, f, size, path)
            if MANIFEST not in infos:
                raise ArtifactError(f"{path} is not a .tpu artifact (it has no {MANIFEST})")
            if infos[MANIFEST].file_size > MAX_MANIFEST_BYTES:
                raise ArtifactError(f"{path}: its manifest is {infos[MANIFEST].file_size:,} bytes (at most "
                                    f"{MAX_MANIFEST_BYTES:,})")
            manifest = load_json(zf.read(MANIFEST), f"{path}: {MANIFEST}", max_bytes=MAX_MANIFEST_BYTES)
        except ArtifactError:
            raise
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError,
                zipfile.LargeZipFile, ValueError, NotImplementedError, RecursionError) as e:
            raise ArtifactError(f"{path} is not a valid .tpu artifact ({type(e).__name__}: {str(e)[:200]})",
                                hint="the file is corrupt or truncated: export it again") from e
        check_manifest(manifest, path)
        names = _named_entries(manifest)
        unknown = sorted(set(names) - set(infos))
        if unknown:
            raise ArtifactError(f"{path} is corrupt: entries {unknown[:3]} named in the manifest are missing")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if manifest["format_version"] >= 2:
            _check_digests(manifest, infos, f, mm, path)
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
            extras = {name: zf.read(name) for name in _extra_entries(manifest)}
            info = infos[manifest["weights"]["file"]]
            start = _entry_offset(f, info)
            weights = safetensors_io.read(memoryview(mm)[start:start + info.file_size]) if info.file_size else {}
            for name, spec in manifest["weights"].get("abstract", {}).items():
                if name in weights:
                    raise ArtifactError(f"{path} is corrupt: weight {name[:80]!r} is both stored and abstract")
                weights[name] = AbstractWeight(tuple(spec["shape"]), safetensors_io.dtype_of(spec["dtype"]))
        except ArtifactError:
            raise
        except (zipfile.BadZipFile, KeyError, ValueError, TypeError, OSError, EOFError, UnicodeDecodeError,
                zlib.error, RecursionError) as e:
            raise ArtifactError(f"{path} is corrupt ({type(e).__name__}: {str(e)[:200]})",
                                hint="export the model again") from e
    missing = [w for prog in manifest["programs"].values() for w in prog["weights"] if w not in weights]
    if missing:
        raise ArtifactError(f"{path} is corrupt: weights {missing[:3]} are missing")
    return TpuArtifact(manifest, programs, mlir, weights, mm, executables, extras)


def _check_entries(zf: zipfile.ZipFile, f, size: int, path: str) -> dict[str, zipfile.ZipInfo]:
    """Every entry stored (a .tpu is never compressed, so nothing can expand), inside the file, named once."""
    infos: dict[str, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        if info.filename in infos:
            raise ArtifactError(f"{path} is corrupt: entry {info.filename!r} appears twice")
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise ArtifactError(f"{path}: entry {info.filename!r} is compressed; .tpu entries are stored",
                                hint="a .tpu written by torchtpu-export is never compressed: export it again")
        if _entry_offset(f, info) + info.file_size > size:
            raise ArtifactError(f"{path} is truncated: entry {info.filename!r} ends past the end of the file",
                                hint="export the model again")
        infos[info.filename] = info
    return infos


def _named_entries(manifest: dict) -> list[str]:
    names = [manifest["weights"]["file"]]
    for spec in manifest["programs"].values():
        names += list(spec["files"].values()) + list(spec.get("stablehlo", {}).values())
    for per_program in manifest.get("compiled", {}).values():
        names += [e["executable"]["file"] for e in per_program.values() if e.get("executable")]
    return names + _extra_entries(manifest)


def _extra_entries(manifest: dict) -> list[str]:
    """An LLM's tokenizer and its engine's stored executables (:mod:`.stored`)."""
    llm = manifest.get("llm", {})
    calls = [c["file"] for entry in (llm.get("engine") or {}).values() for c in entry["calls"].values()]
    return ([llm["tokenizer"]] if llm.get("tokenizer") else []) + calls


_CHUNK = 16 << 20


def _check_digests(manifest: dict, infos: dict, f, mm, path: str) -> None:
    """Each entry's sha256 against the manifest's, a chunk at a time (the pages read are released)."""
    digests = manifest.get("digests")
    entries = set(infos) - {MANIFEST}
    if not isinstance(digests, dict) or set(digests) != entries:
        raise ArtifactError(f"{path} is corrupt: the manifest's digests do not list its entries",
                            hint="export the model again")
    for name in sorted(entries):
        info = infos[name]
        start = _entry_offset(f, info)
        h = hashlib.sha256()
        for a in range(start, start + info.file_size, _CHUNK):
            b = min(a + _CHUNK, start + info.file_size)
            h.update(mm[a:b])
            page = a - a % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, page, b - page)
        if h.hexdigest() != digests[name]:
            raise ArtifactError(f"{path} is corrupt: entry {name} does not match its sha256 in the manifest",
                                hint="the file was damaged after export: export it again")


def _manifest_schema():
    from ...images import RESAMPLE
    from ...untrusted import BOOL, NAME, NUMBER, STR, Count, Is, ListOf, MapOf, OneOf, Opt, Record, TupleOf
    axis = Opt(NAME)
    stats = Record({"hbm_bytes": Record({k: NUMBER for k in ("arguments", "outputs", "temporaries", "code", "total")},
                                        {"aliased": NUMBER}),
                    "hbm_capacity_bytes": NUMBER, "fits": BOOL, "flops": NUMBER, "bytes_accessed": NUMBER,
                    "roofline": Record({"seconds": NUMBER, "dtype": STR, "bound": STR},
                                       {"peak_flops": NUMBER, "hbm_bytes_per_s": NUMBER})},
                   {"generation": STR, "transcendentals": NUMBER, "kernel_estimates": Count(),
                    "collectives": MapOf(Record({"ops": Count(), "bytes": Count()}))})
    compiled = Record({"stats": stats},
                      {"libtpu": Opt(STR), "jax": STR, "jaxlib": STR, "device_kind": STR, "devices": Count(),
                       "executable": Opt(Record({"file": NAME, "sha256": STR}, {"bytes": Count()})),
                       "executable_reason": STR, "shapes": MapOf(Count())})
    engine = Record({"jax": STR, "jaxlib": STR, "device_kind": STR, "devices": Count(),
                     "calls": MapOf(Record({"file": NAME, "sha256": STR}, {"bytes": Count(), "seconds": NUMBER}))},
                    {"libtpu": Opt(STR), "server": STR, "host": STR})
    kernel = Record({}, {k: STR for k in ("node", "op", "kernel", "detail", "reason", "platform")}
                    | {"cost": MapOf(NUMBER)})
    sharding = Record({"mode": STR, "weights": MapOf(ListOf(axis)), "inputs": ListOf(ListOf(axis)),
                       "column_parallel": ListOf(NAME), "row_parallel": ListOf(NAME)},
                      {"mesh": MapOf(Count()), "outputs": ListOf(ListOf(axis)), "expert_axis": NAME,
                       "expert_parallel": ListOf(NAME)})
    # a VLM (llm.plan.VISION): the image size, rows per image, and the text and token that place an image
    vision = Record({k: Count() for k in ("height", "width", "rows", "hidden", "image_token_id")}
                    | {"marker": STR, "sequence": STR, "bidirectional": BOOL, "resample": OneOf(*RESAMPLE)},
                    {"family": STR})
    program = Record({"files": MapOf(NAME), "weights": ListOf(NAME)},
                     {"stablehlo": MapOf(NAME), "uses_x64": BOOL, "narrow_64bit": BOOL,
                      "calling_convention_version": Opt(Count()), "kernels": ListOf(kernel),
                      "ragged_outputs": MapOf(Count(), key=Is(str, max_len=12)), "rng_key": BOOL,
                      "op_histogram": MapOf(Count()), "quantization": Record({"recipe": STR}),
                      "sharding": Opt(sharding), "donate": ListOf(Count()),
                      "kernel_cost": Record({"kept": OneOf("pallas", "xla")},
                                            {"pallas": MapOf(NUMBER), "xla": MapOf(NUMBER), "not_compared": STR,
                                             "without": MapOf(MapOf(NUMBER)), "dropped": ListOf(STR)}),
                      "state": ListOf(Record({"name": STR, "shape": ListOf(Count()), "dtype": STR}))})
    return Record({"format": OneOf(FORMAT), "format_version": Count(), "programs": MapOf(program),
                   "weights": Record({"file": NAME}, {"count": Count(), "bytes": Count(),
                                                      "abstract": MapOf(Record({"dtype": STR, "shape": ListOf(Count())}))})},
                  {"versions": MapOf(STR), "platforms": ListOf(STR), "digests": MapOf(STR),
                   "mesh": Opt(Record({"axes": ListOf(TupleOf(NAME, Count())), "devices": Count()})),
                   "compiled": MapOf(MapOf(compiled)),
                   "llm": Record({"cache_length": Count(), "prefill_lengths": ListOf(Count())},
                                 {"tokenizer": NAME, "chat_template": Opt(STR), "bos_id": Opt(Count()),
                                  "pad_id": Opt(Count()), "stop_ids": ListOf(Count()), "slots": Count(),
                                  "name": STR, "recurrent_states": Record({"tensors": Count(),
                                                                           "bytes_per_sequence": Count()}),
                                  "engine": MapOf(engine), "vision": vision,
                                  "specials": MapOf(STR, key=Is(str, max_len=64)),
                                  "chat": Record({"runtime": STR, "probes": ListOf(STR)}, {"refused": ListOf(STR)})})})


def donated(spec: dict) -> tuple[int, ...]:
    """The positions of a program's inputs whose buffers its outputs may take over: the ``donate`` list
    (a KV cache passed in), then the state after the inputs (buffers the module changes in place)."""
    n = len(spec["inputs"])
    return tuple(int(i) for i in spec.get("donate", ())) + tuple(n + k for k in range(len(spec.get("state", ()))))


def check_manifest(manifest, path: str = "artifact") -> None:
    """Every field a reader of the manifest uses, with its type, before any is used (ArtifactError)."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a torchtpu-export .tpu artifact (manifest format is missing)")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArtifactError(f"{path}: manifest has no format_version")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {version}, newer than this torchtpu-export reads ({FORMAT_VERSION})",
            hint="upgrade torchtpu-export to load it")
    problem = _manifest_schema().problem(manifest, "manifest")
    if problem:
        raise ArtifactError(f"{path} is corrupt: {problem}", hint="export the model again")
    programs = manifest["programs"]
    if not programs:
        raise ArtifactError(f"{path}: manifest lists no programs")
    for name, spec in programs.items():
        _check_program(spec, f"{path}: program {name!r}")
    mesh = manifest.get("mesh")
    if mesh is not None and mesh["devices"] != math.prod(n for _, n in mesh["axes"]):
        raise ArtifactError(f"{path} is corrupt: its mesh's devices do not match its axes")
    for topology, per_program in manifest.get("compiled", {}).items():
        unknown = sorted(set(per_program) - set(programs))
        if unknown:
            raise ArtifactError(f"{path} is corrupt: executables for {topology} name unknown programs {unknown[:3]}",
                                hint="export the model again")


def _check_program(spec: dict, where: str) -> None:
    """A program entry's call metadata, and the references between its fields."""
    from ...specs import call_metadata_problem
    problem = call_metadata_problem(spec)
    n_out = len(spec["outputs"]) if not problem else 0
    plan = spec.get("sharding")
    if not problem and any(not k.isdigit() for k in spec.get("ragged_outputs", {})):
        problem = "its ragged outputs are not keyed by output positions"
    if not problem and plan is not None and (len(plan["inputs"]) != len(spec["inputs"]) + len(spec.get("state", ()))
                                             or len(plan.get("outputs", spec["outputs"]))
                                             != len(spec["outputs"]) + len(spec.get("state", ()))
                                             or not set(plan["weights"]) <= set(spec["weights"])):
        problem = "its sharding plan does not match its inputs and weights"
    if not problem and any(int(k) >= n_out for k in spec.get("ragged_outputs", {})):
        problem = "a ragged output names an output it does not have"
    if not problem and spec.get("donate"):
        # a donated input's buffer becomes an output's: one of the same shape and dtype must exist
        outs = {(tuple(o["shape"]), o["dtype"]) for o in spec["outputs"]}
        ins = spec["inputs"]
        if any(i >= len(ins) or (tuple(ins[i]["shape"]), ins[i]["dtype"]) not in outs for i in spec["donate"]):
            problem = "a donated input has no output of its shape and dtype"
    if not problem and spec.get("state") and spec.get("ragged_outputs"):
        problem = "a program with state has ragged outputs"
    if problem:
        raise ArtifactError(f"{where} is corrupt: in the manifest, {problem}", hint="export the model again")
