"""Files the user names: read only when they are regular files, and written atomically.

Reading (:func:`open_regular`, :func:`read_regular`): a FIFO, device, socket or directory is refused with
InputError before a byte is read, and opening never blocks (a FIFO with no writer would hang the command).

Writing: a temp file in the target directory, renamed into place on success. On any failure, Ctrl-C
included, the temp file is removed and the target is left as it was, so a half-written artifact never
exists under its real name.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile

from .errors import InputError, OutputError, Terminated

# The signal the CLI was asked to stop with (SIGTERM, SIGHUP), if any: no output is renamed into place
# after it, even where the exception the signal handler raised was swallowed on the way.
STOP_SIGNAL: list = [None]


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words, for messages ("a FIFO", "a directory", ...)."""
    for test, word in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a plain file"


@contextlib.contextmanager
def open_regular(path: str | os.PathLike, what: str, *, follow_links: bool = True):
    """Yields ``(file, size)``: ``path`` opened for reading, once it is known to be a regular file; InputError
    naming ``what`` (the file as the user knows it: "the JSON schema x.json (--json-schema)") otherwise.

    Checked before opening (opening some devices acts on them) and again on the opened descriptor (a FIFO
    swapped in between); opened with O_NONBLOCK, so a FIFO never blocks the open. ``follow_links=False``
    refuses a symbolic link as well (a path already resolved by the caller)."""
    path = os.fspath(path)
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}") from None
    _require_regular(st.st_mode, what)
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        _require_regular(st.st_mode, what)
        yield f, st.st_size


def _require_regular(mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise InputError(f"{what} is not a regular file ({file_kind(mode)}): not read")


def read_regular(path: str | os.PathLike, what: str, max_bytes: int, *, follow_links: bool = True) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``max_bytes``: a larger file, or
    one that grows past it while read, is InputError naming ``what``."""
    with open_regular(path, what, follow_links=follow_links) as (f, size):
        if size > max_bytes:
            raise InputError(f"{what} is {size:,} bytes, more than any real one (at most {max_bytes:,} are read)")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise InputError(f"cannot read {what}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise InputError(f"{what} grew past {max_bytes:,} bytes while read")
    return data


def check_writable(path: str | os.PathLike, inputs: tuple = ()) -> str:
    """``path`` if an artifact may be written there: a new file, or an existing regular file (never a
    directory, FIFO, device, socket or symlink, which the atomic rename would replace), and never one
    of ``inputs`` (the files the command reads, compared by inode: another name of the same file too)."""
    path = os.fspath(path)
    if not path or path.endswith(("/", os.sep)):
        raise OutputError(f"output path {path!r} names a folder, not a file", hint="give a file name, e.g. model.tpu")
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise OutputError(f"output path {path} is a directory", hint="give a file name, e.g. model.tpu")
    _check_not_special(path)
    for other in inputs:
        if other is not None and _same_file(path, os.fspath(other)):
            raise OutputError(f"output path {path} is the input {os.fspath(other)}: writing it would destroy it",
                              hint="choose another -o")
    if not os.path.isdir(directory):
        raise OutputError(f"output directory {directory} does not exist", hint="create it first, or choose another -o")
    if not os.access(directory, os.W_OK):
        raise OutputError(f"output directory {directory} is not writable", hint="choose another -o")
    return path


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _check_not_special(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise OutputError(f"cannot check output path {path}: {e.strerror}") from e
    if not stat.S_ISREG(mode):
        raise OutputError(f"output path {path} is {file_kind(mode)}; torchtpu-export only writes new or regular "
                          "files", hint="choose another -o")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w+b", verify=None):
    """Yields a file object; on success it replaces ``path``, on failure it vanishes. ``verify(tmp_path)``, when
    given, reads the written file before it takes ``path``'s place; whatever it raises leaves ``path`` as it was."""
    path = check_writable(path)
    directory, base = os.path.split(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise OutputError(f"cannot write to {directory}: {e.strerror}") from e
    with _replacing(tmp, path), os.fdopen(fd, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
        if verify is not None:
            verify(tmp)


@contextlib.contextmanager
def _replacing(tmp: str, path: str):
    # when the block succeeds, the temporary file ``tmp`` replaces ``path``; otherwise it vanishes
    try:
        yield
        os.chmod(tmp, _mode_for(path))
        _check_not_special(path)  # again: it may have appeared while the file was written
        if STOP_SIGNAL[0] is not None:
            raise Terminated(STOP_SIGNAL[0])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(path: str) -> int:
    """An existing file keeps its permissions; a new one gets what the umask allows of rw-rw-rw-."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    try:  # read, not set: setting it to read it races with other threads creating files
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def link_atomic(src: str | os.PathLike, path: str | os.PathLike) -> None:
    """Puts the file ``src`` at ``path`` as a hard link (no copy), atomically like ``atomic_open``.

    OSError when the two are on different filesystems (or links are not supported): copy instead.
    """
    path = check_writable(path)
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{os.urandom(6).hex()}.tmp")
    os.link(src, tmp)
    with _replacing(tmp, path), open(tmp, "rb") as f:
        os.fsync(f.fileno())
