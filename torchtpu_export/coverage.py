"""The op-coverage matrix: every op of the table on every runtime, compared with torch eager.

    torchtpu-export coverage [--targets xla,tpu,litert,onnx] [--ops PATTERN] [--format md|json] [-o FILE]
    python -m torchtpu_export.coverage --regenerate     # docs/coverage.{json,md}, tests/coverage_expected.json

A cell is one op on one runtime: ``pass`` (every sample within the op's tolerance),
``mismatch`` (the worst error and the sample), ``unsupported`` (the converter's reason) or
``error`` (the runtime's or converter's message). Each cell runs in a worker process, so a
crash in a native runtime becomes an ``error`` cell instead of ending the run.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib
import json
import logging
import math
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

from .cli import command
from .errors import InputError, UnsupportedOpError

log = logging.getLogger("torchtpu_export")

FLOAT_RUNTIMES = ("xla", "litert", "onnx")
# tpu: the xla column's program compiled for a TPU by libtpu (pass = the TPU compiler accepts it);
# then the quantized LiteRT columns
RUNTIMES = ("xla", "tpu", "litert", "onnx", "litert_dynamic_int8", "litert_int8")
TPU_TOPOLOGY = "v5e:2x2"
STATUSES = ("pass", "mismatch", "unsupported", "error")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED_FILE = os.path.join(REPO, "tests", "coverage_expected.json")
DOCS_JSON = os.path.join(REPO, "docs", "coverage.json")
DOCS_MD = os.path.join(REPO, "docs", "coverage.md")
CELL_TIMEOUT_S = 180.0


@dataclasses.dataclass
class Cell:
    """One op on one runtime: its status, worst error, failing sample and reason."""

    status: str
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    sample: str | None = None
    reason: str | None = None
    samples: int = 0
    note: str | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("max_abs_err", "max_rel_err"):
            v = d[k]
            if v is not None:
                d[k] = None if math.isnan(v) else ("inf" if math.isinf(v) else float(f"{v:.3g}"))
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Cell":
        d = dict(d)
        for k in ("max_abs_err", "max_rel_err"):
            if d.get(k) == "inf":
                d[k] = math.inf
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls) if f.name in d})


# ---- columns -------------------------------------------------------------------------------

@dataclasses.dataclass
class Column:
    """A runtime of the matrix: which converter feeds it and what it accepts."""

    name: str
    target: str                    # the converter (api target) that makes its artifact
    lowp: frozenset                # half-precision dtypes it is tested with
    narrows_64bit: bool = False    # int64/float64 results may come back as 32-bit
    quant: str | None = None       # a quantization recipe: the column runs only QUANTIZED[quant]'s ops
    compile_for: str | None = None  # a TPU topology: the cell is whether libtpu compiles the program

    def converter(self):
        from . import api
        return api._converter(self.target)

    def runs(self, op_name: str) -> bool:
        """Whether the column has a cell for the op (quantized columns: the ops the recipe quantizes)."""
        return self.quant is None or op_name in QUANTIZED[self.quant]

    def missing(self) -> str | None:
        """Why this column cannot run in this build, or None."""
        if self.compile_for:
            from .tpu_compile import libtpu_version
            if libtpu_version() is None:
                return "libtpu (the TPU compiler) is not installed: pip install 'torchtpu-export[tpu]'"
        if self.target == "litert":
            conv = self.converter()
            if not hasattr(conv, "convert_programs"):
                return "no LiteRT converter in this build (converters.litert has no convert_programs)"
        return None

    def keep_whole(self) -> list:
        return list(getattr(self.converter(), "KEEP_WHOLE", []))

    def build(self, captures: dict):
        """The runnable artifact (with ``run_flat``) of already-captured programs."""
        from . import api
        if self.name == "xla":
            return api._export_tpu(captures, platforms=("cpu",))
        if self.compile_for:
            return api._export_tpu(captures, platforms=("tpu",))
        if self.name == "onnx":
            return api._export_onnx(captures)
        # like tte.convert: one "serving_default" signature
        cap = captures["main"]
        quant = self.quant
        if quant == "int8":  # full integer: activation scales from the sample itself
            quant = {"recipe": "int8", "calibration": [tuple(cap.sample_inputs)]}
        return self.converter().convert_programs({"serving_default": cap}, quant_config=quant)


def _columns() -> dict[str, Column]:
    import torch
    return {
        "xla": Column("xla", "tpu", frozenset({torch.float16, torch.bfloat16})),
        "tpu": Column("tpu", "tpu", frozenset({torch.float16, torch.bfloat16}), compile_for=TPU_TOPOLOGY),
        # ONNX Runtime's CPU provider and the LiteRT interpreter lack half-precision kernels for most
        # ops: their columns are measured on float32, integer and bool samples.
        "litert": Column("litert", "litert", frozenset(), narrows_64bit=True),
        "onnx": Column("onnx", "onnx", frozenset()),
        # the quantized LiteRT recipes, on the ops they quantize (weights as constants, as in a model)
        "litert_dynamic_int8": Column("litert_dynamic_int8", "litert", frozenset(), True, "dynamic_int8"),
        "litert_int8": Column("litert_int8", "litert", frozenset(), True, "int8"),
    }


# The ops each LiteRT recipe quantizes. In the quantized columns the weight ops' weights are
# constants of the program (as a model's are), so the recipe can quantize them.
_WEIGHT_OPS = ("aten.convolution.default", "aten.addmm.default", "aten.mm.default", "aten.bmm.default",
               "aten.linear.default", "aten.embedding.default")
QUANTIZED = {
    # hybrid kernels: FULLY_CONNECTED, CONV_2D, BATCH_MATMUL, EMBEDDING_LOOKUP
    "dynamic_int8": _WEIGHT_OPS,
    # full integer: those, and the activation ops with int8 kernels
    "int8": _WEIGHT_OPS + (
        "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.relu.default", "aten.hardtanh.default",
        "aten.sigmoid.default", "aten.tanh.default", "aten._softmax.default", "aten.mean.dim",
        "aten.avg_pool2d.default", "aten._adaptive_avg_pool2d.default", "aten.cat.default",
        "aten.view.default", "aten.permute.default", "aten.upsample_nearest2d.vec", "aten.maximum.default",
        "aten.minimum.default", "aten.leaky_relu.default"),
}
# Quantization costs accuracy by design: a cell passes when the error relative to the output's
# scale and the cosine similarity to torch stay within the recipe's bound (8-bit steps are 1/127).
QUANT_BOUNDS = {"dynamic_int8": (0.05, 0.999), "int8": (0.08, 0.99)}


# ---- one cell ------------------------------------------------------------------------------

def _op_module(entry, samples):
    """An nn.Module whose forward calls the op once per sample; inputs are the samples' tensors."""
    import torch
    import torch.utils._pytree as pytree

    from .optable import Constant, View, _is_input, view_of

    plans = []
    for s in samples:
        leaves, spec = pytree.tree_flatten((s.args, s.kwargs), is_leaf=lambda x: isinstance(x, View))
        plans.append((spec, [(_is_input(x), x.how if isinstance(x, View) else None,
                              None if _is_input(x) else (x.tensor if isinstance(x, Constant) else x))
                             for x in leaves]))

    class OpModule(torch.nn.Module):
        def forward(self, *tensors):
            outs, k = [], 0
            for spec, leaves in plans:
                values = []
                for is_input, how, const in leaves:
                    if is_input:
                        x = tensors[k]
                        k += 1
                        values.append(view_of(x, how) if how else x)
                    else:
                        values.append(const)
                args, kwargs = pytree.tree_unflatten(values, spec)
                result = entry.invoke(*args, **kwargs)
                outs.append(tuple(x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)))
            return tuple(outs)

    OpModule.__name__ = OpModule.__qualname__ = f"Op_{entry.op.__name__}" if hasattr(entry.op, "__name__") else "Op"
    return OpModule()


