"""Where the ``flatbuffers`` package is used below its public API, in one place.

The ``.tflite`` writer builds into memory it provides and leaves room for weight bytes it
writes to the file itself; the reader finds where a buffer's bytes start without copying
them. flatbuffers' Python package has no public API for either, so these four functions
touch its internals (``Builder.Bytes``, ``Builder.head``, ``Table``'s ``_tab``), pinned to
``flatbuffers==25.12.19``; ``tests/test_flatbuf.py`` fails loudly if a release changes them.
"""
from __future__ import annotations

import flatbuffers


def use_memory(builder: flatbuffers.Builder, space) -> None:
    """Makes ``builder`` build back to front into ``space`` (e.g. an anonymous mmap) from its end."""
    builder.Bytes, builder.head = space, len(space)


def memory(builder: flatbuffers.Builder):
    """The builder's whole backing buffer (what it has built is its tail, from ``builder.Head()``)."""
    return builder.Bytes


def skip(builder: flatbuffers.Builder, n: int) -> None:
    """Leaves ``n`` bytes of the vector being built unwritten (their room is kept, for the caller to fill)."""
    builder.head = builder.head - n


def vector_start(table, slot: int) -> int:
    """Where the data of the vector field in vtable ``slot`` of a generated table object starts in its buffer."""
    tab = table._tab
    return tab.Vector(tab.Offset(slot))
