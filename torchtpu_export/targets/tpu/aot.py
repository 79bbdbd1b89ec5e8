"""Ahead-of-time TPU compilation with libtpu: no TPU is needed to know that a TPU accepts a program.

libtpu (``pip install 'torchtpu-export[tpu]'``, i.e. ``jax[tpu]``) describes TPU slices by name
(``v5e:2x2``, ``v6e:2x2``, ``v5p:2x2x1``, ``v4:2x2x1``) through ``jax.experimental.topologies``;
``jit(...).lower(lowering_platforms=("tpu",)).compile()`` then runs the real TPU compiler for
them on any machine. That gives three things this module provides:

- ``compile_exported``: a ``jax.export.Exported`` compiled for a topology (with the program's
  recorded shardings, at concrete shapes for dynamic programs);
- ``stats``: what the compiler says: HBM bytes (arguments, outputs, temporaries, code), FLOPs,
  bytes accessed, and a roofline estimate from the generation's published figures;
- ``serialize`` / ``load_executable``: the executable's bytes, and loading them back on a TPU
  host through an unpickler that only builds the handful of jax classes an executable holds.

Only numbers and speed need a real TPU.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import io
import logging
import math
import os
import pickle
import re

from ...errors import ArtifactError, ConversionError, InputError
from .artifact import donated

log = logging.getLogger("torchtpu_export")

DEFAULT_TOPOLOGIES = ("v5e:2x2", "v6e:2x2")


@dataclasses.dataclass(frozen=True)
class Generation:
    """Per-chip figures Google publishes for a TPU generation (docs.cloud.google.com/tpu/docs/<name>)."""

    name: str
    device_kind: str          # what jax reports as device.device_kind
    hbm_bytes: int
    hbm_bytes_per_s: float
    peak_bf16_flops: float    # per chip, dense bfloat16 on the MXUs
    peak_int8_ops: float

    def roofline_seconds(self, flops: float, bytes_accessed: float, dtype: str = "bf16") -> float:
        peak = self.peak_int8_ops if dtype == "int8" else self.peak_bf16_flops
        return max(flops / peak, bytes_accessed / self.hbm_bytes_per_s)


_GB, _GIB = 10 ** 9, 1 << 30
GENERATIONS = {g.name: g for g in (
    Generation("v4", "TPU v4", 32 * _GIB, 1200e9, 275e12, 275e12),
    Generation("v5e", "TPU v5 lite", 16 * _GB, 819e9, 197e12, 393e12),
    Generation("v5p", "TPU v5", 95 * _GB, 2765e9, 459e12, 918e12),
    Generation("v6e", "TPU v6 lite", 32 * _GB, 1638e9, 918e12, 1836e12),
)}
_BY_KIND = {g.device_kind: g for g in GENERATIONS.values()}


# Google's PCI vendor id and its TPU device ids (v3, v4, v5p, v5e, v6e, 7x), as jax's hardware_utils lists them
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}


def tpu_chips_attached() -> int:
    """How many TPU chips this host has: a PCI scan like jax's (without importing jax), or the
    device nodes TPU VMs have."""
    chips = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "device")) as f:
                chips += f.read().strip() in _TPU_PCI_DEVICES
        except OSError:
            continue
    return chips or len(glob.glob("/dev/accel[0-9]*")) + len(glob.glob("/dev/vfio/[0-9]*"))


@functools.cache
def prepare_environment() -> None:
    """On a host without TPU chips, tell libtpu so before it loads (once per process).

    Without this, every process that starts jax with libtpu installed prints libtpu's failed
    attempts to find a TPU, and a second process cannot load libtpu at all (its lockfile
    guards chips this host does not have). Settings already in the environment are kept.
    """
    if importlib.util.find_spec("libtpu") is None or tpu_chips_attached():
        return
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                       ("TPU_ACCELERATOR_TYPE", "v5litepod-4"), ("TPU_WORKER_ID", "0"),
                       ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(key, value)


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None without libtpu."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def require_libtpu(why: str) -> str:
    v = libtpu_version()
    if v is None:
        raise InputError(f"{why} needs libtpu, the TPU compiler, which is not installed",
                         hint="pip install 'torchtpu-export[tpu]' (jax[tpu] at the pinned jax version)")
    return v


def parse_topologies(spec) -> tuple[str, ...]:
    """``"v5e:2x2,v6e-8,v5e"`` or a sequence of names -> their canonical ``GEN:LAYOUT`` names."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s and s.strip()]
    if not names:
        raise InputError("no TPU topology given", hint="e.g. v5e:2x2 or v5e:2x2,v6e:2x2")
    return tuple(dict.fromkeys(canonical_topology(name) for name in names))


