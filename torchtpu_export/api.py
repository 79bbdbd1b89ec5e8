"""The public API: ``export``, ``convert``, ``load``, ``signature``.

This is the one layer that joins converters and runtimes: converters make
artifacts, runtimes run them, and the objects here hold an artifact and run it.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree

from . import converters, onnx_format, tpu_format, treespec
from .capture import CapturedProgram, capture, flatten_call_args
from .edge import DEFAULT_SIGNATURE
from .errors import InputError
from .specs import TensorSpec

log = logging.getLogger("torchtpu_export")

TARGETS = ("tpu", "litert", "onnx")


def _unflatten(outputs: list, out_spec: str | pytree.TreeSpec):
    spec = treespec.loads(out_spec) if isinstance(out_spec, str) else out_spec
    return pytree.tree_unflatten(outputs, spec)


class TpuProgram:
    """A ``.tpu`` artifact: StableHLO programs for each platform, plus weights.

    ``prog(*args)`` runs the program on the local PJRT backend (cpu on a
    machine without TPU) and returns numpy arrays in the model's output
    structure. With several programs (``tte.signature``), pick one with
    ``signature_name``.
    """

    def __init__(self, artifact: tpu_format.TpuArtifact):
        self.artifact = artifact
        self._runners: dict = {}
        self.quant_report = None  # set by export(..., quant_config=...)

    @property
    def manifest(self) -> dict:
        return self.artifact.manifest

    @property
    def signatures(self) -> list[str]:
        return list(self.manifest["programs"])

    def _program(self, signature_name: str | None) -> str:
        if signature_name is None:
            if len(self.signatures) != 1:
                raise InputError(f"this artifact has several programs {self.signatures}: pass signature_name=")
            return self.signatures[0]
        if signature_name not in self.manifest["programs"]:
            raise InputError(f"no program {signature_name!r}; this artifact has {self.signatures}")
        return signature_name

    def inputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        return [TensorSpec.from_json(d) for d in self.manifest["programs"][self._program(signature_name)]["inputs"]]

    def outputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        return [TensorSpec.from_json(d) for d in self.manifest["programs"][self._program(signature_name)]["outputs"]]

    def save(self, path: str | os.PathLike) -> None:
        """Writes the ``.tpu`` file atomically."""
        self.artifact.save(path)

    def runner(self, signature_name: str | None = None, platform: str | None = None):
        from .runtimes.xla import XlaRunner
        key = (self._program(signature_name), platform)
        if key not in self._runners:
            self._runners[key] = XlaRunner(self.artifact, key[0], platform)
        return self._runners[key]

    def run_flat(self, inputs: Sequence, signature_name: str | None = None) -> list[np.ndarray]:
        """Runs on already-flattened inputs (the manifest's input order); returns the flat outputs."""
        return self.runner(signature_name).run(list(inputs))

    def __call__(self, *args, signature_name: str | None = None, **kwargs):
        spec = self.manifest["programs"][self._program(signature_name)]
        flat = flatten_call_args(spec["in_spec"], spec.get("constant_inputs", {}), args, kwargs)
        return _unflatten(self.run_flat(flat, signature_name), spec["out_spec"])

    def stablehlo_text(self, platform: str = "tpu", signature_name: str | None = None) -> str:
        """The StableHLO module of one platform, as MLIR text."""
        prog = self._program(signature_name)
        texts = self.artifact.mlir[prog]
        if platform not in texts:
            raise InputError(f"no {platform} program in this artifact; it has {sorted(texts)}")
        return texts[platform]

    def compile(self, topology="v5e:2x2", signature_name: str | None = None) -> "TpuProgram":
        """Compiles the tpu program(s) for TPU topologies (``"v5e:2x2"``, ``"v5e:2x2,v6e:2x2"`` or a
        sequence) with libtpu, ahead of time (no TPU needed), and stores each executable in the
        artifact (``save`` writes them; ``load`` on a matching TPU host runs them without compiling).
        Raises ConversionError with the compiler's message if it rejects a program."""
        from . import tpu_compile
        programs = None if signature_name is None else [self._program(signature_name)]
        for topo in tpu_compile.parse_topologies(topology):
            tpu_compile.compile_artifact(self.artifact, topo, programs)
        return self

    def compiled_stats(self, topology: str = "v5e:2x2", signature_name: str | None = None) -> dict:
        """What the TPU compiler says about one program on a topology's chips: HBM bytes (arguments,
        outputs, temporaries, code) and whether they fit, FLOPs, bytes accessed, and a roofline estimate
        from the generation's published peak FLOP/s and HBM bandwidth. Compiles (and stores) if needed."""
        from . import tpu_compile
        prog = self._program(signature_name)
        (topo,) = tpu_compile.parse_topologies(topology)
        entry = self.manifest.get("compiled", {}).get(topo, {}).get(prog)
        if entry is None or entry.get("libtpu") != tpu_compile.libtpu_version():
            self.compile(topo, signature_name=prog if len(self.signatures) > 1 else None)
            entry = self.manifest["compiled"][topo][prog]
        return entry["stats"]

    def kernels(self) -> list[dict]:
        """Per hot node: the Pallas kernel chosen, or why it fell back to XLA."""
        return [dict(k, program=p) for p, spec in self.manifest["programs"].items() for k in spec.get("kernels", [])]

    def __repr__(self) -> str:
        return f"TpuProgram(programs={self.signatures}, platforms={self.manifest['platforms']})"


class OnnxProgram:
    """An ``.onnx`` artifact: ``prog(*args)`` runs it on ONNX Runtime and returns numpy arrays
    in the model's output structure; ``save`` writes it atomically."""

    def __init__(self, artifact: onnx_format.OnnxArtifact):
        self.artifact = artifact
        self._runner = None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "OnnxProgram":
        return cls(onnx_format.read(path))

    def _check(self, signature_name: str | None) -> None:
        if signature_name not in (None, "main"):
            raise InputError(f"an ONNX model has one program ('main'), not {signature_name!r}")

    def inputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        self._check(signature_name)
        return list(self.artifact.inputs)

    def outputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        self._check(signature_name)
        return list(self.artifact.outputs)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the ``.onnx`` file atomically."""
        self.artifact.save(path)

    def run_flat(self, inputs: Sequence, signature_name: str | None = None) -> list[np.ndarray]:
        """Runs on already-flattened inputs (the captured input order); returns the flat outputs."""
        self._check(signature_name)
        if self._runner is None:
            from .runtimes.onnx import OnnxRunner
            # from its file when it has one, so that external data resolves beside it (checked on read)
            source = self.artifact.path if self.artifact.path is not None else self.artifact.model
            self._runner = OnnxRunner(source, self.artifact.inputs, self.artifact.outputs)
        return self._runner.run(list(inputs))

    def __call__(self, *args, signature_name: str | None = None, **kwargs):
        art = self.artifact
        if art.in_spec is None:  # an ONNX file from elsewhere: flat inputs, flat outputs
            if kwargs:
                raise InputError("this ONNX model has no recorded call structure: pass its inputs positionally")
            outs = self.run_flat(args, signature_name)
            return outs[0] if len(outs) == 1 else tuple(outs)
        flat = flatten_call_args(art.in_spec, art.constant_inputs, args, kwargs)
        return _unflatten(self.run_flat(flat, signature_name), art.out_spec)

    def __repr__(self) -> str:
        return f"OnnxProgram(inputs={[str(s) for s in self.artifact.inputs]})"


def captures(entries: Sequence[tuple], target: str, strict_export=False,
             dynamic_shapes=None) -> dict[str, CapturedProgram]:
    """Captures each ``(name, module, args, kwargs, dynamic_shapes)`` entry for ``target``'s converter."""
    converter = converters.converter(target)
    out = {}
    for name, module, args, kwargs, dyn in entries:
        out[name] = capture(module, args, kwargs, dynamic_shapes=dyn if dyn is not None else dynamic_shapes,
                            strict_export=strict_export, keep=converter.KEEP_WHOLE, lowerable=converter.lowerable)
    return out


def build(target: str, captured: dict[str, CapturedProgram], **options):
    """Converts already-captured programs for ``target`` and wraps the artifact in its runtime:
    a TpuProgram (``platforms`` default ``("tpu", "cpu")``), an EdgeModel or an OnnxProgram. Each
    has ``run_flat``, ``save`` and ``__call__``. What ``export`` and ``convert`` do after capturing."""
    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    converter = converters.converter(target)
    if target == "tpu":
        prog = TpuProgram(converter.convert(captured, **options))
        quant_config, platforms = options.get("quant_config"), options.get("platforms", ("tpu", "cpu"))
        if quant_config is not None and "cpu" in platforms:
            from .quant import parse
            float_bytes = sum(t.numel() * t.element_size() for c in captured.values() for t in c.weights.values())
            prog.quant_report = _quant_report(prog, captured, parse(quant_config, "tpu").recipe, float_bytes,
                                              sum(w.nbytes for w in prog.artifact.weights.values()))
        return prog
    if target == "onnx":
        return OnnxProgram(converter.convert(captured, **options))
    from .edge import EdgeModel
    from .runtimes.litert import TensorObserver
    edge = EdgeModel.from_artifact(converter.convert(captured, observer=TensorObserver, **options))
    info = edge.quantization
    if info is not None:  # a recipe, or a model quantized with pt2e
        edge.quant_report = _quant_report(edge, captured, info["recipe"], info["float_weight_bytes"],
                                          info["weight_bytes"])
    return edge


def _quant_report(prog, captured, recipe: str, float_bytes: int, quant_bytes: int):
    """Size before and after, and the error against the float model (torch eager) on the sample inputs."""
    from .quant import measure
    name, cap = next(iter(captured.items()))
    leaves = list(cap.sample_inputs)
    for i in sorted(cap.constant_inputs):  # the non-tensor arguments torch.export specialised
        leaves.insert(i, cap.constant_inputs[i])
    args, kwargs = pytree.tree_unflatten(leaves, cap.in_spec)
    with torch.no_grad():
        ref = cap.exported.module()(*args, **kwargs)
    got = prog.run_flat(cap.sample_inputs, signature_name=name if len(captured) > 1 else None)
    return measure(recipe, pytree.tree_leaves(ref), got, float_bytes, quant_bytes)


def export(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *, target: str = "tpu",
           platforms: Sequence[str] = ("tpu", "cpu"), dynamic_shapes=None, kernels: str = "auto",
           strict_export: bool | str = False, narrow_64bit: bool = False, quant_config=None, mesh=None,
           sharding: str | None = None, precompile=(), **options):
    """Captures ``module`` once and converts it for ``target`` (``"tpu"``, ``"litert"`` or ``"onnx"``).

    TPU options: ``platforms``, ``kernels`` (Pallas kernels for hot ops), ``narrow_64bit``,
    ``mesh=(("data", 1), ("model", 8))`` with ``sharding="tensor_parallel"`` for a program sharded
    over several chips, and ``precompile=("v5e:2x2",)`` to store TPU executables compiled by libtpu.
    """
    if target not in TARGETS:
        raise InputError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if target == "litert":
        return convert(module, sample_args, sample_kwargs, dynamic_shapes=dynamic_shapes,
                       quant_config=quant_config, strict_export=strict_export, **options)
    if target == "onnx":
        caps = captures([("main", module, sample_args, sample_kwargs, None)], "onnx", strict_export, dynamic_shapes)
        return build("onnx", caps, **options)
    if options:
        raise TypeError(f"export() got an unexpected keyword argument {sorted(options)[0]!r} for the tpu target")
    caps = captures([("main", module, sample_args, sample_kwargs, None)], "tpu", strict_export, dynamic_shapes)
    return build("tpu", caps, platforms=platforms, kernels=kernels, narrow_64bit=narrow_64bit,
                 quant_config=quant_config, mesh=mesh, sharding=sharding, precompile=precompile)


def _to_channel_last(x):
    """(N, C, ...) -> (N, ..., C)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise InputError("to_channel_last_io needs a tensor of rank >= 3 in layout (N, C, ...)")
    return x.permute(0, *range(2, x.dim()), 1)


def _to_channel_first(x):
    """(N, ..., C) -> (N, C, ...)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise InputError("to_channel_last_io needs a tensor of rank >= 3 in layout (N, ..., C)")
    return x.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


class ChannelLastIO(torch.nn.Module):
    """``module`` taking the positional inputs ``args`` (indices) channel-last, (N, ..., C), and giving
    the outputs ``outputs`` (indices into its output tuple, or 0 for a single one) channel-last. The
    permutes are part of the captured program, where the layout pass absorbs them into the model's
    NHWC ops: the converted file takes and gives those tensors with no TRANSPOSE at its boundary.
    With ``args``/``outputs`` ``"images"``: every 4-D float tensor, wherever it is (``channels_last_io=True``).
    """

    def __init__(self, module, args=None, outputs=None):
        super().__init__()
        self.module, self.args, self.outputs = module, args or [], outputs or []

    def forward(self, *args, **kwargs):
        if self.args == "images":
            args, kwargs = pytree.tree_map(_image_to_first, (args, kwargs))
        else:
            args = list(args)
            for i in self.args:
                args[i] = _to_channel_first(args[i])
        out = self.module(*args, **kwargs)
        if self.outputs == "images":
            return pytree.tree_map(lambda t: _to_channel_last(t) if _image_like(t) else t, out)
        single = not isinstance(out, (list, tuple))
        items = [out] if single else list(out)
        for i in self.outputs:
            items[i] = _to_channel_last(items[i])
        return items[0] if single else type(out)(items)


def _image_like(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()


def _image_to_first(t):
    return _to_channel_first(t) if _image_like(t) else t


def to_channel_last_io(module, args=None, outputs=None) -> ChannelLastIO:
    """litert-torch's wrapper: ``module`` with the positional inputs ``args`` (indices) taken as
    (N, ..., C) and the outputs ``outputs`` (indices) given as (N, ..., C), any rank >= 3. Wrap before
    ``convert``; wrappers chain."""
    return ChannelLastIO(module, args=list(args or []), outputs=list(outputs or []))


def channels_last(module, sample_args: Sequence, sample_kwargs: dict | None = None):
    """``channels_last_io=True``: every 4-D float input and output NHWC; the sample inputs transposed to match."""
    from .capture import to_torch
    to_nhwc = lambda t: _to_channel_last(t).contiguous() if _image_like(t) else t  # noqa: E731
    args = pytree.tree_map(to_nhwc, pytree.tree_map(to_torch, tuple(sample_args)))
    kwargs = pytree.tree_map(to_nhwc, pytree.tree_map(to_torch, dict(sample_kwargs or {})))
    if not any(_image_like(t) for t in pytree.tree_leaves((args, kwargs))):
        raise InputError("channels_last_io=True needs a 4-D floating input (an NCHW image)")
    return ChannelLastIO(module, args="images", outputs="images"), args, kwargs


# Keyword options of the litert target (litert-torch's lightweight_conversion is accepted and changes
# nothing: conversion here always streams weights instead of holding copies).
LITERT_OPTIONS = ("io_dtypes", "skip_passes", "output_file_path")
_NO_OPS = ("lightweight_conversion",)


def _litert_options(where: str, options: dict) -> dict:
    unknown = sorted(set(options) - set(LITERT_OPTIONS) - set(_NO_OPS))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""))
    return {k: v for k, v in options.items() if k not in _NO_OPS}