def _dynamic_shapes(samples):
    from torch.export import Dim
    specs = []
    for s in samples:
        for i, t in enumerate(s.tensors()):
            dims = (s.dynamic or {}).get(i)
            specs.append({d: Dim(f"d{len(specs)}_{d}", min=lo, max=hi) for d, (lo, hi) in dims.items()} if dims
                         else None)
    return (tuple(specs),) if any(specs) else None


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0] if text else ''}"
    return msg if len(msg) <= limit else msg[:limit] + "..."


def _to_numpy(t):
    import torch

    from .specs import as_numpy
    if isinstance(t, torch.Tensor):
        t = t.resolve_conj().resolve_neg()  # lazy conjugate/negative views have no numpy form
    return as_numpy(t)


def compare_sample(entry, sample, outs: list, refs: list, column: Column):
    """The verdict of one sample: shapes and dtypes must match, values within the op's tolerance."""
    from .numerics import compare
    outs = [np.asarray(o) for o in outs]
    refs = [_to_numpy(r) for r in refs]
    if len(outs) != len(refs):
        return _failed(f"{len(outs)} outputs, torch has {len(refs)}")
    for i, (o, r) in enumerate(zip(outs, refs)):
        if entry.compared is not None and i not in entry.compared:
            continue
        if o.shape != r.shape:
            return _failed(f"output {i}: shape {o.shape}, torch {r.shape}")
        if o.dtype != r.dtype:
            narrowed = column.narrows_64bit and o.dtype.kind == r.dtype.kind and r.dtype.itemsize == 8 \
                and o.dtype.itemsize == 4
            if not narrowed:
                return _failed(f"output {i}: dtype {o.dtype.name}, torch {r.dtype.name}")
    if entry.compared is not None:
        outs, refs = [outs[i] for i in entry.compared], [refs[i] for i in entry.compared]
    if column.quant is not None:
        return _quant_verdict(outs, refs, *QUANT_BOUNDS[column.quant])
    if entry.compare is not None:
        return entry.compare(outs, refs, sample)
    return compare(outs, refs, rtol=entry.tolerance(sample))


