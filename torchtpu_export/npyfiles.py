"""``.npy`` and ``.npz`` files given as inputs, read header first.

Every array's dtype and shape come from its header, which is checked (numeric dtypes only: no
objects, structures, datetimes or strings; sizes that agree with the file or zip entry) before
any data is read, so callers can compare shapes with what a model takes before allocating.
Data is then read exactly, a chunk at a time; a damaged zip entry (bad CRC, short data) is an
InputError like every other problem here.
"""
from __future__ import annotations

import dataclasses
import math
import os
import zipfile

import ml_dtypes
import numpy as np

from .errors import InputError
from .fileio import open_regular

_CHUNK = 16 << 20
MAX_MEMBERS = 4096


@dataclasses.dataclass
class StoredArray:
    """One array of a .npy file or .npz member: what its header says, and where its data lies."""

    name: str  # the .npz member's key, or the .npy file's stem
    shape: tuple
    dtype: np.dtype  # native byte order; bfloat16 for numpy's 2-byte void (how np.save stores it)
    fortran_order: bool
    path: str
    member: str | None = None
    _stored: np.dtype | None = None  # the dtype as written (byte order included)
    _offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        """The array, read into memory of its own (C order, native byte order)."""
        raw = np.empty(self.nbytes, np.uint8)
        view = memoryview(raw)
        try:
            if self.member is None:
                with open_regular(self.path, _what(self.path)) as (f, _):
                    f.seek(self._offset)
                    _fill(f, view, self.name)
            else:
                with open_regular(self.path, _what(self.path)) as (file, _), zipfile.ZipFile(file) as zf, \
                        zf.open(self.member) as f:
                    f.read(self._offset)  # the member's header
                    _fill(f, view, self.name)
                    if f.read(1):
                        raise InputError(f"{self.path}: member {self.member} has data past its array")
        except InputError:
            raise
        except (OSError, EOFError, zipfile.BadZipFile, ValueError, NotImplementedError, RuntimeError) as e:
            raise InputError(f"cannot read {self.path}" + (f" member {self.member}" if self.member else "")
                             + f" ({type(e).__name__}: {str(e)[:150]})") from None
        stored = self.dtype if self._stored.kind == "V" else self._stored
        out = raw.view(stored).reshape(self.shape, order="F" if self.fortran_order else "C")
        if not stored.isnative:
            out = out.astype(stored.newbyteorder("="))
        return np.asarray(out, order="C")


def _fill(f, view: memoryview, name: str) -> None:
    filled = 0
    while filled < len(view):
        chunk = f.read(min(_CHUNK, len(view) - filled))
        if not chunk:
            raise InputError(f"{name}: the file ends before its array's data does (truncated)")
        view[filled:filled + len(chunk)] = chunk
        filled += len(chunk)


def _header(f, where: str):
    """(dtype as stored, the dtype to give, shape, fortran_order) from an open file at a header."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            raise ValueError(f"npy format version {version} is not read here")
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, zipfile.BadZipFile) as e:
        raise InputError(f"{where} is not a valid .npy array ({type(e).__name__}: {str(e)[:150]})") from None
    if not (isinstance(shape, tuple) and all(isinstance(d, int) and d >= 0 for d in shape)) or len(shape) > 32:
        raise InputError(f"{where} has a malformed shape {str(shape)[:60]}")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise InputError(f"{where} holds a structured array ({dtype}); inputs are plain numeric arrays")
    if dtype.kind == "V" and dtype.itemsize == 2:
        given = np.dtype(ml_dtypes.bfloat16)  # np.save writes bfloat16 as '<V2'
    elif dtype.kind in "biufc" and dtype.itemsize <= 16:
        given = dtype.newbyteorder("=")
    else:
        raise InputError(f"{where} holds {dtype} values; inputs are bool, integer, float or complex arrays")
    return dtype, given, tuple(shape), bool(fortran)


def _what(path: str) -> str:
    return f"the input file {path} (--inputs)"


def scan(path: str) -> list[StoredArray]:
    """The arrays of a .npy or .npz file, from their headers only."""
    if not os.path.lexists(path):
        raise InputError(f"input file {path} does not exist")
    with open_regular(path, _what(path)) as (f, size):
        if path.endswith(".npz"):
            return _scan_npz(f, path)
        stored, dtype, shape, fortran = _header(f, path)
        offset = f.tell()
    arr = StoredArray(os.path.splitext(os.path.basename(path))[0], shape, dtype, fortran, path, None, stored, offset)
    if offset + arr.nbytes != size:
        raise InputError(f"{path}: its header says {list(shape)} {stored} ({arr.nbytes:,} bytes of data); "
                         f"the file holds {size - offset:,}")
    return [arr]


def _scan_npz(file, path: str) -> list[StoredArray]:
    try:
        zf = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise InputError(f"{path} is not a valid .npz file ({type(e).__name__}: {str(e)[:150]})") from None
    out = []
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise InputError(f"{path} has {len(infos):,} members (at most {MAX_MEMBERS})")
        for info in infos:
            if info.is_dir():
                continue
            if not info.filename.endswith(".npy"):
                raise InputError(f"{path}: member {info.filename!r} is not an .npy array")
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise InputError(f"{path}: member {info.filename!r} uses a compression .npz files do not")
            where = f"{path} member {info.filename}"
            try:
                with zf.open(info) as f:
                    stored, dtype, shape, fortran = _header(_Bounded(f, 1 << 16), where)
                    offset = f.tell()
            except (zipfile.BadZipFile, OSError, EOFError, RuntimeError, NotImplementedError) as e:
                raise InputError(f"cannot read {where} ({type(e).__name__}: {str(e)[:150]})") from None
            arr = StoredArray(info.filename[:-4], shape, dtype, fortran, path, info.filename, stored, offset)
            if offset + arr.nbytes != info.file_size:
                raise InputError(f"{where}: its header says {list(shape)} {stored} ({arr.nbytes:,} bytes); "
                                 f"the member declares {info.file_size - offset:,}")
            out.append(arr)
    return out


class _Bounded:
    """A file that gives at most ``limit`` bytes (the header of an .npz member, whatever it claims)."""

    def __init__(self, f, limit: int):
        self.f, self.left = f, limit

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        self.left -= len(data)
        return data


def check_against(arrays: list[StoredArray], specs, what: str) -> None:
    """Each array against the input it feeds (``specs``: name, shape with str for dynamic dims), before
    any data is read: InputError naming the first that cannot be that input."""
    if len(arrays) != len(specs):
        raise InputError(f"{what}: the model takes {len(specs)} inputs, the files hold {len(arrays)} arrays",
                         hint="inputs are: " + ", ".join(str(s) for s in specs))
    for i, (a, s) in enumerate(zip(arrays, specs)):
        if s is None:  # not a tensor input: the caller says what it takes
            continue
        if len(a.shape) != len(s.shape) or any(isinstance(d, int) and d != n for d, n in zip(s.shape, a.shape)):
            raise InputError(f"{what} #{i + 1} ({getattr(a, 'name', 'random')}): expected shape {list(s.shape)} "
                             f"for input {s.name}, got {list(a.shape)}")
