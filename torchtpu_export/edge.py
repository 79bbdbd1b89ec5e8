"""The edge model: a ``.tflite`` flatbuffer held in memory and run on LiteRT.

``tte.convert`` returns an :class:`EdgeModel`; ``tte.load("model.tflite")``
gives one back. Flatbuffers made by torchtpu-export carry their inputs' and
outputs' pytree structure in their ``torchtpu_export`` metadata, so a loaded
model takes and returns the same structures as the original module; other
``.tflite`` files are called with their signature's inputs in order.
"""
from __future__ import annotations

import mmap
import os
import shutil
from typing import Sequence

import numpy as np
import torch.utils._pytree as pytree

from .errors import ArtifactError, InputError
from .fileio import atomic_open, write_bytes_atomic
from .litert_format import LiteRTArtifact, damaged, read_metadata, signature_io, validate
from .specs import TensorSpec, as_numpy, bind_dims, check_dims, numpy_dtype

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


class EdgeModel:
    """A LiteRT flatbuffer: ``edge(*args)`` runs it; ``edge.export(path)`` writes it.

    With several signatures (``tte.signature``), pick one with ``signature_name``.
    Inputs may be torch tensors or numpy arrays; outputs are numpy arrays, in the
    structure the module returned.
    """

    def __init__(self, content: bytes, signatures: dict | None = None, quantization: dict | None = None):
        self._content = bytes(content) if not isinstance(content, mmap.mmap) else content
        self._path: str | None = None  # the file the content maps, which runtimes then load themselves
        self._artifact: LiteRTArtifact | None = None  # what conversion made (it may own a temporary file)
        model = validate(self._content)  # before LiteRT ever sees it
        try:
            self._io = signature_io(model)
        except Exception as e:
            raise damaged(e) from e
        meta = read_metadata(self._content, verify=True) if signatures is None else {"signatures": signatures}
        self._meta = (meta or {}).get("signatures", {})
        # recipe and weight sizes when quantized; tte.convert adds the error against float as quant_report
        self.quantization = quantization if signatures is not None else (meta or {}).get("quantization")
        self.quant_report = None
        if not self._io:
            raise ArtifactError("the flatbuffer has no SignatureDef; LiteRT runs models through signatures",
                                hint="convert it with a tool that writes signatures (e.g. torchtpu-export)")
        for sig, spec in self._meta.items():  # the metadata must describe these very signatures
            io = self._io.get(sig)
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
        return list(self._io)

    def _signature(self, signature_name: str | None) -> str:
        if signature_name is None:  # the only signature, else the default one, as litert-torch picks
            if len(self._io) == 1:
                return self.signatures[0]
            if DEFAULT_SIGNATURE in self._io:
                return DEFAULT_SIGNATURE
            raise InputError(f"this model has several signatures {self.signatures} and no "
                             f"{DEFAULT_SIGNATURE!r}: pass signature_name=")
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
            if s.dtype not in ("bfloat16", "string") and o.dtype != numpy_dtype(s.dtype):
                o = o.astype(numpy_dtype(s.dtype))
            result.append(o)
        return result

    def __call__(self, *args, signature_name: str | None = None, **kwargs):
        """Runs one signature on the module's own arguments (its pytree structure), or on its
        inputs by signature name as litert-torch calls them (``edge(args_0=x, z_data_1=w)``;
        positional ones are ``args_<i>``). Outputs come back in the module's structure; a dict
        also answers its flat output names (``out["y_data_1"]``)."""
        sig = self._signature(signature_name)
        meta = self._meta.get(sig)
        flat = self._by_name(sig, args, kwargs)
        if meta is None:
            if flat is None and kwargs:
                raise InputError(f"pass the inputs positionally or by their signature names "
                                 f"{[s.name for s in self.inputs(sig)]}")
            outs = self.run_flat(list(args) if flat is None else flat, sig)
            return outs[0] if len(outs) == 1 else tuple(outs)
        from . import treespec
        from .capture import flatten_call_args
        if flat is None:
            flat = flatten_call_args(meta["in_spec"], meta.get("constant_inputs", {}), args, kwargs)
        outs = self.run_flat(flat, sig)
        tree = pytree.tree_unflatten(outs, treespec.loads(meta["out_spec"]))
        if isinstance(tree, dict):
            return NamedOutputs(tree, {s.name: o for s, o in zip(self.outputs(sig), outs)})
        return tree

    def _by_name(self, sig: str, args, kwargs) -> list | None:
        """The inputs in signature order when the call names exactly the signature's inputs."""
        names = [s.name for s in self.inputs(sig)]
        given = {f"args_{i}": a for i, a in enumerate(args)}
        if not kwargs or set(kwargs) & set(given):
            return None
        given.update(kwargs)
        return [given[n] for n in names] if set(given) == set(names) else None

    def __repr__(self) -> str:
        return f"EdgeModel(signatures={self.signatures}, {len(self._content):,} bytes)"
