"""A second, larger source of cases: PyTorch's own OpInfo samples (``--source opinfo``).

``torch.testing._internal.common_methods_invocations.op_db`` (it needs ``expecttest``) lists
about 700 torch-level ops with sample inputs. Each one runs through the same machinery as the
op table (one module per op, captured once, converted per runtime, compared with eager) on its
first float32 samples, and is reported separately from the table: these are torch functions
(``nn.functional.conv2d``, ``cumprod``), not ATen overloads. Every non-pass cell carries its reason.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import sys
import time
from typing import Sequence

from ..errors import InputError
from .cells import STATUSES, Cell, columns, first_line
from .harness import Batch, first_failure
from .pool import run_isolated
from .report import cell_text, totals, totals_line

SAMPLES_PER_OP = 3
TOLERANCE = 1e-5   # relative to the output scale, float32


@functools.cache
def _op_db() -> dict:
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError as e:
        raise InputError(f"--source opinfo needs PyTorch's test helpers ({e})",
                         hint="pip install expecttest (it is in the [test] extra)") from e
    return {_name(o): o for o in op_db}


def _name(opinfo) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


@dataclasses.dataclass
class OpInfoEntry:
    """An OpInfo seen through the op-table interface the coverage batches use."""

    name: str
    op: object
    note: str = ""
    rewrite: None = None
    compare: None = None
    compared: None = None
    core: bool = False

    def invoke(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def tolerance(self, sample) -> float:
        return TOLERANCE


def sample_dtype(opinfo):
    """float32 where the op takes it, else the first of int64, int32, bool it takes (None: none)."""
    import torch
    supported = opinfo.supported_dtypes("cpu")
    return next((d for d in (torch.float32, torch.int64, torch.int32, torch.bool) if d in supported), None)


def samples(opinfo, limit: int = SAMPLES_PER_OP) -> list:
    """The first samples of an OpInfo (float32, or the integer/bool dtype it takes), as op-table samples."""
    from ..optable import Sample
    dtype = sample_dtype(opinfo)
    if dtype is None:
        return []
    out = []
    for i, si in enumerate(opinfo.sample_inputs("cpu", dtype, requires_grad=False)):
        if i >= limit:
            break
        out.append(Sample((si.input, *si.args), dict(si.kwargs), f"sample {i}" + (f" ({si.name})" if si.name else "")))
    return out


def prepare(name: str):
    """The case of one OpInfo, ``(entry, samples, batch)``, or the Cell that says why it has none
    to compare (no sample, eager fails, random values)."""
    import torch
    opinfo = _op_db()[name]
    entry = OpInfoEntry(name, opinfo.op)
    try:
        cases = samples(opinfo)
    except Exception as e:
        return Cell("error", reason=f"sample_inputs: {first_line(e)}")
    if not cases:
        return Cell("unsupported", reason="the OpInfo has no float32, integer or bool sample")
    try:
        batch = Batch(entry, cases)
        with torch.no_grad():  # random ops cannot be compared by value
            again = batch.module(*[t.clone() for t in batch.inputs])
        if not _same(batch.refs, again):
            return Cell("unsupported", reason="random: eager gives different values on each call")
    except Exception as e:
        return Cell("error", reason=f"eager: {first_line(e)}")
    seeded = _random_ops(batch)
    if seeded:
        # OpInfo seeds torch's generator around random ops; a compiled program has its own generator
        reason = f"random ({', '.join(seeded)}): torch's random stream cannot be reproduced, values are not comparable"
        return Cell("unsupported", reason=reason)
    return entry, cases, batch


def run_column(case, column) -> Cell:
    """One prepared case on one column."""
    entry, cases, batch = case
    missing = column.missing()
    if missing:
        return Cell("unsupported", reason=missing)
    cell = batch.run(column)
    if cell.status == "error" and len(cases) > 1:
        cell = first_failure(entry, column, cases, cell)
    return cell


def run_opinfo(name: str, runtimes: Sequence[str]) -> dict:
    """One OpInfo on each runtime (in this process), as JSON-able cells."""
    case = prepare(name)
    if isinstance(case, Cell):
        return {rt: case.to_json() for rt in runtimes}
    all_columns = columns()
    return {rt: run_column(case, all_columns[rt]).to_json() for rt in runtimes}


def _random_ops(batch) -> list[str]:
    """The random ops (tagged nondeterministic_seeded) of the batch's core-ATen graph."""
    import torch
    try:
        ep = batch.exported().run_decompositions()
    except Exception:  # the columns will report the capture failure themselves
        return []
    return sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags})