def _failed(detail: str):
    from .numerics import Agreement
    return Agreement(math.inf, math.inf, False, detail)


def _quant_verdict(outs, refs, max_rel: float, min_cosine: float):
    from .numerics import Agreement
    from .quant import measure
    report = measure("", refs, outs, 0, 0)
    ok = report.max_rel_err <= max_rel and report.cosine >= min_cosine
    detail = None if ok else f"rel err {report.max_rel_err:.3g} (bound {max_rel}), cosine {report.cosine:.5f} " \
                             f"(bound {min_cosine})"
    return Agreement(report.max_abs_err, report.max_rel_err, ok, detail)


def _weight_samples(op_name: str) -> list:
    """Layer-sized calls of the weight ops (a recipe leaves weights under 1024 values float, as
    TFLite's converter does, so the table's small samples would not quantize)."""
    import torch

    from .optable import Constant, Sample
    g = torch.Generator().manual_seed(0)

    def f(*shape):
        return torch.randn(*shape, generator=g)

    def w(*shape):
        return Constant(f(*shape) / shape[-1] ** 0.5)

    samples = {
        "aten.convolution.default": [Sample((f(1, 8, 10, 10), w(32, 8, 3, 3), Constant(f(32)), [1, 1], [1, 1],
                                             [1, 1], False, [0, 0], 1), {}, "3x3 conv, padding 1"),
                                     Sample((f(1, 16, 9, 9), w(32, 16, 1, 1), None, [2, 2], [0, 0], [1, 1], False,
                                             [0, 0], 1), {}, "1x1 conv, stride 2, no bias")],
        "aten.addmm.default": [Sample((Constant(f(64)), f(4, 48), w(48, 64)), {}, "bias + x @ w")],
        "aten.mm.default": [Sample((f(4, 48), w(48, 64)), {}, "x @ w")],
        "aten.bmm.default": [Sample((f(2, 4, 48), w(2, 48, 64)), {}, "batched x @ w")],
        "aten.linear.default": [Sample((f(2, 5, 48), w(64, 48), Constant(f(64))), {}, "3-d input, bias"),
                                Sample((f(3, 48), w(64, 48)), {}, "2-d input, no bias")],
        "aten.embedding.default": [Sample((w(300, 16), torch.randint(0, 300, (2, 7), generator=g)), {},
                                          "300x16 table")],
    }
    return samples[op_name]


def _quant_samples(op_name: str, samples) -> list:
    """The samples of a quantized column: layer-sized ones with constant weights for the weight
    ops, the table's ordinary float32 ones for the activation ops."""
    import torch
    if op_name in _WEIGHT_OPS:
        return _weight_samples(op_name)
    out = []
    for s in samples:
        if s.dynamic or any(t.dtype.is_floating_point and t.dtype != torch.float32 for t in s.tensors()):
            continue
        floats = [t for t in s.tensors() if t.dtype == torch.float32]
        # edge values (inf, nan, 1e37) have no 8-bit range, and a tensor of one value (0-d) or none
        # no meaningful one: quantization is measured on ordinary tensors
        if floats and all(t.numel() >= 2 and bool(t.abs().le(1e4).all()) for t in floats):
            out.append(s)
    return out


