"""``torchtpu-export coverage``: the matrix on the command line."""
from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import InputError
from .cells import FLOAT_RUNTIMES, RUNTIMES
from .pool import CELL_TIMEOUT_S
from .report import parse_runtimes, run_matrix, select_ops, to_markdown, totals_line

HELP = "op-coverage matrix: every op on every runtime, compared with torch eager"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=None, help=f"comma-separated runtimes (default: {','.join(RUNTIMES)})")
    p.add_argument("--ops", default=None, metavar="PATTERN",
                   help="ops to run: a glob over ATen names (aten.add.*) or a substring (conv)")
    p.add_argument("--format", default="md", choices=["md", "json"])
    p.add_argument("-o", "--output", default=None, help="write the report here instead of stdout")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--timeout", type=float, default=CELL_TIMEOUT_S, help="seconds per cell before it is an error")
    p.add_argument("--source", default="table", choices=["table", "opinfo"],
                   help="table: the project's op table; opinfo: PyTorch's OpInfo samples (reported separately)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="with --source opinfo: the samples' float dtype (bfloat16: the xla column)")


def run(args) -> int:
    if args.output:
        from ..fileio import check_writable
        check_writable(args.output)
    runtimes = parse_runtimes(args.targets)
    if args.jobs < 1:
        raise InputError("--jobs must be at least 1")
    t0 = time.perf_counter()
    if args.dtype != "float32" and args.source != "opinfo":
        raise InputError("--dtype applies to --source opinfo (the op table has its own float16/bfloat16 samples)")
    if args.source == "opinfo":
        from . import opinfo
        quantized = [rt for rt in runtimes if rt not in FLOAT_RUNTIMES]
        if quantized and args.targets:
            raise InputError(f"--source opinfo runs the float columns only, not {', '.join(quantized)}")
        runtimes = [rt for rt in runtimes if rt in FLOAT_RUNTIMES]
        if args.dtype != "float32" and not args.targets:
            runtimes = ["xla"]  # the edge runtimes have few half-precision kernels (see docs/coverage.md)
        report = opinfo.run(runtimes, pattern=args.ops, jobs=args.jobs, timeout=args.timeout,
                            progress=args.verbose > 0, dtype=args.dtype)
        text = opinfo.dump(report) if args.format == "json" else opinfo.to_markdown(report)
    else:
        report = run_matrix(select_ops(args.ops), runtimes, jobs=args.jobs, timeout=args.timeout,
                            progress=args.verbose > 0)
        text = json.dumps(report, indent=1) + "\n" if args.format == "json" else to_markdown(report)
    if args.output:
        from ..fileio import write_bytes_atomic
        write_bytes_atomic(args.output, text.encode())
    else:
        sys.stdout.write(text)
    if not args.quiet:
        print(f"{totals_line(report)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0
