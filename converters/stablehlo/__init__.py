"""The TPU target: captured core ATen -> JAX -> jax.export (StableHLO) -> ``.tpu``.

Importing this package registers every lowering (one module per op family).
"""
from __future__ import annotations

import contextlib
import logging
import operator
from typing import Mapping, Sequence

from torchtpu_export.targets.tpu import aot as tpu_compile

tpu_compile.prepare_environment()  # before jax loads libtpu (on a host without TPU chips)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from torchtpu_export import progress
from torchtpu_export.targets.tpu import artifact as tpu_format  # noqa: E402
from torchtpu_export._version import __version__  # noqa: E402
from torchtpu_export.capture import CapturedProgram, is_abstract
from torchtpu_export.core_ops import core_aten_ops, rewritten_core_ops
from torchtpu_export.errors import ConversionError, InputError, UnsupportedOpError
from torchtpu_export.quant import parse as parse_quant

from . import quantize
from . import sharding as sharding_plans
from . import (ops_backward, ops_distance, ops_elementwise, ops_embedding, ops_fft,  # noqa: F401
               ops_hot, ops_index, ops_linalg, ops_misc, ops_nn, ops_noncore, ops_random, ops_reduction,
               ops_sampling, ops_shape, ops_special)
from .fusion import fuse_hot_ops
from .interpreter import check_supported, to_jax_function, uses_random
from .kernel_cost import kernels_that_pay
from .registry import LOWERINGS, PLATFORMS, LoweringContext, jax_dtype, lookup, lowers  # noqa: F401

log = logging.getLogger("torchtpu_export")

KERNEL_MODES = ("auto", "pallas", "xla")

# Composite ops this target lowers whole instead of letting torch decompose them.
KEEP_WHOLE: list = [*ops_hot.KEEP_WHOLE]
# the core ops torch's table would still rewrite that it has a rule for, and every non-core op it has a rule for
KEEP_WHOLE += [op for op in rewritten_core_ops() if op in LOWERINGS]
KEEP_WHOLE += [op for op in LOWERINGS.ops() if op not in core_aten_ops() and op not in KEEP_WHOLE]


def lowerable(op) -> bool:
    """Whether this target has a rule for ``op`` (capture skips decomposition when all ops do)."""
    return op in LOWERINGS


def _symbolic_specs(captured: CapturedProgram, narrow: bool):
    """jax ShapeDtypeStructs for the inputs, dynamic dims as jax.export symbols with torch's bounds."""
    scope = None
    if captured.dim_ranges:
        constraints = []
        for name, (lower, upper) in sorted(captured.dim_ranges.items()):
            if lower > 1:
                constraints.append(f"{name} >= {lower}")
            if upper is not None:
                constraints.append(f"{name} <= {upper}")
        scope = jax.export.SymbolicScope(constraints)
    specs = []
    for spec in captured.inputs:
        dtype = jax_dtype(getattr(torch, spec.dtype), narrow)
        if any(isinstance(d, str) for d in spec.shape):
            shape = jax.export.symbolic_shape(", ".join(str(d) for d in spec.shape), scope=scope)
        else:
            shape = spec.shape
        specs.append(jax.ShapeDtypeStruct(shape, dtype))
    return specs


def _merge_weights(captures: Mapping[str, CapturedProgram]):
    """One weight table for all programs; a name used with different values gets a program prefix."""
    merged: dict[str, torch.Tensor] = {}
    per_program: dict[str, list[str]] = {}
    for prog, cap in captures.items():
        names = []
        for name, t in cap.weights.items():
            key = name
            if key in merged and not (merged[key] is t or (merged[key].shape == t.shape and merged[key].dtype == t.dtype
                                                           and _same_values(merged[key], t))):
                key = f"{prog}.{name}"
            merged.setdefault(key, t)
            names.append(key)
        per_program[prog] = names
    return merged, per_program


