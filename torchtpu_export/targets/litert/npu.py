"""Ahead-of-time compilation of ``.tflite`` files for phone NPUs, through LiteRT's own AOT path.

``ai_edge_litert.aot.aot_compile`` runs a vendor's compiler plugin on a flatbuffer and writes one
``.tflite`` per SoC, whose graph (or the part of it the NPU takes) becomes a ``DISPATCH_OP``
with the NPU's bytecode appended. Nothing here re-implements that: this module names the SoCs as
users type them (``qualcomm:SM8650``, ``qualcomm:all``), finds the vendor SDK's libraries, turns
each plugin failure into one message that names the SoC and what is missing, and refuses to
call a file compiled when the NPU took none of its ops.

Vendor SDKs: each vendor's compiler plugin ships in ``ai-edge-litert``; the SDK libraries it loads
come from ``ai-edge-litert-sdk-<vendor>``, which downloads them from the vendor's host when it is
installed. For Qualcomm, a QAIRT SDK folder named by ``QNN_SDK_ROOT`` works too, and so does
``<venv>/qairt`` (where ``make`` places the QNN libraries of the ``onnxruntime-qnn`` wheel for the
test suite).

Every file compiled here carries a digest: before compilation the model gets a metadata entry
``torchtpu_export_npu`` whose buffer is a fixed-size placeholder (a new root table put in front of
the model, whose bytes stay as they are). LiteRT's AOT path rewrites the flatbuffer but copies
metadata buffers byte for byte, so afterwards the placeholder is found in the compiled file and
overwritten in place with the sha256 of the whole file (the placeholder standing in for itself).
Nothing moves, so the DISPATCH_OPs' bytecode offsets stay right. The digest covers the NPU bytecode, the offsets
that say where it lies, the graph and the weights; :func:`require_digest` runs before any runtime is
handed a compiled file, because NPU runtimes (QNN's HTP included) trust the bytecode they load.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import io
import os
import re
import struct
import sys
import tempfile

from ...errors import ArtifactError, InputError, TteError

# vendor name as users type it -> (ai_edge_litert.aot.vendors module, SDK package, what the SDK is)
VENDORS = {
    "qualcomm": ("qualcomm", "ai-edge-litert-sdk-qualcomm", "Qualcomm's QAIRT (QNN) SDK"),
    "mediatek": ("mediatek", "ai-edge-litert-sdk-mediatek", "MediaTek's NeuroPilot SDK"),
    "google_tensor": ("google_tensor", "ai-edge-litert-sdk-google-tensor", "the Google Tensor ML SDK"),
    "samsung": ("samsung", "ai-edge-litert-sdk-samsung-nightly", "Samsung's Exynos AI Studio SDK"),
    "intel": ("intel_openvino", "ai-edge-litert-sdk-intel", "Intel's OpenVINO NPU runtime"),
}
_ALIASES = {"qnn": "qualcomm", "mtk": "mediatek", "tensor": "google_tensor", "google": "google_tensor",
            "exynos": "samsung", "intel_openvino": "intel", "openvino": "intel"}
QNN_LIB_SUBDIR = os.path.join("lib", "x86_64-linux-clang")  # a QAIRT SDK's host libraries


class NpuCompileError(TteError, RuntimeError):
    """A vendor's NPU compiler could not compile the model for a SoC (its SDK is missing, or the
    NPU takes none of the model's ops)."""

    exit_code = 4


def _vendor_modules(vendor: str):
    module = VENDORS[vendor][0]
    target = importlib.import_module(f"ai_edge_litert.aot.vendors.{module}.target")
    importlib.import_module(f"ai_edge_litert.aot.vendors.{module}.{module}_backend")  # registers the backend
    return target


def socs(vendor: str) -> list[str]:
    """The SoC names LiteRT's AOT path knows for a vendor."""
    return [m.value for m in _vendor_modules(vendor).SocModel if m.value != "ALL"]


