"""The edge model: a ``.tflite`` flatbuffer held in memory and run on LiteRT.

``tte.convert`` returns an :class:`EdgeModel`; ``tte.load("model.tflite")``
gives one back. Flatbuffers made by torchtpu-export carry their inputs' and
outputs' pytree structure in their ``torchtpu_export`` metadata, so a loaded
model takes and returns the same structures as the original module; other
``.tflite`` files are called with their signature's inputs in order.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import weakref
from typing import Sequence

import numpy as np
import torch.utils._pytree as pytree

from .errors import ArtifactError, InputError
from .fileio import atomic_open, link_atomic, write_bytes_atomic
from .specs import TensorSpec, as_numpy, bind_dims, check_dims, numpy_dtype

METADATA_NAME = "torchtpu_export"
_TYPE_NAMES = {0: "float32", 1: "float16", 2: "int32", 3: "uint8", 4: "int64", 5: "string", 6: "bool", 7: "int16",
               8: "complex64", 9: "int8", 10: "float64", 11: "complex128", 12: "uint64", 15: "uint32", 16: "uint16",
               18: "bfloat16"}


def _model(content: bytes):
    from ai_edge_litert import schema_py_generated as fb
    if len(content) < 8 or content[4:8] != b"TFL3":
        raise ArtifactError("not a TFLite flatbuffer (no TFL3 identifier)")
    try:
        return fb.Model.GetRootAs(content, 0)
    except Exception as e:
        raise ArtifactError(f"cannot parse the TFLite flatbuffer ({type(e).__name__}: {e})") from e


def weights_digest(chunks) -> str:
    """blake2b of a model's constant buffers in order (each prefixed by its length)."""
    h = hashlib.blake2b(digest_size=16)
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def _damaged(e: Exception) -> ArtifactError:
    return ArtifactError(f"the TFLite flatbuffer is truncated or damaged ({type(e).__name__}: {str(e)[:120]})",
                         hint="convert or download the model again")


def _verify_digest(model, content, skip: set, expected: str) -> None:
    # blake2b as weights_digest computes it, over views of the content (no copies). A mapped
    # file is hashed a chunk at a time and each chunk unmapped again: the check reads the whole
    # file without keeping it in memory.
    h = hashlib.blake2b(digest_size=16)
    view = memoryview(content)
    try:
        for i in range(1, model.BuffersLength()):
            if i in skip:
                continue
            start, size = _buffer_span(model, content, i)
            h.update(size.to_bytes(8, "little"))
            for a in range(start, start + size, _CHUNK):
                b = min(a + _CHUNK, start + size)
                h.update(view[a:b])
                if isinstance(content, mmap.mmap):
                    page = a - a % mmap.PAGESIZE
                    content.madvise(mmap.MADV_DONTNEED, page, b - page)
    finally:
        view.release()
    if h.hexdigest() != expected:
        raise ArtifactError("the model's weights do not match the digest written with them",
                            hint="the file was damaged after conversion: convert it again")


_CHUNK = 64 << 20


def _buffer_span(model, content, index: int) -> tuple[int, int]:
    # (start, size) of a buffer's data in the content
    buf = model.Buffers(index)
    if buf.Offset() > 1:  # stored after the flatbuffer (models past 2 GB)
        if buf.Offset() + buf.Size() > len(content):
            raise ValueError(f"buffer {index} ends past the end of the file")
        return buf.Offset(), buf.Size()
    n = buf.DataLength()
    return (buf._tab.Vector(buf._tab.Offset(4)), n) if n else (0, 0)


def _buffer_bytes(model, content, index: int) -> bytes:
    start, size = _buffer_span(model, content, index)
    return bytes(content[start:start + size])


def read_metadata(content: bytes, *, verify: bool = False) -> dict | None:
    """The ``torchtpu_export`` metadata of a flatbuffer, or None for files made elsewhere.

    With ``verify``, the constants are checked against the digest the metadata records.
    """
    model = _model(content)
    try:
        for i in range(model.MetadataLength()):
            m = model.Metadata(i)
            if m.Name() and m.Name().decode() == METADATA_NAME:
                meta = json.loads(_buffer_bytes(model, content, m.Buffer()))
                if verify and "weights_blake2b" in meta:
                    _verify_digest(model, content, {m.Buffer()}, meta["weights_blake2b"])
                return meta
    except ArtifactError:
        raise
    except Exception as e:
        raise _damaged(e) from e
    return None