def _same(a, b) -> bool:
    """Whether two eager results are identical (nan equal to nan)."""
    import torch
    import torch.utils._pytree as pytree
    la = [x for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    lb = [x for x in pytree.tree_leaves(b) if isinstance(x, torch.Tensor)]
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if (x.is_floating_point() or x.is_complex()) and not bool(((x == y) | (x.isnan() & y.isnan())).all()):
            return False
        if not (x.is_floating_point() or x.is_complex()) and not torch.equal(x, y):
            return False
    return True


def run(runtimes: Sequence[str], *, pattern: str | None = None, jobs: int = 2, timeout: float = 180.0,
        progress: bool = False) -> dict:
    """The OpInfo report: {"torch", "runtimes", "source": "opinfo", "ops": [{"op", "cells"}]}."""
    import torch
    names = sorted(_op_db())
    if pattern:
        wild = any(c in pattern for c in "*?[")
        names = [n for n in names if (fnmatch.fnmatchcase(n, pattern) if wild else pattern in n)]
        if not names:
            raise InputError(f"no OpInfo matches {pattern!r}")
    tasks = [("torchtpu_export.coverage.opinfo:run_opinfo", (n, list(runtimes))) for n in names]
    t0 = time.monotonic()

    def report(i, result, seconds):
        if progress:
            status = ", ".join(f"{rt} {result.get(rt, result).get('status')}" for rt in runtimes)
            print(f"[{i + 1}/{len(tasks)}] {names[i]}: {status} ({seconds:.1f} s)", file=sys.stderr, flush=True)

    results = run_isolated(tasks, jobs=jobs, timeout=timeout * len(runtimes), on_result=report)
    ops = []
    for n, result in zip(names, results):
        cells = {rt: Cell.from_json(result.get(rt, result)).to_json() for rt in runtimes}
        ops.append({"op": n, "core": False, "cells": cells})
    return {"torch": torch.__version__.split("+")[0], "source": "opinfo", "runtimes": list(runtimes), "ops": ops,
            "samples_per_op": SAMPLES_PER_OP, "seconds": round(time.monotonic() - t0)}


def to_markdown(report: dict) -> str:
    rts = report["runtimes"]
    tot = totals(report)
    lines = ["# Op coverage: PyTorch OpInfo samples", "",
             "Generated by `python tools/coverage.py --opinfo`; do not edit by hand.", "",
             f"The first {report.get('samples_per_op', SAMPLES_PER_OP)} float32 samples (integer or bool for "
             "ops without float32) of each of the "
             f"{len(report['ops'])} OpInfos in torch {report['torch']}'s `op_db`, batched into one module per "
             "op, captured, converted for each runtime and compared with torch eager (max error within "
             f"{TOLERANCE:g} of the output's scale; integers and bools exactly). These are torch functions, not "
             "ATen overloads: one OpInfo may exercise several core ops. Every cell that does not pass says why.",
             "", "| runtime | " + " | ".join(STATUSES) + " |", "|---|" + "---|" * len(STATUSES)]
    lines += [f"| {rt} | " + " | ".join(str(tot[rt][s]) for s in STATUSES) + " |" for rt in rts]
    lines += ["", "| OpInfo | " + " | ".join(rts) + " |", "|---|" + "---|" * len(rts)]
    for row in report["ops"]:
        lines.append(f"| `{row['op']}` | " + " | ".join(cell_text(row["cells"][rt]) for rt in rts) + " |")
    return "\n".join(lines) + "\n"


def summary(report: dict) -> str:
    return "opinfo " + totals_line(report)


def dump(report: dict) -> str:
    return json.dumps(report, indent=1) + "\n"
