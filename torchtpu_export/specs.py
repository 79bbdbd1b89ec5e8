"""Input/output specs and the conversion of user inputs to the arrays a runtime takes."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import torch

from .errors import InputError

_NP_DTYPES = {
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
        return np.dtype(_NP_DTYPES[name])
    except KeyError:
        raise InputError(f"unknown dtype {name!r}; known: {', '.join(sorted(_NP_DTYPES))}") from None


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


def as_numpy(x) -> np.ndarray:
    """A torch tensor, numpy array or Python number as a numpy array."""
    if isinstance(x, torch.Tensor):
        from .safetensors_io import to_numpy
        return to_numpy(x)
    return np.asarray(x)


def coerce_input(spec: TensorSpec, x, *, dtype: str | None = None) -> np.ndarray:
    """Checks an input against its spec; converts within a dtype kind (float64 -> float32, int64 -> int32)."""
    a = as_numpy(x)
    want = numpy_dtype(dtype or spec.dtype)
    if len(a.shape) != len(spec.shape) or any(isinstance(d, int) and d != n for d, n in zip(spec.shape, a.shape)):
        raise InputError(f"input {spec.name}: expected shape {list(spec.shape)}, got {list(a.shape)}")
    if a.dtype != want:
        if a.dtype.kind != want.kind and not (a.dtype.kind in "iub" and want.kind in "iu"):
            raise InputError(f"input {spec.name}: expected {spec.dtype}, got {a.dtype.name}")
        if want.kind in "iu" and a.size:
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
