"""The safetensors format, written as a stream and read without copies.

The layout is the standard one (8-byte header size, JSON header, raw data),
so the ``safetensors`` package and other tools read our files. We write it
ourselves so that weights go straight from each tensor to the output file,
one at a time, without building the whole blob in memory.
"""
from __future__ import annotations

import json
import math
import struct
import warnings
from typing import BinaryIO, Iterable, Mapping

import ml_dtypes
import numpy as np
import torch

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "C64": np.complex64,
}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # the safetensors package's own cap


class CastOnRead:
    """A checkpoint tensor (memory-mapped) seen in the program's dtype, cast only as it is read: a slice
    when a process places its own shards (``value[index]``), the whole tensor when one device takes
    it (``np.asarray``), one weight at a time. Binding a checkpoint stored in another float type thus
    never holds a cast copy of the whole model."""

    def __init__(self, value: np.ndarray, dtype: np.dtype):
        self._value, self.dtype = value, np.dtype(dtype)
        self.shape, self.ndim = tuple(value.shape), value.ndim

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self._value[index]).astype(self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.asarray(self._value).astype(self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __len__(self) -> int:
        return self.shape[0]


def to_numpy(t) -> np.ndarray:
    """A tensor (bf16 included), or anything numpy reads (a JAX array: ``ml_dtypes`` types stay as they
    are), as a numpy array sharing memory where possible."""
    if isinstance(t, CastOnRead):  # stays lazy: a writer reads it when it gets to it
        return t
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def from_numpy(a) -> torch.Tensor:
    """A numpy array (bfloat16 and non-native byte orders included) as a CPU tensor, sharing memory
    where it can."""
    a = np.asarray(a, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    with warnings.catch_warnings():
        # a read-only array (a runtime's output, a memory-mapped file) is shared, not copied: torch warns
        # that writing to the tensor would be undefined, and nothing here writes to inputs
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def dtype_code(dtype) -> str:
    """safetensors' name of a numpy dtype (``F32``, ``BF16``, ...)."""
    code = _CODES.get(np.dtype(dtype))
    if code is None:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors")
    return code


def dtype_of(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name; ValueError for one it does not define."""
    if code not in _DTYPES:
        raise ValueError(f"unknown safetensors dtype {code!r}")
    return np.dtype(_DTYPES[code])


def header_for(arrays: Iterable[tuple[str, np.ndarray]], metadata: Mapping[str, str] | None = None) -> bytes:
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, a in arrays:
        code = _CODES.get(a.dtype)
        if code is None:
            raise TypeError(f"weight {name}: dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":"), sort_keys=False).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def write(f: BinaryIO, tensors: Mapping[str, object], metadata: Mapping[str, str] | None = None) -> int:
    """Streams ``tensors`` (name -> torch tensor or numpy array) to ``f``; returns bytes written."""
    arrays = [(name, to_numpy(t)) for name, t in tensors.items()]
    head = header_for(arrays, metadata)
    f.write(head)
    total = len(head)
    for _, a in arrays:
        # bytes, not the array's buffer: the buffer protocol has no code for ml_dtypes' bfloat16
        f.write(memoryview(np.asarray(a, order="C").reshape(-1).view(np.uint8)))
        total += a.nbytes
    return total


def read(buf) -> dict[str, np.ndarray]:
    """Parses safetensors bytes (bytes, memoryview or mmap); arrays are views into ``buf``.

    Nothing in the header is trusted: sizes, offsets and shapes are checked against the data
    before any view is made (ValueError when they do not add up).
    """
    mv = memoryview(buf)
    if len(mv) < 8:
        raise ValueError("safetensors data is truncated")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > len(mv) - 8:
        raise ValueError("safetensors header is truncated")
    base = 8 + n
    return {name: np.frombuffer(mv[base + start:base + end], dtype=dtype, count=math.prod(shape)).reshape(shape)
            for name, (dtype, shape, start, end) in _entries(mv[8:base], len(mv) - base, MAX_HEADER_BYTES).items()}


def read_header(f: BinaryIO, size: int, max_bytes: int = MAX_HEADER_BYTES) -> dict[str, tuple]:
    """The entries of the safetensors file open as ``f`` (``size`` bytes): name -> ``(dtype, shape, start,
    end)``, offsets into the data after the header, checked as :func:`read` checks them, without reading
    the data. A header over ``max_bytes`` is refused before it is read (ValueError, as for any fault)."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError("safetensors data is truncated")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise ValueError("safetensors header is truncated")
    if n > max_bytes:
        of_size = f" in a file of {size:,}" if max_bytes < MAX_HEADER_BYTES else ""
        raise ValueError(f"the safetensors header is {n:,} bytes (at most {max_bytes:,} are read{of_size})")
    raw = f.read(n)
    if len(raw) != n:
        raise ValueError("safetensors header is truncated")
    return _entries(raw, size - 8 - n, max_bytes)


def _entries(raw, data_size: int, max_bytes: int) -> dict[str, tuple]:
    from .untrusted import load_json
    header = load_json(raw, "the safetensors header", max_bytes=max_bytes, error=ValueError)
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
            raise ValueError(f"safetensors entry {name!r} has no known dtype")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(_count(d) for d in shape)):
            raise ValueError(f"safetensors entry {name!r} has a malformed shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
            raise ValueError(f"safetensors entry {name!r} has malformed data_offsets")
        start, end = offsets
        if end < start or end > data_size:
            raise ValueError(f"safetensors entry {name!r} points outside the data")
        if math.prod(shape) * dtype.itemsize != end - start:
            raise ValueError(f"safetensors entry {name!r} has a size that does not match its shape")
        out[name] = (dtype, tuple(shape), start, end)
    return out


def _count(x) -> bool:
    """A non-negative int (not a bool) that an array size may be."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2 ** 62
