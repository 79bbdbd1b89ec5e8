"""The litert target: on-device deployment (Android, iOS, desktop, browser) as LiteRT flatbuffers.

- converter: ``converters/litert`` (TFLite builtins per ATen op, the passes in its ``PIPELINE``,
  the flatbuffer written directly: no TensorFlow, no MLIR converter);
- artifact: ``.tflite`` (``litert_format`` reads and validates flatbuffers);
- runtime: ``runtimes/litert`` (LiteRT's Interpreter with XNNPACK, or its CompiledModel API);
- runnable: :class:`EdgeModel` (litert-torch's ``Model``); describer: :func:`describe`.

Flatbuffers made by torchtpu-export carry their inputs' and outputs' pytree structure in their
``torchtpu_export`` metadata, so a loaded model takes and returns the same structures as the
original module; other ``.tflite`` files are called with their signature's inputs in order.
"""
from __future__ import annotations

import mmap
import os
import shutil
from typing import Sequence

import numpy as np
import torch
import torch.utils._pytree as pytree

from ...errors import ArtifactError, InputError, OutputError
from ...fileio import atomic_open, write_bytes_atomic
from .artifact import LiteRTArtifact, damaged, op_histogram, parse_model, read_metadata, signature_io, validate
from ...specs import TensorSpec, as_numpy, bind_dims, check_dims, numpy_dtype
from ..base import LlmSupport, Runnable, Target, no_topologies


def _quantize_input(x, scale_zero: tuple, dtype: str) -> np.ndarray:
    # float values for a quantized (integer I/O) input: q = round(x / scale) + zero_point, saturated
    a = as_numpy(x)
    if a.dtype.kind != "f":
        return a  # already quantized by the caller
    info = np.iinfo(numpy_dtype(dtype))
    scale, zero = scale_zero
    return np.clip(np.rint(a.astype(np.float64) / scale) + zero, info.min, info.max).astype(numpy_dtype(dtype))


DEFAULT_SIGNATURE = "serving_default"


class NamedOutputs(dict):
    """A dict of outputs in the module's structure that also answers its flat output names."""

    def __init__(self, tree: dict, flat: dict):
        super().__init__(tree)
        self._flat = flat

    def __missing__(self, key):
        if key in self._flat:
            return self._flat[key]
        raise KeyError(key)


# flattened like the dict it is (a pytree leaf otherwise)
pytree.register_pytree_node(NamedOutputs, lambda d: (list(d.values()), list(d.keys())),
                            lambda values, keys: dict(zip(keys, values)))