class _Batch:
    """One module calling the op on some samples, exported once by torch.export and shared by
    every column (each column then decomposes it for its own target)."""

    def __init__(self, entry, samples):
        import torch
        self.entry, self.samples = entry, list(samples)
        self.module = _op_module(entry, self.samples)
        self.inputs = [t for s in self.samples for t in s.tensors()]
        with torch.no_grad():
            self.refs = self.module(*[t.clone() for t in self.inputs])
        self.label = self.samples[0].desc if len(self.samples) == 1 else f"{len(self.samples)} samples"
        self._exported = None

    def exported(self):
        """torch.export's program (captured like capture() does: eval mode, no grad, non-strict)."""
        import torch
        if self._exported is None:
            with torch.no_grad():
                self._exported = torch.export.export(self.module, tuple(self.inputs),
                                                     dynamic_shapes=_dynamic_shapes(self.samples), strict=False)
        return self._exported

    def run(self, column: Column) -> Cell:
        """Converts for ``column``, runs, and compares each sample with torch."""
        from .capture import capture
        entry, label = self.entry, self.label
        try:
            cap = capture(self.exported(), tuple(self.inputs), keep=column.keep_whole())
            if entry.rewrite is not None:
                entry.rewrite(cap.exported.graph_module)
        except Exception as e:
            return Cell("error", sample=label, reason=f"capture: {_first_line(e)}")
        note = None
        if _is_overload(entry.op) and entry.name not in cap.op_histogram():
            found = ", ".join(sorted(cap.op_histogram())) or "nothing"
            if entry.core:
                return Cell("error", sample=label,
                            reason=f"the captured graph does not contain the op (it has {found})")
            note = f"decomposed for this target into {found}"
        try:
            program = column.build({"main": cap})
            if column.quant is not None:
                from .edge import int8_ops
                quantized = int8_ops(program.model_content())
                if not quantized:
                    return Cell("unsupported", sample=label, reason=f"the {column.quant} recipe leaves it float")
                if set(quantized) == {"DEQUANTIZE"}:
                    note = "int8 weights dequantized at load; the op runs in float"
            if column.compile_for:
                return _compile_cell(program, column.compile_for, self.samples, label, note)
            outs = program.run_flat([_to_numpy(t) for t in self.inputs])
        except UnsupportedOpError as e:
            reason = e.reason if e.op == entry.name else f"{e.op}: {e.reason}"
            return Cell("unsupported", sample=label, reason=reason or str(e), note=note)
        except Exception as e:  # the converter's or runtime's own failure is the cell's verdict
            log.debug("cell %s/%s failed", entry.name, column.name, exc_info=True)
            return Cell("error", sample=label, reason=_first_line(e), note=note)
        return compare_outputs(entry, self.samples, self.refs, outs, column, note)


def _compile_cell(program, topology: str, samples, label: str, note: str | None) -> Cell:
    """A tpu cell: pass when libtpu compiles the program for ``topology`` (the numbers are the xla column's)."""
    from . import tpu_compile
    try:
        tpu_compile.compile_artifact(program.artifact, topology, store=False)
    except tpu_compile.CompileError as e:
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        return Cell("unsupported", sample=label, reason=f"the TPU compiler rejects it: {' '.join(lines)[:400]}",
                    note=note)
    return Cell("pass", samples=len(samples), note=note)


def compare_outputs(entry, samples, refs, outs, column: Column, note: str | None = None) -> Cell:
    """The cell of a program's flat outputs against torch's (``refs``: one tuple per sample)."""
    worst_abs = worst_rel = 0.0
    k = 0
    for s, ref in zip(samples, refs):
        got = list(outs[k:k + len(ref)])
        k += len(ref)
        v = compare_sample(entry, s, got, list(ref), column)
        if not v.ok:
            return Cell("mismatch", v.max_abs_err, v.max_rel_err, s.desc, v.detail or None, note=note)
        worst_abs, worst_rel = max(worst_abs, v.max_abs_err), max(worst_rel, v.max_rel_err)
    return Cell("pass", worst_abs, worst_rel, None, None, len(samples), note)


def _is_overload(op) -> bool:
    import torch
    return isinstance(op, torch._ops.OpOverload)


def _first_failure(entry, column: Column, samples, failed: Cell) -> Cell:
    """Bisects the samples for the shortest failing prefix, so an error names its sample."""
    lo, hi, cell = 1, len(samples), failed   # prefix hi fails; find the smallest failing prefix
    while lo < hi:
        mid = (lo + hi) // 2
        probe = _Batch(entry, samples[:mid]).run(column)
        if probe.status == "error":
            hi, cell = mid, probe
        else:
            lo = mid + 1
    cell.sample = samples[hi - 1].desc
    return cell


def _column_samples(entry, column: Column, samples=None) -> list:
    """The samples (of ``samples``, default all of the entry's) whose dtypes the column is tested with."""
    half = _half_dtypes() - column.lowp
    return [s for s in (entry.all_samples() if samples is None else samples) if not (s.dtypes() & half)]


