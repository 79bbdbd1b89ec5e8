"""Dynamic dimensions in the graph IR: sympy expressions over the exported program's symbols.

A tensor dim is an ``int`` or a sympy expression over torch.export's symbols
(``s0``, ``2*s1``, ``floor(s0/2) + 1``), canonicalised so that builders can
compute shapes with ordinary arithmetic (``x.shape[0] * 4``, ``n // 2``) and
compare them structurally. The flatbuffer gets ``-1`` in ``shape_signature``
for such a dim and the sample size in ``shape``; wherever a dim must be a
value inside the model (a RESHAPE target, a BROADCAST_TO shape, a SLICE
size), it is computed at run time from the inputs' SHAPE
(:meth:`~.registry.BuildContext.dim`).

Python's own ``bool()`` of a sympy expression is always True, so code that
branches on a dim asks :func:`is_static` first; comparisons such as
``d > 4`` raise TypeError for a dim sympy cannot decide, which
:func:`~.lower.lower` reports as an op that cannot be dynamic.
"""
from __future__ import annotations

import math
import re

import numpy as np
import sympy
import torch


def symbol(name: str) -> sympy.Symbol:
    """The symbol of a dynamic dim (positive integers, as torch.export's sizes are)."""
    return sympy.Symbol(name, integer=True, positive=True)


def is_static(d) -> bool:
    return isinstance(d, (int, np.integer))


def all_static(shape) -> bool:
    return all(is_static(d) for d in shape)


def normalize(d):
    """A dim as an ``int`` when it is a number, else its sympy expression."""
    if isinstance(d, (int, np.integer)):
        return int(d)
    if isinstance(d, sympy.Basic):
        if d.is_Integer:
            return int(d)
        if d.is_number:
            raise TypeError(f"dimension {d} is not an integer")
        return d
    raise TypeError(f"not a dimension: {d!r}")


_TORCH_BINARY = {
    "FloorDiv": lambda a, b: a // b, "CleanDiv": lambda a, b: a // b, "IntTrueDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -((-a) // b), "Mod": lambda a, b: a % b, "PythonMod": lambda a, b: a % b,
}


def canon(value):
    """A torch SymInt (or its sympy expression, or an int) as a dim of the IR."""
    if isinstance(value, torch.SymInt):
        value = value.node.expr
    if isinstance(value, (int, np.integer)):
        return int(value)
    return normalize(_canon(sympy.sympify(value)))


def _canon(e):
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        return symbol(e.name)
    args = [_canon(a) for a in e.args]
    name = type(e).__name__
    if isinstance(e, sympy.Add):
        return sum(args[1:], args[0])
    if isinstance(e, sympy.Mul):
        return math.prod(args[1:], start=args[0])
    if isinstance(e, sympy.Pow) and is_static(args[1]) and args[1] >= 0:
        return args[0] ** args[1]
    if name in _TORCH_BINARY:
        return _TORCH_BINARY[name](*args)
    if name == "ModularIndexing":
        base, div, mod = args
        return (base // div) % mod
    if name in ("Max", "Min"):
        return (sympy.Max if name == "Max" else sympy.Min)(*args)
    if isinstance(e, (sympy.floor, sympy.ceiling, sympy.Mod)):
        return type(e)(*args)
    if isinstance(e, sympy.Rational):
        return e
    raise TypeError(f"the dimension expression {e} ({name}) has no TFLite equivalent here")


def concrete(d, hints: dict) -> int:
    """The value of a dim at the sample sizes (``hints``: symbol -> size)."""
    if is_static(d):
        return int(d)
    v = d.subs(hints)
    if not v.is_Integer:
        raise TypeError(f"dimension {d} has no value at the sample sizes")
    return int(v)


def symbol_ranges(cap) -> dict[str, tuple]:
    """symbol name -> (min, max or None) for every symbol in a captured program's input dims,
    those that appear only inside expressions ("4*s0") included."""
    names = set()
    for spec in cap.inputs:
        names |= {n for d in spec.shape if isinstance(d, str) for n in re.findall(r"[A-Za-z_]\w*", d)}
    out = {}
    for sym, rng in cap.exported.range_constraints.items():
        if str(sym) in names:
            out[str(sym)] = (_bound(rng.lower) or 0, _bound(rng.upper))
    return out


def _bound(v) -> int | None:
    try:
        v = int(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if abs(v) < 2**62 else None


def source_of(sym, tensors):
    """``(tensor, axis, a, b)``: a dim of one of ``tensors`` that is ``a * sym + b`` (a plain ``sym``
    preferred), from which ``sym`` can be read; None when there is none."""
    linear = None
    for t in tensors:
        for axis, d in enumerate(t.shape):
            if d == sym:
                return t, axis, 1, 0
            if linear is None and not is_static(d) and d.free_symbols == {sym}:
                try:
                    poly = sympy.Poly(d, sym)
                except sympy.PolynomialError:  # floor(), Mod(): not linear
                    continue
                if poly.degree() == 1 and all(c.is_Integer for c in poly.all_coeffs()):
                    a, b = poly.all_coeffs()
                    linear = t, axis, int(a), int(b)
    return linear


def broadcast_shapes(*shapes) -> tuple:
    """numpy's broadcast of shapes whose dims may be dynamic (equal expressions, or 1 against anything)."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dim = 1
        for s in shapes:
            d = s[i - rank + len(s)] if i - rank + len(s) >= 0 else 1
            if d == 1 or d == dim:
                continue
            if dim != 1:
                raise TypeError(f"cannot broadcast dims {dim} and {d}")
            dim = d
        out.append(dim)
    return tuple(out)
