"""The per-op harness: one module calling the op on its samples, captured once, built and run per column."""
from __future__ import annotations

import logging
from typing import Sequence

from ..errors import UnsupportedOpError
from .cells import Cell, Column, columns, compare_outputs, compile_cell, first_line, to_numpy

log = logging.getLogger("torchtpu_export")


def op_module(entry, samples):
    """An nn.Module whose forward calls the op once per sample; inputs are the samples' tensors."""
    import torch
    import torch.utils._pytree as pytree

    from ..optable import Constant, View, is_input, view_of

    plans = []
    for s in samples:
        leaves, spec = pytree.tree_flatten((s.args, s.kwargs), is_leaf=lambda x: isinstance(x, View))
        plans.append((spec, [(is_input(x), x.how if isinstance(x, View) else None,
                              None if is_input(x) else (x.tensor if isinstance(x, Constant) else x))
                             for x in leaves]))

    class OpModule(torch.nn.Module):
        def forward(self, *tensors):
            outs, k = [], 0
            for spec, leaves in plans:
                values = []
                for fed, how, const in leaves:
                    if fed:
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


class Batch:
    """One module calling the op on some samples, exported once by torch.export and shared by
    every column (each column then decomposes it for its own target)."""

    def __init__(self, entry, samples):
        import torch
        self.entry, self.samples = entry, list(samples)
        self.module = op_module(entry, self.samples)
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

    def build(self, column: Column):
        """``(program, note)`` for ``column``, or the Cell that says why there is none."""
        from ..capture import capture
        entry, label = self.entry, self.label
        try:
            cap = capture(self.exported(), tuple(self.inputs), keep=column.keep_whole())
            if entry.rewrite is not None:
                entry.rewrite(cap.exported.graph_module)
        except Exception as e:
            return Cell("error", sample=label, reason=f"capture: {first_line(e)}")
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
                from ..targets.litert.artifact import int8_ops
                quantized = int8_ops(program.model_content())
                if not quantized:
                    return Cell("unsupported", sample=label, reason=f"the {column.quant} recipe leaves it float")
                if set(quantized) == {"DEQUANTIZE"}:
                    note = "int8 weights dequantized at load; the op runs in float"
        except Exception as e:
            return self.failure(column, e, note)
        return program, note

    def failure(self, column: Column, e: Exception, note) -> Cell:
        if isinstance(e, UnsupportedOpError):
            reason = e.reason if e.op == self.entry.name else f"{e.op}: {e.reason}"
            return Cell("unsupported", sample=self.label, reason=reason or str(e), note=note)
        # the converter's or runtime's own failure is the cell's verdict
        log.debug("cell %s/%s failed", self.entry.name, column.name, exc_info=True)
        return Cell("error", sample=self.label, reason=first_line(e), note=note)

    def run(self, column: Column) -> Cell:
        """Converts for ``column``, runs, and compares each sample with torch."""
        built = self.build(column)
        if isinstance(built, Cell):
            return built
        program, note = built
        try:
            if column.compile_for:
                return compile_cell(program, column.compile_for, self.samples, self.label, note)
            outs = program.run_flat([to_numpy(t) for t in self.inputs])
        except Exception as e:
            return self.failure(column, e, note)
        return compare_outputs(self.entry, self.samples, self.refs, outs, column, note)


def _is_overload(op) -> bool:
    import torch
    return isinstance(op, torch._ops.OpOverload)


def first_failure(entry, column: Column, samples, failed: Cell) -> Cell:
    """Bisects the samples for the shortest failing prefix, so an error names its sample."""
    lo, hi, cell = 1, len(samples), failed   # prefix hi fails; find the smallest failing prefix
    while lo < hi:
        mid = (lo + hi) // 2
        probe = Batch(entry, samples[:mid]).run(column)
        if probe.status == "error":
            hi, cell = mid, probe
        else:
            lo = mid + 1
    cell.sample = samples[hi - 1].desc
    return cell


def column_samples(entry, column: Column, samples=None) -> list:
    """The samples (of ``samples``, default all of the entry's) a column runs: the dtypes it is tested
    with; for a quantized column, the entry's layer-sized samples or its ordinary float32 ones."""
    import torch
    half = frozenset({torch.float16, torch.bfloat16}) - column.lowp
    chosen = [s for s in (entry.all_samples() if samples is None else samples) if not (s.dtypes() & half)]
    if column.only is not None:
        chosen = [s for s in chosen if column.only in s.dtypes()]
    if column.quant is None:
        return chosen
    if entry.quant_samples is not None:
        return entry.quant_samples(None)
    out = []
    for s in chosen:
        if s.dynamic or any(t.dtype.is_floating_point and t.dtype != torch.float32 for t in s.tensors()):
            continue
        floats = [t for t in s.tensors() if t.dtype == torch.float32]
        # edge values (inf, nan, 1e37) have no 8-bit range, and a tensor of one value (0-d) or none
        # no meaningful one: quantization is measured on ordinary tensors
        if floats and all(t.numel() >= 2 and bool(t.abs().le(1e4).all()) for t in floats):
            out.append(s)
    return out


def run_op(op_name: str, runtimes: Sequence[str], *, locate: bool = True) -> dict[str, Cell]:
    """Runs every sample of one op on each runtime (in this process); returns the cells.

    ``locate`` bisects an error down to the sample that causes it (a few more exports).
    """
    from .. import optable
    entry = optable.get(op_name)
    all_columns = columns()
    everything = entry.all_samples()
    cells: dict[str, Cell] = {}
    batches: dict[tuple, Batch] = {}   # columns that run the same samples share one export
    for rt in runtimes:
        column = all_columns[rt]
        if not column.runs(entry):
            continue  # a quantized column has cells only for the ops its recipe quantizes
        missing = column.missing()
        if missing:
            cells[rt] = Cell("unsupported", reason=missing)
            continue
        samples = column_samples(entry, column, everything)
        if not samples:
            cells[rt] = Cell("unsupported", reason="no sample of this op has a dtype this runtime is tested with")
            continue
        groups = [[s for s in samples if not s.dynamic]] + [[s] for s in samples if s.dynamic]
        total, worst_abs, worst_rel, note, cell = 0, 0.0, 0.0, None, None
        for group in (g for g in groups if g):
            key = tuple(id(s) for s in group)
            if key not in batches:
                batches[key] = Batch(entry, group)
            cell = batches[key].run(column)
            if cell.status == "error" and len(group) > 1 and locate:
                # an error can hinge on one sample (a dtype, a 0-d input): find it. "unsupported" is about the op
                cell = first_failure(entry, column, group, cell)
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


def run_op_json(op_name: str, runtimes: Sequence[str]) -> dict:
    """``run_op`` with JSON-able results (what worker processes send back)."""
    try:
        return {rt: c.to_json() for rt, c in run_op(op_name, runtimes).items()}
    except Exception as e:  # a bug in the table or harness: still cells, never a dead run
        log.debug("harness failure", exc_info=True)
        return {rt: Cell("error", reason=f"harness: {first_line(e)}").to_json() for rt in runtimes}