def parse_targets(text: str) -> list:
    """``qualcomm:SM8650,qualcomm:SM8750`` or ``qualcomm:all`` -> ``ai_edge_litert.aot`` targets
    (one per SoC, in the order given, each once)."""
    examples = "e.g. qualcomm:SM8650, qualcomm:SM8550,qualcomm:SM8750 or qualcomm:all"
    out, seen = [], set()
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        vendor, _, soc = item.partition(":")
        vendor = _ALIASES.get(vendor.lower(), vendor.lower())
        if vendor not in VENDORS or not soc:
            raise InputError(f"bad SoC {item!r}: give VENDOR:SOC with VENDOR one of {', '.join(VENDORS)}",
                             hint=examples)
        module = _vendor_modules(vendor)
        known = socs(vendor)
        if soc.lower() == "all":
            chosen = known
        else:
            match = [k for k in known if k.lower() == soc.lower()]
            if not match:
                raise InputError(f"unknown {vendor} SoC {soc!r}; LiteRT's AOT path knows {', '.join(known)}",
                                 hint=f"or {vendor}:all")
            chosen = match
        for name in chosen:
            if (vendor, name) not in seen:
                seen.add((vendor, name))
                out.append(module.Target(module.SocModel(name)))
    if not out:
        raise InputError("no SoC given", hint=examples)
    return out


def _vendor_of(target) -> str:
    # our vendor name of an aot Target, by the vendor module that defines it (backend ids differ:
    # Google Tensor's is "GOOGLE")
    module = type(target).__module__.split(".")
    name = module[module.index("vendors") + 1] if "vendors" in module else target.backend_id()
    return next((v for v, (m, _, _) in VENDORS.items() if m == name), name)


def qnn_library_dirs() -> list[str]:
    """Folders holding QNN's host libraries (libQnnHtp.so, ...) other than the vendor SDK package:
    ``$QNN_SDK_ROOT/lib/x86_64-linux-clang``, then ``<venv>/qairt/lib/x86_64-linux-clang``."""
    dirs = []
    for root in (os.environ.get("QNN_SDK_ROOT"), os.path.join(sys.prefix, "qairt")):
        if root and os.path.isfile(os.path.join(root, QNN_LIB_SUBDIR, "libQnnHtp.so")):
            dirs.append(os.path.abspath(os.path.join(root, QNN_LIB_SUBDIR)))
    return dirs


@contextlib.contextmanager
def _library_path(dirs: list[str]):
    # the AOT tool runs the plugin in a subprocess whose LD_LIBRARY_PATH ends with ours
    old = os.environ.get("LD_LIBRARY_PATH")
    if dirs:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(dirs + ([old] if old else []))
    try:
        yield
    finally:
        if dirs:
            if old is None:
                os.environ.pop("LD_LIBRARY_PATH", None)
            else:
                os.environ["LD_LIBRARY_PATH"] = old


_LOG_FILE = re.compile(r"See (\S+\.error) for details")
_MISSING_LIB = re.compile(r"([\w.+-]+\.so(?:\.[\w.]+)?): cannot open shared object file")
_FAILED_LOAD = re.compile(r"Failed to load (\w+) shared library")
_QNN_OP = re.compile(r"could not create op: (?:q::)?([\w:]+)")
_QNN_NODE = re.compile(r'<E> "(.+?)(?:_LiteRt_OpId_\d+)?" generated: could not create op')


def _diagnose(target, error: str) -> str:
    """One line saying why a vendor's plugin failed for ``target``, from the AOT tool's log."""
    vendor = _vendor_of(target)
    _, package, sdk = VENDORS.get(vendor, (None, f"the {vendor} SDK package", f"the {vendor} SDK"))
    log = ""
    m = _LOG_FILE.search(error)
    if m:
        try:
            with open(m.group(1), errors="replace") as f:
                log = f.read(1 << 20)
            os.unlink(m.group(1))  # the tool leaves one in the temp folder per failure
        except OSError:
            pass
    lib = _MISSING_LIB.findall(log)
    # the plugin's own library names the SDK library it could not find (the plugin itself is found)
    missing = [x for x in lib if not x.startswith("libLiteRtCompilerPlugin")]
    where = (f"install {package}, which downloads {sdk} from the vendor's host"
             + (", or point QNN_SDK_ROOT at a QAIRT SDK" if vendor == "qualcomm" else ""))
    if missing:
        return f"{sdk} is missing: the compiler plugin cannot load {missing[0]} ({where})"
    m = _FAILED_LOAD.search(log)
    if m:
        return f"{sdk} is missing: the compiler plugin cannot load {m.group(1)} ({where})"
    if "Loaded 0 plugins" in log:
        return f"LiteRT could not load the {vendor} compiler plugin ({where})"
    m = _QNN_OP.search(log)
    if m:
        node = _QNN_NODE.search(log)
        return (f"the NPU compiler could not create op {m.group(1)}"
                + (f" ({node.group(1)})" if node else "") + " for this SoC")
    errors = [line.strip() for line in log.splitlines() if line.lstrip().startswith(("ERROR", "└"))]
    return errors[-1][:300] if errors else error.strip()[:300]


