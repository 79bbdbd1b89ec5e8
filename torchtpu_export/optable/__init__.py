"""The op table: every core ATen overload (plus the composite ops a target keeps whole),
with sample inputs and the tolerance each op is held to.

One table feeds the coverage matrix (``torchtpu-export coverage``), the test suite and
``docs/coverage.md``. An entry is registered once, next to its family's other entries::

    entry(aten.sin.default, unary(-4, 4), tol=F32_ULPS, why="...")

Samples are deterministic (seeded by the op's name), small, and cover 0-d and broadcast
shapes, non-contiguous inputs (the op sees a transposed or strided view made inside the
graph), negative dims, edge values, and the integer and bool dtypes the op accepts.
float16/bfloat16 variants are derived from the float32 samples.
"""
from __future__ import annotations

# the entries and their parts live in a leaf module the families import (._entry); re-exported here
from ._entry import (EXACT, F32_ACCUM, F32_ULPS, LOWP_RTOL, TABLE, Comparator, Constant, Entry, Gen, S, Sample,
                     View, aten, edge_values, entry, is_input, ties_in_any_order, view_of)


__all__ = ["EXACT", "F32_ACCUM", "F32_ULPS", "LOWP_RTOL", "TABLE", "Comparator", "Constant", "Entry", "Gen", "S",
           "Sample", "View", "aten", "edge_values", "entry", "is_input", "ties_in_any_order", "view_of",
           "op_names", "get"]


def op_names() -> list[str]:
    """Every entry's op name, core ops first, each group sorted."""
    _load()
    return sorted(TABLE, key=lambda n: (not TABLE[n].core, n))


def get(name: str) -> Entry:
    _load()
    return TABLE[name]


def _load() -> None:
    from . import _backward, _composite, _elementwise, _index, _misc, _nn, _reduction, _shape  # noqa: F401
    from . import _quantized  # noqa: F401  (marks entries of the modules above)
