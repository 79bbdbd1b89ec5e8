"""The op-coverage matrix: every op of the table on every runtime, compared with torch eager.

    torchtpu-export coverage [--targets xla,tpu,litert,onnx] [--ops PATTERN] [--format md|json] [-o FILE]
    python -m tools.coverage [--ops PATTERN]   # regenerates docs/coverage.{json,md} and the committed verdicts

A cell is one op on one runtime: ``pass`` (every sample within the op's tolerance),
``mismatch`` (the worst error and the sample), ``unsupported`` (the converter's reason) or
``error`` (the runtime's or converter's message). Each op runs in a worker process, so a
crash in a native runtime becomes an ``error`` cell instead of ending the run.

Modules: ``cells`` (cells and columns), ``harness`` (one op's module, built and run per
column), ``pool`` (worker processes), ``report`` (the matrix and its reports), ``opinfo``
(PyTorch's OpInfo samples, a second source of cases) and ``cli``.
"""
from .cells import FLOAT_RUNTIMES, RUNTIMES, STATUSES, Cell, Column, columns
from .harness import column_samples, run_cell, run_op
from .pool import run_isolated
from .report import (differences, expected, parse_runtimes, run_matrix, select_ops, to_markdown, totals,
                     totals_line)

__all__ = ["FLOAT_RUNTIMES", "RUNTIMES", "STATUSES", "Cell", "Column", "columns", "column_samples", "run_cell",
           "run_op", "run_isolated", "differences", "expected", "parse_runtimes", "run_matrix", "select_ops",
           "to_markdown", "totals", "totals_line"]