def convert(captures: Mapping[str, CapturedProgram], *, platforms: Sequence[str] = ("tpu", "cpu"),
                    kernels: str = "auto", narrow_64bit: bool = False, mesh=None,
                    sharding: str | None = None, input_shardings=None, quant_config=None,
                    precompile=(), donate_prefixes: Sequence[str] = ()) -> tpu_format.TpuArtifact:
    """Lowers each captured program for each platform and packs them as one ``.tpu`` artifact.

    With ``mesh`` (e.g. ``(("data", 1), ("model", 8))``) the programs are sharded over that many
    devices following ``sharding`` (default ``"tensor_parallel"``; see sharding.py);
    ``input_shardings`` (``{input name: [axis or None per dim]}``) splits named inputs, and the
    outputs of the same name, as given (state such as a KV cache split by head); a key
    ``"<program>:<input name>"`` splits that program's input so instead (an input of another layout there).
    ``precompile`` (TPU topologies, e.g. ``("v5e:2x2",)``) stores an executable per program and
    topology, compiled by libtpu. Where libtpu is installed, every Pallas kernel is first compiled
    for the generations of ``precompile`` (default v5e and v6e); one the compiler rejects falls
    back to XLA, and the manifest says why. With ``kernels="auto"`` a program with kernels is then
    compiled whole beside its XLA lowering (for the generations of ``precompile``; without it, for
    the first default, v5e), and keeps its kernels only where the compiler's cost analysis says they
    access no more bytes (``kernel_cost`` in the manifest).
    ``donate_prefixes``: inputs whose name starts with one of them are donated (a KV cache updated
    in place); the comparison compiles the programs so.
    """
    platforms = tuple(platforms)
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad or not platforms:
        raise InputError(f"unknown platform(s) {bad}; choose from {', '.join(PLATFORMS)}")
    if kernels not in KERNEL_MODES:
        raise InputError(f"kernels must be one of {', '.join(KERNEL_MODES)}, not {kernels!r}")
    precompile = tpu_compile.parse_topologies(precompile) if precompile else ()
    if precompile:
        if "tpu" not in platforms:
            raise InputError("precompile= needs the tpu platform", hint="export with platforms including 'tpu'")
        tpu_compile.require_libtpu("precompile=")
    kernel_topologies = _kernel_topologies(precompile) if "tpu" in platforms else ()
    for cap in captures.values():
        fuse_hot_ops(cap)
        for p in platforms:
            check_supported(cap, p)
    mesh_axes = sharding_plans.parse_mesh(mesh)
    if sharding is not None and not mesh_axes:
        raise InputError("sharding= needs a mesh=, e.g. mesh=(('data', 1), ('model', 8))")
    if input_shardings and not mesh_axes:
        raise InputError("input_shardings= needs a mesh=, e.g. mesh=(('data', 1), ('model', 8))")
    if input_shardings:
        known = {spec.name for cap in captures.values() for spec in cap.inputs}
        known |= {f"{prog}:{spec.name}" for prog, cap in captures.items() for spec in cap.inputs}
        unknown = sorted(set(input_shardings) - known)
        if unknown:
            raise InputError(f"input_shardings names {unknown[0]!r}, which no program takes",
                             hint=f"the inputs are {', '.join(sorted(known)[:12])}")
    weights, weight_names = _merge_weights(captures)
    np_weights = {name: _weight_array(t, narrow_64bit) for name, t in weights.items()}
    # buffers changed in place: their values before the first call, stored beside the weights (programs of
    # one module share them by name)
    for cap in captures.values():
        for name, value in cap.state:
            np_weights.setdefault(tpu_format.STATE_PREFIX + name, _weight_array(value, narrow_64bit))
    quant = parse_quant(quant_config, "tpu")
    float_dtype, dequantize = quantize.apply(quant, captures, np_weights, weight_names) if quant else (None, {})
    manifest = {
        "format": tpu_format.FORMAT,
        "format_version": tpu_format.FORMAT_VERSION,
        "versions": {"torchtpu_export": __version__, "jax": jax.__version__,
                     "jaxlib": tpu_compile.jaxlib_version(),
                     "torch": torch.__version__.split("+")[0]},
        "platforms": list(platforms),
        "programs": {},
    }
    if mesh_axes:
        manifest["mesh"] = {"axes": [[k, v] for k, v in mesh_axes.items()],
                            "devices": sharding_plans.devices_needed(mesh_axes)}
    programs: dict[str, dict[str, bytes]] = {}
    mlir: dict[str, dict[str, str]] = {}
    for prog, cap in captures.items():
        wspecs = {n: jax.ShapeDtypeStruct(np_weights[n].shape, np_weights[n].dtype) for n in weight_names[prog]}
        renames = dict(zip(cap.weights, weight_names[prog]))
        uses_x64 = not narrow_64bit
        programs[prog], mlir[prog] = {}, {}
        kernel_log: list[dict] = []
        calling_convention = None
        given = {k: v for k, v in (input_shardings or {}).items() if ":" not in k}
        given.update({k[len(prog) + 1:]: v for k, v in (input_shardings or {}).items() if k.startswith(prog + ":")})
        plan = sharding_plans.plan(cap, mesh_axes, sharding or "tensor_parallel", given) if mesh_axes else None
        jit_kwargs = _jit_shardings(plan, renames) if plan else {}
        if plan:  # from here on, by the artifact's weight names (the manifest's plan, what compiling reads)
            plan["weights"] = {renames[k]: v for k, v in plan["weights"].items()}
            plan["column_parallel"] = [renames[k] for k in plan["column_parallel"]]
            plan["row_parallel"] = [renames[k] for k in plan["row_parallel"]]
            if "expert_parallel" in plan:
                plan["expert_parallel"] = [renames[k] for k in plan["expert_parallel"]]
        meta = cap.call_metadata()
        if donate_prefixes:
            meta["donate"] = [i for i, spec in enumerate(meta["inputs"])
                              if spec["name"].startswith(tuple(donate_prefixes))]
        kernel_cost = None

        def lower(platform, kernels, off=()):
            ctx = LoweringContext(platform, narrow_64bit=narrow_64bit, kernels=kernels, float_dtype=float_dtype,
                                  sharded=bool(mesh_axes), mesh_axes=mesh_axes, kernels_off=off,
                                  expert_axis=plan.get("expert_axis") if plan else None,
                                  kernel_topologies=kernel_topologies if platform == "tpu" else ())
            fn = to_jax_function(cap, ctx, renames, dequantize)
            with jax.enable_x64(uses_x64), _no_source_paths(), progress.stage(f"lower ({platform})"):
                ispecs = _symbolic_specs(cap, narrow_64bit)
                if uses_random(cap):
                    ispecs.append(jax.ShapeDtypeStruct((2,), np.uint32))
                try:
                    exp = jax.export.export(jax.jit(fn, **jit_kwargs), platforms=[platform])(wspecs, *ispecs)
                except (UnsupportedOpError, ConversionError, InputError):
                    raise
                except Exception as e:
                    raise ConversionError(f"jax.export failed for platform {platform}: {type(e).__name__}: {e}",
                                          hint="rerun with --debug and report it") from e
            return exp, fn, ctx.kernel_log

        for platform in platforms:
            exp, fn, log_entries = lower(platform, kernels)
            if kernels == "auto" and kernel_topologies and any(e.get("kernel") for e in log_entries):
                exp, log_entries, kernel_cost = kernels_that_pay(
                    exp, log_entries, lambda: lower(platform, "xla")[0],
                    lambda off: operator.itemgetter(0, 2)(lower(platform, kernels, off)),
                    kernel_topologies if precompile else kernel_topologies[:1], uses_x64=uses_x64,
                    mesh_axes=mesh_axes, shardings=plan, dims=cap.dim_ranges,
                    donate=tpu_format.donated(meta))
            ragged = {str(i): pos for i, pos in fn.ragged_outputs.items()}
            programs[prog][platform] = bytes(exp.serialize())
            mlir[prog][platform] = exp.mlir_module()
            calling_convention = exp.calling_convention_version
            kernel_log += [dict(entry, platform=platform) for entry in log_entries]
        manifest["programs"][prog] = {
            **meta,
            "weights": weight_names[prog],
            "uses_x64": uses_x64,
            "narrow_64bit": narrow_64bit,
            "calling_convention_version": calling_convention,
            "kernels": kernel_log,
            # outputs whose row count depends on the data: output index -> the extra output with its count
            "ragged_outputs": ragged,
            # a uint32[2] PRNG key follows the inputs: the runner draws one per call
            "rng_key": uses_random(cap),
            "op_histogram": cap.op_histogram(),
            "dims": {k: list(v) for k, v in sorted(cap.dim_ranges.items())},
        }
        if kernel_cost:
            manifest["programs"][prog]["kernel_cost"] = kernel_cost
        if quant:
            manifest["programs"][prog]["quantization"] = {
                "recipe": quant.recipe,
                "weights": {n: {"scale": s, "axis": a} for n, (s, a) in dequantize.items() if n in weight_names[prog]}}
        if plan:
            manifest["programs"][prog]["sharding"] = plan
    artifact = tpu_format.TpuArtifact(manifest, programs, mlir, np_weights)
    for topology in precompile:
        with progress.stage(f"compile ({topology})"):
            tpu_compile.compile_artifact(artifact, topology)
    return artifact