def convert(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *, dynamic_shapes=None,
            quant_config=None, strict_export: bool | str = False, channels_last_io: bool = False, **options):
    """Converts ``module`` to a LiteRT flatbuffer (a drop-in for ``litert_torch.convert``).

    ``channels_last_io=True``: 4-D float inputs and outputs are NHWC in the file (the NCHW sample
    inputs are transposed for you), so a vision model takes camera frames as they come, with no
    TRANSPOSE at its boundary. ``io_dtypes="web"``: every input and output is float32, int32 or
    uint8, the tensor types LiteRT.js accepts (int64 token ids become int32, checked to fit).
    ``quant_config``: ``"fp16"``, ``"dynamic_int8"`` or ``{"recipe": "int8", "calibration": [sample_args,
    ...]}``; the result's ``quant_report`` gives sizes and the error against float on the sample inputs.
    """
    if not isinstance(sample_args, (tuple, list)):
        sample_args = (sample_args,)
    if channels_last_io:
        if isinstance(quant_config, dict) and isinstance(quant_config.get("calibration"), (list, tuple)):
            quant_config = dict(quant_config, calibration=[
                dict(zip(("args", "kwargs"), channels_last(module, *_sample_parts(c))[1:]))
                for c in quant_config["calibration"]])
        module, sample_args, sample_kwargs = channels_last(module, sample_args, sample_kwargs)
    options = _litert_options("convert", options)
    caps = captures([(DEFAULT_SIGNATURE, module, sample_args, sample_kwargs, None)], "litert", strict_export,
                    dynamic_shapes)
    return _built_litert(caps, quant_config, options)