@dataclasses.dataclass
class SocResult:
    """What the NPU compiler did for one SoC."""

    target: object
    content: bytes
    ops_on_npu: int
    ops_total: int
    partitions: int

    @property
    def name(self) -> str:  # "Qualcomm_SM8650": LiteRT's name of the target, as in its file names
        return self.target.__repr__()


def compile_model(model, configs: list, *, keep_going: bool = False):
    """``ai_edge_litert.aot.aot_compile`` on ``model`` (bytes or a path) for ``configs`` (aot
    ``Target``s or ``CompilationConfig``s); returns its ``CompilationResult`` with every model in
    memory. A SoC whose plugin fails, or whose NPU takes no op, raises NpuCompileError (naming every
    such SoC) unless ``keep_going``, which leaves them in ``failed_backends``. Each compiled model
    carries its digest (see the module's docstring); a CPU fallback is ``model`` as given."""
    from ai_edge_litert.aot import aot_compile
    from ai_edge_litert.aot.core import aot_types
    from ai_edge_litert.aot.vendors import fallback_backend

    configs = [c if isinstance(c, aot_types.CompilationConfig) else aot_types.CompilationConfig(target=c)
               for c in configs]
    for c in configs:
        if c.target.backend_id() == "all":  # every vendor LiteRT has, registered
            for vendor in VENDORS:
                _vendor_modules(vendor)
        elif not isinstance(c.target, fallback_backend.FallbackTarget) and _vendor_of(c.target) in VENDORS:
            _vendor_modules(_vendor_of(c.target))
    if isinstance(model, (str, os.PathLike)):
        with open(model, "rb") as f:
            model = f.read()
    original, model = model, _with_digest_slot(model)
    qnn_dirs = qnn_library_dirs() if any(c.target.backend_id() in ("qualcomm", "all") for c in configs) else []
    with tempfile.TemporaryDirectory(prefix="tte-npu-") as tmp, _library_path(qnn_dirs), \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = aot_compile.aot_compile(aot_types.Model.create_from_bytes(model), output_dir=tmp,
                                         config=configs, keep_going=True)
        result.load()  # into memory before the folder goes
    result.failed_backends[:] = [(backend, _diagnose(backend.target, err)) for backend, err in result.failed_backends]
    failures = [(backend.target, why) for backend, why in result.failed_backends]
    kept = []
    for backend, m in result.models_with_backend:
        stats = getattr(m, "partition_stats", None)
        subgraphs = stats.subgraph_stats if stats is not None else []
        if backend.id() == "fallback":
            m.set_bytes(original)  # the CPU model as it was given, without the digest's placeholder
            kept.append((backend, m))
            continue
        offloaded = not subgraphs or any(s.num_ops_offloaded for s in subgraphs)
        sealed = _seal(m.model_bytes) if offloaded else None
        if sealed is not None:
            m.set_bytes(sealed)
            kept.append((backend, m))
            continue
        failures.append((backend.target, "LiteRT's AOT path did not keep the placeholder of the file's digest (a "
                                         "metadata buffer): this LiteRT is not one torchtpu-export knows" if offloaded
                         else "the NPU took none of the model's ops (the file would run on the CPU only)"))
        result.failed_backends.append((backend, failures[-1][1]))
    result.models_with_backend[:] = kept
    if failures and not keep_going:
        lines = [f"{t!r}: {why}" for t, why in failures]
        raise NpuCompileError(f"NPU compilation failed for {len(failures)} SoC{'s' if len(failures) > 1 else ''}: "
                              + "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else ""),
                              hint="nothing was written: fix this and compile again, or leave these SoCs out"
                              if len(configs) > len(failures) else None)
    return result


def soc_results(result) -> list[SocResult]:
    """Per compiled SoC (the CPU fallback left out): its bytes and how many ops its NPU runs."""
    out = []
    for backend, m in result.models_with_backend:
        if backend.id() == "fallback":
            continue
        stats = m.partition_stats.subgraph_stats if getattr(m, "partition_stats", None) else []
        out.append(SocResult(backend.target, m.model_bytes, sum(s.num_ops_offloaded for s in stats),
                             sum(s.num_total_ops for s in stats), sum(s.num_partitions_offloaded for s in stats)))
    return out