def _no_source_paths():
    """Lowering without Python tracebacks in the StableHLO locations: the same model gives the same
    bytes from any caller, and no path of the exporting machine ends up in the artifact (the
    locations keep the op names)."""
    from jax._src import config as jax_config
    limit = getattr(jax_config, "traceback_in_locations_limit", None)
    return limit(0) if limit is not None else contextlib.nullcontext()


def _kernel_topologies(precompile: Sequence[str]) -> tuple[str, ...]:
    """One topology per TPU generation whose compiler must accept each kernel (none without libtpu)."""
    if tpu_compile.libtpu_version() is None:
        return ()
    by_generation = {}
    for name in precompile or tpu_compile.DEFAULT_TOPOLOGIES:
        by_generation.setdefault(tpu_compile.generation(name).name, name)
    return tuple(by_generation.values())


def _jit_shardings(plan: dict, renames: dict) -> dict:
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec
    axes = plan["mesh"]
    mesh = AbstractMesh(tuple(axes.values()), tuple(axes))
    weights = {renames[k]: NamedSharding(mesh, PartitionSpec(*v)) for k, v in plan["weights"].items()}
    inputs = [NamedSharding(mesh, PartitionSpec(*s)) for s in plan["inputs"]]
    outputs = [NamedSharding(mesh, PartitionSpec(*s)) for s in plan["outputs"]]
    return {"in_shardings": (weights, *inputs), "out_shardings": outputs}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values; abstract weights (no values) of one name and shape are taken as the same weight."""
    if is_abstract(a) or is_abstract(b):
        return is_abstract(a) and is_abstract(b)
    return torch.equal(a, b)


def _weight_array(t: torch.Tensor, narrow: bool):
    from torchtpu_export.safetensors_io import to_numpy
    if is_abstract(t):
        a = tpu_format.AbstractWeight(tuple(t.shape), np.dtype(jax_dtype(t.dtype, False)))
    else:
        a = to_numpy(t)
    if narrow and a.dtype in (np.int64, np.float64, np.uint64):
        a = a.astype({np.dtype(np.int64): np.int32, np.dtype(np.float64): np.float32,
                      np.dtype(np.uint64): np.uint32}[a.dtype])
    return a
