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
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import re
import sys
import tempfile

from .errors import InputError, TteError

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
    such SoC) unless ``keep_going``, which leaves them in ``failed_backends``."""
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
        if backend.id() != "fallback" and subgraphs and not any(s.num_ops_offloaded for s in subgraphs):
            failures.append((backend.target, "the NPU took none of the model's ops (the file would run on "
                                             "the CPU only)"))
            result.failed_backends.append((backend, failures[-1][1]))
        else:
            kept.append((backend, m))
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
    from .litert_format import opcode_names
    from flatbuffers import flexbuffers
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
                from .errors import ArtifactError
                raise ArtifactError(f"subgraph {k} operator {j}: DISPATCH_OP options are unreadable ({e})") from e
            if not (0 < offset and 0 < size and offset + size <= len(content)):
                from .errors import ArtifactError
                raise ArtifactError(f"subgraph {k} operator {j}: the NPU bytecode ({size} bytes at {offset}) "
                                    f"lies outside the file ({len(content)} bytes)")
            found.append({"subgraph": k, "operator": j, "name": name, "bytecode_offset": offset,
                          "bytecode_size": size, "inputs": list(op.InputsAsNumpy()) if op.InputsLength() else [],
                          "outputs": list(op.OutputsAsNumpy()) if op.OutputsLength() else []})
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
