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
import math
import sys
import time
from typing import Sequence

import numpy as np

from ..errors import InputError
from .cells import STATUSES, Cell, columns, first_line, to_numpy
from .harness import Batch, first_failure
from .pool import run_isolated
from .report import cell_text, totals, totals_line

SAMPLES_PER_OP = 3
TOLERANCE = 1e-5   # relative to the output scale, float32
# ``--dtype bfloat16``: the same OpInfos on their bfloat16 samples, on the xla column (the tpu target's
# CPU program). torch computes bf16 ops in float32 and rounds once; a lowering that rounds at another
# step differs by a few bf16 steps (2**-8 each), so the bound is 2e-2 of the output's scale.
DTYPES = {"float32": TOLERANCE, "bfloat16": 2e-2}


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
    tol: float = TOLERANCE

    def invoke(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def tolerance(self, sample) -> float:
        return self.tol


def sample_dtype(opinfo, dtype: str = "float32"):
    """float32 where the op takes it, else the first of int64, int32, bool it takes (None: none);
    with ``dtype="bfloat16"``, bfloat16 or None."""
    import torch
    supported = opinfo.supported_dtypes("cpu")
    if dtype == "bfloat16":
        return torch.bfloat16 if torch.bfloat16 in supported else None
    return next((d for d in (torch.float32, torch.int64, torch.int32, torch.bool) if d in supported), None)


def samples(opinfo, limit: int = SAMPLES_PER_OP, dtype: str = "float32") -> list:
    """The first samples of an OpInfo (float32, or the integer/bool dtype it takes; or bfloat16), as
    op-table samples."""
    from ..optable import Sample
    dtype = sample_dtype(opinfo, dtype)
    if dtype is None:
        return []
    out = []
    for i, si in enumerate(opinfo.sample_inputs("cpu", dtype, requires_grad=False)):
        if i >= limit:
            break
        out.append(Sample((si.input, *si.args), dict(si.kwargs), f"sample {i}" + (f" ({si.name})" if si.name else "")))
    return out


# OpInfos whose outputs hold vectors defined only up to sign (eigenvectors, singular vectors, as
# LAPACK returns them): output index -> the axis along which each vector lies (-2: columns, -1: rows)
SIGN_FREE = {"linalg.eigh": {1: -2}, "linalg.svd": {0: -2, 2: -1}, "svd": {0: -2, 2: -2}}

# OpInfos whose index outputs torch leaves unspecified among equal values (unstable sorts,
# selections): output indices and the position of the dim argument (see optable.ties_in_any_order)
TIES_ANY_ORDER = {"sort": ((1,), 1), "argsort": ((0,), 1), "topk": ((1,), 2)}

# random ops whose matrix results are sets of vectors, each defined up to its sign (randomised SVDs):
# compared by distribution after each vector is turned to make its largest component positive
SIGN_FREE_RANDOM = ("pca_lowrank", "svd_lowrank")


def _canonical_signs(leaves: list) -> list:
    out = []
    for x in leaves:
        x = np.asarray(x)
        if x.ndim >= 2 and x.dtype.kind == "f" and x.size:
            top = np.take_along_axis(x, np.abs(x).argmax(axis=-2)[..., None, :], axis=-2)
            x = np.where(top < 0, -x, x)
        out.append(x)
    return out


# ops that return uninitialised memory: only the shape and dtype of their results are defined
_UNINITIALISED = ("empty", "new_empty", "empty_like", "empty_strided", "empty_permuted", "new_empty_strided")


def _up_to_sign(axes: dict):
    """A comparison that first flips each vector of the ``axes`` outputs to the sign of torch's."""
    from ..numerics import compare

    def compare_signs(outs, refs, sample, rtol=TOLERANCE):
        outs = list(outs)
        for i, axis in axes.items():
            if i < len(outs) and np.asarray(outs[i]).size:
                o, r = np.asarray(outs[i]), np.asarray(refs[i])
                dot = np.sum(o * r, axis=axis, keepdims=True)
                outs[i] = np.where(dot < 0, -o, o)
        return compare(outs, refs, rtol=rtol)
    return compare_signs


def _shape_only(outs, refs, sample):
    from ..numerics import Agreement
    return Agreement(ok=True)


def prepare(name: str, dtype: str = "float32"):
    """The case of one OpInfo, ``(entry, samples, batch, kind)``, or the Cell that says why it has
    none to compare (no sample, eager fails). ``kind`` is None (compared by value), "random" (random
    ops: compared by distribution over repeated calls) or "uninitialised" (shapes and dtypes only)."""
    import torch
    opinfo = _op_db()[name]
    entry = OpInfoEntry(name, opinfo.op, tol=DTYPES[dtype])
    if name in SIGN_FREE:
        entry.compare = functools.partial(_up_to_sign(SIGN_FREE[name]), rtol=entry.tol)
    if name in TIES_ANY_ORDER:
        from ..optable import ties_in_any_order
        entry.compare = functools.partial(ties_in_any_order(*TIES_ANY_ORDER[name]), rtol=entry.tol)
    try:
        cases = samples(opinfo, dtype=dtype)
    except Exception as e:
        return Cell("error", reason=f"sample_inputs: {first_line(e)}")
    if not cases:
        return Cell("unsupported", reason="the OpInfo has no float32, integer or bool sample" if dtype == "float32"
                    else f"the OpInfo has no {dtype} sample (torch's CPU kernel does not take it)")
    try:
        batch = Batch(entry, cases)
        with torch.no_grad():
            again = batch.module(*[t.clone() for t in batch.inputs])
    except Exception as e:
        return Cell("error", reason=f"eager: {first_line(e)}")
    if _random_ops(batch):
        return entry, cases, batch, "random"
    if not _same(batch.refs, again):
        if name.split(".")[0] in _UNINITIALISED:
            entry.compare = _shape_only
            return entry, cases, batch, "uninitialised"
        return Cell("unsupported", reason="random: eager gives different values on each call")
    if dtype != "float32":
        off = _reference_off(batch)
        if off:
            return Cell("error", reason=f"eager: torch's {dtype} result is no reference here: {off}")
    return entry, cases, batch, None


REFERENCE_OFF = 0.25  # a half-precision eager result this far (of the output's scale) from float32 eager


def _reference_off(batch) -> str | None:
    """Why torch's own half-precision result cannot judge a program (None when it can): it is off its
    float32 result by far more than half precision explains (torch's bfloat16 ``matrix_exp`` on CPU
    returns 1e30 or NaN for matrices of norm ~1), or it is not finite where float32 is."""
    import torch
    import torch.utils._pytree as pytree
    from ..numerics import compare
    try:
        with torch.no_grad():
            wide = batch.module(*[t.float() if t.is_floating_point() else t.clone() for t in batch.inputs])
    except Exception:
        return None
    refs = [r for r in pytree.tree_leaves(batch.refs) if isinstance(r, torch.Tensor) and r.is_floating_point()]
    wides = [w for w in pytree.tree_leaves(wide) if isinstance(w, torch.Tensor) and w.is_floating_point()]
    if len(refs) != len(wides) or not refs:
        return None
    for i, (r, w) in enumerate(zip(refs, wides)):
        if r.shape != w.shape:
            return None
        r, w = r.float().numpy(), w.float().numpy()  # (a factory op's "float32" run is still half)
        if (np.isfinite(w) & ~np.isfinite(r)).any():
            return f"output {i} is not finite where torch's float32 result is"
        verdict = compare([r], [w], rtol=REFERENCE_OFF)
        if not verdict.ok:
            return f"output {i} is off torch's float32 result by {verdict.max_rel_err:.3g} of its scale"
    return None


def run_column(case, column) -> Cell:
    """One prepared case on one column."""
    entry, cases, batch, kind = case
    missing = column.missing()
    if missing:
        return Cell("unsupported", reason=missing)
    cell = random_cell(batch, column) if kind == "random" else batch.run(column)
    if cell.status == "error" and len(cases) > 1:
        cell = first_failure(entry, column, cases, cell)
    if cell.status == "pass" and kind is not None:
        cell.note = {"random": "random: compared by distribution over repeated calls (Kolmogorov-Smirnov)",
                     "uninitialised": "uninitialised values: shapes and dtypes compared"}[kind]
    return cell


RANDOM_VALUES = 4000   # values per output pooled over the calls of a random case (at least 16 calls)


def random_cell(batch, column) -> Cell:
    """A random case: eager and the program each called repeatedly, compared by distribution."""
    import torch
    import torch.utils._pytree as pytree
    from ..numerics import same_distribution
    built = batch.build(column)
    if isinstance(built, Cell):
        return built
    program, note = built
    inputs = [to_numpy(t) for t in batch.inputs]
    n = max(1, min(int(np.asarray(to_numpy(r)).size) for r in pytree.tree_leaves(batch.refs)) or 1)
    calls = int(min(200, max(16, -(-RANDOM_VALUES // n))))

    def draw(first_seed: int):
        """``calls`` outputs of eager and of the program, each call under its own seed."""
        state = torch.random.get_rng_state()
        try:
            eager, runs = [], []
            seed = torch.manual_seed
            with torch.no_grad():
                for k in range(calls):
                    seed(first_seed + k)
                    # OpInfo's random ops reseed torch with 42 inside each call (wrapper_set_seed): made a
                    # no-op here, so that eager draws a new sample per call as it does outside the tests
                    torch.manual_seed = lambda s: torch.default_generator
                    try:
                        out = batch.module(*[t.clone() for t in batch.inputs])
                    finally:
                        torch.manual_seed = seed
                    eager.append([to_numpy(t) for t in pytree.tree_leaves(out)])
            for k in range(calls):
                torch.manual_seed(100_000 + first_seed + k)
                runs.append(program.run_flat(inputs))
        finally:
            torch.random.set_rng_state(state)
        return eager, runs
    try:
        eager, runs = draw(0)
    except Exception as e:
        return batch.failure(column, e, note)
    ref0 = eager[0]
    if len(runs[0]) != len(ref0):
        return Cell("mismatch", sample=batch.label, reason=f"{len(runs[0])} outputs, torch has {len(ref0)}", note=note)
    for i, (o, r) in enumerate(zip(runs[0], ref0)):
        o = np.asarray(o)
        narrowed = column.narrows_64bit and o.dtype.kind == r.dtype.kind and r.dtype.itemsize == 8 \
            and o.dtype.itemsize == 4
        if o.shape != r.shape or (o.dtype != r.dtype and not narrowed):
            return Cell("mismatch", sample=batch.label, note=note,
                        reason=f"output {i}: {o.dtype.name}{list(o.shape)}, torch {r.dtype.name}{list(r.shape)}")
    if batch.entry.name in SIGN_FREE_RANDOM:
        eager, runs = [_canonical_signs(e) for e in eager], [_canonical_signs(r) for r in runs]
    verdict = same_distribution(eager, runs, rtol=batch.entry.tolerance(None))
    if not verdict.ok and math.isfinite(verdict.max_abs_err):
        # a Kolmogorov-Smirnov rejection at alpha 0.005 happens by chance one cell in 200 (LiteRT seeds each
        # interpreter anew, so its draws differ from run to run): an independent sample must reject too (a
        # chance failure one in 40,000), as a real difference in distribution does
        try:
            eager, runs = draw(1_000_000)
        except Exception as e:
            return batch.failure(column, e, note)
        if batch.entry.name in SIGN_FREE_RANDOM:
            eager, runs = [_canonical_signs(e) for e in eager], [_canonical_signs(r) for r in runs]
        verdict = same_distribution(eager, runs, rtol=batch.entry.tolerance(None))
    if not verdict.ok:
        return Cell("mismatch", verdict.max_abs_err, verdict.max_rel_err, batch.label, verdict.detail, note=note)
    return Cell("pass", verdict.max_abs_err, verdict.max_rel_err, None, None, len(batch.samples), note)


def run_opinfo(name: str, runtimes: Sequence[str], dtype: str = "float32") -> dict:
    """One OpInfo on each runtime (in this process), as JSON-able cells."""
    case = prepare(name, dtype)
    if isinstance(case, Cell):
        return {rt: case.to_json() for rt in runtimes}
    all_columns = columns()
    return {rt: run_column(case, all_columns[rt]).to_json() for rt in runtimes}


def _random_ops(batch) -> list[str]:
    """The ops of the batch's core-ATen graph that draw random numbers."""
    try:
        ep = batch.exported().run_decompositions()
    except Exception:  # the columns will report the capture failure themselves
        return []
    from ..fxnodes import draws_random
    return sorted({str(n.target) for n in ep.graph.nodes if draws_random(n)})


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
        progress: bool = False, dtype: str = "float32") -> dict:
    """The OpInfo report: {"torch", "runtimes", "source": "opinfo", "dtype", "ops": [{"op", "cells"}]}."""
    import torch
    if dtype not in DTYPES:
        raise InputError(f"OpInfo samples come in {', '.join(DTYPES)}, not {dtype!r}")
    names = sorted(_op_db())
    if pattern:
        wild = any(c in pattern for c in "*?[")
        names = [n for n in names if (fnmatch.fnmatchcase(n, pattern) if wild else pattern in n)]
        if not names:
            raise InputError(f"no OpInfo matches {pattern!r}")
    tasks = [("torchtpu_export.coverage.opinfo:run_opinfo", (n, list(runtimes), dtype)) for n in names]
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
    return {"torch": torch.__version__.split("+")[0], "source": "opinfo", "dtype": dtype,
            "runtimes": list(runtimes), "ops": ops,
            "samples_per_op": SAMPLES_PER_OP, "seconds": round(time.monotonic() - t0)}


# why a cell does not pass (the report's last column groups them)
CAUSES = ("ours: missing or imprecise lowering", "runtime limit", "torch.export limit", "not a case",
          "torch.onnx limit")
_NOT_A_CASE = ("eager:", "the OpInfo has no")
# reasons that name a limit of the runtime: its tensor types, static shapes, operators, float kernels
_RUNTIME_LIMITS = ("TFLite has no", "has no such tensor type", "static shapes", "no JAX equivalent",
                   "depends on the input's values", "complex results that TFLite kernels cannot",
                   "torch bfloat16", "Sparse", "ONNX has no",
                   "aten._sparse_")  # ATen's kernels on sparse layouts: no runtime here has sparse tensors


def cause(cell: dict) -> str | None:
    """Why a cell does not pass (None when it does), one of CAUSES: a lowering we have not written
    or that is not precise enough (ours to fix); a limit of the runtime (a tensor type, dynamic
    shapes, sparse layouts it lacks); a case torch.export cannot capture; or no case at all (eager
    itself fails, or the OpInfo has no sample of a tested type), which two leave the denominator of
    the pass rate over captured cases; and in the onnx column, what torch.onnx's exporter lacks."""
    if cell["status"] == "pass":
        return None
    reason = cell.get("reason") or ""
    if reason.startswith(_NOT_A_CASE):
        return CAUSES[3]
    if reason.startswith("capture:"):
        return CAUSES[2]
    if any(s in reason for s in _RUNTIME_LIMITS):
        return CAUSES[1]
    if "torch.onnx" in reason:  # the onnx column's converter is torch.onnx's exporter
        return CAUSES[4]
    return CAUSES[0]


def captured_rates(report: dict) -> dict[str, tuple[int, int]]:
    """runtime -> (passing cells, cells of cases torch.export captures)."""
    out = {}
    for rt in report["runtimes"]:
        causes = [cause(row["cells"][rt]) for row in report["ops"]]
        captured = [c for c in causes if c not in CAUSES[2:4]]
        out[rt] = (sum(c is None for c in captured), len(captured))
    return out


def to_markdown(report: dict) -> str:
    rts = report["runtimes"]
    tot = totals(report)
    rates = captured_rates(report)
    by_cause = {rt: {c: sum(cause(row["cells"][rt]) == c for row in report["ops"]) for c in CAUSES} for rt in rts}
    dtype = report.get("dtype", "float32")
    n = report.get('samples_per_op', SAMPLES_PER_OP)
    what = (f"The first {n} float32 samples (integer or bool for ops without float32)" if dtype == "float32" else
            f"The first {n} {dtype} samples (OpInfos whose CPU kernel does not take {dtype} have none)")
    lines = [f"# Op coverage: PyTorch OpInfo samples{'' if dtype == 'float32' else ' in ' + dtype}", "",
             f"Generated by `python -m tools.coverage --opinfo{'' if dtype == 'float32' else ' --dtype ' + dtype}`; "
             "do not edit by hand.", "",
             f"{what} of each of the "
             f"{len(report['ops'])} OpInfos in torch {report['torch']}'s `op_db`, batched into one module per "
             "op, captured, converted for each runtime and compared with torch eager (max error within "
             f"{DTYPES[dtype]:g} of the output's scale; integers and bools exactly). These are torch functions, not "
             "ATen overloads: one OpInfo may exercise several core ops. Every cell that does not pass says why.",
             "", "| runtime | " + " | ".join(STATUSES) + " |", "|---|" + "---|" * len(STATUSES)]
    lines += [f"| {rt} | " + " | ".join(str(tot[rt][s]) for s in STATUSES) + " |" for rt in rts]
    lines += ["", "Of the OpInfos whose cases torch.export captures (eager failures and OpInfos without a "
              "tested sample type left out):", "", "| runtime | pass | captured | pass rate |", "|---|---|---|---|"]
    lines += [f"| {rt} | {p} | {n} | {100 * p / n:.1f} % |" for rt, (p, n) in rates.items() if n]
    lines += ["", "Every cell that does not pass, by cause:", "",
              "| runtime | " + " | ".join(CAUSES) + " |", "|---|" + "---|" * len(CAUSES)]
    lines += [f"| {rt} | " + " | ".join(str(by_cause[rt][c]) for c in CAUSES) + " |" for rt in rts]
    lines += ["", "| OpInfo | " + " | ".join(rts) + " |", "|---|" + "---|" * len(rts)]
    for row in report["ops"]:
        lines.append(f"| `{row['op']}` | " + " | ".join(_cell_with_cause(row["cells"][rt]) for rt in rts) + " |")
    return "\n".join(lines) + "\n"


def _cell_with_cause(cell: dict) -> str:
    why = cause(cell)
    return cell_text(cell) if why is None else f"**{why}**: {cell_text(cell)}"


def summary(report: dict) -> str:
    rates = "; ".join(f"{rt} {p}/{n} ({100 * p / n:.1f} %)" for rt, (p, n) in captured_rates(report).items() if n)
    return f"opinfo {totals_line(report)}; of captured cases: {rates}"


def dump(report: dict) -> str:
    return json.dumps(report, indent=1) + "\n"