def run_op(op_name: str, runtimes: Sequence[str], *, locate: bool = True) -> dict[str, Cell]:
    """Runs every sample of one op on each runtime (in this process); returns the cells.

    ``locate`` bisects an error down to the sample that causes it (a few more exports).
    """
    from . import optable
    entry = optable.get(op_name)
    columns = _columns()
    everything = entry.all_samples()
    cells: dict[str, Cell] = {}
    batches: dict[tuple, _Batch] = {}   # columns that run the same samples share one export
    for rt in runtimes:
        column = columns[rt]
        if not column.runs(op_name):
            continue  # a quantized column has cells only for the ops its recipe quantizes
        missing = column.missing()
        if missing:
            cells[rt] = Cell("unsupported", reason=missing)
            continue
        samples = _column_samples(entry, column, everything)
        if column.quant is not None:
            samples = _quant_samples(op_name, samples)
        if not samples:
            cells[rt] = Cell("unsupported", reason="no sample of this op has a dtype this runtime is tested with")
            continue
        groups = [[s for s in samples if not s.dynamic]] + [[s] for s in samples if s.dynamic]
        total, worst_abs, worst_rel, note, cell = 0, 0.0, 0.0, None, None
        for group in (g for g in groups if g):
            key = tuple(id(s) for s in group)
            if key not in batches:
                batches[key] = _Batch(entry, group)
            cell = batches[key].run(column)
            if cell.status == "error" and len(group) > 1 and locate:
                # an error can hinge on one sample (a dtype, a 0-d input): find it. "unsupported" is about the op
                cell = _first_failure(entry, column, group, cell)
            if cell.status != "pass":
                cell.samples = len(samples)
                break
            total += cell.samples
            worst_abs, worst_rel = max(worst_abs, cell.max_abs_err or 0.0), max(worst_rel, cell.max_rel_err or 0.0)
            note = note or cell.note
        else:
            cell = Cell("pass", worst_abs, worst_rel, samples=total, note=note)
        cells[rt] = cell
    return cells


def run_cell(op_name: str, runtime: str) -> Cell:
    """One op on one runtime, in this process."""
    return run_op(op_name, [runtime])[runtime]


def _half_dtypes():
    import torch
    return frozenset({torch.float16, torch.bfloat16})


def run_op_json(op_name: str, runtimes: Sequence[str]) -> dict:
    """``run_op`` with JSON-able results (what worker processes send back)."""
    try:
        return {rt: c.to_json() for rt, c in run_op(op_name, runtimes).items()}
    except Exception as e:  # a bug in the table or harness: still cells, never a dead run
        log.debug("harness failure", exc_info=True)
        return {rt: Cell("error", reason=f"harness: {_first_line(e)}").to_json() for rt in runtimes}


# ---- isolation: worker processes -----------------------------------------------------------

_ISOLATION_REASONS = ("the runtime crashed", "timed out")
_READY = "ready"


def _worker(conn) -> None:
    # one ONNX Runtime / torch thread per worker: the matrix runs as many workers as there are cores
    os.environ.setdefault("TTE_ONNX_THREADS", "1")
    import warnings
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)  # torch logs failed traces at length; the cell carries the reason
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        path, args = task
        mod, _, fn = path.partition(":")
        try:
            result = getattr(importlib.import_module(mod), fn)(*args)
        except BaseException as e:  # noqa: BLE001  (reported as the task's result)
            result = {"status": "error", "reason": f"harness: {_first_line(e)}"}
        conn.send(result)