class EdgeModel(Runnable):
    """A LiteRT flatbuffer: ``edge(*args)`` runs it; ``edge.export(path)`` writes it.

    With several signatures (``tte.signature``), pick one with ``signature_name``.
    Inputs may be torch tensors or numpy arrays, as the module takes them or by signature name
    as litert-torch calls them (``edge(args_0=x, z_data_1=w)``); outputs are numpy arrays, in the
    structure the module returned, and a dict also answers its flat output names (``out["y_data_1"]``).
    """

    default_signature = DEFAULT_SIGNATURE  # as litert-torch picks among several

    def __init__(self, content: bytes, signatures: dict | None = None, quantization: dict | None = None):
        self._content = bytes(content) if not isinstance(content, mmap.mmap) else content
        self._path: str | None = None  # the file the content maps, which runtimes then load themselves
        self._artifact: LiteRTArtifact | None = None  # what conversion made (it may own a temporary file)
        model = validate(self._content)  # before LiteRT ever sees it
        try:
            self._sigs = signature_io(model)
        except Exception as e:
            raise damaged(e) from e
        from . import npu
        self._npu = bool(npu.dispatch_ops(model, self._content))  # compiled for a phone NPU
        meta = read_metadata(self._content, verify=True) if signatures is None else {"signatures": signatures}
        self._meta = (meta or {}).get("signatures", {})
        # recipe and weight sizes when quantized; tte.convert adds the error against float as quant_report
        self.quantization = quantization if signatures is not None else (meta or {}).get("quantization")
        self.quant_report = None
        if not self._sigs:
            raise ArtifactError("the flatbuffer has no SignatureDef; LiteRT runs models through signatures",
                                hint="convert it with a tool that writes signatures (e.g. torchtpu-export)")
        for sig, spec in self._meta.items():  # the metadata must describe these very signatures
            io = self._sigs.get(sig)
            if io is None or any(sorted(s["name"] for s in spec[side]) != sorted(t.name for t in io[side])
                                 for side in ("inputs", "outputs")):
                raise ArtifactError(f"the flatbuffer's metadata does not match its signature {sig!r}",
                                    hint="the file was damaged after conversion: convert it again")
        self._runners: dict = {}
        self._interpreters: dict = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, signatures: dict | None = None,
                  quantization: dict | None = None) -> "EdgeModel":
        """The model in a ``.tflite`` file, mapped rather than read: memory holds what runs, not a
        copy of the file, and LiteRT loads the file itself."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                content = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror}") from e
        except ValueError:  # an empty file cannot be mapped
            raise ArtifactError(f"{path} is empty, not a TFLite flatbuffer") from None
        try:
            model = cls(content, signatures, quantization)
        except BaseException:
            try:
                content.close()
            except BufferError:  # views into it still live (in the error's traceback): freed with them
                pass
            raise
        model._path = path
        return model

    @classmethod
    def from_artifact(cls, artifact: LiteRTArtifact) -> "EdgeModel":
        """The model the converter made (its temporary file, if any, lives as long as the model)."""
        if artifact.content is not None:
            model = cls(artifact.content, artifact.signatures, artifact.quantization)
        else:
            model = cls.from_file(artifact.path, signatures=artifact.signatures, quantization=artifact.quantization)
        model._artifact = artifact
        return model

    # ---- what it holds ---------------------------------------------------------------------

    @property
    def signatures(self) -> list[str]:
        return list(self._sigs)

    def _call_metadata(self, sig: str) -> dict | None:
        return self._meta.get(sig)

    def _io(self, sig: str):
        return self._sigs[sig]["inputs"], self._sigs[sig]["outputs"]

    def dim_ranges(self, signature_name: str | None = None) -> dict[str, tuple]:
        """The dynamic dims of a signature's inputs -> (min, max or None), as exported."""
        sig = self.signature(signature_name)
        return {k: tuple(v) for k, v in self._meta.get(sig, {}).get("dims", {}).items()}

    def model_content(self) -> bytes:
        """The flatbuffer's bytes (for a model held in a file, read from it: prefer ``export`` for large ones)."""
        return self._content if isinstance(self._content, bytes) else self._content[:]

    tflite_model = model_content

    def export(self, path: str | os.PathLike) -> None:
        """Writes the ``.tflite`` file atomically (a failed write leaves nothing behind)."""
        if self._artifact is not None:
            self._artifact.save(path)  # a converted model's temporary file is linked into place
        elif isinstance(self._content, bytes):
            write_bytes_atomic(path, self._content)
        else:  # copied file to file: reading it through the mapping would bring all of it into memory
            with atomic_open(path) as f, open(self._path, "rb") as src:
                shutil.copyfileobj(src, f, 8 << 20)

    save = export

    # ---- running it ------------------------------------------------------------------------

    def runner(self, signature_name: str | None = None, *, runtime: str = "interpreter",
               num_threads: int | None = None, allow_unverified_npu: bool = False):
        """The runner of one signature: LiteRT's ``"interpreter"`` or its ``"compiled_model"`` API, or for a
        file compiled for a Qualcomm NPU, ``"qnn_htp"``: QNN's HTP simulator (x86-64, onnxruntime-qnn).

        A compiled file runs only when it matches the digest ``torchtpu-export compile`` wrote in it;
        ``allow_unverified_npu=True`` runs one without a digest (compiled by another tool) too."""
        from ...runtimes import litert
        sig = self.signature(signature_name)
        if runtime not in litert.RUNTIMES:
            raise InputError(f"unknown LiteRT runtime {runtime!r}; choose one of {', '.join(litert.RUNTIMES)}")
        if self._npu and runtime != "qnn_htp":  # a changed file is named as such; then no CPU runtime gets it
            from . import npu
            npu.require_digest(npu.digest_state(self._content, parse_model(self._content)), allow_unverified=True)
            raise ArtifactError(f"LiteRT's {runtime} runtime here runs on the CPU, and this file is compiled for a "
                                f"phone NPU (DISPATCH_OP)", hint=litert.NPU_HINT)
        key = (sig, runtime, num_threads, allow_unverified_npu)
        if key not in self._runners:
            # torch's shapes (dynamic dims by name) with the dtypes the flatbuffer declares
            ins, outs = self.inputs(sig), self.outputs(sig)
            io_ins = {s.name: s for s in self._sigs[sig]["inputs"]}
            io_outs = {s.name: s for s in self._sigs[sig]["outputs"]}
            ins = [TensorSpec(s.name, s.shape, io_ins[s.name].dtype) if s.name in io_ins else s for s in ins]
            outs = [TensorSpec(s.name, s.shape, io_outs[s.name].dtype) if s.name in io_outs else s for s in outs]
            if runtime == "interpreter":
                # one Interpreter serves every signature of the model
                interp = self._interpreters.get(num_threads)
                r = litert.InterpreterRunner(self._source(), sig, ins, outs, num_threads=num_threads,
                                             interpreter=interp)
                self._interpreters[num_threads] = r.interpreter
            elif runtime == "qnn_htp":
                from ...runtimes.qnn_htp import QnnHtpRunner
                r = QnnHtpRunner(self._source(), sig, ins, outs, allow_unverified=allow_unverified_npu)
            else:
                r = litert.CompiledModelRunner(self._source(), sig, ins, outs, num_threads=num_threads)
            self._runners[key] = r
        return self._runners[key]

    def _source(self):
        # what a runtime loads: the file when there is one (LiteRT maps it), else the bytes
        return self._path if self._path is not None else self._content

    def run_flat(self, inputs: Sequence, signature_name: str | None = None, *,
                 runtime: str = "interpreter", allow_unverified_npu: bool = False) -> list[np.ndarray]:
        """Runs on already-flattened inputs (the signature's input order); returns the flat outputs,
        on LiteRT's ``"interpreter"`` or ``"compiled_model"`` runtime, or ``"qnn_htp"`` (see :meth:`runner`)."""
        return self._run(self.signature(signature_name), list(inputs), runtime, allow_unverified_npu)

    def _run(self, sig: str, inputs: list, runtime: str = "interpreter",
             allow_unverified_npu: bool = False) -> list[np.ndarray]:
        specs = self.inputs(sig)
        if len(inputs) != len(specs):
            raise InputError(f"expected {len(specs)} inputs ({', '.join(str(s) for s in specs)}), got {len(inputs)}")
        inputs = [x if hasattr(x, "shape") else np.asarray(x) for x in inputs]
        ranges = self.dim_ranges(sig)
        check_dims(specs, inputs, ranges)
        # symbols that inputs only have inside expressions ("4*s0"), against their ranges too
        for name, n in bind_dims(specs, inputs).items():
            lo, hi = ranges.get(name, (0, None))
            if n < lo or (hi is not None and n > hi):
                raise InputError(f"dynamic dim {name} = {n} (from the inputs' sizes {[list(np.shape(x)) for x in inputs]}) "
                                 f"is outside the exported range [{lo}, {hi if hi is not None else 'inf'}]",
                                 hint="export again with wider dynamic_shapes bounds")
        quant = self._sigs[sig]["quant"] if sig in self._meta else {}
        if quant:  # integer I/O (int8 recipe): float values in and out, as the module takes and gives them
            io_ins = {s.name: s for s in self._sigs[sig]["inputs"]}
            inputs = [_quantize_input(x, quant[s.name], io_ins[s.name].dtype)
                      if s.name in quant and s.dtype.startswith(("float", "bfloat")) else x
                      for x, s in zip(inputs, specs)]
        outs = self.runner(sig, runtime=runtime, allow_unverified_npu=allow_unverified_npu).run(list(inputs))
        result = []
        for o, s in zip(outs, self.outputs(sig)):
            if s.name in quant and s.dtype.startswith(("float", "bfloat")):
                scale, zero = quant[s.name]
                o = ((o.astype(np.float32) - zero) * np.float32(scale)).astype(np.float32)
            # 64-bit outputs travel as 32-bit ones inside the model: give back torch's dtype
            if s.dtype not in ("bfloat16", "string") and o.dtype != numpy_dtype(s.dtype):
                o = o.astype(numpy_dtype(s.dtype))
            result.append(o)
        return result

    def _bind(self, sig: str, args, kwargs) -> list | None:
        """The inputs in signature order when the call names exactly the signature's inputs."""
        names = [s.name for s in self.inputs(sig)]
        given = {f"args_{i}": a for i, a in enumerate(args)}
        if not kwargs or set(kwargs) & set(given):
            return None
        given.update(kwargs)
        return [given[n] for n in names] if set(given) == set(names) else None

    def _structure(self, sig: str, outs: list):
        tree = super()._structure(sig, outs)
        if isinstance(tree, dict):
            return NamedOutputs(tree, {s.name: o for s, o in zip(self.outputs(sig), outs)})
        return tree

    def __repr__(self) -> str:
        return f"EdgeModel(signatures={self.signatures}, {len(self._content):,} bytes)"


