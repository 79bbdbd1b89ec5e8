"""Loading what the CLI is given: model files (.pt2, TorchScript, factories) and ``--inputs``.

Arbitrary pickles (``torch.save(module)``) are refused unless the user passes
``trust_pickle=True``: unpickling runs whatever code the file names.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
import sys
import zipfile
from typing import Any, Sequence

import numpy as np
import torch

from .errors import ArtifactError, InputError, UnsafeInputError
from .specs import numpy_dtype, require_memory

_SPEC_RE = re.compile(r"^(?P<shape>scalar|\d+(?:x\d+)*):(?P<dtype>[a-z0-9]+)(?::(?P<low>-?\d+):(?P<high>-?\d+))?$")


def sniff_model(path: str) -> str:
    """``"pt2"``, ``"torchscript"``, ``"pickle"``, ``"tpu"``, ``"litert"``, ``"onnx"`` for the file at ``path``."""
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory, not a model file")
    size = os.path.getsize(path)
    if size == 0:
        raise InputError(f"{path} is empty")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[4:8] == b"TFL3":
        return "litert"
    if head[:1] == b"\x80":
        return "pickle"
    if head[:2] == b"PK":
        try:
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
            raise ArtifactError(f"{path} is a damaged zip archive ({e})",
                                hint="the file is truncated or corrupt: save or export it again") from e
        if "manifest.json" in names:
            return "tpu"
        if any(n.endswith("/models/model.json") or n.endswith("/archive_format") for n in names):
            return "pt2"
        if any("/code/__torch__" in n for n in names):
            return "torchscript"
        if any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
            return "pickle"
        raise ArtifactError(f"{path} is a zip archive but not a .pt2, TorchScript or .tpu file")
    if path.endswith(".onnx"):
        return "onnx"
    raise ArtifactError(f"{path} is not a model file torchtpu-export reads (unrecognised header)",
                        hint="give a .pt2 from torch.export.save, a TorchScript archive, or package.module:factory")


def _is_factory(spec: str) -> bool:
    """``package.module:factory`` or ``path/to/file.py:factory`` (and not a file of that name)."""
    if ":" not in spec or os.path.exists(spec):
        return False
    source, _, attr = spec.rpartition(":")
    return attr.isidentifier() and (source.endswith(".py") or re.match(r"^[A-Za-z_][\w.]*$", source) is not None)


def load_model(spec: str, *, trust_pickle: bool = False, sample_inputs: Sequence | None = None):
    """Returns ``(model, args, kwargs)``; ``model`` is an nn.Module, callable or ExportedProgram."""
    if _is_factory(spec):
        return _load_factory(spec)
    kind = sniff_model(spec)
    if kind == "pt2":
        from torch.ao.quantization.fx import _decomposed  # noqa: F401 (the quantize ops of pt2e-quantized models)
        try:
            with contextlib.nullcontext() if trust_pickle else _no_unpickling(spec):
                ep = torch.export.load(spec)
        except UnsafeInputError:
            raise
        except Exception as e:
            raise ArtifactError(f"cannot read {spec} as a .pt2 file ({type(e).__name__}: {str(e)[:200]})",
                                hint="the file is truncated or was written by an incompatible torch: export it again")
        args, kwargs = ep.example_inputs if ep.example_inputs is not None else ((), {})
        return ep, tuple(args), dict(kwargs)
    if kind == "torchscript":
        return _load_torchscript(spec, sample_inputs)
    if kind == "pickle":
        if not trust_pickle:
            raise UnsafeInputError(
                f"{spec} is a Python pickle (torch.save of a whole module); loading it would run arbitrary code",
                hint="save with torch.export.save(torch.export.export(model, args), 'model.pt2') instead, "
                     "or pass --trust-pickle if you trust the file")
        try:
            model = torch.load(spec, weights_only=False)
        except Exception as e:
            raise ArtifactError(f"cannot unpickle {spec} ({type(e).__name__}: {str(e)[:200]})") from e
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"{spec} holds a {type(model).__name__}, not a torch.nn.Module",
                             hint="a state_dict needs its model class: use package.module:factory")
        return model, (), {}
    raise InputError(f"{spec} is a {kind} artifact, not a model to convert",
                     hint="use `torchtpu-export inspect` or `torchtpu-export run` on artifacts")


@contextlib.contextmanager
def _no_unpickling(path: str):
    """torch.export.load with every pickle it would open read by torch's weights-only unpickler
    (tensors, containers, numbers: nothing runs), and pickled Python objects refused.

    torch.export.load unpickles parts of a .pt2: the sample inputs (weights-only first, then a
    plain-pickle fallback), and pickled weights, constants and opaque objects with plain pickle.
    Those calls are routed here for the duration of the load.
    """
    from unittest import mock

    from torch.export.pt2_archive import _package

    def refuse(what):
        def raiser(*args, **kwargs):
            raise UnsafeInputError(
                f"{path} holds {what}, which would have to be unpickled to load it (that runs code from the file)",
                hint="pass --trust-pickle if you trust the file, or export it again from the model")
        return raiser

    real_load = torch.load

    def weights_only_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            # torch's message is long; its "Unsupported global: GLOBAL module.name" line says what was refused
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
            what = f" (it names {found.group(1)})" if found else ""
            raise UnsafeInputError(
                f"{path} holds a pickled object that is not plain tensors and containers{what}; loading it would "
                "run code from the file",
                hint="pass --trust-pickle if you trust the file, or export it again from the model") from None

    fake_pickle = mock.Mock(loads=refuse("a pickled Python object"), load=refuse("a pickled Python object"))
    with mock.patch.object(torch, "load", weights_only_load), \
            mock.patch.object(_package, "pickle", fake_pickle), \
            mock.patch.object(torch._C, "_pickle_load_obj", refuse("a pickled TorchScript object")):
        yield


def _import_file(path: str):
    """The module in a .py file the user named (its folder on sys.path, for its own imports)."""
    import importlib.util
    if not os.path.isfile(path):
        raise InputError(f"{path} does not exist")
    path = os.path.abspath(path)
    if os.path.dirname(path) not in sys.path:
        sys.path.insert(0, os.path.dirname(path))
    name = os.path.splitext(os.path.basename(path))[0]
    existing = sys.modules.get(name)
    if existing is not None and os.path.abspath(getattr(existing, "__file__", None) or "") == path:
        return existing
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    # registered before it runs (dataclasses and pickling look modules up), never over another module
    sys.modules[name if existing is None else f"_tte_user_{name}"] = mod
    try:
        spec.loader.exec_module(mod)
    except ImportError as e:
        raise InputError(f"cannot import {path}: {e}") from e
    return mod


def _load_factory(spec: str):
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        mod = _import_file(module_name)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(module_name)
        except ImportError as e:
            raise InputError(f"cannot import {module_name}: {e}",
                             hint="run from the directory that holds the package") from e
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise InputError(f"{module_name} has no callable {attr}")
    made = factory()
    if isinstance(made, torch.nn.Module):
        return made, (), {}
    if isinstance(made, tuple) and len(made) in (2, 3) and callable(made[0]):
        args = made[1] if isinstance(made[1], (tuple, list)) else (made[1],)
        kwargs = made[2] if len(made) == 3 else {}
        return made[0], tuple(args), dict(kwargs or {})
    raise InputError(f"{spec} must return a module or (module, sample_args[, sample_kwargs]), "
                     f"got {type(made).__name__}")


def _load_torchscript(path: str, sample_inputs):
    try:
        ts = torch.jit.load(path, map_location="cpu")
    except Exception as e:
        raise ArtifactError(f"cannot read {path} as TorchScript ({type(e).__name__}: {str(e)[:200]})") from e
    if not sample_inputs:
        raise InputError(f"{path} is a TorchScript archive, which carries no sample inputs",
                         hint="pass --inputs, e.g. --inputs 1x3x224x224:float32")
    from torch._export.converter import TS2EPConverter
    try:
        ep = TS2EPConverter(ts, tuple(sample_inputs)).convert()
    except Exception as e:
        from .errors import CaptureError
        raise CaptureError(f"cannot convert the TorchScript module to an ExportedProgram "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                           hint="export the original nn.Module with torch.export.save instead") from e
    return ep, tuple(sample_inputs), {}


def parse_inputs(specs: Sequence[str], seed: int = 0) -> list:
    """``--inputs`` values: ``1x3x224x224:float32[:LOW:HIGH]``, ``scalar:int64``, ``x.npy`` or ``inputs.npz``."""
    rng = np.random.default_rng(seed)
    out: list = []
    for spec in specs:
        if spec.endswith(".npy") or spec.endswith(".npz"):
            out.extend(_load_array_file(spec))
            continue
        m = _SPEC_RE.match(spec)
        if not m:
            raise InputError(f"bad --inputs value {spec!r}",
                             hint="use SHAPE:DTYPE such as 1x3x224x224:float32, 2x8:int64:0:1000, scalar:float32, "
                                  "or a .npy/.npz file")
        shape = () if m["shape"] == "scalar" else tuple(int(d) for d in m["shape"].split("x"))
        dtype = numpy_dtype(m["dtype"])
        require_memory(shape, dtype, f"--inputs {spec}")
        if dtype.kind == "f":
            a = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iu":
            low = int(m["low"]) if m["low"] is not None else 0
            high = int(m["high"]) if m["high"] is not None else 10
            if high <= low:
                raise InputError(f"bad range in --inputs {spec!r}: HIGH must be greater than LOW")
            a = rng.integers(low, high, size=shape).astype(dtype)
        elif dtype.kind == "b":
            a = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise InputError(f"--inputs cannot make random {dtype.name} values; pass a .npy file")
        out.append(torch.from_numpy(np.asarray(a, order="C")))
    return out


def _load_array_file(path: str) -> list:
    if not os.path.exists(path):
        raise InputError(f"input file {path} does not exist")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as e:
        raise InputError(f"cannot read {path} as a numpy file ({type(e).__name__}: {e})") from e
    if isinstance(data, np.ndarray):
        return [torch.from_numpy(np.asarray(data, order="C"))]
    with data:
        return [torch.from_numpy(np.asarray(data[k], order="C")) for k in data.files]


def describe_inputs(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{'x'.join(map(str, a.shape)) or 'scalar'}:{str(a.dtype).removeprefix('torch.')}")
        else:
            parts.append(repr(a))
    return ", ".join(parts)