# Cloud TPU accelerator types: v5e/v6e count chips (v5litepod-32: 32 chips), v5p/v4 count TensorCores,
# two per chip (v5p-128: 64 chips); the slice shapes Google documents for each size
_LAYOUTS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_LAYOUTS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
               512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SINGLE = {"v5e": "1x1", "v6e": "1x1", "v5p": "2x2x1", "v4": "2x2x1"}  # a generation alone: one chip, or a host
_TOPOLOGY_FORMS = ("a generation (v5e, v6e: one chip; v5p, v4: one host), GEN:LAYOUT in chips per dimension "
                   "(v5e:1x1, v5e:2x4, v6e:8x8, v5p:2x2x4, v4:2x2x1), or a Cloud TPU accelerator type "
                   "(v5litepod-1, v5litepod-32, v6e-8, v5p-128, v4-8)")


def canonical_topology(name: str) -> str:
    """A TPU slice as users name it (``v5e``, ``v5e:1x1``, ``v5litepod-32``, ``v6e-8``, ``v5p-128``) as
    libtpu's ``GEN:LAYOUT`` (``v5e:1x1``, ``v5e:4x8``, ``v6e:2x4``, ``v5p:4x4x4``)."""
    text = str(name).strip().lower()
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)", text)
    if m:
        return f"{text}:{_SINGLE[text]}"
    m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d{1,4}(?:x\d{1,4}){1,2})", text)
    if m:
        gen, layout = m.groups()
        dims = [int(d) for d in layout.split("x")]
        flat = gen in ("v5e", "v6e")
        if len(dims) != (2 if flat else 3) or min(dims) < 1:
            raise InputError(f"TPU topology {name!r}: {gen} layouts have {2 if flat else 3} dimensions of at least "
                             f"1 chip, e.g. {gen}:{'2x2' if flat else '2x2x1'}", hint=_TOPOLOGY_FORMS)
        return f"{gen}:{layout}"
    m = re.fullmatch(r"(v5litepod|v5e|v6e|v5p|v4)-(\d{1,5})", text)
    if m:
        kind, count = m.group(1), int(m.group(2))
        gen = "v5e" if kind == "v5litepod" else kind
        if gen in ("v5e", "v6e"):
            layout = _LAYOUTS_2D.get(count)
        else:  # TensorCores: two per chip
            layout = _LAYOUTS_3D.get(count // 2) if count % 2 == 0 else None
        if layout is None:
            sizes = sorted(_LAYOUTS_2D) if gen in ("v5e", "v6e") else sorted(2 * n for n in _LAYOUTS_3D)
            raise InputError(f"TPU topology {name!r}: {kind} comes in sizes {', '.join(map(str, sizes))}",
                             hint=_TOPOLOGY_FORMS)
        return f"{gen}:{layout}"
    raise InputError(f"unknown TPU topology {str(name)[:80]!r}", hint=_TOPOLOGY_FORMS)


def host_bounds(canonical: str) -> tuple[int, int, int] | None:
    """The chips-per-host bounds libtpu needs for a slice (None: its default, 2x2x1): the layout itself
    for slices smaller than a host, and 2x4 for the 8-chip v5e/v6e hosts (v5litepod-8, v6e-8)."""
    gen, layout = canonical.split(":")
    dims = [int(d) for d in layout.split("x")]
    chips = math.prod(dims)
    if chips < 4:
        return (*dims, 1) if len(dims) == 2 else tuple(dims)
    if gen in ("v5e", "v6e") and dims in ([2, 4], [4, 2]):
        return (dims[0], dims[1], 1)
    return None


def generation(topology_name: str) -> Generation:
    return GENERATIONS[canonical_topology(topology_name).split(":", 1)[0]]


def generation_of_device_kind(kind: str) -> Generation | None:
    return _BY_KIND.get(kind)


@functools.lru_cache(maxsize=None)
def topology(name: str):
    """libtpu's description of a TPU slice (its devices stand for the chips)."""
    name = canonical_topology(name)
    require_libtpu(f"compiling for {name}")
    prepare_environment()
    from jax.experimental import topologies
    bounds = host_bounds(name)
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu",
                                            **({"chips_per_host_bounds": bounds} if bounds else {}))
    except Exception as e:  # libtpu's message says which layouts it takes
        raise InputError(f"libtpu cannot describe TPU topology {name!r}: {str(e).splitlines()[0][:300]}",
                         hint="layouts are chips per dimension, e.g. v5e:2x2, v6e:2x4, v5p:2x2x1") from e