# ---- channel-last inputs and outputs ---------------------------------------------------------

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
    from ...capture import to_torch
    to_nhwc = lambda t: _to_channel_last(t).contiguous() if _image_like(t) else t  # noqa: E731
    args = pytree.tree_map(to_nhwc, pytree.tree_map(to_torch, tuple(sample_args)))
    kwargs = pytree.tree_map(to_nhwc, pytree.tree_map(to_torch, dict(sample_kwargs or {})))
    if not any(_image_like(t) for t in pytree.tree_leaves((args, kwargs))):
        raise InputError("channels_last_io=True needs a 4-D floating input (an NCHW image)")
    return ChannelLastIO(module, args="images", outputs="images"), args, kwargs


# Keyword options of the litert target (litert-torch's lightweight_conversion is accepted and changes
# nothing: conversion here always streams weights instead of holding copies).
LITERT_OPTIONS = ("io_dtypes", "skip_passes", "output_file_path", "quant_config", "quant_report")
_NO_OPS = ("lightweight_conversion",)


def _litert_options(where: str, options: dict) -> dict:
    unknown = sorted(set(options) - set(LITERT_OPTIONS) - set(_NO_OPS))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else ""))
    return {k: v for k, v in options.items() if k not in _NO_OPS}


def prepare(module, sample_args, sample_kwargs, options: dict):
    """Before capture: ``channels_last_io=True`` wraps the module so that 4-D float inputs and outputs
    are NHWC, and transposes the sample inputs (and int8 calibration samples) to match."""
    options = dict(options)
    if options.pop("channels_last_io", False):
        quant_config = options.get("quant_config")
        if isinstance(quant_config, dict) and isinstance(quant_config.get("calibration"), (list, tuple)):
            options["quant_config"] = dict(quant_config, calibration=[
                dict(zip(("args", "kwargs"), channels_last(module, *_sample_parts(c))[1:]))
                for c in quant_config["calibration"]])
        module, sample_args, sample_kwargs = channels_last(module, sample_args, sample_kwargs)
    return module, sample_args, sample_kwargs, options


