"""Runs a ``.tpu`` program on the local PJRT backend (cpu here; tpu or gpu where present).

On a TPU host, a program whose artifact stores an executable for these chips, this libtpu and
this jax (``torchtpu-export compile``) runs it without compiling; otherwise the StableHLO is
compiled, and a warning says once why no stored executable could be used.
"""
from __future__ import annotations

import logging

from typing import Sequence

import jax
import numpy as np

from torchtpu_export import tpu_compile
from torchtpu_export.errors import ArtifactError, InputError
from torchtpu_export.specs import TensorSpec, check_dims, coerce_input
from torchtpu_export.tpu_format import TpuArtifact

log = logging.getLogger("torchtpu_export")
_WARNED: set = set()

_BACKEND_PLATFORM = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda", "cuda": "cuda", "rocm": "rocm"}


def local_platform() -> str:
    return _BACKEND_PLATFORM.get(jax.default_backend(), jax.default_backend())


class XlaRunner:
    """One program of a ``.tpu`` artifact, compiled for the local backend, weights on device."""

    name = "xla"

    def __init__(self, artifact: TpuArtifact, program: str = "main", platform: str | None = None):
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
        self.outputs = [TensorSpec.from_json(d) for d in spec["outputs"]]
        self.uses_x64 = bool(spec.get("uses_x64", True))
        self.dims = {k: tuple(v) for k, v in spec.get("dims", {}).items()}
        self.ragged = {int(i): pos for i, pos in spec.get("ragged_outputs", {}).items()}
        self.rng_key = bool(spec.get("rng_key", False))
        self.platform = platform
        self.mesh, self._input_shardings = None, None
        with jax.enable_x64(self.uses_x64):
            try:
                self.exported = jax.export.deserialize(bytearray(artifact.programs[program][platform]))
            except Exception as e:
                raise ArtifactError(f"the {platform} program is corrupt ({type(e).__name__}: {str(e)[:200]})",
                                    hint="export the model again") from e
            plan = spec.get("sharding")
            if plan:
                self.mesh = _local_mesh(artifact.manifest["mesh"])
                wsh = {n: _named(self.mesh, s) for n, s in plan["weights"].items()}
                self._input_shardings = [_named(self.mesh, s) for s in plan["inputs"]]
            else:
                wsh = {}
            self.weights = {n: jax.device_put(np.asarray(artifact.weights[n]), wsh.get(n)) for n in spec["weights"]}
            self._call = None
            self.executable = None  # the stored executable's topology, when one is used
            if platform == "tpu":
                self._call = self._stored(artifact, program)
            if self._call is None:
                self._call = jax.jit(self.exported.call)
        avals = self.exported.in_avals[len(self.weights):]
        if self.rng_key:
            avals = avals[:-1]
        if len(avals) != len(self.inputs):
            raise ArtifactError("the manifest's inputs do not match the program's arguments")
        self._input_dtypes = [np.dtype(a.dtype).name for a in avals]

    def _stored(self, artifact: TpuArtifact, program: str):
        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        found, why = tpu_compile.stored_executable(artifact, program, devices, self.uses_x64)
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
            log.warning("compiling the tpu program %r: no stored executable can run here (%s)", program, why)
        return None

    def run(self, inputs: Sequence) -> list[np.ndarray]:
        if len(inputs) != len(self.inputs):
            raise InputError(f"expected {len(self.inputs)} inputs ({', '.join(str(s) for s in self.inputs)}), "
                             f"got {len(inputs)}")
        arrays = [coerce_input(spec, x, dtype=dt) for spec, x, dt in zip(self.inputs, inputs, self._input_dtypes)]
        check_dims(self.inputs, arrays, self.dims)
        with jax.enable_x64(self.uses_x64):
            if self._input_shardings:
                arrays = [jax.device_put(a, sh) for a, sh in zip(arrays, self._input_shardings)]
            if self.rng_key:
                arrays.append(new_key())
            outs = [np.asarray(o) for o in self._call(self.weights, *arrays)]
        # data-dependent row counts: the program pads, its extra outputs say how many rows are real
        for i, pos in self.ragged.items():
            outs[i] = outs[i][:int(outs[pos])]
        return outs[:len(self.outputs)]


def new_key() -> np.ndarray:
    """A PRNG key (``uint32[2]``) for one call of a program with random ops, drawn from torch's
    default generator: ``torch.manual_seed`` makes a sequence of calls repeatable, as in eager."""
    import torch
    return torch.randint(0, 2 ** 32, (2,), dtype=torch.int64).numpy().astype(np.uint32)


def _named(mesh, spec):
    from jax.sharding import NamedSharding, PartitionSpec
    return NamedSharding(mesh, PartitionSpec(*spec))


def _local_mesh(mesh_spec: dict):
    """The artifact's mesh over this machine's first devices (on CPU, XLA_FLAGS can make 8)."""
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