def _built_litert(caps, quant_config, options):
    output_file_path = options.pop("output_file_path", None)  # litert-torch's: also write the file
    edge = build("litert", caps, quant_config=quant_config, **options)
    if output_file_path is not None:
        edge.export(output_file_path)
    return edge


def _sample_parts(sample) -> tuple:
    if isinstance(sample, dict) and set(sample) <= {"args", "kwargs"}:
        return tuple(sample.get("args", ())), sample.get("kwargs")
    return (tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)), None


class SignatureSet:
    """Several entry points (e.g. ``prefill`` and ``decode``) exported into one artifact, weights shared."""

    def __init__(self):
        self.entries: list[tuple] = []

    def signature(self, name: str, module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
                  dynamic_shapes=None) -> "SignatureSet":
        """Adds a named entry point (``add_signature`` is litert-torch's name for it)."""
        if any(e[0] == name for e in self.entries):
            raise InputError(f"signature {name!r} is given twice")
        self.entries.append((name, module, tuple(sample_args) if isinstance(sample_args, (tuple, list))
                             else (sample_args,), sample_kwargs, dynamic_shapes))
        return self

    add_signature = signature

    def convert(self, module=None, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
                quant_config=None, strict_export: bool | str = False, dynamic_shapes=None, **options):
        """One ``.tflite`` with every signature, weights stored once. ``module`` (with its sample
        inputs) adds the default signature, ``serving_default``: what a call without
        ``signature_name`` runs, as in litert-torch."""
        options = _litert_options("convert", options)
        entries = list(self.entries)
        if module is not None:
            if any(e[0] == DEFAULT_SIGNATURE for e in entries):
                raise InputError(f"signature {DEFAULT_SIGNATURE!r} is given twice")
            entries.append((DEFAULT_SIGNATURE, module, tuple(sample_args) if isinstance(sample_args, (tuple, list))
                            else (sample_args,), sample_kwargs, dynamic_shapes))
        return _built_litert(captures(entries, "litert", strict_export), quant_config, options)

    def export(self, *, target: str = "tpu", strict_export: bool | str = False, **options):
        if target == "litert":
            return self.convert(strict_export=strict_export, **options)
        if target != "tpu":
            raise InputError(f"signatures can be exported for tpu or litert, not {target!r}")
        return build("tpu", captures(self.entries, "tpu", strict_export), **options)


def signature(name: str, module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
              dynamic_shapes=None) -> SignatureSet:
    """Starts a multi-signature export: ``tte.signature("prefill", m, a).signature("decode", m, b).convert()``."""
    return SignatureSet().signature(name, module, sample_args, sample_kwargs, dynamic_shapes=dynamic_shapes)


def load(path: str | os.PathLike):
    """Loads a ``.tpu`` (TpuProgram), ``.tflite`` (EdgeModel) or ``.onnx`` file into its runtime."""
    from .models import sniff_model
    kind = sniff_model(os.fspath(path))
    if kind == "tpu":
        return TpuProgram(tpu_format.read(path))
    if kind == "litert":
        from .edge import EdgeModel
        return EdgeModel.from_file(path)
    if kind == "onnx":
        return OnnxProgram.from_file(path)
    raise InputError(f"{path} is a {kind} file, not a converted artifact; convert it first "
                     f"(torchtpu-export {os.fspath(path)} --target tpu)")