def build(captures: dict, options: dict) -> "EdgeModel":
    """One flatbuffer with a signature per captured program, wrapped in an EdgeModel; with a quantization
    recipe, its ``quant_report``; with ``output_file_path`` (litert-torch's option), also written there."""
    from ... import converters
    from ...runtimes.litert import TensorObserver
    options = _litert_options("convert", options)
    TARGET.check_recipe(options.get("quant_config"))
    output_file_path = options.pop("output_file_path", None)
    report = options.pop("quant_report", True)  # False: no error measured on the sample inputs
    edge = EdgeModel.from_artifact(converters.converter(TARGET.converter).convert(captures, observer=TensorObserver,
                                                                        **options))
    info = edge.quantization
    if info is not None and report:  # a recipe, or a model quantized with pt2e
        from ...quant import report_against_eager
        edge.quant_report = report_against_eager(edge, captures, info["recipe"], info["float_weight_bytes"],
                                                 info["weight_bytes"])
    if output_file_path is not None:
        edge.export(output_file_path)
    return edge


def load(path) -> "EdgeModel":
    return EdgeModel.from_file(path)


def cli_options(args, sample_args, sample_kwargs) -> dict:
    options = {k: v for k, v in (("io_dtypes", args.io_dtypes), ("channels_last_io", args.channels_last)) if v}
    if args.quantize == "int8":  # the command line has one set of inputs: they calibrate
        options["quant_config"] = {"recipe": "int8", "calibration": [{"args": sample_args, "kwargs": sample_kwargs}]}
    elif args.quantize:
        options["quant_config"] = args.quantize
    return options


