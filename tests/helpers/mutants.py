"""Byte-level mutants of the files the readers take, for the fuzzing and hostile-input tests: random edits
(flips, bytes, truncation, insertion, deletion, extreme integers) and one zip entry replaced."""
import io
import random
import zipfile


def mutations(rng: random.Random, size: int):
    """A few byte-level edits: flips, random bytes, truncation, insertion, deletion, big integers."""
    ops = []
    for _ in range(rng.randint(1, 4)):
        kind = rng.choice(["flip", "byte", "truncate", "insert", "delete", "int32", "int64"])
        ops.append((kind, rng.randrange(max(size, 1)), rng.randrange(256)))
    return ops


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for kind, pos, value in ops:
        if not b:
            break
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= 1 << (value % 8)
        elif kind == "byte":
            b[i] = value
        elif kind == "truncate":
            b = b[:i]
        elif kind == "insert":
            b[i:i] = bytes([value])
        elif kind == "delete":
            del b[i]
        else:  # an extreme little-endian integer where offsets and sizes live
            width = 4 if kind == "int32" else 8
            b[i:i + width] = (0xFF if value % 2 else 0x7F).to_bytes(1, "little") * width
    return bytes(b)


def _rezip(original: bytes, entry: str, new_content: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(original)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, new_content if info.filename == entry else zin.read(info.filename))
    return out.getvalue()