def run_isolated(tasks: Sequence[tuple[str, tuple]], *, jobs: int = 2, timeout: float = CELL_TIMEOUT_S,
                 on_result: Callable[[int, dict, float], None] | None = None) -> list[dict]:
    """Runs ``module:function(*args)`` tasks in ``jobs`` worker processes.

    A task whose worker dies (a segfault in a native runtime) or that runs past ``timeout``
    seconds gets an ``error`` result; its worker is replaced and the run goes on.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    results: list[dict | None] = [None] * len(tasks)
    pending = list(range(len(tasks)))[::-1]
    workers: list[dict] = []

    def start():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child,), daemon=True)
        p.start()
        child.close()
        # the timeout clock of a task starts when its worker is ready (imports done)
        return {"proc": p, "conn": parent, "task": None, "t0": 0.0, "ready": False}

    def finish(w, result):
        i = w["task"]
        results[i] = result
        w["task"] = None
        if on_result:
            on_result(i, result, time.monotonic() - w["t0"])

    def replace(w, reason):
        finish(w, {"status": "error", "reason": reason})
        w["proc"].kill()
        w["proc"].join()
        w["conn"].close()
        workers[workers.index(w)] = start()

    try:
        workers.extend(start() for _ in range(max(1, min(jobs, len(tasks)))))
        while pending or any(w["task"] is not None for w in workers):
            for w in workers:
                if w["ready"] and w["task"] is None and pending:
                    i = pending.pop()
                    w["task"], w["t0"] = i, time.monotonic()
                    w["conn"].send(tasks[i])
            for w in [w for w in workers if not w["ready"]]:
                if w["conn"].poll(0.05):
                    try:
                        w["ready"] = w["conn"].recv() == _READY
                    except (EOFError, OSError):
                        pass
                if not w["ready"] and not w["proc"].is_alive():
                    raise RuntimeError(f"a coverage worker process failed to start (exit code {w['proc'].exitcode})")
            busy = [w for w in workers if w["task"] is not None]
            if not busy:
                continue
            ready = wait([w["conn"] for w in busy] + [w["proc"].sentinel for w in busy], timeout=1.0)
            now = time.monotonic()
            for w in busy:
                if w["conn"] in ready:
                    try:
                        finish(w, w["conn"].recv())
                        continue
                    except (EOFError, OSError):
                        pass
                if w["proc"].sentinel in ready or not w["proc"].is_alive():
                    code = w["proc"].exitcode
                    what = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    replace(w, f"{_ISOLATION_REASONS[0]} the worker process ({what})")
                elif now - w["t0"] > timeout:
                    replace(w, f"{_ISOLATION_REASONS[1]} after {timeout:.0f} s")
    finally:
        for w in workers:
            try:
                w["conn"].send(None)
            except (OSError, BrokenPipeError):
                pass
        for w in workers:
            w["proc"].join(timeout=5)
            if w["proc"].is_alive():
                w["proc"].kill()
    return results


# ---- the matrix ----------------------------------------------------------------------------

def select_ops(pattern: str | None, source: str = "table") -> list[str]:
    from . import optable
    names = optable.op_names()
    if not pattern:
        return names
    wild = any(c in pattern for c in "*?[")
    chosen = [n for n in names if (fnmatch.fnmatchcase(n, pattern) if wild else pattern in n)]
    if not chosen:
        raise InputError(f"no op of the table matches {pattern!r}", hint="e.g. --ops 'aten.add.*' or --ops conv")
    return chosen


def parse_runtimes(text: str | None) -> list[str]:
    if not text:
        return list(RUNTIMES)
    out = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        name = {"tflite": "litert"}.get(name, name)
        if name not in RUNTIMES:
            raise InputError(f"unknown runtime {name!r}; choose from {', '.join(RUNTIMES)}")
        if name not in out:
            out.append(name)
    return out


def run_matrix(ops: Sequence[str], runtimes: Sequence[str], *, jobs: int = 2, timeout: float = CELL_TIMEOUT_S,
               progress: bool = False) -> dict:
    """The coverage report (the JSON document) of ``ops`` x ``runtimes``.

    Each op runs all its runtimes in one worker task (one torch.export shared by the columns);
    an op whose worker crashes or times out is rerun one runtime per task, so the crash lands
    in the cell that caused it.
    """
    import torch

    from . import optable
    fn = "torchtpu_export.coverage:run_op_json"
    cells: dict[str, dict] = {op: {} for op in ops}
    done = [0]

    def report(tasks):
        def on_result(i, result, seconds):
            done[0] += 1
            if progress:
                op, rts = tasks[i][1]
                status = ", ".join(f"{rt} {result.get(rt, result).get('status')}" for rt in rts
                                   if rt in result or "status" in result)
                print(f"[{done[0]}/{len(tasks)}] {op}: {status} ({seconds:.1f} s)", file=sys.stderr, flush=True)
        return on_result

    tasks = [(fn, (op, list(runtimes))) for op in ops]
    results = run_isolated(tasks, jobs=jobs, timeout=timeout * len(runtimes), on_result=report(tasks))
    retry = []
    columns = _columns()
    for (_, (op, rts)), result in zip(tasks, results):
        if "status" in result:  # the worker died or timed out: no per-runtime cells
            retry += [(fn, (op, [rt])) for rt in rts if columns[rt].runs(op)] if len(rts) > 1 else []
            if len(rts) == 1:
                cells[op][rts[0]] = result
        else:
            cells[op].update(result)
    if retry:
        for (_, (op, (rt,))), result in zip(retry, run_isolated(retry, jobs=jobs, timeout=timeout,
                                                                 on_result=report(retry))):
            cells[op][rt] = result.get(rt, result)
    return {
        "torch": torch.__version__.split("+")[0],
        "runtimes": list(runtimes),
        "ops": [{"op": op, "core": optable.get(op).core, "note": optable.get(op).note or None,
                 "cells": {rt: Cell.from_json(cells[op][rt]).to_json() for rt in runtimes if rt in cells[op]}}
                for op in ops],
    }


def totals(report: dict) -> dict[str, dict[str, int]]:
    out = {rt: {s: 0 for s in STATUSES} for rt in report["runtimes"]}
    for row in report["ops"]:
        for rt, cell in row["cells"].items():
            out[rt][cell["status"]] += 1
    return out


def _cell_text(cell: dict) -> str:
    status = cell["status"]
    if status == "pass":
        return "pass"
    if status == "mismatch":
        text = f"mismatch: max abs {cell['max_abs_err']}, rel {cell['max_rel_err']} ({cell.get('sample')})"
        if cell.get("reason"):
            text += f"; {cell['reason']}"
    else:
        text = f"{status}: {cell.get('reason') or ''}"
        if cell.get("sample") and status == "error":
            text += f" (sample: {cell['sample']})"
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: dict) -> str:
    rts = report["runtimes"]
    core = [r for r in report["ops"] if r["core"]]
    lines = [
        "# Op coverage",
        "",
        "Generated by `make coverage` (`python -m torchtpu_export.coverage --regenerate`) from the op table",
        "in `torchtpu_export/optable/`; do not edit by hand. Each op runs every sample of the table on each",
        "runtime and is compared with torch eager (the reference): **pass** means every sample is within the",
        "op's tolerance (each entry of the table states its tolerance and why). float16/bfloat16 samples",
        "run on xla only (ONNX Runtime's CPU provider and the LiteRT interpreter lack half-precision kernels",
        "for most ops); litert may return int64/float64 results as 32-bit. PyTorch's own OpInfo samples go",
        "through the same machinery in [coverage_opinfo.md](coverage_opinfo.md).",
        "",
        f"The `tpu` column compiles the xla column's program for a TPU ({TPU_TOPOLOGY}) with libtpu, ahead of",
        "time on this CPU machine: **pass** means the TPU compiler accepts it (its numbers are the xla",
        "column's; only a TPU can measure them), and a rejection quotes the compiler.",
        "",
        "The quantized columns (`litert_dynamic_int8`, `litert_int8`) run the LiteRT recipes on the ops they",
        "quantize (`-` elsewhere): weight ops with layer-sized constant weights (a recipe leaves weights",
        "under 1024 values float), activation ops on the table's ordinary float32 samples (no edge values,",
        "no 0-d tensors), `int8` calibrated on the sample itself. A cell passes when the artifact runs int8",
        "kernels (a recipe that leaves the op float is *unsupported*) and the error stays within the",
        "recipe's bound: max abs error <= " + ", ".join(f"{b[0]} ({r})" for r, b in QUANT_BOUNDS.items()),
        "of the output's largest magnitude and cosine similarity >= "
        + ", ".join(f"{b[1]} ({r})" for r, b in QUANT_BOUNDS.items()) + ".",
        "",
        f"torch {report['torch']}; {len(core)} core ATen overloads and {len(report['ops']) - len(core)} non-core ops",
        "(composites a target may keep whole, and torch.export's form of training-mode batch norm).",
        "",
        "| runtime | " + " | ".join(STATUSES) + " |",
        "|---|" + "---|" * len(STATUSES),
    ]
    tot = totals(report)
    for rt in rts:
        lines.append(f"| {rt} | " + " | ".join(str(tot[rt][s]) for s in STATUSES) + " |")
    lines += ["", "| op | core | " + " | ".join(rts) + " |", "|---|---|" + "---|" * len(rts)]
    for row in report["ops"]:
        lines.append(f"| `{row['op']}` | {'yes' if row['core'] else 'no'} | "
                     + " | ".join(_cell_text(row["cells"][rt]) if rt in row["cells"] else "-" for rt in rts) + " |")
    notes = [f"- `{row['op']}`: {row['note']}" for row in report["ops"] if row.get("note")]
    notes += [f"- `{row['op']}` ({rt}): {c['note']}" for row in report["ops"] for rt, c in row["cells"].items()
              if c.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def totals_line(report: dict) -> str:
    tot = totals(report)
    return "; ".join(f"{rt}: {tot[rt]['pass']}/{sum(tot[rt].values())} pass" for rt in report["runtimes"])


def expected_statuses(report: dict) -> dict:
    """The committed verdicts: op -> runtime -> status, and the ops whose worker crashed or hung
    (the test suite runs those in a worker process too)."""
    cells, isolate = {}, []
    for row in report["ops"]:
        cells[row["op"]] = {rt: c["status"] for rt, c in row["cells"].items()}
        if any(c["status"] == "error" and (c.get("reason") or "").startswith(_ISOLATION_REASONS)
               for c in row["cells"].values()):
            isolate.append(row["op"])
    return {"torch": report["torch"], "runtimes": report["runtimes"], "cells": cells, "isolate": isolate}


def _write(path: str, text: str) -> None:
    from .fileio import write_bytes_atomic
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_bytes_atomic(path, text.encode())


_README_BEGIN, _README_END = "<!-- coverage-totals:begin -->", "<!-- coverage-totals:end -->"


def _update_readme(report: dict) -> None:
    path = os.path.join(REPO, "README.md")
    with open(path) as f:
        text = f.read()
    if _README_BEGIN not in text:
        return
    head, rest = text.split(_README_BEGIN, 1)
    _, tail = rest.split(_README_END, 1)
    tot = totals(report)
    n_core = sum(1 for r in report["ops"] if r["core"])
    table = [f"Op coverage ({n_core} core ATen overloads + {len(report['ops']) - n_core} non-core ops, "
             f"torch {report['torch']}; details in [docs/coverage.md](docs/coverage.md)):", "",
             "| runtime | " + " | ".join(STATUSES) + " |", "|---|" + "---|" * len(STATUSES)]
    table += [f"| {rt} | " + " | ".join(str(tot[rt][s]) for s in STATUSES) + " |" for rt in report["runtimes"]]
    _write(path, head + _README_BEGIN + "\n" + "\n".join(table) + "\n" + _README_END + tail)


def regenerate(jobs: int = 2) -> dict:
    """Runs the whole matrix and rewrites docs/coverage.{json,md}, the README totals and the expected file."""
    t0 = time.perf_counter()
    report = run_matrix(select_ops(None), list(RUNTIMES), jobs=jobs, progress=True)
    wall = time.perf_counter() - t0
    _write(DOCS_JSON, json.dumps(report, indent=1) + "\n")
    _write(DOCS_MD, to_markdown(report))
    _write(EXPECTED_FILE, json.dumps(expected_statuses(report), indent=1, sort_keys=True) + "\n")
    _update_readme(report)
    print(f"coverage: {totals_line(report)} ({wall:.0f} s with {jobs} workers)", file=sys.stderr)
    return report


# ---- CLI -----------------------------------------------------------------------------------

def _coverage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=None, help=f"comma-separated runtimes (default: {','.join(RUNTIMES)})")
    p.add_argument("--ops", default=None, metavar="PATTERN",
                   help="ops to run: a glob over ATen names (aten.add.*) or a substring (conv)")
    p.add_argument("--format", default="md", choices=["md", "json"])
    p.add_argument("-o", "--output", default=None, help="write the report here instead of stdout")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--timeout", type=float, default=CELL_TIMEOUT_S, help="seconds per cell before it is an error")
    p.add_argument("--source", default="table", choices=["table", "opinfo"],
                   help="table: the project's op table; opinfo: PyTorch's OpInfo samples (reported separately)")


@command("coverage", "op-coverage matrix: every op on every runtime, compared with torch eager")(_coverage_args)
def _coverage(args) -> int:
    if args.output:
        from .fileio import check_writable
        check_writable(args.output)
    runtimes = parse_runtimes(args.targets)
    if args.jobs < 1:
        raise InputError("--jobs must be at least 1")
    t0 = time.perf_counter()
    if args.source == "opinfo":
        from . import opinfo
        quantized = [rt for rt in runtimes if rt not in FLOAT_RUNTIMES]
        if quantized and args.targets:
            raise InputError(f"--source opinfo runs the float columns only, not {', '.join(quantized)}")
        runtimes = [rt for rt in runtimes if rt in FLOAT_RUNTIMES]
        report = opinfo.run(runtimes, pattern=args.ops, jobs=args.jobs, timeout=args.timeout,
                            progress=args.verbose > 0)
        text = opinfo.dump(report) if args.format == "json" else opinfo.to_markdown(report)
    else:
        report = run_matrix(select_ops(args.ops), runtimes, jobs=args.jobs, timeout=args.timeout,
                            progress=args.verbose > 0)
        text = json.dumps(report, indent=1) + "\n" if args.format == "json" else to_markdown(report)
    if args.output:
        _write(args.output, text)
    else:
        sys.stdout.write(text)
    if not args.quiet:
        print(f"{totals_line(report)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtpu_export.coverage",
                                description="regenerate the committed coverage files")
    p.add_argument("--regenerate", action="store_true",
                   help="run the full matrix; rewrite docs/coverage.{json,md}, README totals, tests/coverage_expected.json")
    p.add_argument("--regenerate-opinfo", action="store_true",
                   help="run PyTorch's OpInfo samples (slow); rewrite docs/coverage_opinfo.{json,md}")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    if not (args.regenerate or args.regenerate_opinfo):
        p.print_help()
        return 2
    if args.regenerate:
        regenerate(jobs=args.jobs)
    if args.regenerate_opinfo:
        from . import opinfo
        report = opinfo.run(list(FLOAT_RUNTIMES), jobs=args.jobs, progress=True)
        _write(os.path.join(REPO, "docs", "coverage_opinfo.json"), opinfo.dump(report))
        _write(os.path.join(REPO, "docs", "coverage_opinfo.md"), opinfo.to_markdown(report))
        print(opinfo.summary(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
