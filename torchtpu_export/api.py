"""The public API: ``export``, ``convert``, ``load``, ``signature``.

This is the one layer that joins capture and the targets: ``captures`` captures for a target's
converter, ``build`` converts and wraps the artifact in the target's runnable object (see
``targets``); ``export``, ``convert`` and ``signature`` are those two calls.
"""
from __future__ import annotations

import os
from typing import Sequence

from . import targets
from .capture import CapturedProgram, capture, is_abstract
from .errors import InputError


def captures(entries: Sequence[tuple], target: str, strict_export=False,
             dynamic_shapes=None) -> dict[str, CapturedProgram]:
    """Captures each ``(name, module, args, kwargs, dynamic_shapes)`` entry for ``target``'s converter."""
    from . import converters
    converter = converters.converter(targets.get(target).converter)
    out = {}
    for name, module, args, kwargs, dyn in entries:
        out[name] = capture(module, args, kwargs, dynamic_shapes=dyn if dyn is not None else dynamic_shapes,
                            strict_export=strict_export, keep=converter.KEEP_WHOLE, lowerable=converter.lowerable,
                            state=targets.get(target).stateful)
        abstract = [w for w, t in out[name].weights.items() if is_abstract(t)]
        if abstract and not targets.get(targets.get(target).program_target or target).abstract_weights:
            raise InputError(f"weight {abstract[0]!r} has no values (built under abstract_weights() or on the meta "
                             f"device); the {target} target writes weights into its file",
                             hint="load the weights (e.g. from safetensors) before converting, or export to the tpu "
                                  "target, whose programs take abstract weights and bind values at load")
    return out


def build(target: str, captured: dict[str, CapturedProgram], **options):
    """Converts already-captured programs for ``target`` and wraps the artifact in its runnable object
    (a TpuProgram, an EdgeModel or an OnnxProgram: each has ``run_flat``, ``save`` and ``__call__``).
    What ``export`` and ``convert`` do after capturing."""
    return targets.get(target).build(captured, options)


def export(module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *, target: str = "tpu",
           dynamic_shapes=None, strict_export: bool | str = False, **options):
    """Captures ``module`` once and converts it for ``target`` (``"tpu"``, ``"litert"`` or ``"onnx"``).

    tpu options: ``platforms=("tpu", "cpu")``, ``kernels="auto"`` (Pallas kernels for hot ops),
    ``narrow_64bit``, ``quant_config``, ``mesh=(("data", 1), ("model", 8))`` with
    ``sharding="tensor_parallel"`` for a program sharded over several chips, and
    ``precompile=("v5e:2x2",)`` to store TPU executables compiled by libtpu. litert options: those of
    :func:`convert`. An option the target does not take is a TypeError.
    """
    t = targets.get(target)
    if not isinstance(sample_args, (tuple, list)):
        sample_args = (sample_args,)
    if t.prepare is not None:
        module, sample_args, sample_kwargs, options = t.prepare(module, sample_args, sample_kwargs, options)
    caps = captures([(t.signature, module, sample_args, sample_kwargs, None)], target, strict_export,
                    dynamic_shapes)
    return t.build(caps, options)


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
    return export(module, sample_args, sample_kwargs, target="litert", dynamic_shapes=dynamic_shapes,
                  strict_export=strict_export, quant_config=quant_config, channels_last_io=channels_last_io,
                  **options)