def _signature_io(model) -> dict:
    # Per signature: input and output TensorSpecs read from the SignatureDefs themselves.
    out = {}
    for i in range(model.SignatureDefsLength()):
        sig = model.SignatureDefs(i)
        sub = model.Subgraphs(sig.SubgraphIndex())

        quant = {}

        def specs(n, get):
            res = []
            for j in range(n):
                tm = get(j)
                t = sub.Tensors(tm.TensorIndex())
                shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
                if t.ShapeSignatureLength():
                    # -1 in shape_signature: a dynamic dim, named after its tensor and axis
                    shape = tuple(f"{tm.Name().decode()}_{k}" if int(d) < 0 else n
                                  for k, (d, n) in enumerate(zip(t.ShapeSignatureAsNumpy(), shape)))
                res.append(TensorSpec(tm.Name().decode(), shape, _TYPE_NAMES.get(t.Type(), str(t.Type()))))
                q = t.Quantization()
                if q is not None and q.ScaleLength() == 1 and t.Type() in (3, 9):  # uint8, int8
                    quant[tm.Name().decode()] = (float(q.Scale(0)), int(q.ZeroPoint(0)) if q.ZeroPointLength() else 0)
            return res
        out[sig.SignatureKey().decode()] = {"inputs": specs(sig.InputsLength(), sig.Inputs),
                                            "outputs": specs(sig.OutputsLength(), sig.Outputs),
                                            "subgraph": sig.SubgraphIndex(), "quant": quant}
    return out


def _quantize_input(x, scale_zero: tuple, dtype: str) -> np.ndarray:
    # float values for a quantized (integer I/O) input: q = round(x / scale) + zero_point, saturated
    a = as_numpy(x)
    if a.dtype.kind != "f":
        return a  # already quantized by the caller
    info = np.iinfo(numpy_dtype(dtype))
    scale, zero = scale_zero
    return np.clip(np.rint(a.astype(np.float64) / scale) + zero, info.min, info.max).astype(numpy_dtype(dtype))


