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
from .specs import dtype_kind, numpy_dtype, require_memory

_SPEC_RE = re.compile(r"^(?P<shape>scalar|\d+(?:x\d+)*):(?P<dtype>[a-z0-9]+)(?::(?P<low>-?\d+):(?P<high>-?\d+))?$")


def sniff_model(path: str) -> str:
    """``"pt2"``, ``"torchscript"``, ``"pickle"``, or the name of the target whose artifact the file is."""
    from .targets import sniff
    return sniff(path)


def is_factory(spec: str) -> bool:
    """``package.module:factory`` or ``path/to/file.py:factory`` (and not a file of that name)."""
    if ":" not in spec or os.path.exists(spec):
        return False
    source, _, attr = spec.rpartition(":")
    return attr.isidentifier() and (source.endswith(".py") or re.match(r"^[A-Za-z_][\w.]*$", source) is not None)


def load_model(spec: str, *, trust_pickle: bool = False, sample_inputs: Sequence | None = None):
    """Returns ``(model, args, kwargs)``; ``model`` is an nn.Module, callable or ExportedProgram."""
    if is_factory(spec):
        return _load_factory(spec)
    kind = sniff_model(spec)
    if kind == "pt2":
        from torch.ao.quantization.fx import _decomposed  # noqa: F401 (the quantize ops of pt2e-quantized models)
        check_pt2_entries(spec)
        try:
            with _private_tempdir(), contextlib.nullcontext() if trust_pickle else _no_unpickling(spec):
                # torch.export.load's own loader, called directly: torch.export.load logs the error it
                # meets and raises one that says "check the warnings above", which users never see
                from torch.export.pt2_archive._package import load_pt2
                programs = load_pt2(spec).exported_programs
        except (UnsafeInputError, ArtifactError):
            raise
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            raise ArtifactError(f"cannot read {spec} as a .pt2 file ({type(e).__name__}: {first})",
                                hint="the file is truncated or was written by an incompatible torch: export it "
                                     "again") from None
        if "model" not in programs:
            raise ArtifactError(f"{spec} holds no exported program named 'model' (it has {sorted(programs)[:5]})",
                                hint="save it with torch.export.save(exported_program, path)")
        ep = programs["model"]
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


# What torch.export.save writes for a program, under the archive's one top folder (a .pt2 is a zip).
# Anything else is refused before torch opens the file: AOTInductor libraries (data/aotinductor/,
# native code torch.export.load would extract and dlopen), ExecuTorch and MTIA payloads, and any
# name with "..", a leading "/" or a backslash (written outside the folder it is extracted to).
_PT2_ENTRIES = re.compile(
    r"^(archive_format|archive_version|byteorder|version|\.data/version|\.data/serialization_id"
    r"|models/\w[\w.-]*\.json|data/sample_inputs/\w[\w.-]*\.pt"
    r"|data/weights/\w[\w.-]*|data/constants/\w[\w.-]*|extra/\w[\w.-]*)$")
_PT2_COMPONENT = re.compile(r"^[\w.-]+$")
MAX_PT2_JSON_BYTES = 128 << 20
MAX_PT2_ENTRIES = 1 << 16


def check_pt2_entries(path: str) -> None:
    """Refuses a .pt2 whose zip holds anything but a plain exported program (see ``_PT2_ENTRIES``),
    whose compressed entries would expand past a few times the file's size, or whose JSON is
    larger or more deeply nested than torch could parse in bounded memory."""
    from .untrusted import json_shape, read_member
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise ArtifactError(f"{path} is a damaged zip archive ({e})") from None
    size = os.path.getsize(path)
    refuse = "torchtpu-export reads the exported program of a .pt2 and nothing else: export it again " \
             "with torch.export.save"
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_PT2_ENTRIES:
            raise InputError(f"{path} has {len(infos):,} zip entries; a .pt2 holds a few per weight")
        roots = {info.filename.split("/", 1)[0] for info in infos}
        if len(roots) != 1:
            raise InputError(f"{path} is not a .pt2 archive: its entries lie in {len(roots)} top folders", hint=refuse)
        expanded = sum(i.file_size for i in infos if i.compress_type != zipfile.ZIP_STORED)
        if expanded > 3 * size:
            raise InputError(f"{path}: its compressed entries expand to {expanded:,} bytes, {expanded / size:.0f}x "
                             "the file (torch.export.save stores entries uncompressed); refused", hint=refuse)
        for info in infos:
            name = info.filename
            parts = name.split("/")
            rest = "/".join(parts[1:])
            if "\\" in name or name.startswith("/") or any(p in ("", ".", "..") or not _PT2_COMPONENT.match(p)
                                                             for p in parts):
                raise InputError(f"{path} holds an entry named {name[:120]!r}, which would be written outside "
                                 "the folder it is extracted to; refused", hint=refuse)
            if rest.startswith("data/aotinductor/"):
                raise InputError(f"{path} carries AOTInductor native code ({name[:120]}): loading it would run "
                                 "that code, and torchtpu-export converts the exported program, never a compiled "
                                 "library; refused", hint=refuse)
            if not _PT2_ENTRIES.match(rest):
                raise InputError(f"{path} holds {name[:120]!r}, which is not part of an exported program; refused",
                                 hint=refuse)
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise InputError(f"{path}: entry {name[:120]!r} uses an unknown compression", hint=refuse)
            if name.endswith(".json"):
                data = read_member(zf, info, f"{path}: {name}", max_bytes=MAX_PT2_JSON_BYTES, error=InputError)
                containers, depth = json_shape(data)
                if depth > 256 or containers > len(data) // 8 + 4096:
                    raise InputError(f"{path}: {name} is JSON no exported program has ({containers:,} objects and "
                                     f"lists in {len(data):,} bytes, {depth} levels deep); refused", hint=refuse)


