"""Reading what a file someone else made says: JSON with caps on its size, containers and nesting,
zip members read no further than their declared size, and dimension expressions parsed without
recursion. Whatever is wrong raises the caller's error class (ArtifactError unless told), naming
what was being read, before the memory or time it would take is spent.
"""
from __future__ import annotations

import json
import re
import zipfile

import numpy as np

from .errors import ArtifactError

MAX_JSON_BYTES = 16 << 20  # a manifest or a metadata blob: a 70B model's is well under 1 MB
MAX_JSON_DEPTH = 64
# Python holds a JSON container in ~60-250 bytes; one per 8 bytes of text keeps a blob's parsed
# form within ~30x its size (a real manifest has one per ~40 bytes; `[{},{},...]` one per 3).
_BYTES_PER_CONTAINER = 8
_JSON_CHUNK = 1 << 20


def json_shape(data: bytes) -> tuple[int, int]:
    """(containers, depth) of JSON text, counted outside its strings without parsing it: a megabyte at a
    time, in a few megabytes of memory whatever its size."""
    a = np.frombuffer(data, np.uint8)
    containers, depth, level, inside, start = 0, None, 0, 0, 0
    while start < len(a):
        end = min(start + _JSON_CHUNK, len(a))
        while end < len(a) and a[end - 1] == 0x5C:  # an escape never straddles two chunks
            end += 1
        c = a[start:end]
        quotes = _unescaped(c, np.flatnonzero(c == 0x22))
        brackets = np.flatnonzero((c == 0x7B) | (c == 0x5B) | (c == 0x7D) | (c == 0x5D))
        brackets = brackets[(np.searchsorted(quotes, brackets) + inside) % 2 == 0]  # outside strings
        if len(brackets):
            opens = (c[brackets] == 0x7B) | (c[brackets] == 0x5B)
            steps = np.where(opens, 1, -1).astype(np.int64)
            top = level + int(np.cumsum(steps).max())
            depth = top if depth is None else max(depth, top)
            containers += int(np.count_nonzero(opens))
            level += int(steps.sum())
        inside = (inside + len(quotes)) % 2
        start = end
    return containers, 0 if depth is None else depth


def _unescaped(c: np.ndarray, quotes: np.ndarray) -> np.ndarray:
    """The ``quotes`` (positions in ``c``) that open or close a string: those after no odd run of backslashes."""
    slashes = np.flatnonzero(c == 0x5C)
    if not len(slashes) or not len(quotes):
        return quotes
    breaks = np.flatnonzero(np.diff(slashes) != 1)
    firsts = np.concatenate((slashes[:1], slashes[breaks + 1]))
    lasts = np.concatenate((slashes[breaks], slashes[-1:]))
    escaped = lasts[(lasts - firsts) % 2 == 0] + 1  # a run of odd length escapes the character after it
    return quotes[~np.isin(quotes, escaped)]


def load_json(data, what: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              error=ArtifactError):
    """``json.loads`` of untrusted bytes or text, once its size, container count and nesting pass."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    data = bytes(data)
    check_json(data, what, max_bytes=max_bytes, max_depth=max_depth, error=error)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{what} is not valid JSON ({type(e).__name__}: {str(e)[:120]})") from None


def check_json(data: bytes, what: str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
               error=ArtifactError) -> None:
    """:func:`load_json`'s caps on JSON text (size, container count, nesting), without parsing it."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data):,} bytes of JSON (at most {max_bytes:,} are read)")
    containers, depth = json_shape(data)
    if depth > max_depth:
        raise error(f"{what} nests {depth} levels deep (at most {max_depth})")
    if containers > len(data) // _BYTES_PER_CONTAINER + 4096:
        raise error(f"{what} holds {containers:,} JSON objects and lists in {len(data):,} bytes, "
                    "far more than any real one (it would take gigabytes to parse)")