class EdgeModel:
    """A LiteRT flatbuffer: ``edge(*args)`` runs it; ``edge.export(path)`` writes it.

    With several signatures (``tte.signature``), pick one with ``signature_name``.
    Inputs may be torch tensors or numpy arrays; outputs are numpy arrays, in the
    structure the module returned.
    """

    def __init__(self, content: bytes, signatures: dict | None = None, quantization: dict | None = None):
        self._content = bytes(content) if not isinstance(content, mmap.mmap) else content
        self._path: str | None = None  # the file the content maps, which runtimes then load themselves
        self._temporary = False
        model = _model(self._content)
        try:
            self._io = _signature_io(model)
        except Exception as e:
            raise _damaged(e) from e
        meta = read_metadata(self._content, verify=True) if signatures is None else {"signatures": signatures}
        self._meta = (meta or {}).get("signatures", {})
        # recipe and weight sizes when quantized; tte.convert adds the error against float as quant_report
        self.quantization = quantization if signatures is not None else (meta or {}).get("quantization")
        self.quant_report = None
        if not self._io:
            raise ArtifactError("the flatbuffer has no SignatureDef; LiteRT runs models through signatures",
                                hint="convert it with a tool that writes signatures (e.g. torchtpu-export)")
        self._runners: dict = {}
        self._interpreters: dict = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, signatures: dict | None = None,
                  temporary: bool = False, quantization: dict | None = None) -> "EdgeModel":
        """The model in a ``.tflite`` file, mapped rather than read: memory holds what runs, not a
        copy of the file, and LiteRT loads the file itself. ``temporary``: the file is deleted with
        the model (what conversion writes large models to)."""
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
            content.close()
            if temporary:
                _remove(path)
            raise
        model._path, model._temporary = path, temporary
        if temporary:
            weakref.finalize(model, _remove, path)
        return model

    # ---- what it holds ---------------------------------------------------------------------

    @property
    def signatures(self) -> list[str]:
        return list(self._io)

    def _signature(self, signature_name: str | None) -> str:
        if signature_name is None:
            if len(self._io) != 1:
                raise InputError(f"this model has several signatures {self.signatures}: pass signature_name=")
            return self.signatures[0]
        if signature_name not in self._io:
            raise InputError(f"no signature {signature_name!r}; this model has {self.signatures}")
        return signature_name

    def inputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        """The inputs as the original module takes them (torch's dtypes)."""
        sig = self._signature(signature_name)
        if sig in self._meta:
            return [TensorSpec.from_json(d) for d in self._meta[sig]["inputs"]]
        return list(self._io[sig]["inputs"])

    def outputs(self, signature_name: str | None = None) -> list[TensorSpec]:
        sig = self._signature(signature_name)
        if sig in self._meta:
            return [TensorSpec.from_json(d) for d in self._meta[sig]["outputs"]]
        return list(self._io[sig]["outputs"])

    def dim_ranges(self, signature_name: str | None = None) -> dict[str, tuple]:
        """The dynamic dims of a signature's inputs -> (min, max or None), as exported."""
        sig = self._signature(signature_name)
        return {k: tuple(v) for k, v in self._meta.get(sig, {}).get("dims", {}).items()}

    def model_content(self) -> bytes:
        """The flatbuffer's bytes (for a model held in a file, read from it: prefer ``export`` for large ones)."""
        return self._content if isinstance(self._content, bytes) else self._content[:]

    tflite_model = model_content

    def export(self, path: str | os.PathLike) -> None:
        """Writes the ``.tflite`` file atomically (a failed write leaves nothing behind)."""
        if isinstance(self._content, bytes):
            write_bytes_atomic(path, self._content)
            return
        if self._temporary:
            # the file conversion wrote: linked into place, not copied (unless on another filesystem)
            with contextlib.suppress(OSError):
                link_atomic(self._path, path)
                return
        # copied file to file: reading it through the mapping would bring all of it into memory
        with atomic_open(path) as f, open(self._path, "rb") as src:
            shutil.copyfileobj(src, f, 8 << 20)

    save = export

    # ---- running it ------------------------------------------------------------------------

    def runner(self, signature_name: str | None = None, *, runtime: str = "interpreter",
               num_threads: int | None = None):
        """The runner of one signature: LiteRT's ``"interpreter"`` or its ``"compiled_model"`` API."""
        from .runtimes import litert
        sig = self._signature(signature_name)
        if runtime not in litert.RUNTIMES:
            raise InputError(f"unknown LiteRT runtime {runtime!r}; choose one of {', '.join(litert.RUNTIMES)}")
        key = (sig, runtime, num_threads)
        if key not in self._runners:
            # torch's shapes (dynamic dims by name) with the dtypes the flatbuffer declares
            ins, outs = self.inputs(sig), self.outputs(sig)
            io_ins = {s.name: s for s in self._io[sig]["inputs"]}
            io_outs = {s.name: s for s in self._io[sig]["outputs"]}
            ins = [TensorSpec(s.name, s.shape, io_ins[s.name].dtype) if s.name in io_ins else s for s in ins]
            outs = [TensorSpec(s.name, s.shape, io_outs[s.name].dtype) if s.name in io_outs else s for s in outs]
            if runtime == "interpreter":
                # one Interpreter serves every signature of the model
                interp = self._interpreters.get(num_threads)
                r = litert.InterpreterRunner(self._source(), sig, ins, outs, num_threads=num_threads,
                                             interpreter=interp)
                self._interpreters[num_threads] = r.interpreter
            else:
                r = litert.CompiledModelRunner(self._source(), sig, ins, outs, num_threads=num_threads)
            self._runners[key] = r
        return self._runners[key]

    def _source(self):
        # what a runtime loads: the file when there is one (LiteRT maps it), else the bytes
        return self._path if self._path is not None else self._content

    def run_flat(self, inputs: Sequence, signature_name: str | None = None, *,
                 runtime: str = "interpreter") -> list[np.ndarray]:
        """Runs on already-flattened inputs (the signature's input order); returns the flat outputs."""
        sig = self._signature(signature_name)
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
        quant = self._io[sig]["quant"] if sig in self._meta else {}
        if quant:  # integer I/O (int8 recipe): float values in and out, as the module takes and gives them
            io_ins = {s.name: s for s in self._io[sig]["inputs"]}
            inputs = [_quantize_input(x, quant[s.name], io_ins[s.name].dtype)
                      if s.name in quant and s.dtype.startswith(("float", "bfloat")) else x
                      for x, s in zip(inputs, specs)]
        outs = self.runner(sig, runtime=runtime).run(list(inputs))
        result = []
        for o, s in zip(outs, self.outputs(sig)):
            if s.name in quant and s.dtype.startswith(("float", "bfloat")):
                scale, zero = quant[s.name]
                o = ((o.astype(np.float32) - zero) * np.float32(scale)).astype(np.float32)
            # 64-bit outputs travel as 32-bit ones inside the model: give back torch's dtype
            if s.dtype != "bfloat16" and o.dtype != numpy_dtype(s.dtype):
                o = o.astype(numpy_dtype(s.dtype))
            result.append(o)
        return result

    def __call__(self, *args, signature_name: str | None = None, **kwargs):
        sig = self._signature(signature_name)
        meta = self._meta.get(sig)
        if meta is None:
            if kwargs:
                raise InputError("this .tflite was not made by torchtpu-export: pass inputs positionally")
            outs = self.run_flat(list(args), sig)
            return outs[0] if len(outs) == 1 else tuple(outs)
        from . import treespec
        from .capture import flatten_call_args
        flat = flatten_call_args(meta["in_spec"], meta.get("constant_inputs", {}), args, kwargs)
        outs = self.run_flat(flat, sig)
        return pytree.tree_unflatten(outs, treespec.loads(meta["out_spec"]))

    def __repr__(self) -> str:
        return f"EdgeModel(signatures={self.signatures}, {len(self._content):,} bytes)"


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_OP_NAMES: dict | None = None