class SignatureSet:
    """Several entry points (e.g. ``prefill`` and ``decode``) exported into one artifact, weights shared."""

    def __init__(self):
        self.entries: list[tuple] = []
        self.compilation_configs: list = []  # NPU targets (ai_edge_litert.aot CompilationConfigs)

    def experimental_add_compilation_backend(self, target=None, **kwargs) -> "SignatureSet":
        """litert-torch's NPU hook: ``convert`` then compiles the ``.tflite`` for ``target`` (an
        ``ai_edge_litert.aot`` target such as ``qualcomm.target.Target(SocModel.SM8650)``, a SoC
        string ``"qualcomm:SM8650"``/``"qualcomm:all"``, or None for every registered vendor)
        through ``ai_edge_litert.aot.aot_compile`` and returns its ``CompilationResult``. Adding a
        target twice is a no-op; ``kwargs`` go to the vendor's compiler."""
        from ai_edge_litert.aot.core import aot_types

        from .targets.litert import npu
        if target is None:
            from ai_edge_litert.aot.vendors import import_vendor
            found = [import_vendor.AllRegisteredTarget()]
        elif isinstance(target, str):
            found = npu.parse_targets(target)
        elif isinstance(target, aot_types.Target):
            found = [target]
        else:
            raise InputError(f"experimental_add_compilation_backend takes an ai_edge_litert.aot Target or a "
                             f"SoC string such as 'qualcomm:SM8650', not {type(target).__name__}")
        for t in found:
            if not any(type(c.target) is type(t) and c.target.flatten() == t.flatten()
                       for c in self.compilation_configs):
                self.compilation_configs.append(aot_types.CompilationConfig(target=t, **kwargs))
        return self

    def signature(self, name: str, module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
                  dynamic_shapes=None) -> "SignatureSet":
        """Adds a named entry point (``add_signature`` is litert-torch's name for it)."""
        if any(e[0] == name for e in self.entries):
            raise InputError(f"signature {name!r} is given twice")
        self.entries.append((name, module, _tuple(sample_args), sample_kwargs, dynamic_shapes))
        return self

    add_signature = signature

    def convert(self, module=None, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
                quant_config=None, strict_export: bool | str = False, dynamic_shapes=None, **options):
        """One ``.tflite`` with every signature, weights stored once. ``module`` (with its sample
        inputs) adds the default signature, ``serving_default``: what a call without
        ``signature_name`` runs, as in litert-torch."""
        entries = list(self.entries)
        if module is not None:
            default = targets.get("litert").signature
            if any(e[0] == default for e in entries):
                raise InputError(f"signature {default!r} is given twice")
            entries.append((default, module, _tuple(sample_args), sample_kwargs, dynamic_shapes))
        edge = self._export(entries, "litert", strict_export, dict(options, quant_config=quant_config))
        if self.compilation_configs:  # litert-torch's result type: ai_edge_litert.aot's CompilationResult
            from .targets.litert import npu
            return npu.compile_model(edge.model_content(), self.compilation_configs)
        return edge

    def export(self, *, target: str = "tpu", strict_export: bool | str = False, **options):
        """One artifact of ``target`` with every signature (tpu and litert take several)."""
        return self._export(self.entries, target, strict_export, options)

    @staticmethod
    def _export(entries, target: str, strict_export, options: dict):
        t = targets.get(target)
        if not t.multi_signature:
            raise InputError(f"an artifact of the {target} target holds one program, not signatures",
                             hint=f"export each signature to its own {t.suffix} file")
        return t.build(captures(entries, target, strict_export), options)


def _tuple(sample_args) -> tuple:
    return tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,)


def signature(name: str, module, sample_args: Sequence = (), sample_kwargs: dict | None = None, *,
              dynamic_shapes=None) -> SignatureSet:
    """Starts a multi-signature export: ``tte.signature("prefill", m, a).signature("decode", m, b).convert()``."""
    return SignatureSet().signature(name, module, sample_args, sample_kwargs, dynamic_shapes=dynamic_shapes)


def experimental_add_compilation_backend(target=None, **kwargs) -> SignatureSet:
    """``tte.experimental_add_compilation_backend(target).convert(model, args)``: the ``.tflite``
    compiled for an NPU through ``ai_edge_litert.aot`` (see :meth:`SignatureSet.experimental_add_compilation_backend`)."""
    return SignatureSet().experimental_add_compilation_backend(target, **kwargs)


def load(path: str | os.PathLike):
    """Loads an artifact (``.tpu``, ``.tflite``, ``.onnx``) into its target's runnable object."""
    from .models import sniff_model
    kind = sniff_model(os.fspath(path))
    if kind not in targets.NAMES:
        raise InputError(f"{path} is a {kind} file, not a converted artifact; convert it first "
                         f"(torchtpu-export {os.fspath(path)} --target tpu)")
    return targets.get(kind).load(path)
