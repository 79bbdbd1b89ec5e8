"""The serving engine's device calls compiled ahead of time and stored in the ``.tpu`` file.

``torchtpu-export compile model.tpu --topology v5e`` (or ``cpu``: this host's processor) compiles every call
that a server's engine makes: each prefill and decode program with its sampling, the mixed steps of a paged
cache, the row and page copies. It stores the executables beside the programs
(``engine/<topology>/<call>.bin``, listed in the manifest's ``llm.engine``). They are native code, so they
are read only from a file the user marked trusted (``tte.load(path, trust_stored_executables=True)``,
``--trust-stored-executables``): a file's digests prove nothing, whoever edits it recomputes them. Otherwise
the engine compiles every call as if the file stored none. A server over a trusted file, on matching chips
with the same jax, jaxlib and libtpu, loads them and compiles nothing; when none of them can run here, it
refuses to start rather than compile behind them.

For a TPU topology no chip is needed: the engine is built over libtpu's description of the slice
(:class:`TopologyProgram`), its arrays abstract, and each call is lowered for ``tpu``.
"""
from __future__ import annotations

import hashlib
import platform as _platform
import time

import numpy as np

from ...errors import ArtifactError, InputError

CPU = "cpu"  # the topology name of this host's processor


def host_fingerprint() -> str:
    """This host's processor as a CPU executable depends on it: machine and instruction-set flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    digest = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]
    return f"{_platform.machine()}:{digest}"


class AbstractRunner:
    """What the engine reads of a program's runner, for a TPU topology: the exported tpu program, its
    inputs and outputs, and its weights as shapes placed on the slice's devices (its sharding plan's)."""

    def __init__(self, artifact, sig: str, topology_name: str):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

        from ...specs import TensorSpec
        from .aot import devices_for
        spec = artifact.manifest["programs"][sig]
        blob = artifact.programs[sig].get("tpu")
        if blob is None:
            raise InputError(f"program {sig!r} has no tpu program (platforms {sorted(artifact.programs[sig])})",
                             hint="export with platforms including 'tpu'")
        with jax.enable_x64(bool(spec.get("uses_x64", True))):
            self.exported = jax.export.deserialize(bytearray(blob))
        self.inputs = [TensorSpec.from_json(d) for d in spec["inputs"]]
        self.outputs = [TensorSpec.from_json(d) for d in spec["outputs"]]
        self.mesh, self.input_shardings = None, None
        plan, mesh_spec = spec.get("sharding"), artifact.manifest.get("mesh")
        if plan and mesh_spec:
            axes = [(str(a), int(n)) for a, n in mesh_spec["axes"]]
            devices = devices_for(topology_name, int(np.prod([n for _, n in axes])))
            self.mesh = Mesh(np.array(devices).reshape([n for _, n in axes]), [a for a, _ in axes])
            self.input_shardings = [NamedSharding(self.mesh, PartitionSpec(*s)) for s in plan["inputs"]]
            weight = {n: NamedSharding(self.mesh, PartitionSpec(*s)) for n, s in plan["weights"].items()}
            default = NamedSharding(self.mesh, PartitionSpec())
        else:
            weight, default = {}, SingleDeviceSharding(devices_for(topology_name, 1)[0])
        (weights, *_), _ = jax.tree_util.tree_unflatten(self.exported.in_tree, list(self.exported.in_avals))
        self.weights = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=weight.get(n, default))
                        for n, a in weights.items()}


class TopologyProgram:
    """A ``.tpu`` LLM program seen from a TPU topology without its chips: an engine built over it has
    abstract arrays, and its calls lower for ``tpu`` (see :func:`compile_engine`)."""
    abstract = True

    def __init__(self, program, topology_name: str):
        self.program, self.topology = program, topology_name
        self._runners: dict = {}

    @property
    def signatures(self) -> list[str]:
        return self.program.signatures

    @property
    def manifest(self) -> dict:
        return self.program.manifest

    @property
    def llm(self) -> dict | None:
        return self.program.llm

    @property
    def trust_stored_executables(self) -> bool:
        return self.program.trust_stored_executables

    def call_metadata(self, sig: str):
        return self.program.call_metadata(sig)

    def stored_calls(self, devices: list) -> dict[str, bytes] | None:
        return self.program.stored_calls(devices)

    def ignored_calls(self) -> int:
        return self.program.ignored_calls()

    def load_executable(self, blob: bytes, *, uses_x64: bool, devices: list, trees):
        return self.program.load_executable(blob, uses_x64=uses_x64, devices=devices, trees=trees)

    def runner(self, sig: str, platform: str | None = None):
        if sig not in self._runners:
            self._runners[sig] = AbstractRunner(self.program.artifact, sig, self.topology)
        return self._runners[sig]


def compile_engine(program, topology_name: str) -> dict:
    """Compiles every call of the engine that serves ``program`` by default (``serve`` without flags) for
    ``topology_name`` (a TPU topology, or ``cpu``: this host), stores the executables in the program's
    artifact and records them in its manifest; returns the manifest entry. Raises CompileError naming the
    call the compiler rejects."""
    import jax

    from ...engine.scheduler import Engine
    from . import aot
    llm = program.manifest.get("llm")
    if llm is None:
        raise InputError("only an LLM's program (tte.export_llm) has engine calls to compile for the cpu",
                         hint="compile other programs for TPU topologies, e.g. --topology v5e")
    on_cpu = topology_name == CPU
    artifact = program.artifact
    # the executables this replaces go first: an engine over a trusted file would load them as it starts
    old = ((llm.get("engine") or {}).pop(topology_name, None) or {}).get("calls", {})
    for call in old.values():
        artifact.extras.pop(call["file"], None)
    if on_cpu:
        engine = Engine(program, platform="cpu")
        kind, versions = engine.device.device_kind, {"libtpu": None}
    else:
        engine = Engine(TopologyProgram(program, topology_name))
        kind, versions = aot.generation(topology_name).device_kind, {"libtpu": aot.libtpu_version()}
    calls = {}
    for name, fn, args in engine.calls():
        t0 = time.perf_counter()
        try:
            compiled = fn.compile(*args, platforms=None if on_cpu else ("tpu",))
        except Exception as e:
            raise aot.CompileError(f"the compiler ({topology_name}) rejects the engine's call {name!r}:\n"
                                   f"{aot.compiler_message(e)}") from e
        data = aot.serialize(compiled)
        file = f"engine/{topology_name.replace(':', '_')}/{name}.bin"
        artifact.extras[file] = data
        calls[name] = {"file": file, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                       "seconds": round(time.perf_counter() - t0, 3)}
    devices = engine.decode_runner.mesh.devices.size if engine.decode_runner.mesh is not None else 1
    entry = {**versions, "jax": jax.__version__, "jaxlib": aot.jaxlib_version(), "device_kind": kind,
             "devices": int(devices), "server": type(engine).__name__, "calls": calls}
    if on_cpu:
        entry["host"] = host_fingerprint()
    llm.setdefault("engine", {})[topology_name] = entry
    return entry


def trusted(program) -> bool:
    """Whether ``program``'s file was marked trusted when it was loaded (``trust_stored_executables``): only
    then is any of its stored executables read."""
    return program.trust_stored_executables is True


def ignored_calls(program) -> int:
    """How many engine executables ``program``'s file stores that are never read because it is not trusted."""
    if trusted(program):
        return 0
    stored = (program.manifest.get("llm") or {}).get("engine") or {}
    return sum(len(entry.get("calls", {})) for entry in stored.values())


