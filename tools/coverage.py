"""Regenerates the committed coverage files: ``make coverage`` (a repository tool, not installed code).

    python -m tools.coverage                      # the whole table: docs/coverage.{json,md}, the totals in
                                                  # docs/op-coverage.md,
                                                  # tests/coverage_expected.json
    python -m tools.coverage --ops 'aten.add.*'   # only these ops' rows, the rest kept as committed
    python -m tools.coverage --runtimes xla_bf16  # only these columns, the rest kept as committed
    python -m tools.coverage --opinfo             # PyTorch's OpInfo samples: docs/coverage_opinfo.{json.gz,md}
    python -m tools.coverage --opinfo --ops fft   # only the OpInfos whose names contain 'fft' (or match a glob)
    python -m tools.coverage --opinfo --dtype bfloat16   # their bfloat16 samples on the tpu target's CPU program
                                                  # (xla column): docs/coverage_opinfo_bf16.{json.gz,md}
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

from torchtpu_export import coverage
from torchtpu_export.coverage import opinfo
from torchtpu_export.fileio import write_bytes_atomic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = os.path.join(REPO, "tests", "coverage_expected.json")
DOCS_JSON = os.path.join(REPO, "docs", "coverage.json")
DOCS_MD = os.path.join(REPO, "docs", "coverage.md")
OPINFO_JSON = os.path.join(REPO, "docs", "coverage_opinfo.json.gz")
OPINFO_MD = os.path.join(REPO, "docs", "coverage_opinfo.md")
OPINFO_BF16_JSON = os.path.join(REPO, "docs", "coverage_opinfo_bf16.json.gz")
OPINFO_BF16_MD = os.path.join(REPO, "docs", "coverage_opinfo_bf16.md")
TOTALS_PAGE = os.path.join(REPO, "docs", "op-coverage.md")  # the site's op-coverage page, between its markers
BEGIN, END = "<!-- coverage-totals:begin -->", "<!-- coverage-totals:end -->"


def _write(path: str, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def table(pattern: str | None, jobs: int, runtimes: list[str] | None = None) -> None:
    t0 = time.perf_counter()
    ops = coverage.select_ops(pattern)
    fresh = coverage.run_matrix(ops, runtimes or list(coverage.RUNTIMES), jobs=jobs, progress=True)
    if pattern or runtimes:  # splice the new rows (or the new columns of them) into the committed report
        with open(DOCS_JSON) as f:
            report = json.load(f)
        rows = {r["op"]: r for r in fresh["ops"]}
        names = coverage.select_ops(None)
        old = {r["op"]: r for r in report["ops"]}
        if runtimes:
            for name, row in rows.items():
                if name in old:
                    cells = {**old[name]["cells"], **row["cells"]}
                    row["cells"] = {rt: cells[rt] for rt in coverage.RUNTIMES if rt in cells}
        report["ops"] = [rows.get(n) or old[n] for n in names if n in rows or n in old]
        report["runtimes"] = list(coverage.RUNTIMES)
    else:
        report = fresh
    _write(DOCS_JSON, json.dumps(report, indent=1) + "\n")
    _write(DOCS_MD, coverage.to_markdown(report))
    _write(EXPECTED, json.dumps(coverage.expected(report), indent=1, sort_keys=True) + "\n")
    _write_totals(report)
    print(f"coverage: {coverage.totals_line(report)} ({time.perf_counter() - t0:.0f} s with {jobs} workers)",
          file=sys.stderr)


def totals_block(report: dict) -> str:
    """The totals per runtime that docs/op-coverage.md shows between its markers (links relative to docs/)."""
    tot = coverage.totals(report)
    n_core = sum(1 for r in report["ops"] if r["core"])
    lines = [f"Op coverage ({n_core} core ATen overloads + {len(report['ops']) - n_core} non-core ops, "
             f"torch {report['torch']}; details in [coverage.md](coverage.md)):", "",
             "| runtime | " + " | ".join(coverage.STATUSES) + " |", "|---|" + "---|" * len(coverage.STATUSES)]
    lines += [f"| {rt} | " + " | ".join(str(tot[rt][s]) for s in coverage.STATUSES) + " |" for rt in report["runtimes"]]
    return "\n".join(lines) + "\n"


def _write_totals(report: dict) -> None:
    with open(TOTALS_PAGE) as f:
        text = f.read()
    if BEGIN not in text:
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    _write(TOTALS_PAGE, head + BEGIN + "\n" + totals_block(report) + END + tail)


def opinfo_source(pattern: str | None, jobs: int, dtype: str = "float32") -> None:
    bf16 = dtype != "float32"
    runtimes = ["xla"] if bf16 else list(coverage.FLOAT_RUNTIMES)
    json_path, md_path = (OPINFO_BF16_JSON, OPINFO_BF16_MD) if bf16 else (OPINFO_JSON, OPINFO_MD)
    report = opinfo.run(runtimes, pattern=pattern, jobs=jobs, progress=True, dtype=dtype)
    if pattern:  # splice the new rows into the committed report
        with gzip.open(json_path, "rt") as f:
            old = json.load(f)
        rows = {r["op"]: r for r in report["ops"]}
        old["ops"] = [rows.pop(r["op"], r) for r in old["ops"]] + list(rows.values())
        old["ops"].sort(key=lambda r: r["op"])
        report = old
    write_bytes_atomic(json_path, gzip.compress(opinfo.dump(report).encode(), mtime=0))
    _write(md_path, opinfo.to_markdown(report))
    print(opinfo.summary(report), file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=None, metavar="PATTERN", help="regenerate only these ops' rows")
    p.add_argument("--opinfo", action="store_true", help="the OpInfo report instead of the table (slow)")
    p.add_argument("--dtype", default="float32", choices=sorted(opinfo.DTYPES),
                   help="with --opinfo: the samples' float dtype (bfloat16 runs the xla column only)")
    p.add_argument("--runtimes", default=None, help="the table: regenerate only these columns (comma-separated)")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if args.opinfo:
        opinfo_source(args.ops, args.jobs, args.dtype)
    else:
        table(args.ops, args.jobs, coverage.parse_runtimes(args.runtimes) if args.runtimes else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