def slice_size(name: str) -> tuple[int, int]:
    """(chips, hosts) of a topology, as libtpu describes it (v4 counts each TensorCore as a device)."""
    devices = list(topology(name).devices)
    return len(devices), len({d.process_index for d in devices})


def with_chips(name: str, count: int) -> str | None:
    """``name`` if its slice has ``count`` chips or more, else the smallest documented slice of the same
    generation that has (None: there is none)."""
    if slice_size(name)[0] >= count:
        return name
    gen = canonical_topology(name).split(":", 1)[0]
    layouts = _LAYOUTS_2D if gen in ("v5e", "v6e") else _LAYOUTS_3D
    size = min((n for n in layouts if n >= count), default=None)
    return None if size is None else f"{gen}:{layouts[size]}"


def devices_for(name: str, count: int) -> list:
    devices = list(topology(name).devices)
    if count > len(devices):
        raise InputError(f"the program needs {count} chips; TPU topology {name} has {len(devices)}",
                         hint=f"choose a topology with at least {count} chips, e.g. v5e:2x4 for 8")
    return devices[:count]


class CompileError(ConversionError):
    """The TPU compiler rejected a program; the message is the compiler's."""

    def __init__(self, message: str):
        super().__init__(message, hint=_hint(message))


def _hint(message: str) -> str:
    if any(t in message for t in ("f64", "F64", "c128", "C128")):
        # float64 compiles on TPUs (emulated, slowly) except where the compiler has no such kernel
        return ("the TPU compiler has no float64 kernel for this op (FFT and LU-based linear algebra): "
                "export with narrow_64bit=True (--narrow-64bit) to compute in float32")
    return "export with kernels='xla' if the message names a Pallas kernel; otherwise please report it"


