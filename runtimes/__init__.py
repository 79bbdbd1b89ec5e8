"""Runtimes: load an artifact and run it. One module per runtime, one small interface.

A runtime takes the flat list of input arrays (in the artifact's input order)
and returns the flat list of output arrays, as numpy. Runtimes never import
converters; both depend only on torchtpu_export's core.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Runtime(Protocol):
    name: str

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        ...
