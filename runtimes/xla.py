"""Runs a ``.tpu`` program on the local PJRT backend (cpu here; tpu or gpu where present).

On a TPU host, a program whose artifact stores an executable for these chips, this libtpu and
this jax (``torchtpu-export compile``) runs it without compiling, where the file was loaded as
trusted (``trust_stored_executables``: an executable is native code); otherwise the StableHLO is
compiled, and a warning says once why no stored executable was used.
"""
from __future__ import annotations

import logging
from typing import Sequence

from torchtpu_export.targets.tpu import aot as tpu_compile

tpu_compile.prepare_environment()  # before jax loads libtpu (on a host without TPU chips)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.specs import TensorSpec, check_dims, coerce_input
from torchtpu_export.targets.tpu import artifact as tpu_format
from torchtpu_export.targets.tpu.artifact import TpuArtifact

log = logging.getLogger("torchtpu_export")
_WARNED: set = set()

_BACKEND_PLATFORM = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm"}


def local_platform() -> str:
    return _BACKEND_PLATFORM.get(jax.default_backend(), jax.default_backend())


class XlaRunner:
    """One program of a ``.tpu`` artifact, compiled for the local backend, weights on device."""

    name = "xla"

    def __init__(self, artifact: TpuArtifact, program: str = "main", platform: str | None = None,
                 placed: dict | None = None, state: dict | None = None, *, trust_stored_executables: bool = False):
        """``placed``: weights already on the device, shared by the programs of one artifact (keyed by
        name and sharding); the weights this runner places are added to it. ``state``: the values of
        the buffers the programs change in place, on the device, shared likewise (by name and platform);
        each call takes them (donated) and leaves their new values there. ``trust_stored_executables``:
        the file's stored executable for these chips may be loaded (never read without it)."""
        spec = artifact.manifest["programs"].get(program)
        if spec is None:
            raise InputError(f"no program {program!r} in the artifact; it has {sorted(artifact.manifest['programs'])}")
        platform = platform or local_platform()
        if platform not in artifact.programs[program]:
            raise ArtifactError(
                f"the artifact has no {platform} program (it has {sorted(artifact.programs[program])})",
                hint=f"export it with platforms including {platform!r}")
        version = spec.get("calling_convention_version")
        if version is not None and not (jax.export.minimum_supported_calling_convention_version <= version
                                        <= jax.export.maximum_supported_calling_convention_version):
            raise ArtifactError(
                f"the artifact uses jax.export calling convention {version}; this jax {jax.__version__} supports "
                f"{jax.export.minimum_supported_calling_convention_version}.."
                f"{jax.export.maximum_supported_calling_convention_version}",
                hint="jax.export artifacts load in jax releases up to about 6 months newer: re-export it with this jax")
        self.inputs = [TensorSpec.from_json(d) for d in spec["inputs"]]
        self.state_specs = [TensorSpec.from_json(d) for d in spec.get("state", ())]
        self._state_store = {} if state is None else state
        self._artifact_state = {d["name"]: artifact.weights.get(tpu_format.STATE_PREFIX + d["name"])
                                for d in spec.get("state", ())}
        if any(v is None for v in self._artifact_state.values()):
            raise ArtifactError("the artifact lacks the initial value of its programs' state",
                                hint="export the model again")
        self.outputs = [TensorSpec.from_json(d) for d in spec["outputs"]]
        self.uses_x64 = bool(spec.get("uses_x64", True))
        self.dims = {k: tuple(v) for k, v in spec.get("dims", {}).items()}
        self.ragged = {int(i): pos for i, pos in spec.get("ragged_outputs", {}).items()}
        self.rng_key = bool(spec.get("rng_key", False))
        self.platform = platform
        self.mesh, self._input_shardings = None, None
        self.executable = None  # the stored executable's topology, when one is used
        with jax.enable_x64(self.uses_x64):
            try:
                self.exported = jax.export.deserialize(bytearray(artifact.programs[program][platform]))
            except Exception as e:
                raise ArtifactError(f"the {platform} program is corrupt ({type(e).__name__}: {str(e)[:200]})",
                                    hint="export the model again") from e
            self._check_program(artifact, spec)
            try:
                plan = spec.get("sharding")
                if plan:
                    self.mesh = _local_mesh(artifact.manifest["mesh"])
                    wsh = {n: _named(self.mesh, s) for n, s in plan["weights"].items()}
                    self._input_shardings = [_named(self.mesh, s) for s in plan["inputs"]]
                else:
                    wsh = {}
                placed = {} if placed is None else placed
                self.weights = {}
                self.bytes_read = 0  # weight bytes this process read (its own shards, under several processes)
                for n in spec["weights"]:
                    key = (n, platform, repr(wsh.get(n)))
                    if key not in placed:
                        placed[key], read = place(artifact.weights[n], wsh.get(n))
                        self.bytes_read += read
                    self.weights[n] = placed[key]
            except (ArtifactError, InputError):
                raise
            except Exception as e:  # a sharding plan naming axes the mesh does not have, and the like
                raise ArtifactError(f"the artifact's program {program!r} cannot be placed on the devices "
                                    f"({type(e).__name__}: {str(e)[:200]})", hint="export the model again") from e
            self._call = None
            if platform == "tpu":
                self._call = self._stored(artifact, program, trust_stored_executables)
            # inputs the program updates in place (a KV cache): their buffers become the outputs'
            self.donate = tpu_format.donated(spec)
            if self._call is None:
                self._call = jax.jit(self.exported.call, donate_argnums=tuple(1 + i for i in self.donate))
        avals = self.exported.in_avals[len(spec["weights"]):]
        if self.rng_key:
            avals = avals[:-1]
        self._input_dtypes = [np.dtype(a.dtype).name for a in avals]

    def _check_program(self, artifact: TpuArtifact, spec: dict) -> None:
        """The deserialized program against the manifest and the weights: the call structure the runner
        uses, one argument per weight and input with the weight's own shape and dtype, enough results."""
        exp, names = self.exported, spec["weights"]
        n_args = len(names) + len(self.inputs) + len(self.state_specs) + (1 if self.rng_key else 0)
        try:
            expected = jax.tree.structure((({n: 0 for n in names}, *([0] * (n_args - len(names)))), {}))
            same = exp.in_tree == expected
        except Exception:  # noqa: BLE001 (a tree that cannot even be compared is not ours)
            same = False
        if not same or len(exp.in_avals) != n_args:
            raise ArtifactError("the artifact's program does not take the weights and inputs its manifest lists",
                                hint="export the model again")
        by_name = dict(zip(sorted(names), exp.in_avals[:len(names)]))  # a dict argument flattens by sorted key
        for name in names:
            w, aval = artifact.weights[name], by_name[name]
            if tuple(w.shape) != tuple(aval.shape) or np.dtype(w.dtype) != np.dtype(aval.dtype):
                raise ArtifactError(f"weight {name[:80]!r} is {np.dtype(w.dtype).name}{list(w.shape)} in the file; "
                                    f"the program takes {np.dtype(aval.dtype).name}{list(aval.shape)}",
                                    hint="the weights and the program do not belong together: export the model again")
        for spec_in, aval in zip(self.inputs, exp.in_avals[len(names):]):
            if len(spec_in.shape) != len(aval.shape):
                raise ArtifactError(f"input {spec_in.name[:80]!r} has rank {len(spec_in.shape)} in the manifest and "
                                    f"{len(aval.shape)} in the program", hint="export the model again")
        n_results = len(exp.out_avals)
        if n_results < len(self.outputs) or any(i >= n_results or pos >= n_results for i, pos in self.ragged.items()):
            raise ArtifactError("the artifact's program returns fewer results than its manifest lists",
                                hint="export the model again")

    def _stored(self, artifact: TpuArtifact, program: str, trusted: bool):
        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        if trusted:
            found, why = tpu_compile.stored_executable(artifact, program, devices, self.uses_x64)
        else:
            found, why = None, ("the file is not marked trusted: its executables are native code, loaded only "
                                "with --trust-stored-executables (tte.load(path, trust_stored_executables=True))")
        if found is not None:
            topology, data = found
            try:
                call = tpu_compile.load_executable(data, self.exported, uses_x64=self.uses_x64, devices=devices)
            except ArtifactError as e:
                why = str(e)
            else:
                self.executable = topology
                return call
        key = (id(artifact), program)
        if artifact.manifest.get("compiled") and key not in _WARNED:
            _WARNED.add(key)
            log.warning("compiling the tpu program %r: no stored executable is used here (%s)", program, why)
        return None

    @property
    def input_shardings(self) -> list | None:
        """The sharding of each input (then each state buffer) of a sharded program, as its plan says;
        None for a program on one device."""
        return self._input_shardings

    def state_arrays(self) -> list:
        """The current value of each buffer the program changes in place, on the device (placed from the
        artifact's initial values on first use, and after ``TpuProgram.reset_state``)."""
        arrays = []
        n = len(self.inputs)
        for k, spec in enumerate(self.state_specs):
            key = (spec.name, self.platform)
            if key not in self._state_store:
                sharding = self._input_shardings[n + k] if self._input_shardings else None
                self._state_store[key] = place(self._artifact_state[spec.name], sharding)[0]
            arrays.append(self._state_store[key])
        return arrays

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs ({', '.join(str(s) for s in self.inputs)}), "
                             f"got {len(inputs)}")
        arrays = [coerce_input(spec, x, dtype=dt) for spec, x, dt in zip(self.inputs, inputs, self._input_dtypes)]
        check_dims(self.inputs, arrays, self.dims)
        with jax.enable_x64(self.uses_x64):
            if self._input_shardings and jax.process_count() > 1:
                arrays = [global_array(a, sh)[0] for a, sh in zip(arrays, self._input_shardings)]
            elif self._input_shardings:
                arrays = [jax.device_put(a, sh) for a, sh in zip(arrays, self._input_shardings)]
            arrays += self.state_arrays()
            if self.rng_key:
                arrays.append(new_key())
            try:
                results = list(self._call(self.weights, *arrays))
                n = len(self.outputs)
                for spec_state, value in zip(self.state_specs, results[n:n + len(self.state_specs)]):
                    self._state_store[(spec_state.name, self.platform)] = value  # stays on the device
                outs = [to_host(o) for o in results[:n]] + [to_host(o) for o in results[n + len(self.state_specs):]]
            except Exception as e:
                # inputs were checked against the manifest above, and the program came from a file: one
                # that XLA cannot compile or run is a bad file
                raise ArtifactError(f"the {self.platform} program cannot be compiled or run here "
                                    f"({type(e).__name__}: {str(e).strip()[:300]})",
                                    hint="the artifact is corrupt or was made by an incompatible version: "
                                         "export the model again") from e
        # data-dependent row counts: the program pads, its extra outputs say how many rows are real
        for i, pos in self.ragged.items():
            outs[i] = outs[i][:int(outs[pos])]
        return outs[:len(self.outputs)]