def compiler_message(e: BaseException, limit: int = 1500) -> str:
    """The compiler's own words: the first lines of its error, without Python's framing."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    text = "\n".join(lines[:12])
    return text if len(text) <= limit else text[:limit] + " ..."


def compile_exported(exported, topology_name: str, *, uses_x64: bool, mesh_axes=None, shardings=None,
                     dims: dict | None = None, donate: tuple = ()):
    """Compiles one program for a TPU topology; raises CompileError with the compiler's message.

    ``mesh_axes`` (``{"data": 1, "model": 4}``) and ``shardings`` (the manifest's plan: weight name
    -> partition spec, and one spec per input) place a sharded program on that many chips.
    ``dims`` gives dynamic dimensions their values (default: their upper bounds). ``donate``: the
    positions of inputs whose buffers the program may reuse for its outputs (a KV cache updated in place).
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
    import numpy as np

    if mesh_axes:
        need = math.prod(mesh_axes.values())
        mesh = Mesh(np.array(devices_for(topology_name, need)).reshape(tuple(mesh_axes.values())),
                    tuple(mesh_axes))
        weight_specs = (shardings or {}).get("weights", {})
        input_specs = (shardings or {}).get("inputs", [])

        def sharding(kind, key):
            spec = weight_specs.get(key) if kind == "weight" else (
                input_specs[key] if key < len(input_specs) else None)
            return NamedSharding(mesh, PartitionSpec(*(spec or ())))
    else:
        device = SingleDeviceSharding(devices_for(topology_name, 1)[0])

        def sharding(kind, key):
            return device
    with jax.enable_x64(uses_x64):
        (weights, *inputs), _ = jax.tree_util.tree_unflatten(exported.in_tree, list(exported.in_avals))
        wspecs = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding("weight", n)) for n, a in weights.items()}
        ispecs = [jax.ShapeDtypeStruct(concrete_shape(a.shape, dims), a.dtype, sharding=sharding("input", i))
                  for i, a in enumerate(inputs)]
        try:
            call = jax.jit(exported.call, donate_argnums=tuple(1 + int(i) for i in donate))
            return call.trace(wspecs, *ispecs).lower(lowering_platforms=("tpu",)).compile()
        except Exception as e:
            raise CompileError(compiler_message(e)) from e


def concrete_shape(shape, dims: dict | None) -> tuple:
    """A jax.export symbolic shape with each dimension's value from ``dims`` (a name -> int map)."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
            continue
        try:
            out.append(int(d))
            continue
        except Exception:  # a symbolic dimension
            pass
        name = str(d)
        if not dims or name not in dims:
            raise InputError(f"dynamic dimension {name!r} needs a value to compile for a TPU",
                             hint="export with dynamic dims that have an upper bound (Dim(..., max=N))")
        out.append(int(dims[name]))
    return tuple(out)


_COLLECTIVE = re.compile(r"^(.*?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start|-done)?\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}


def collectives(hlo_text: str) -> dict:
    """Bytes each chip receives from collectives per run of a compiled program, by kind (the result
    shapes of every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute in the
    compiled HLO; an async pair counted once, at its -done; an op inside a loop counted once)."""
    out: dict = {}
    for line in hlo_text.splitlines():
        lhs, eq, rhs = line.partition(" = ")
        m = _COLLECTIVE.match(rhs) if eq else None
        if m is None or m.group(3) == "-start":
            continue
        size = 0
        for dt, dims in _ARRAY.findall(m.group(1)):
            item = _ITEM_BYTES.get(dt) or max(1, int(dt[1:]) // 8)
            size += item * math.prod(int(d) for d in dims.split(",") if d)
        entry = out.setdefault(m.group(2), {"ops": 0, "bytes": 0})
        entry["ops"] += 1
        entry["bytes"] += size
    return out


def cost_of(compiled) -> dict:
    """The compiler's cost analysis of a compiled program ("flops", "bytes accessed", ...)."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per executable
        cost = cost[0] if cost else {}
    return cost