def _op_names() -> dict:
    global _OP_NAMES
    if _OP_NAMES is None:
        from ai_edge_litert import schema_py_generated as fb
        _OP_NAMES = {v: k for k, v in vars(fb.BuiltinOperator).items() if not k.startswith("_")}
    return _OP_NAMES


def _opcode_names(model) -> list[str]:
    # the operator name of each of the model's opcode entries (CUSTOM ones with their custom code)
    names = _op_names()
    codes = []
    for i in range(model.OperatorCodesLength()):
        oc = model.OperatorCodes(i)
        code = max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode())
        codes.append(names.get(code, f"CUSTOM:{(oc.CustomCode() or b'').decode()}" if code == 32 else str(code)))
    return codes


def int8_ops(content: bytes) -> dict[str, int]:
    """The operators of a flatbuffer that read an 8-bit integer tensor, by name: the kernels that run
    quantized. DEQUANTIZE counts only for constant inputs (weights stored int8, dequantized at load);
    QUANTIZE, which makes int8 values, never."""
    model = _model(content)
    codes = _opcode_names(model)
    hist: dict[str, int] = {}
    for k in range(model.SubgraphsLength()):
        sub = model.Subgraphs(k)
        for j in range(sub.OperatorsLength()):
            op = sub.Operators(j)
            name = codes[op.OpcodeIndex()]
            if name == "QUANTIZE":
                continue
            ins = [sub.Tensors(i) for i in op.InputsAsNumpy() if i >= 0] if op.InputsLength() else []
            eight_bit = [t for t in ins if t.Type() in (3, 9)]  # uint8, int8
            if name == "DEQUANTIZE":
                eight_bit = [t for t in eight_bit if model.Buffers(t.Buffer()).DataLength()
                             or model.Buffers(t.Buffer()).Size()]
            if eight_bit:
                hist[name] = hist.get(name, 0) + 1
    return hist


def describe_tflite(path: str) -> dict:
    """What ``torchtpu-export inspect`` prints for a ``.tflite``: signatures, I/O, op histograms, sizes."""
    try:
        with open(path, "rb") as f:
            content = f.read()
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}") from e
    try:
        return _describe(path, content)
    except ArtifactError:
        raise
    except Exception as e:
        raise _damaged(e) from e


def _describe(path: str, content: bytes) -> dict:
    model = _model(content)
    codes = _opcode_names(model)
    io = _signature_io(model)
    meta = read_metadata(content) or {}
    programs = {}
    transposes = 0
    for sig, spec in io.items():
        sub = model.Subgraphs(spec["subgraph"])
        hist: dict[str, int] = {}
        for j in range(sub.OperatorsLength()):
            name = codes[sub.Operators(j).OpcodeIndex()]
            hist[name] = hist.get(name, 0) + 1
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
    extra = [f"TRANSPOSE ops: {transposes}",
             "made by torchtpu-export" if meta else "not made by torchtpu-export (no pytree metadata)"]
    quant = meta.get("quantization")
    if quant:
        extra.append(f"quantized: {quant['recipe']} (weights {quant['weight_bytes']:,} bytes; "
                     f"{quant['float_weight_bytes']:,} in float)")
    return {
        "path": path, "kind": "litert", "size": os.path.getsize(path), "programs": programs,
        "versions": versions, "schema_version": model.Version(),
        "weights": {"count": weight_count, "bytes": weight_bytes},
        "transposes": transposes, "quantization": quant,
        "extra_lines": extra,
    }