# ---- compiled files: what inspect shows ----------------------------------------------------

def dispatch_ops(model, content: bytes) -> list[dict]:
    """The DISPATCH_OPs of a validated flatbuffer: subgraph, partition name and the NPU bytecode's
    span, checked to lie inside the file."""
    try:
        return _dispatch_ops(model, content)
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - validate() leaves opcode tables unread: damage fails in their readers
        raise ArtifactError(f"the TFLite flatbuffer's operators are damaged ({type(e).__name__}: {str(e)[:120]})",
                            hint="compile or download the model again") from None


def _dispatch_ops(model, content: bytes) -> list[dict]:
    from flatbuffers import flexbuffers

    from .artifact import opcode_names
    codes = opcode_names(model)
    found = []
    for k in range(model.SubgraphsLength()):
        sub = model.Subgraphs(k)
        for j in range(sub.OperatorsLength()):
            op = sub.Operators(j)
            if codes[op.OpcodeIndex()] != "CUSTOM:DISPATCH_OP":
                continue
            try:
                opts = flexbuffers.Loads(bytes(op.CustomOptionsAsNumpy())) if op.CustomOptionsLength() else {}
                offset, size = int(opts["bytecode_offset"]), int(opts["bytecode_size"])
                name = opts.get("name", "")
                name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            except Exception as e:  # noqa: BLE001 - a damaged options map, whatever flexbuffers raised
                raise ArtifactError(f"subgraph {k} operator {j}: DISPATCH_OP options are unreadable "
                                    f"({type(e).__name__}: {str(e)[:120]})") from None
            if not (0 < offset and 0 < size and offset + size <= len(content)):
                raise ArtifactError(f"subgraph {k} operator {j}: the NPU bytecode ({size} bytes at {offset}) "
                                    f"lies outside the file ({len(content)} bytes)")
            found.append({"subgraph": k, "operator": j, "name": name, "bytecode_offset": offset,
                          "bytecode_size": size,  # tensor indices as ints: inspect --json prints them
                          "inputs": [int(i) for i in op.InputsAsNumpy()] if op.InputsLength() else [],
                          "outputs": [int(i) for i in op.OutputsAsNumpy()] if op.OutputsLength() else []})
    return found


def soc_stamp(content: bytes, model) -> tuple[str, str] | None:
    """(manufacturer, SoC) from the ``LiteRtStamp`` metadata the AOT tool writes, if present."""
    for i in range(model.MetadataLength()):
        md = model.Metadata(i)
        if md.Name() != b"LiteRtStamp":
            continue
        b = model.Buffers(md.Buffer())
        raw = bytes(b.DataAsNumpy()) if b.DataLength() else content[b.Offset():b.Offset() + b.Size()]
        parts = [p.decode(errors="replace") for p in raw.split(b"\0") if p]
        return (parts[0], parts[1]) if len(parts) >= 2 else None
    return None


# ---- the digest of a compiled file ---------------------------------------------------------

DIGEST_NAME = "torchtpu_export_npu"  # the metadata entry
_DIGEST_PREFIX = b"torchtpu-export npu sha256 v1 "
_DIGEST_PENDING = _DIGEST_PREFIX + b"-" * 64  # what the digest's bytes are while it is computed
_CHUNK = 64 << 20
_ALIGN = 64  # the head put before a model keeps its data's alignment
_MODEL_FIELDS = 10  # the Model table's fields in LiteRT's schema (version ... external_buffers)
_BUFFERS, _METADATA = 4, 6  # their field numbers
_BUFFER_OFFSET_SLOT = 6  # Buffer.offset: where data past a 2 GB flatbuffer starts, from the file's start


def _with_digest_slot(content) -> bytes:
    """The flatbuffer with a ``torchtpu_export_npu`` metadata entry whose buffer is the digest's placeholder.

    No byte of the model is rewritten: a new root Model table goes in front of it, a copy of the old
    one's fields whose buffers and metadata vectors have the new entry too (an earlier entry of that
    name left out). Offsets in a flatbuffer are relative, so the old tables still read the same; only
    data kept after a 2 GB flatbuffer is addressed from the file's start, and those offsets move with it."""
    from .artifact import validate
    model = validate(content)
    if dispatch_ops(model, content):
        raise InputError("the model is already compiled for an NPU (it has DISPATCH_OPs)",
                         hint="compile the CPU .tflite it was made from")
    old_entries = [j for j in range(model.MetadataLength()) if model.Metadata(j).Name() != DIGEST_NAME.encode()]
    try:
        out = _prefix_digest_slot(content, old_entries)
    except (struct.error, ValueError, IndexError) as e:
        raise ArtifactError(f"the TFLite flatbuffer's root table is damaged ({type(e).__name__}: {str(e)[:120]})",
                            hint="convert or download the model again") from None
    slot = _digest_slot(validate(out), out)  # what LiteRT is given reads as the model it was
    if slot is None or out[slot[0]:slot[0] + slot[1]] != _DIGEST_PENDING:
        raise ArtifactError("the model's metadata could not take the digest's placeholder",
                            hint="convert the model again")
    return out