def stats(compiled, generation_: Generation, dtype: str = "bf16") -> dict:
    """What the compiler says about a program on one chip of ``generation_``."""
    mem = compiled.memory_analysis()
    cost = cost_of(compiled)
    arg = int(mem.argument_size_in_bytes)
    out = int(mem.output_size_in_bytes)
    alias = int(mem.alias_size_in_bytes)
    temp = int(mem.temp_size_in_bytes)
    code = int(mem.generated_code_size_in_bytes)
    hbm = arg + out - alias + temp + code
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    try:
        comms = collectives(compiled.as_text())
    except Exception:  # noqa: BLE001 (the HLO text is informative; its absence is not an error)
        comms = {}
    return {
        "generation": generation_.name,
        "collectives": comms,
        "hbm_bytes": {"arguments": arg, "outputs": out, "aliased": alias, "temporaries": temp, "code": code,
                      "total": hbm},
        "hbm_capacity_bytes": generation_.hbm_bytes,
        "fits": hbm <= generation_.hbm_bytes,
        "flops": flops,
        "transcendentals": float(cost.get("transcendentals", 0.0)),
        "bytes_accessed": accessed,
        "roofline": {"seconds": generation_.roofline_seconds(flops, accessed, dtype), "dtype": dtype,
                     "peak_flops": generation_.peak_int8_ops if dtype == "int8" else generation_.peak_bf16_flops,
                     "hbm_bytes_per_s": generation_.hbm_bytes_per_s,
                     "bound": "compute" if flops / (generation_.peak_int8_ops if dtype == "int8"
                                                    else generation_.peak_bf16_flops)
                     >= accessed / generation_.hbm_bytes_per_s else "memory"},
    }


def describe_stats(s: dict) -> str:
    """One line for people: HBM use and fit, FLOPs, bytes, the roofline estimate."""
    hbm = s["hbm_bytes"]
    fit = "fits" if s["fits"] else "does NOT fit"
    roof = s["roofline"]
    return (f"HBM {_human(hbm['total'])} ({fit} in {_human(s['hbm_capacity_bytes'])}: args {_human(hbm['arguments'])}, "
            f"out {_human(hbm['outputs'])}, temp {_human(hbm['temporaries'])}, code {_human(hbm['code'])}"
            + (f", aliased in place {_human(hbm['aliased'])}" if hbm.get("aliased") else "") + "); "
            f"{s['flops'] / 1e9:.3g} GFLOP, {_human(s['bytes_accessed'])} accessed; roofline "
            f"{_seconds(roof['seconds'])} ({roof['bound']}-bound at {roof['dtype']} peak)"
            + (("; collectives " + ", ".join(f"{k} {v['ops']}x {_human(v['bytes'])}"
                                             for k, v in sorted(s["collectives"].items())) + " per chip per run")
               if s.get("collectives") else ""))


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _seconds(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


# ---- executables ---------------------------------------------------------------------------

def serialize(compiled) -> bytes:
    """The executable's bytes (jax's serialized form; the pytrees are rebuilt from the program on load)."""
    from jax.experimental import serialize_executable
    blob, _, _ = serialize_executable.serialize(compiled)
    return blob


# Everything a serialized executable may build: jax's own classes for its metadata (shapes,
# shardings, layouts, argument info), no callable of any other module. An executable is native
# code for the TPU, so load only artifacts you trust; this only keeps the container from
# running Python of the file's choosing.
_EXECUTABLE_CLASSES = frozenset({
    ("jax", "P"), ("jax._src.core", "ManualAxisType"), ("jax._src.core", "MemorySpace"),
    ("jax._src.core", "ShapedArray"), ("jax._src.interpreters.pxla", "AllArgsInfo"),
    ("jax._src.interpreters.pxla", "UnloadedMeshExecutable"), ("jax._src.layout", "Layout"),
    ("jax._src.linear_util", "DebugInfo"), ("jax._src.mesh", "AbstractDevice"), ("jax._src.mesh", "AbstractMesh"),
    ("jax._src.mesh", "AxisType"), ("jax._src.mesh", "Mesh"), ("jax._src.named_sharding", "_unpickle_named_sharding"),
    ("jax._src.sharding_impls", "_unpickle_single_device_sharding"), ("jax._src.stages", "ArgInfo"),
    ("jaxlib._jax", "DeviceList"), ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.multiarray", "_reconstruct"),
})


def load_executable(blob: bytes, exported, *, uses_x64: bool, devices: list, trees=None):
    """A stored executable, loaded for ``devices`` (the local TPU chips), callable like ``jit(exported.call)``
    (or with ``trees``, its ``(input tree, output tree)``: the engine's calls, whose trees are its own).

    The container is unpickled with a class allow-list: a file that names anything else is
    refused (ArtifactError), before any of it runs.
    """
    import jax
    from jax.experimental import serialize_executable as se

    class Restricted(se._JaxPjrtUnpickler):
        def find_class(self, module, name):
            if (module, name) not in _EXECUTABLE_CLASSES:
                raise pickle.UnpicklingError(f"refusing {module}.{name} in a stored executable")
            return super().find_class(module, name)

    backend = devices[0].client
    with jax.enable_x64(uses_x64):
        try:
            unloaded, args_info_flat, no_kwargs = Restricted(io.BytesIO(blob), backend, devices).load()
        except Exception as e:
            raise ArtifactError(f"the stored executable cannot be loaded ({type(e).__name__}: {str(e)[:200]})",
                                hint="compile it again: torchtpu-export compile MODEL.tpu --topology ...") from e
        in_tree, out_tree = trees or (exported.in_tree, exported.out_tree)
        if in_tree.num_leaves != len(args_info_flat):
            raise ArtifactError("a stored executable takes other arguments than its program",
                                hint="compile it again: torchtpu-export compile MODEL.tpu --topology ...")
        args_info = in_tree.unflatten(args_info_flat)
        return jax.stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=no_kwargs)