def _sample_parts(sample) -> tuple:
    if isinstance(sample, dict) and set(sample) <= {"args", "kwargs"}:
        return tuple(sample.get("args", ())), sample.get("kwargs")
    return (tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)), None


# ---- the target ----------------------------------------------------------------------------

def describe(path: str, topologies=None) -> dict:
    """What ``torchtpu-export inspect`` prints for a ``.tflite``: signatures, I/O, op histograms, sizes."""
    no_topologies(topologies)
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    try:
        return describe_content(path, content)
    except ArtifactError:
        raise
    except Exception as e:
        raise damaged(e) from e


def gpu_compatibility(path: str) -> dict:
    """LiteRT's own GPU-delegate compatibility check of a ``.tflite`` (its model analyzer):
    ``{"compatible": bool, "problems": [the analyzer's warning lines]}``. The file is validated first:
    the analyzer is native code that trusts the file."""
    try:
        with open(path, "rb") as f:
            validate(f.read())
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    from ai_edge_litert import _pywrap_analyzer_wrapper as analyzer
    text = analyzer.ModelAnalyzer(str(path), True, True)
    problems = [line.strip() for line in text.splitlines() if "GPU COMPATIBILITY WARNING" in line]
    return {"compatible": "looks compatible with GPU delegate" in text and not problems, "problems": problems}


def describe_content(path: str, content: bytes) -> dict:
    model = validate(content)
    io = signature_io(model)
    meta = read_metadata(content) or {}
    programs = {}
    transposes = 0
    for sig, spec in io.items():
        hist = op_histogram(model, [spec["subgraph"]])
        transposes += hist.get("TRANSPOSE", 0)
        sig_meta = meta.get("signatures", {}).get(sig)
        programs[sig] = {
            "inputs": [s.to_json() for s in spec["inputs"]], "outputs": [s.to_json() for s in spec["outputs"]],
            "op_histogram": dict(sorted(hist.items())), "transposes": hist.get("TRANSPOSE", 0),
            "torch_inputs": sig_meta["inputs"] if sig_meta else None,
        }
    weight_bytes, weight_count = 0, 0
    meta_buffers = {model.Metadata(i).Buffer() for i in range(model.MetadataLength())}
    for i in range(model.BuffersLength()):
        if i in meta_buffers:
            continue
        b = model.Buffers(i)
        n = b.Size() if b.Offset() > 1 else b.DataLength()
        if n:
            weight_count += 1
            weight_bytes += n
    versions = meta.get("versions", {})
    npu_info = _npu_description(model, content, programs)
    extra = ([npu_info["line"], npu_info["digest_line"]] if npu_info else []) + [f"TRANSPOSE ops: {transposes}",
             "made by torchtpu-export" if meta else "not made by torchtpu-export (no pytree metadata)"]
    quant = meta.get("quantization")
    if quant:
        extra.append(f"quantized: {quant['recipe']} (weights {quant['weight_bytes']:,} bytes; "
                     f"{quant['float_weight_bytes']:,} in float)")
    return {
        "path": path, "kind": "litert", "unit": "signature", "size": os.path.getsize(path), "programs": programs,
        "versions": versions, "schema_version": model.Version(),
        "weights": {"count": weight_count, "bytes": weight_bytes},
        "transposes": transposes, "quantization": quant, "npu": npu_info,
        "extra_lines": extra,
    }


