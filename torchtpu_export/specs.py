"""Input/output specs and the conversion of user inputs to the arrays a runtime takes."""
from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np
import torch

from .errors import InputError

NP_DTYPES = {
    "float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_,
    "complex64": np.complex64, "complex128": np.complex128,
}


def dtype_name(dtype) -> str:
    """``"float32"`` for torch.float32, np.float32 or "float32"."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def numpy_dtype(name: str):
    try:
        return np.dtype(NP_DTYPES[name])
    except KeyError:
        raise InputError(f"unknown dtype {name!r}; known: {', '.join(sorted(NP_DTYPES))}") from None


@dataclasses.dataclass
class TensorSpec:
    """Name, shape (ints, or strings for symbolic dims) and dtype name of one program input or output."""

    name: str
    shape: tuple
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], tuple(d["shape"]), d["dtype"])

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}[{', '.join(str(d) for d in self.shape)}]"


def _schemas():
    from .untrusted import MAX_DIM_TEXT, NAME, Count, Either, Is, ListOf, MapOf, OneOf, Record
    digits = Is(str, max_len=12)
    tensor = Record({"name": NAME, "dtype": OneOf(*NP_DTYPES),
                     "shape": ListOf(Either(Count(), Is(str, max_len=MAX_DIM_TEXT)))})
    call = Record({"inputs": ListOf(tensor), "outputs": ListOf(tensor), "in_spec": Is(str), "out_spec": Is(str)},
                  {"constant_inputs": MapOf(Either(Is(int, float, str, bool), OneOf(None)), key=digits),
                   "dims": MapOf(ListOf(Either(Count(), OneOf(None)), length=2))})
    return tensor, call


def call_metadata_problem(meta) -> str | None:
    """What is wrong with an artifact's call metadata (``CapturedProgram.call_metadata``, and its
    dynamic ``dims``), or None: the fields and types its readers rely on, checked before they are used."""
    from . import treespec
    from .errors import ArtifactError
    problem = _schemas()[1].problem(meta)
    if problem:
        return problem
    if not all(k.isdigit() for k in meta.get("constant_inputs", {})):
        return "its constant_inputs are not keyed by input positions"
    for key in ("in_spec", "out_spec"):
        try:
            treespec.loads(meta[key])
        except ArtifactError:
            return f"its {key} is not a valid pytree spec"
    return None


def available_memory() -> int:
    """Bytes of memory this machine can still give (Linux's MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 1 << 62


def require_memory(shape, dtype, what: str, error=None) -> None:
    """Raises ``error`` (default InputError) when an array of ``shape`` and ``dtype`` cannot fit in memory."""
    n = 1
    for d in shape:
        n *= int(d)
    need = n * np.dtype(dtype).itemsize
    have = available_memory()
    if need > have:
        raise (error or InputError)(
            f"{what} needs {need / 2**30:,.1f} GiB ({'x'.join(map(str, shape))} {np.dtype(dtype).name}); "
            f"this machine has {have / 2**30:,.1f} GiB available")


def jsonable(v):
    """A value for a JSON manifest: plain scalars as they are, anything else as its repr."""
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return repr(v)


def as_numpy(x) -> np.ndarray:
    """A torch tensor, numpy array, JAX array or Python number as a numpy array (bfloat16 as
    ``ml_dtypes.bfloat16``)."""
    from .safetensors_io import to_numpy
    return to_numpy(x)


def dtype_kind(dtype) -> str:
    """numpy's kind letter, with ml_dtypes' floats (bfloat16, float8s: kind ``V`` to numpy) as ``f``."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V" and dtype.type.__module__.startswith("ml_dtypes") and "float" in dtype.name:
        return "f"
    return dtype.kind


def coerce_input(spec: TensorSpec, x, *, dtype: str | None = None) -> np.ndarray:
    """Checks an input against its spec; converts within a dtype kind (float64 -> float32, int64 -> int32,
    bfloat16 <-> float32: one cast, never through a third dtype). Takes numpy arrays (``ml_dtypes``
    bfloat16 included), torch tensors of any dtype, JAX arrays and Python numbers."""
    a = as_numpy(x)
    want = numpy_dtype(dtype or spec.dtype)
    if len(a.shape) != len(spec.shape) or any(isinstance(d, int) and d != n for d, n in zip(spec.shape, a.shape)):
        raise InputError(f"input {spec.name}: expected shape {list(spec.shape)}, got {list(a.shape)}")
    if a.dtype != want:
        have_kind, want_kind = dtype_kind(a.dtype), dtype_kind(want)
        if have_kind != want_kind and not (have_kind in "iub" and want_kind in "iu"):
            raise InputError(f"input {spec.name}: expected {spec.dtype}, got {a.dtype.name}")
        if want_kind in "iu" and a.size:
            info = np.iinfo(want)
            if a.min() < info.min or a.max() > info.max:
                raise InputError(f"input {spec.name}: values do not fit in {want.name}")
        a = a.astype(want)
    return a


def check_dims(specs, arrays, ranges: dict | None = None) -> None:
    """Symbolic dims must take one size across all inputs, within the exported range."""
    bound: dict[str, int] = {}
    for spec, a in zip(specs, arrays):
        for d, n in zip(spec.shape, a.shape):
            if not isinstance(d, str):
                continue
            if bound.setdefault(d, n) != n:
                raise InputError(f"dynamic dim {d} is {bound[d]} in one input and {n} in {spec.name}; "
                                 "inputs must agree")
            lo, hi = (ranges or {}).get(d, (0, None))
            if n < lo or (hi is not None and n > hi):
                raise InputError(f"input {spec.name}: dynamic dim {d} = {n} is outside the exported range "
                                 f"[{lo}, {hi if hi is not None else 'inf'}]",
                                 hint="export again with wider dynamic_shapes bounds")


def bind_dims(specs, arrays) -> dict[str, int]:
    """The size of each symbolic dim, read from the arrays given for inputs of these specs.

    A dim is a plain symbol (``"s0"``) or a linear expression of one (``"4*s0"``, ``"2*s1 + 1"``).
    """
    from .untrusted import dim_names
    sizes: dict[str, int] = {}
    derived = []
    for spec, a in zip(specs, arrays):
        for d, n in zip(spec.shape, a.shape):
            if isinstance(d, str):
                if d.isidentifier():
                    sizes[d] = int(n)
                else:
                    derived.append((d, int(n)))
    for text, n in derived:
        names = dim_names(text) - set(sizes)
        if len(names) == 1:
            (name,) = names
            b = eval_dim(text, {**sizes, name: 0}, text)
            a = eval_dim(text, {**sizes, name: 1}, text) - b
            if a and (n - b) % a == 0:
                sizes[name] = (n - b) // a
    return sizes


def eval_dim(text: str, sizes: dict, what: str = "a dim") -> int:
    """A symbolic dim as torch prints it (``"2*s1"``, ``"(s0 - 1)//2 + 1"``, ``"Max(1, s0)"``) at ``sizes``.

    Integer arithmetic only, by a small non-recursive parser (never ``eval``): the text may come
    from a file, so its length is capped too.
    """
    from .untrusted import eval_dim_expr
    try:
        return eval_dim_expr(text, sizes)
    except (ValueError, KeyError, ZeroDivisionError) as e:
        raise InputError(f"{what}: cannot compute the dynamic dim {text[:80]!r} from the inputs' sizes "
                         f"({type(e).__name__}: {e})") from None