# ---- artifacts -----------------------------------------------------------------------------

def compile_artifact(artifact, topology_name: str, programs=None, *, store: bool = True) -> dict[str, dict]:
    """Compiles the ``.tpu`` artifact's tpu programs for a topology and records the result in it.

    Each program's entry in ``manifest["compiled"][topology]`` gets the compiler's statistics and,
    with ``store``, the serialized executable (its sha256 in the manifest, its bytes an entry of
    the file). Dynamic programs are compiled at their lower and upper bounds and report the upper
    one; their executables are not stored (an executable has fixed shapes). Returns program ->
    statistics. Raises CompileError, naming the program, with the compiler's message.
    """
    import hashlib

    import jax

    version = require_libtpu(f"compiling for {topology_name}")
    gen = generation(topology_name)
    manifest = artifact.manifest
    mesh_axes = {str(k): int(v) for k, v in manifest["mesh"]["axes"]} if manifest.get("mesh") else None
    results = {}
    for prog, spec in manifest["programs"].items():
        if programs is not None and prog not in programs:
            continue
        blob = artifact.programs[prog].get("tpu")
        if blob is None:
            raise InputError(f"program {prog!r} has no tpu program (platforms {sorted(artifact.programs[prog])})",
                             hint="export with platforms including 'tpu'")
        uses_x64 = bool(spec.get("uses_x64", True))
        with jax.enable_x64(uses_x64):
            try:
                exported = jax.export.deserialize(bytearray(blob))
            except Exception as e:
                raise ArtifactError(f"program {prog!r}: the tpu program is corrupt ({type(e).__name__}: "
                                    f"{str(e)[:200]})", hint="export the model again") from e
        bounds = {name: tuple(r) for name, r in spec.get("dims", {}).items()}
        unbounded = sorted(name for name, (_, hi) in bounds.items() if hi is None)
        if unbounded:
            raise InputError(f"program {prog!r}: dynamic dimension(s) {', '.join(unbounded)} have no upper bound, "
                             "so there is no shape to compile for a TPU",
                             hint="export with Dim(..., max=N)")
        try:
            if bounds:  # the smallest shapes must compile too; the statistics are the largest's
                compile_exported(exported, topology_name, uses_x64=uses_x64, mesh_axes=mesh_axes,
                                 shardings=spec.get("sharding"), dims={n: lo for n, (lo, _) in bounds.items()},
                                 donate=donated(spec))
            compiled = compile_exported(exported, topology_name, uses_x64=uses_x64, mesh_axes=mesh_axes,
                                        shardings=spec.get("sharding"), dims={n: hi for n, (_, hi) in bounds.items()},
                                        donate=donated(spec))
        except CompileError as e:
            raise CompileError(f"the TPU compiler ({topology_name}) rejects program {prog!r}:\n{e}") from e
        st = stats(compiled, gen)
        _add_kernel_costs(st, spec.get("kernels", []), gen)
        entry = {"libtpu": version, "jax": jax.__version__, "jaxlib": jaxlib_version(),
                 "device_kind": gen.device_kind, "devices": math.prod(mesh_axes.values()) if mesh_axes else 1,
                 "stats": st, "executable": None}
        if bounds:
            entry["shapes"] = {n: hi for n, (_, hi) in bounds.items()}
            entry["executable_reason"] = "dynamic shapes: an executable has fixed shapes (compiled at the bounds)"
        elif store:
            data = serialize(compiled)
            entry["executable"] = {"file": artifact.executable_path(topology_name, prog),
                                   "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            artifact.executables.setdefault(topology_name, {})[prog] = data
        manifest.setdefault("compiled", {}).setdefault(topology_name, {})[prog] = entry
        results[prog] = st
    return results


def _add_kernel_costs(st: dict, kernels: list, gen: Generation) -> None:
    """Adds what kernels that declare no cost to the compiler (JAX's splash and paged attention) would count."""
    extra = [k["cost"] for k in kernels if k.get("platform") == "tpu" and k.get("cost")]
    if not extra:
        return
    for key, field in (("flops", "flops"), ("transcendentals", "transcendentals"), ("bytes_accessed", "bytes_accessed")):
        st[field] += float(sum(c.get(key, 0) for c in extra))
    st["kernel_estimates"] = len(extra)
    roof = st["roofline"]
    roof["seconds"] = gen.roofline_seconds(st["flops"], st["bytes_accessed"], roof["dtype"])
    roof["bound"] = "compute" if st["flops"] / roof["peak_flops"] >= st["bytes_accessed"] / gen.hbm_bytes_per_s \
        else "memory"


def jaxlib_version() -> str:
    import jax
    return getattr(getattr(jax, "lib", None), "__version__", None) or jax.__version__


def stored_executable(artifact, program: str, devices: list, uses_x64: bool):
    """The artifact's stored executable for ``program`` that these local TPU devices can run, or
    (None, why not). Never returns one whose bytes do not match the recorded sha256."""
    import hashlib

    import jax

    compiled = artifact.manifest.get("compiled", {})
    if not compiled:
        return None, "the artifact has no stored executables"
    kind = getattr(devices[0], "device_kind", "?")
    # the chips' own word, never the manifest's: an executable is native code for one TPU generation
    if getattr(devices[0], "platform", None) != "tpu" or generation_of_device_kind(kind) is None:
        return None, f"these devices are {kind}, not TPU chips"
    why = []
    for topology_name, per_program in sorted(compiled.items()):
        entry = per_program.get(program)
        exe = (entry or {}).get("executable")
        if not exe:
            continue
        try:
            made_for = generation(topology_name).device_kind
        except InputError:
            made_for = None
        if made_for != kind or entry.get("device_kind") != kind:
            why.append(f"{topology_name} is for {entry.get('device_kind')}, these chips are {kind}")
            continue
        if int(entry.get("devices", 1)) > len(devices):
            why.append(f"{topology_name} needs {entry.get('devices')} chips, this host has {len(devices)}")
            continue
        versions = (entry.get("libtpu"), entry.get("jax"))
        if versions != (libtpu_version(), jax.__version__):
            why.append(f"{topology_name} was compiled by libtpu {versions[0]} with jax {versions[1]}; "
                       f"this is libtpu {libtpu_version()} with jax {jax.__version__}")
            continue
        data = artifact.executables.get(topology_name, {}).get(program)
        if data is None or hashlib.sha256(data).hexdigest() != exe.get("sha256"):
            why.append(f"{topology_name}'s executable does not match its recorded sha256 (corrupt)")
            continue
        return (topology_name, data), None
    return None, "; ".join(why) or f"no executable stored for program {program!r}"