def _npu_description(model, content, programs: dict) -> dict | None:
    # a file compiled by LiteRT's AOT path: its SoC, NPU partitions and the ops left on the CPU
    from . import npu
    parts = npu.dispatch_ops(model, content)
    if not parts:
        return None
    stamp = npu.soc_stamp(content, model)
    soc = " ".join(stamp) if stamp else "an NPU"
    cpu: dict[str, int] = {}
    for prog in programs.values():
        for op, n in prog["op_histogram"].items():
            if op != "CUSTOM:DISPATCH_OP":
                cpu[op] = cpu.get(op, 0) + n
    nbytes = sum(p["bytecode_size"] for p in parts)
    left = ", ".join(f"{op} {n}" for op, n in sorted(cpu.items())) or "none"
    digest = npu.digest_state(content, model)
    return {"soc": stamp, "partitions": parts, "cpu_ops": cpu, "bytecode_bytes": nbytes, "digest": digest,
            "line": f"compiled for {soc}: {len(parts)} NPU partition{'s' if len(parts) != 1 else ''} "
                    f"(DISPATCH_OP, {nbytes:,} bytes of NPU bytecode); ops left on the CPU: {left}",
            "digest_line": _DIGEST_LINES[digest]}


_DIGEST_LINES = {
    "ok": "NPU digest: ok (the whole file is as torchtpu-export compiled it)",
    "mismatch": "NPU digest: MISMATCH: the file was changed after compilation (runtimes refuse it)",
    "absent": "NPU digest: absent (not compiled by torchtpu-export; runtimes refuse it unless "
              "allow_unverified_npu=True)",
}


def npu_report(path: str, soc: str) -> list[dict]:
    """``inspect model.tflite --soc ...``: compiles in memory for each SoC and says how many of the
    model's ops its NPU takes and which stay on the CPU (nothing is written)."""
    from . import npu
    content = _read_plain_tflite(path)
    out = []
    for r in npu.soc_results(npu.compile_model(content, npu.parse_targets(soc))):
        cpu = op_histogram(validate(r.content))
        cpu.pop("CUSTOM:DISPATCH_OP", None)
        out.append({"soc": r.name, "ops_on_npu": r.ops_on_npu, "ops_total": r.ops_total,
                    "partitions": r.partitions, "cpu_ops": cpu, "size": len(r.content)})
    return out


def _read_plain_tflite(path: str) -> bytes:
    # a .tflite to compile for NPUs: validated, and not one already compiled
    from . import npu
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    model = validate(content)
    if npu.dispatch_ops(model, content):
        raise InputError(f"{path} is already compiled for an NPU (it has DISPATCH_OPs)",
                         hint="compile the CPU .tflite it was made from")
    return content


def compile_cli(args) -> list[str]:
    """``torchtpu-export compile model.tflite --soc qualcomm:SM8650[,...] [-o DIR | --ai-pack DIR]``:
    one ``<stem>_<SoC>.tflite`` per SoC (and the CPU model as the fallback when DIR is not the
    model's folder), or an Android AI Pack. Every SoC compiles before anything is written."""
    from . import npu
    from ...fileio import check_writable
    for flag in ("topology", "signature"):
        if getattr(args, flag, None):
            raise InputError(f"--{flag} applies to .tpu programs; a .tflite compiles for NPUs with --soc")
    if not args.soc:
        raise InputError("compile model.tflite needs --soc", hint="e.g. --soc qualcomm:SM8650 or --soc qualcomm:all")
    for flag, value in (("-o", args.output), ("--ai-pack", args.ai_pack)):
        if value is not None and not value:
            raise InputError(f"{flag} is empty: give a folder")
    if args.ai_pack and args.output:
        raise InputError("give -o DIR (one file per SoC) or --ai-pack DIR, not both")
    socs = npu.parse_targets(args.soc)
    content = _read_plain_tflite(args.artifact)
    stem = os.path.splitext(os.path.basename(args.artifact))[0]
    if args.ai_pack:
        return _write_ai_pack(content, socs, args.ai_pack, stem)
    out_dir = args.output or os.path.dirname(os.path.abspath(args.artifact))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError(f"-o {out_dir} is a file: give the folder for the compiled models")
    _check_folder(out_dir, "-o")
    results = npu.soc_results(npu.compile_model(content, socs))
    _make_folder(out_dir, "-o")
    paths = [check_writable(os.path.join(out_dir, f"{stem}_{r.name}.tflite"), inputs=(args.artifact,))
             for r in results]
    lines = []
    for r, path in zip(results, paths):
        write_bytes_atomic(path, r.content)
        lines.append(f"{r.name}: {r.ops_on_npu}/{r.ops_total} ops on the NPU in {r.partitions} "
                     f"partition{'s' if r.partitions != 1 else ''}; wrote {path} ({len(r.content):,} bytes)")
    fallback = os.path.join(out_dir, f"{stem}.tflite")
    if not (os.path.exists(fallback) and os.path.samefile(fallback, args.artifact)):
        write_bytes_atomic(check_writable(fallback), content)
        lines.append(f"CPU fallback: wrote {fallback}")
    return lines


