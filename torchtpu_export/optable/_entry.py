"""The op table's entries: ``entry`` and what the family modules (``_*.py``) build entries from.

A leaf module: it imports no family, so each family imports from here while the package
(``__init__``) loads the families and re-exports these names.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from ..numerics import Agreement

aten = torch.ops.aten

# Tolerances are relative to the output's scale (its largest finite magnitude), as in numerics.compare.
EXACT = 0.0
F32_ULPS = 1e-6       # elementwise float32 math: a few ulps apart between libms
F32_ACCUM = 1e-5      # float32 reductions and matmuls: the summation order differs
LOWP_RTOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}  # a few ulps of the half types


@dataclasses.dataclass
class View:
    """A tensor argument that the op sees as a non-contiguous view of ``base``.

    The program's input is ``base`` (contiguous); the view is taken inside the graph, so
    eager torch and every converter see the same strided tensor.
    """

    base: torch.Tensor
    how: str          # "t": swap the last two dims, "step": every other element of the last dim
    desc: str = ""


def view_of(x: torch.Tensor, how: str) -> torch.Tensor:
    """The non-contiguous view ``how`` (a View's) of ``x``."""
    if how == "t":
        return x.transpose(-1, -2)
    if how == "step":
        return x[..., ::2]
    raise ValueError(f"unknown view {how!r}")


@dataclasses.dataclass
class Sample:
    """One call of the op: positional and keyword arguments (tensors, Views, Python values)."""

    args: tuple
    kwargs: dict
    desc: str
    dynamic: dict | None = None  # input index -> {dim: (min, max)}: exported with symbolic dims
    lowp: bool = True            # derive float16/bfloat16 variants from it

    def tensors(self) -> list[torch.Tensor]:
        """The program inputs of this sample (View bases), in call order."""
        return [leaf.base if isinstance(leaf, View) else leaf for leaf in self._leaves() if is_input(leaf)]

    def _leaves(self) -> list:
        return pytree.tree_leaves((self.args, self.kwargs), is_leaf=lambda x: isinstance(x, View))

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes of its tensors, and the ``dtype=`` it asks for."""
        out = {t.dtype for t in self.tensors()}
        if isinstance(self.kwargs.get("dtype"), torch.dtype):
            out.add(self.kwargs["dtype"])
        return out

    def cast(self, dtype: torch.dtype) -> "Sample":
        def conv(x):
            if isinstance(x, View):
                return View(conv(x.base), x.how, x.desc)
            if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
                return x.to(dtype)
            return x
        args, kwargs = pytree.tree_map(conv, (self.args, self.kwargs), is_leaf=lambda x: isinstance(x, View))
        return Sample(args, kwargs, f"{self.desc} [{_short_dtype(dtype)}]", self.dynamic, False)


@dataclasses.dataclass
class Constant:
    """A tensor argument baked into the program as a constant (a weight) instead of an input."""

    tensor: torch.Tensor


def is_input(leaf) -> bool:
    return isinstance(leaf, (torch.Tensor, View))


def _short_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def S(*args, desc: str, dynamic: dict | None = None, lowp: bool = True, **kwargs) -> Sample:
    """A sample: ``S(x, 2, desc="...", dim=-1)`` calls ``op(x, 2, dim=-1)``."""
    return Sample(tuple(args), kwargs, desc, dynamic, lowp)


Comparator = Callable[[list, list, Sample], Agreement]  # how one sample's outputs compare with torch's


def ties_in_any_order(index_outputs: tuple[int, ...], dim_position: int) -> Comparator:
    """A comparison for sorts and selections whose indices torch leaves unspecified among equal
    values (``sort``/``argsort`` without ``stable=True``, ``topk``): torch's CPU kernels are not
    stable (an introsort past 16 elements), and half-precision samples tie often. An index output
    passes when its indices are distinct, in range, and select the same values as torch's; the
    other outputs are compared as usual. A stable sort is compared exactly."""
    import numpy as np

    from ..numerics import compare

    def comparator(outs, refs, sample, rtol: float = 0.0):
        x = sample.args[0]
        if isinstance(x, View):
            x = view_of(x.base, x.how)
        stable = sample.kwargs.get("stable") or (len(sample.args) > 3 and dim_position == 1 and sample.args[3])
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or stable:
            return compare(outs, refs, rtol=rtol)
        dim = sample.kwargs.get("dim", sample.args[dim_position] if len(sample.args) > dim_position else -1)
        values = x.detach().float().numpy() if x.is_floating_point() else x.detach().numpy()
        axis = int(dim) % values.ndim
        outs = list(outs)
        for i in index_outputs:
            if i >= min(len(outs), len(refs)):
                continue
            ours, theirs = np.asarray(outs[i]), np.asarray(refs[i])
            if ours.shape != theirs.shape or ours.dtype.kind not in "iu" or not ours.size:
                continue
            n = values.shape[axis]
            distinct = np.all(np.diff(np.sort(ours, axis=axis), axis=axis) > 0) if ours.shape[axis] > 1 else True
            if not (distinct and ours.min() >= 0 and ours.max() < n):
                continue
            picked = np.take_along_axis(values, ours.astype(np.int64), axis)
            wanted = np.take_along_axis(values, theirs.astype(np.int64), axis)
            if np.array_equal(picked, wanted, equal_nan=values.dtype.kind == "f"):
                outs[i] = theirs  # the same values: an order of ties torch could have given
        return compare(outs, refs, rtol=rtol)
    return comparator


@dataclasses.dataclass
class Entry:
    """One op of the table.

    ``tol`` is the float32 tolerance relative to the output scale, ``why`` its reason;
    ``compare`` replaces value comparison for ops whose values are not defined (random ops,
    uninitialised memory); ``rewrite`` puts the op into the captured graph for the few core
    ops that torch.export never emits (out= variants, symbolic-shape queries), replacing the
    node the module's call was captured as; ``compared`` names the outputs that are compared
    when the others are implementation details. ``quantized_by`` names the LiteRT recipes
    that quantize the op (its cells in the quantized columns); ``quant_samples`` gives those
    columns layer-sized samples with constant weights where the table's are too small to
    quantize (a recipe leaves weights under 1024 values float).
    """

    op: Any
    samples: Callable[["Gen"], list[Sample]]
    tol: float = F32_ULPS
    why: str = "elementwise float32 math: a few ulps between libms"
    compare: Comparator | None = None
    call: Callable | None = None
    rewrite: Callable | None = None
    lowp: Sequence[torch.dtype] = (torch.float16, torch.bfloat16)
    lowp_tol: float | None = None
    note: str = ""
    compared: tuple[int, ...] | None = None
    quantized_by: tuple[str, ...] = ()
    quant_samples: Callable[["Gen"], list[Sample]] | None = None

    @property
    def name(self) -> str:
        return str(self.op)

    @property
    def core(self) -> bool:
        """Whether the op is core ATen (tagged torch.Tag.core); the others are composites a target may keep."""
        from ..core_ops import core_aten_ops
        return self.op in core_aten_ops()

    def invoke(self, *args, **kwargs):
        return (self.call or self.op)(*args, **kwargs)

    def tolerance(self, sample: Sample) -> float:
        lowp = [LOWP_RTOL[d] for d in sample.dtypes() if d in LOWP_RTOL]
        if lowp:
            return max(self.lowp_tol or 0.0, self.tol, *lowp)
        return self.tol

    def all_samples(self) -> list[Sample]:
        """The float32/int/bool samples, then their float16 and bfloat16 variants."""
        base = self.samples(Gen(self.name))
        out = list(base)
        for dtype in self.lowp:
            out += [s.cast(dtype) for s in base if s.lowp and torch.float32 in s.dtypes()]
        return out


TABLE: dict[str, Entry] = {}


def entry(op, samples: Callable[["Gen"], list[Sample]], **fields) -> Entry:
    """Registers the table entry of ``op``."""
    e = Entry(op, samples, **fields)
    if e.name in TABLE:
        raise ValueError(f"{e.name} is in the op table twice")
    TABLE[e.name] = e
    return e


class Gen:
    """Seeded sample data for one op: the same op always gets the same numbers."""

    def __init__(self, name: str):
        self.g = torch.Generator().manual_seed(zlib.crc32(name.encode()))

    def f(self, *shape, lo: float = -3.0, hi: float = 3.0, dtype=torch.float32) -> torch.Tensor:
        return (torch.rand(shape, generator=self.g, dtype=torch.float64) * (hi - lo) + lo).to(dtype)

    def n(self, *shape, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=torch.float64).to(dtype)

    def i(self, *shape, lo: int = -5, hi: int = 6, dtype=torch.int32) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=self.g, dtype=torch.int64).to(dtype)

    def b(self, *shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.g) > 0.5

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.g)

    @staticmethod
    def t(x: torch.Tensor) -> View:
        """``x`` as the op sees it, but reached through a transposed (non-contiguous) view."""
        return View(x.transpose(-1, -2).contiguous(), "t", "transposed")

    @staticmethod
    def step(x: torch.Tensor) -> View:
        """``x`` reached through a stride-2 slice of the last dim."""
        base = torch.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
        base[..., ::2] = x
        return View(base, "step", "strided")


def edge_values(dtype=torch.float32) -> torch.Tensor:
    """Zeros, signed zeros, huge and tiny magnitudes, infinities and NaN (3x4)."""
    return torch.tensor([0.0, -0.0, 1.0, -1.0, 3.5e37, -3.5e37, math.inf, -math.inf, math.nan, 1e-37, 0.5, -2.5],
                        dtype=dtype).reshape(3, 4)