def _prefix_digest_slot(content, old_entries: list[int]) -> bytes:
    u16 = lambda pos: struct.unpack_from("<H", content, pos)[0]  # noqa: E731
    u32 = lambda pos: struct.unpack_from("<I", content, pos)[0]  # noqa: E731
    root = u32(0)
    vtable = root - struct.unpack_from("<i", content, root)[0]
    fields = []  # the old Model's field i: where its value is, or None
    for i in range(_MODEL_FIELDS):
        at = u16(vtable + 4 + 2 * i) if 4 + 2 * i < u16(vtable) else 0
        fields.append(root + at if at else None)

    def elements(i):  # where the tables of the old vector field i are
        if fields[i] is None:
            return []
        vec = fields[i] + u32(fields[i])
        return [vec + 4 + 4 * j + u32(vec + 4 + 4 * j) for j in range(u32(vec))]

    buffers = elements(_BUFFERS)
    keep = set(old_entries)
    metadata = [m for j, m in enumerate(elements(_METADATA)) if j in keep]

    head = bytearray(8)
    links: list[tuple[int, int, bool]] = []  # (where a uoffset goes, what it points at, in the old model?)

    def put(data: bytes, align: int = 4, before: int = 0) -> int:  # appends data, its first `before` bytes unaligned
        head.extend(b"\0" * (-(len(head) + before) % align))
        head.extend(data)
        return len(head) - len(data)

    n_table = 4 + 4 * _MODEL_FIELDS
    vt = put(struct.pack(f"<HH{_MODEL_FIELDS}H", 4 + 2 * _MODEL_FIELDS, n_table,
                         *[4 + 4 * i if fields[i] is not None or i in (_BUFFERS, _METADATA) else 0
                           for i in range(_MODEL_FIELDS)]))
    table = put(b"\0" * n_table)
    struct.pack_into("<i", head, table, table - vt)
    struct.pack_into("<I", head, 0, table)
    head[4:8] = b"TFL3"
    if fields[0] is not None:  # version, the only scalar
        struct.pack_into("<I", head, table + 4, u32(fields[0]))
    for i in range(1, _MODEL_FIELDS):
        if fields[i] is not None and i not in (_BUFFERS, _METADATA):
            links.append((table + 4 + 4 * i, fields[i] + u32(fields[i]), True))

    def vector(field: int, old: list[int]) -> int:  # the old tables, then one slot for the new one
        vec = put(struct.pack("<I", len(old) + 1) + b"\0" * 4 * (len(old) + 1))
        links.append((table + 4 + 4 * field, vec, False))
        links.extend((vec + 4 + 4 * j, t, True) for j, t in enumerate(old))
        return vec + 4 + 4 * len(old)

    new_buffer, new_entry = vector(_BUFFERS, buffers), vector(_METADATA, metadata)
    vt = put(struct.pack("<HHH", 6, 8, 4))  # Buffer {data}
    buf = put(struct.pack("<iI", 0, 0))
    struct.pack_into("<i", head, buf, buf - vt)
    links.append((new_buffer, buf, False))
    data = put(struct.pack("<I", len(_DIGEST_PENDING)) + _DIGEST_PENDING, 16, before=4)  # data 16-aligned
    links.append((buf + 4, data, False))
    vt = put(struct.pack("<HHHH", 8, 12, 4, 8))  # Metadata {name, buffer}
    entry = put(struct.pack("<iII", 0, 0, len(buffers)))
    struct.pack_into("<i", head, entry, entry - vt)
    links.append((new_entry, entry, False))
    name = put(struct.pack("<I", len(DIGEST_NAME)) + DIGEST_NAME.encode() + b"\0")
    links.append((entry + 4, name, False))
    put(b"", _ALIGN)
    shift = len(head)
    for at, target, old in links:
        struct.pack_into("<I", head, at, target + (shift if old else 0) - at)

    moved = []  # Buffer.offset fields (data after the flatbuffer), each once
    for t in set(buffers):
        bvt = t - struct.unpack_from("<i", content, t)[0]
        at = u16(bvt + _BUFFER_OFFSET_SLOT) if _BUFFER_OFFSET_SLOT < u16(bvt) else 0
        if at and struct.unpack_from("<Q", content, t + at)[0] > 1:
            moved.append(t + at)
    if not moved:
        return bytes(head) + bytes(content)
    out = bytearray(head) + content
    for at in moved:
        struct.pack_into("<Q", out, shift + at, struct.unpack_from("<Q", content, at)[0] + shift)
    return bytes(out)