def stored_calls(program, devices: list) -> dict[str, bytes] | None:
    """The file's stored engine executables that run on ``devices`` with this jax (call name -> bytes), or
    None when it stores none or is not trusted (:func:`trusted`; nothing stored is then read). Raises
    ArtifactError when it stores some and none can run here: a server never compiles behind them."""
    import jax

    from . import aot
    manifest = program.manifest
    stored = (manifest.get("llm") or {}).get("engine") or {}
    if not stored or not trusted(program):
        return None
    kind = getattr(devices[0], "device_kind", "?")
    here = {"jax": jax.__version__, "jaxlib": aot.jaxlib_version(),
            "libtpu": aot.libtpu_version() if devices[0].platform == "tpu" else None}
    why = []
    for topology_name, entry in sorted(stored.items()):
        if entry.get("device_kind") != kind:
            why.append(f"{topology_name}'s are for {entry.get('device_kind')}, these devices are {kind}")
        elif int(entry.get("devices", 1)) != len(devices):
            why.append(f"{topology_name}'s run on {entry.get('devices')} devices, this engine on {len(devices)}")
        elif any(entry.get(k) != v for k, v in here.items()):
            made = ", ".join(f"{k} {entry.get(k)}" for k in here if entry.get(k) != here[k])
            why.append(f"{topology_name}'s were compiled by {made}; this is "
                       + ", ".join(f"{k} {here[k]}" for k in here if entry.get(k) != here[k]))
        elif topology_name == CPU and entry.get("host") != host_fingerprint():
            why.append(f"{topology_name}'s were compiled for another processor ({entry.get('host')}, this one is "
                       f"{host_fingerprint()})")
        else:
            return {name: program.artifact.extras[call["file"]] for name, call in entry["calls"].items()}
    raise ArtifactError("the file's stored engine executables cannot run here: " + "; ".join(why),
                        hint="compile it for this host (torchtpu-export compile FILE --topology ...), or serve "
                             "with --no-warm to compile each call on first use")