@contextlib.contextmanager
def _private_tempdir():
    """Python's temporary files in a folder of this process's own, removed afterwards: whatever torch
    extracts while loading a file stays there."""
    import shutil
    import tempfile
    folder = tempfile.mkdtemp(prefix="tte-load-")
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield folder
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


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
        def raiser(data=None, *args, **kwargs):
            names = _pickle_globals(data)
            named = f" (it names {', '.join(names)})" if names else ""
            raise UnsafeInputError(
                f"{path} holds {what}{named}, which would have to be unpickled to load it (that runs code from "
                "the file)", hint="pass --trust-pickle if you trust the file, or export it again from the model")
        return raiser

    real_load = torch.load

    def weights_only_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            # torch's message is long; its "Unsupported global: GLOBAL module.name" line says what was refused
            found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) ([\w.]+)", str(e))
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


def _pickle_globals(data, limit: int = 3) -> list[str]:
    """The globals (module.name) a pickle would import, read from its opcodes without running it."""
    import io
    import pickletools
    if hasattr(data, "read"):
        data = data.read()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return []
    names, strings = [], []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(bytes(data))):
            if op.name == "GLOBAL" and isinstance(arg, str):
                names.append(arg.replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
            if len(names) >= limit:
                break
    except Exception:  # noqa: BLE001 (a damaged pickle: whatever names were read so far)
        pass
    return list(dict.fromkeys(names))


def _import_file(path: str):
    """The module in a .py file the user named (its folder on sys.path, for its own imports)."""
    import importlib.util
    if not os.path.isfile(path):
        raise InputError(f"{path} does not exist")
    path = os.path.abspath(path)
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


@contextlib.contextmanager
def user_import_path(folder: str):
    """The user's folder on the import path while their factory's module loads and its factory runs (for
    the module's own imports, as ``python file.py`` would have it), and off it after. The one place the
    project touches ``sys.path``: its own modules find each other as a package."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def call_factory(spec: str):
    """What the function ``package.module:factory`` or ``path/to/file.py:factory`` returns."""
    module_name, _, attr = spec.rpartition(":")
    folder = os.path.dirname(os.path.abspath(module_name)) if module_name.endswith(".py") else os.getcwd()
    with user_import_path(folder):
        if module_name.endswith(".py"):
            mod = _import_file(module_name)
        else:
            try:
                mod = importlib.import_module(module_name)
            except ImportError as e:
                raise InputError(f"cannot import {module_name}: {e}",
                                 hint="run from the directory that holds the package") from e
        factory = getattr(mod, attr, None)
        if not callable(factory):
            raise InputError(f"{module_name} has no callable {attr}")
        return factory()


def _load_factory(spec: str):
    made = call_factory(spec)
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


def parse_inputs(specs: Sequence[str], seed: int = 0, expected: Sequence | None = None) -> list:
    """``--inputs`` values: ``1x3x224x224:float32[:LOW:HIGH]``, ``scalar:int64``, ``x.npy`` or ``inputs.npz``.

    ``expected``: the inputs they feed (TensorSpecs), when known: arrays in files are checked against
    them from their headers, before any data is read (a small compressed file cannot make this
    process allocate what no input of the model takes).
    """
    from .npyfiles import StoredArray, check_against, scan
    from .safetensors_io import from_numpy
    rng = np.random.default_rng(seed)
    items: list = []
    for spec in specs:
        if spec.endswith(".npy") or spec.endswith(".npz"):
            items.extend(scan(spec))
            continue
        m = _SPEC_RE.match(spec)
        if not m:
            raise InputError(f"bad --inputs value {spec!r}",
                             hint="use SHAPE:DTYPE such as 1x3x224x224:float32, 2x8:int64:0:1000, scalar:float32, "
                                  "or a .npy/.npz file")
        shape = () if m["shape"] == "scalar" else tuple(int(d) for d in m["shape"].split("x"))
        dtype = numpy_dtype(m["dtype"])
        require_memory(shape, dtype, f"--inputs {spec}")
        if dtype_kind(dtype) == "f":  # (bfloat16 included)
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
        items.append(a)
    if expected is not None:
        check_against(items, list(expected), "--inputs")
    out = []
    for item in items:
        if isinstance(item, StoredArray):
            require_memory(item.shape, item.dtype, f"--inputs {item.path} ({item.name})")
            item = item.load()
        out.append(from_numpy(item))
    return out


def ep_input_specs(ep) -> list:
    """The user inputs of an ExportedProgram as TensorSpecs (symbolic dims as their names), None for
    a non-tensor input."""
    from .fxnodes import shape_of
    from .specs import TensorSpec, dtype_name
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    specs = []
    for s in ep.graph_signature.input_specs:
        if s.kind.name != "USER_INPUT":
            continue
        meta = placeholders[s.arg.name].meta.get("val") if hasattr(s.arg, "name") else None
        specs.append(TensorSpec(s.arg.name, tuple(shape_of(meta)), dtype_name(meta.dtype))
                     if meta is not None and hasattr(meta, "dtype") else None)
    return specs


def describe_inputs(args: Sequence[Any]) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{'x'.join(map(str, a.shape)) or 'scalar'}:{str(a.dtype).removeprefix('torch.')}")
        else:
            parts.append(repr(a))
    return ", ".join(parts)