def _digest_slot(model, content) -> tuple[int, int] | None:
    # (start, size) of the digest's bytes in a validated flatbuffer; ArtifactError if named twice
    from ... import flatbuf
    found = [model.Metadata(i).Buffer() for i in range(model.MetadataLength())
             if model.Metadata(i).Name() == DIGEST_NAME.encode()]
    if not found:
        return None
    if len(found) > 1:
        raise ArtifactError(f"the file has {len(found)} torchtpu-export NPU digests; a compiled file has one",
                            hint="compile the CPU .tflite again")
    buf = model.Buffers(found[0])
    if buf.Offset() > 1:
        return buf.Offset(), buf.Size()
    n = buf.DataLength()
    return (flatbuf.vector_start(buf, 4), n) if n else (0, 0)


def _file_digest(content, start: int) -> bytes:
    # sha256 of the file with the placeholder in place of the digest's bytes, a chunk at a time
    h = hashlib.sha256()
    view = memoryview(content)
    try:
        end = start + len(_DIGEST_PENDING)
        for a, b in ((0, start), (end, len(content))):
            if a == end:
                h.update(_DIGEST_PENDING)
            for c in range(a, b, _CHUNK):
                h.update(view[c:min(c + _CHUNK, b)])
    finally:
        view.release()
    return h.hexdigest().encode()


def _seal(content: bytes) -> bytes | None:
    """A compiled file with its digest written in place of the placeholder; None without one."""
    from .artifact import validate
    slot = _digest_slot(validate(content), content)
    if slot is None or content[slot[0]:slot[0] + slot[1]] != _DIGEST_PENDING:
        return None
    start, n = slot
    return content[:start] + _DIGEST_PREFIX + _file_digest(content, start) + content[start + n:]


def digest_state(content, model) -> str:
    """``"ok"``, ``"mismatch"`` (the file changed after torchtpu-export compiled it) or ``"absent"``
    (no digest: compiled by another tool) for a validated flatbuffer ``model`` of ``content``."""
    try:
        slot = _digest_slot(model, content)
    except ArtifactError:
        return "mismatch"
    if slot is None:
        return "absent"
    start, n = slot
    if n != len(_DIGEST_PENDING) or content[start:start + len(_DIGEST_PREFIX)] != _DIGEST_PREFIX:
        return "mismatch"
    recorded = bytes(content[start + len(_DIGEST_PREFIX):start + n])
    return "ok" if recorded == _file_digest(content, start) else "mismatch"


_UNVERIFIED_HINT = ("compile the CPU .tflite with torchtpu-export (compile model.tflite --soc ...), which writes "
                   "the digest; for a file you trust, EdgeModel.run_flat(..., allow_unverified_npu=True)")


def require_digest(state: str, *, allow_unverified: bool = False) -> None:
    """Refuses (ArtifactError) a compiled file whose :func:`digest_state` is ``"mismatch"``, and one
    without a digest (``"absent"``) unless ``allow_unverified``: NPU runtimes run the bytecode they are
    given unchecked."""
    if state == "mismatch":
        raise ArtifactError("the NPU-compiled file was changed after compilation: it does not match the digest "
                            "torchtpu-export wrote when it compiled it (NPU bytecode, its offsets or the graph)",
                            hint="compile the CPU .tflite again, or download the compiled file again")
    if state == "absent" and not allow_unverified:
        raise ArtifactError("the NPU-compiled file has no torchtpu-export digest (another tool compiled it, or "
                            "the digest was removed), so its NPU bytecode cannot be checked before a runtime "
                            "loads it", hint=_UNVERIFIED_HINT)