def _check_folder(path: str, flag: str) -> None:
    # before compiling: a folder can be made at ``path`` (or is there): its nearest existing ancestor is one
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        kind = "a symbolic link to nothing" if not os.path.exists(probe) else "not a folder"
        raise OutputError(f"{flag} {path}: {probe} is {kind}", hint="give a folder that exists or can be made")


def _make_folder(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot make the {flag} folder {path}: {e.strerror or e}") from None


def _write_ai_pack(content: bytes, socs: list, folder: str, stem: str) -> list[str]:
    # ai_edge_litert.aot's AI Pack writer, into a new folder made whole or not at all
    import tempfile

    from ai_edge_litert.aot.ai_pack import export_lib
    from ai_edge_litert.aot.vendors import fallback_backend

    from . import npu
    folder = folder.rstrip(os.sep) or os.sep  # "pack/" names the folder itself, not what a link there points to
    if os.path.islink(folder):  # the pack replaces the folder: a link would be replaced, not followed
        raise OutputError(f"--ai-pack {folder} is a symbolic link; the AI Pack is written as a new folder",
                          hint="give a new folder, or the folder the link points to")
    if os.path.exists(folder) and (not os.path.isdir(folder) or os.listdir(folder)):
        raise InputError(f"--ai-pack {folder} exists and is not an empty folder", hint="give a new folder")
    _check_folder(folder, "--ai-pack")
    result = npu.compile_model(content, [*socs, fallback_backend.FallbackTarget()])
    parent = os.path.dirname(os.path.abspath(folder))
    _make_folder(parent, "--ai-pack")
    try:
        tmp = tempfile.mkdtemp(prefix=".tte-aipack-", dir=parent)
    except OSError as e:
        raise OutputError(f"cannot write the AI Pack beside {folder}: {e.strerror or e}") from None
    try:
        export_lib.export(result, tmp, ai_pack_name=stem, litert_model_name=stem)
        if os.path.isdir(folder) and not os.path.islink(folder):
            os.rmdir(folder)
        os.replace(tmp, folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # the folder changed while the models compiled
            raise OutputError(f"cannot write the AI Pack to {folder}: {e.strerror or e}") from None
        raise
    lines = [f"{r.name}: {r.ops_on_npu}/{r.ops_total} ops on the NPU" for r in npu.soc_results(result)]
    files = sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)
    return lines + [f"wrote AI Pack {folder}: {len(files)} files ({', '.join(files[:4])}{', ...' if len(files) > 4 else ''})"]


TARGET = Target(
    name="litert", summary="LiteRT flatbuffers (.tflite) for Android, iOS, desktop and the browser",
    converter="litert", runtime="litert", suffix=".tflite", runnable=EdgeModel, signature="serving_default",
    build=build, load=load, describe=describe, cli_options=cli_options, prepare=prepare,
    cli_arguments=(
        ("--io-dtypes", dict(default=None, choices=["auto", "web"],
                             help="litert target: 'web' makes every input/output float32, int32 or uint8 (LiteRT.js)")),
        ("--channels-last", dict(action="store_true",
                                 help="litert target: 4-D float inputs and outputs in NHWC (camera frames, canvases)")),
    ),
    recipes=("fp16", "dynamic_int8", "int8", "int4_blockwise"), magic=lambda head, names: head[4:8] == b"TFL3",
    gpu_check=gpu_compatibility, compile=compile_cli,
    npu_check=npu_report,
    # the signatures take and give the states; the caller never pads a prompt (llm.contract)
    llm=LlmSupport(recurrent_state=True),
)