def place(value, sharding) -> tuple:
    """A host value (a weight, a state's initial value) on the device(s) ``sharding`` names, and the bytes
    read: under several processes each reads only its own slices (:func:`global_array`)."""
    if sharding is not None and jax.process_count() > 1:
        return global_array(value, sharding)
    return jax.device_put(np.asarray(value), sharding), value.nbytes


def global_array(value, sharding) -> tuple:
    """``value`` (a host array, e.g. memory-mapped from the file) as an array over a mesh that spans
    several processes (JAX's multi-controller runtime): each process reads only the slices its own
    devices hold. Returns the array and the bytes this process read."""
    seen: dict = {}

    def shard(index):
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        part = np.asarray(value[index])
        part = np.ascontiguousarray(part) if part.ndim else part  # (ascontiguousarray makes a scalar 1-D)
        seen[key] = part.nbytes
        return part

    return jax.make_array_from_callback(tuple(value.shape), sharding, shard), sum(seen.values())


def to_host(out) -> np.ndarray:
    """An output as a numpy array; under several processes, gathered from all of them."""
    if getattr(out, "is_fully_addressable", True):
        return np.asarray(out)
    if out.is_fully_replicated:
        return np.asarray(out.addressable_shards[0].data)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(out, tiled=True))


def new_key() -> np.ndarray:
    """A PRNG key (``uint32[2]``) for one call of a program with random ops, drawn from torch's
    default generator: ``torch.manual_seed`` makes a sequence of calls repeatable, as in eager."""
    import torch
    return torch.randint(0, 2 ** 32, (2,), dtype=torch.int64).numpy().astype(np.uint32)


def _named(mesh, spec):
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(mesh, PartitionSpec(*spec))


def _local_mesh(mesh_spec: dict):
    """The artifact's mesh over the first devices (on CPU, XLA_FLAGS can make 8); under JAX's
    multi-controller runtime (``jax.distributed.initialize`` in every process) over the global devices
    of all processes, each process holding its own."""
    from jax.sharding import Mesh
    names = [a for a, _ in mesh_spec["axes"]]
    shape = [int(n) for _, n in mesh_spec["axes"]]
    need = int(np.prod(shape))
    devices = jax.devices()
    if len(devices) < need:
        raise ArtifactError(
            f"this program is sharded over {need} devices ({', '.join(f'{a}={n}' for a, n in mesh_spec['axes'])}); "
            f"this machine has {len(devices)}",
            hint=f"run it on {need} chips; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                 "before starting Python")
    return Mesh(np.array(devices[:need]).reshape(shape), names)
