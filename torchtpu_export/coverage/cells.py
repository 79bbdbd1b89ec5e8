"""Cells and columns: what one op on one runtime comes to, and how a column builds and judges it."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..numerics import Agreement, compare

STATUSES = ("pass", "mismatch", "unsupported", "error")
FLOAT_RUNTIMES = ("xla", "litert", "onnx")
# tpu: the xla column's program compiled for a TPU by libtpu (pass = the TPU compiler accepts it);
# then the quantized LiteRT columns
# xla_bf16/tpu_bf16: the xla and tpu columns on the table's bfloat16 samples alone (the dtype TPUs serve in)
RUNTIMES = ("xla", "tpu", "xla_bf16", "tpu_bf16", "litert", "onnx", "litert_dynamic_int8", "litert_int8")
TPU_TOPOLOGY = "v5e:2x2"
# Quantization costs accuracy by design: a cell passes when the error relative to the output's
# scale and the cosine similarity to torch stay within the recipe's bound (8-bit steps are 1/127).
QUANT_BOUNDS = {"dynamic_int8": (0.05, 0.999), "int8": (0.08, 0.99)}


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


@dataclasses.dataclass
class Column:
    """A runtime of the matrix: which converter feeds it and what it accepts."""

    name: str
    target: str                    # the converter (api target) that makes its artifact
    lowp: frozenset                # half-precision dtypes it is tested with
    narrows_64bit: bool = False    # int64/float64 results may come back as 32-bit
    quant: str | None = None       # a quantization recipe: the column has cells for the ops it quantizes
    compile_for: str | None = None  # a TPU topology: the cell is whether libtpu compiles the program
    options: dict = dataclasses.field(default_factory=dict)  # the target's build options
    only: object = None            # a torch dtype: the column runs the samples of that dtype alone

    def runs(self, entry) -> bool:
        """Whether the column has a cell for the op (quantized columns: the ops the recipe quantizes;
        a one-dtype column: the ops with samples of its dtype)."""
        if self.only is not None:
            return any(self.only in s.dtypes() for s in entry.all_samples())
        return self.quant is None or self.quant in entry.quantized_by

    def missing(self) -> str | None:
        """Why this column cannot run in this installation, or None."""
        if self.compile_for:
            from ..targets.tpu.aot import libtpu_version
            if libtpu_version() is None:
                return "libtpu (the TPU compiler) is not installed: pip install 'torchtpu-export[tpu]'"
        return None

    def keep_whole(self) -> list:
        from .. import converters, targets
        return list(converters.converter(targets.get(self.target).converter).KEEP_WHOLE)

    def build(self, captured: dict):
        """The runnable artifact (with ``run_flat``) of already-captured programs, under the name the
        target gives a single program (litert's ``serving_default``, as ``tte.convert`` makes it)."""
        from .. import api, targets
        cap = captured["main"]
        options = dict(self.options)
        if self.quant == "int8":  # full integer: activation scales from the sample itself
            options["quant_config"] = {"recipe": "int8", "calibration": [tuple(cap.sample_inputs)]}
        elif self.quant:
            options["quant_config"] = self.quant
        return api.build(self.target, {targets.get(self.target).signature: cap}, **options)


def columns() -> dict[str, Column]:
    import torch
    half = frozenset({torch.float16, torch.bfloat16})
    return {
        "xla": Column("xla", "tpu", half, options={"platforms": ("cpu",)}),
        "tpu": Column("tpu", "tpu", half, compile_for=TPU_TOPOLOGY, options={"platforms": ("tpu",)}),
        "xla_bf16": Column("xla_bf16", "tpu", frozenset({torch.bfloat16}), options={"platforms": ("cpu",)},
                           only=torch.bfloat16),
        "tpu_bf16": Column("tpu_bf16", "tpu", frozenset({torch.bfloat16}), compile_for=TPU_TOPOLOGY,
                           options={"platforms": ("tpu",)}, only=torch.bfloat16),
        # ONNX Runtime's CPU provider and the LiteRT interpreter lack half-precision kernels for most
        # ops: their columns are measured on float32, integer and bool samples.
        "litert": Column("litert", "litert", frozenset(), narrows_64bit=True),
        "onnx": Column("onnx", "onnx", frozenset()),
        # the quantized LiteRT recipes, on the ops they quantize (weights as constants, as in a model)
        "litert_dynamic_int8": Column("litert_dynamic_int8", "litert", frozenset(), True, "dynamic_int8"),
        "litert_int8": Column("litert_int8", "litert", frozenset(), True, "int8"),
    }


def first_line(e: BaseException, limit: int = 400) -> str:
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0] if text else ''}"
    return msg if len(msg) <= limit else msg[:limit] + "..."


def to_numpy(t):
    import torch

    from ..specs import as_numpy
    if isinstance(t, torch.Tensor):
        t = t.resolve_conj().resolve_neg()  # lazy conjugate/negative views have no numpy form
    return as_numpy(t)


def compare_sample(entry, sample, outs: list, refs: list, column: Column) -> Agreement:
    """The verdict of one sample: shapes and dtypes must match, values within the op's tolerance."""
    outs = [np.asarray(o) for o in outs]
    refs = [to_numpy(r) for r in refs]
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


def _failed(detail: str) -> Agreement:
    return Agreement(math.inf, math.inf, False, detail)


def _quant_verdict(outs, refs, max_rel: float, min_cosine: float) -> Agreement:
    from ..quant import measure
    report = measure("", refs, outs, 0, 0)
    ok = report.max_rel_err <= max_rel and report.cosine >= min_cosine
    detail = None if ok else f"rel err {report.max_rel_err:.3g} (bound {max_rel}), cosine {report.cosine:.5f} " \
                             f"(bound {min_cosine})"
    return Agreement(report.max_abs_err, report.max_rel_err, ok, detail)


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


def compile_cell(program, topology: str, samples, label: str, note: str | None) -> Cell:
    """A tpu cell: pass when libtpu compiles the program for ``topology`` (the numbers are the xla column's)."""
    from ..targets.tpu import aot as tpu_compile
    try:
        tpu_compile.compile_artifact(program.artifact, topology, store=False)
    except tpu_compile.CompileError as e:
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        return Cell("unsupported", sample=label, reason=f"the TPU compiler rejects it: {' '.join(lines)[:400]}",
                    note=note)
    return Cell("pass", samples=len(samples), note=note)