def read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, what: str, *, max_bytes: int,
                error=ArtifactError) -> bytes:
    """A zip member's bytes, refused when it declares more than ``max_bytes``; never more than it
    declares are decompressed (zipfile stops there and checks the CRC)."""
    if info.file_size > max_bytes:
        raise error(f"{what} is {info.file_size:,} bytes (at most {max_bytes:,} are read)")
    try:
        with zf.open(info) as f:
            data = f.read(max_bytes + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
        raise error(f"{what} cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    if len(data) != info.file_size:
        raise error(f"{what} is not the size its zip entry declares")
    return data


# ---- dimension expressions -----------------------------------------------------------------

MAX_DIM_TEXT = 256  # torch prints a dim as at most a few terms ("(s0 - 1)//2 + 1", "Max(1, s0)")
_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(//|[-+*%(),]))")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "//": 2, "%": 2, "neg": 3}
_FUNCTIONS = {"Max": max, "Min": min, "Mod": lambda a, b: a % b, "FloorDiv": lambda a, b: a // b}
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
          "//": lambda a, b: a // b, "%": lambda a, b: a % b}


class DimSyntaxError(ValueError):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    if len(text) > MAX_DIM_TEXT:
        raise DimSyntaxError(f"longer than {MAX_DIM_TEXT} characters")
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].isspace():
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            raise DimSyntaxError(f"unexpected {text[pos:pos + 10]!r}")
        number, name, op = m.groups()
        out.append(("num", number) if number else ("name", name) if name else ("op", op))
        pos = m.end()
    return out


def dim_names(text: str) -> set[str]:
    """The symbols a dimension expression uses (empty when it is not one)."""
    try:
        toks = _tokens(text)
    except DimSyntaxError:
        return set()
    return {v for i, (k, v) in enumerate(toks)
            if k == "name" and v not in _FUNCTIONS and not (i + 1 < len(toks) and toks[i + 1] == ("op", "("))}


def eval_dim_expr(text: str, sizes: dict) -> int:
    """An integer expression over ``+ - * // %``, unary minus, parentheses and ``Max Min Mod FloorDiv``
    calls, at ``sizes``: a shunting-yard pass, no recursion, length-capped. DimSyntaxError,
    KeyError (an unknown symbol) or ZeroDivisionError when it cannot be computed."""
    values: list[int] = []
    ops: list[str] = []  # operators, "(" and function names awaiting their arguments
    argc: list[int] = []  # per open call: arguments seen so far

    def reduce_top():
        op = ops.pop()
        if op == "neg":
            values.append(-values.pop())
            return
        if len(values) < 2:
            raise DimSyntaxError("an operator lacks an operand")
        b, a = values.pop(), values.pop()
        values.append(_APPLY[op](a, b))

    def close_group():
        while ops and ops[-1] != "(":
            reduce_top()
        if not ops:
            raise DimSyntaxError("unbalanced parentheses")
        ops.pop()

    expect_operand = True
    toks = _tokens(text)
    for i, (kind, v) in enumerate(toks):
        if kind == "num":
            if not expect_operand:
                raise DimSyntaxError("two operands in a row")
            values.append(int(v))
            expect_operand = False
        elif kind == "name":
            if not expect_operand:
                raise DimSyntaxError("two operands in a row")
            if i + 1 < len(toks) and toks[i + 1] == ("op", "("):
                if v not in _FUNCTIONS:
                    raise DimSyntaxError(f"unknown function {v}")
                ops.append("call:" + v)
                continue
            values.append(sizes[v])
            expect_operand = False
        elif v == "(":
            if not expect_operand:
                raise DimSyntaxError("misplaced '('")
            if ops and ops[-1].startswith("call:") and (i == 0 or toks[i - 1][0] == "name"):
                argc.append(1)
            ops.append("(")
        elif v == ",":
            close_group()
            if not (ops and ops[-1].startswith("call:")) or not argc:
                raise DimSyntaxError("',' outside a call")
            argc[-1] += 1
            ops.append("(")
            expect_operand = True
        elif v == ")":
            if expect_operand:
                raise DimSyntaxError("misplaced ')'")
            close_group()
            if ops and ops[-1].startswith("call:") and argc:
                fn, n = _FUNCTIONS[ops.pop()[5:]], argc.pop()
                if n != 2 or len(values) < 2:
                    raise DimSyntaxError("a call takes two arguments")
                b, a = values.pop(), values.pop()
                values.append(int(fn(a, b)))
        else:  # a binary operator, or unary minus where an operand is expected
            if expect_operand:
                if v != "-":
                    raise DimSyntaxError(f"misplaced {v!r}")
                ops.append("neg")
                continue
            while ops and ops[-1] in _PRECEDENCE and _PRECEDENCE[ops[-1]] >= _PRECEDENCE[v]:
                reduce_top()
            ops.append(v)
            expect_operand = True
    if expect_operand:
        raise DimSyntaxError("incomplete expression")
    while ops:
        if ops[-1] == "(" or ops[-1].startswith("call:"):
            raise DimSyntaxError("unbalanced parentheses")
        reduce_top()
    if len(values) != 1:
        raise DimSyntaxError("malformed expression")
    if not -2 ** 62 < values[0] < 2 ** 62:
        raise DimSyntaxError("the value is out of range")
    return values[0]


# ---- the shape of parsed JSON ----------------------------------------------------------------
# A schema is a small tree of these; ``problem(value)`` says where a value read from a file first
# departs from it (or None), so a reader can refuse the file before any field is used. Records
# accept keys they do not know (files from newer versions); the keys they name must match.

class Schema:
    def problem(self, value, path: str = "") -> str | None:
        raise NotImplementedError


class Is(Schema):
    """A value of one of ``types`` (an int is never a bool here; a float may be an int)."""

    def __init__(self, *types, max_len: int | None = None):
        self.types, self.max_len = types, max_len

    def problem(self, value, path=""):
        ok = any((isinstance(value, t) and not (isinstance(value, bool) and t in (int, float)))
                 or (t is float and isinstance(value, int) and not isinstance(value, bool)) for t in self.types)
        if not ok:
            return f"{path or 'the value'} is {type(value).__name__}, not {'/'.join(t.__name__ for t in self.types)}"
        if self.max_len is not None and isinstance(value, str) and len(value) > self.max_len:
            return f"{path} is longer than {self.max_len} characters"
        return None


class Count(Schema):
    """A non-negative int below 2**62 (a size, an index, a count)."""

    def problem(self, value, path=""):
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 62):
            return f"{path or 'the value'} is not a count ({str(value)[:40]})"
        return None


class OneOf(Schema):
    def __init__(self, *values):
        self.values = values

    def problem(self, value, path=""):
        return None if any(value == v and type(value) is type(v) for v in self.values) else \
            f"{path or 'the value'} is not one of {', '.join(map(str, self.values))}"


class Opt(Schema):
    def __init__(self, inner: Schema):
        self.inner = inner

    def problem(self, value, path=""):
        return None if value is None else self.inner.problem(value, path)


class Either(Schema):
    def __init__(self, *options: Schema):
        self.options = options

    def problem(self, value, path=""):
        problems = [o.problem(value, path) for o in self.options]
        return None if None in problems else problems[0]


class ListOf(Schema):
    def __init__(self, item: Schema, length: int | None = None):
        self.item, self.length = item, length

    def problem(self, value, path=""):
        if not isinstance(value, list):
            return f"{path or 'the value'} is not a list"
        if self.length is not None and len(value) != self.length:
            return f"{path} has {len(value)} items, not {self.length}"
        for i, v in enumerate(value):
            p = self.item.problem(v, f"{path}[{i}]")
            if p:
                return p
        return None


class TupleOf(Schema):
    """A JSON list of fixed length whose items have their own schemas."""

    def __init__(self, *items: Schema):
        self.items = items

    def problem(self, value, path=""):
        if not isinstance(value, list) or len(value) != len(self.items):
            return f"{path or 'the value'} is not a list of {len(self.items)}"
        for i, (v, s) in enumerate(zip(value, self.items)):
            p = s.problem(v, f"{path}[{i}]")
            if p:
                return p
        return None


class MapOf(Schema):
    """A JSON object with string keys (``key``: a schema for them) and values of one schema."""

    def __init__(self, value: Schema, key: Schema | None = None):
        self.value, self.key = value, key

    def problem(self, value, path=""):
        if not isinstance(value, dict):
            return f"{path or 'the value'} is not an object"
        for k, v in value.items():
            p = (self.key.problem(k, f"{path} key {k[:40]!r}") if self.key else None) or \
                self.value.problem(v, f"{path}.{k[:40]}")
            if p:
                return p
        return None


class Record(Schema):
    def __init__(self, required: dict | None = None, optional: dict | None = None):
        self.required, self.optional = required or {}, optional or {}

    def problem(self, value, path=""):
        if not isinstance(value, dict):
            return f"{path or 'the value'} is not an object"
        for k, s in self.required.items():
            if k not in value:
                return f"{path + '.' if path else ''}{k} is missing"
        for k, s in {**self.required, **self.optional}.items():
            if k in value:
                p = s.problem(value[k], f"{path + '.' if path else ''}{k}")
                if p:
                    return p
        return None


STR = Is(str)
NAME = Is(str, max_len=4096)
NUMBER = Is(float)
BOOL = Is(bool)


# ---- text from files, shown on a terminal ----------------------------------------------------

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
_CONTROL_KEEP_NEWLINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")


def printable(text: str, *, newlines: bool = False) -> str:
    """``text`` with terminal control characters (escape sequences, carriage returns, bidi overrides)
    written as ``\\xNN`` / ``\\uNNNN``, so a name from a file cannot clear the screen, retitle the
    window or fake a line of output. ``newlines=True`` keeps line breaks (a message's own)."""
    pattern = _CONTROL_KEEP_NEWLINES if newlines else _CONTROL
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", text)
