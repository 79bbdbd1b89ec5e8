"""Elementwise ops: math, rounding, predicates, arithmetic, comparisons, logic, activations."""
from __future__ import annotations

import torch

from ._entry import EXACT, F32_ULPS, S, aten, edge_values, entry

INT_DTYPES = (torch.int32, torch.int64)


def unary(lo: float, hi: float, *, ints: bool = True, bools: bool = True, edge: bool = True, int_lo=None,
          int_hi=None):
    """Samples of a unary op defined on [lo, hi]: 3x4, 0-d, transposed, strided, edge values, ints, bool."""
    ilo = int(lo) if int_lo is None else int_lo
    ihi = int(hi) if int_hi is None else int_hi

    def samples(g):
        out = [S(g.f(3, 4, lo=lo, hi=hi), desc="float32 3x4"),
               S(g.f(lo=lo, hi=hi), desc="0-d"),
               S(g.t(g.f(2, 3, 5, lo=lo, hi=hi)), desc="transposed 2x3x5"),
               S(g.step(g.f(4, 3, lo=lo, hi=hi)), desc="strided 4x3")]
        if edge:
            out.append(S(edge_values(), desc="edge values: +-0, +-3.5e37, +-inf, nan, 1e-37", lowp=False))
        if ints:
            out += [S(g.i(3, 4, lo=ilo, hi=ihi + 1, dtype=dt), desc=str(dt).removeprefix("torch.")) for dt in INT_DTYPES]
        if bools:
            out.append(S(g.b(2, 3), desc="bool"))
        return out
    return samples


_LIBM = "float32 libm functions: a few ulps apart between torch (SLEEF) and XLA"
for _op, _lo, _hi in [
    (aten.acos.default, -1, 1), (aten.asin.default, -1, 1), (aten.atanh.default, -0.99, 0.99),
    (aten.acosh.default, 1, 10), (aten.asinh.default, -10, 10), (aten.atan.default, -10, 10),
    (aten.cos.default, -6, 6), (aten.sin.default, -6, 6), (aten.tan.default, -1.5, 1.5),
    (aten.cosh.default, -5, 5), (aten.sinh.default, -5, 5), (aten.tanh.default, -5, 5),
    (aten.erf.default, -3, 3), (aten.exp.default, -10, 10), (aten.expm1.default, -5, 5),
    (aten.log.default, 0.01, 10), (aten.log10.default, 0.01, 10), (aten.log2.default, 0.01, 10),
    (aten.log1p.default, -0.99, 10), (aten.sqrt.default, 0, 10), (aten.rsqrt.default, 0.01, 10),
    (aten.sigmoid.default, -8, 8), (aten.reciprocal.default, 0.1, 5),
]:
    entry(_op, unary(_lo, _hi, int_lo=max(int(_lo), -5) if _lo > -1 else -1 if _hi <= 1 else -5,
                     int_hi=min(int(_hi), 5)), tol=F32_ULPS, why=_LIBM)

_SAME_DTYPE = "exact in every dtype: the result is one of the input's values or its negation"
entry(aten.abs.default, unary(-5, 5, bools=False), tol=EXACT, why=_SAME_DTYPE)
entry(aten.neg.default, unary(-5, 5, bools=False), tol=EXACT, why=_SAME_DTYPE)
entry(aten.sign.default, unary(-5, 5), tol=EXACT, why=_SAME_DTYPE)
entry(aten.relu.default, unary(-5, 5, bools=False), tol=EXACT, why=_SAME_DTYPE)


def _halves(g):
    return [S(torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -0.0]), desc="halfway cases")]


for _op in (aten.ceil.default, aten.floor.default, aten.round.default, aten.trunc.default):
    entry(_op, lambda g: unary(-5, 5, bools=False)(g) + _halves(g), tol=EXACT,
          why="rounding is exact (round: half to even)")


def _bitwise_unary(g):
    return [S(g.i(3, 4, lo=-100, hi=100), desc="int32"), S(g.i(3, 4, dtype=torch.int64), desc="int64"),
            S(g.i(lo=0, hi=255, dtype=torch.uint8), desc="0-d uint8"), S(g.b(2, 3), desc="bool"),
            S(g.t(g.i(3, 5, dtype=torch.int32)), desc="transposed int32")]


entry(aten.bitwise_not.default, _bitwise_unary, tol=EXACT, why="integer op")


def _predicate(g):
    return [S(edge_values(), desc="edge values"), S(g.f(), desc="0-d"), S(g.t(edge_values()), desc="transposed"),
            S(g.i(3, 4), desc="int32"), S(g.b(2, 3), desc="bool")]


entry(aten.isnan.default, _predicate, tol=EXACT, why="bool output")
entry(aten.isinf.default, _predicate, tol=EXACT, why="bool output")
entry(aten.logical_not.default, _predicate, tol=EXACT, why="bool output")


# ---- binary ------------------------------------------------------------------------------

def binary(*, lo=-3.0, hi=3.0, ints=True, bools=False, edge=True, nonzero_rhs=False, int_lo=-5, int_hi=6,
           kwargs=None):
    """Samples of a binary Tensor-Tensor op: same shape, broadcasting, 0-d operands, mixed dtypes."""
    kwargs = kwargs or {}

    def rhs(g, *shape, **kw):
        x = g.f(*shape, lo=lo, hi=hi, **kw)
        return torch.where(x.abs() < 0.25, torch.full_like(x, 0.5), x) if nonzero_rhs else x

    def irhs(g, *shape, dtype=torch.int32):
        x = g.i(*shape, lo=int_lo, hi=int_hi, dtype=dtype)
        return torch.where(x == 0, torch.ones_like(x), x) if nonzero_rhs else x

    def samples(g):
        out = [S(g.f(3, 4, lo=lo, hi=hi), rhs(g, 3, 4), desc="float32 3x4", **kwargs),
               S(g.f(3, 1, lo=lo, hi=hi), rhs(g, 1, 4), desc="broadcast 3x1 with 1x4", **kwargs),
               S(g.f(2, 3, 4, lo=lo, hi=hi), rhs(g, 4), desc="broadcast 2x3x4 with 4", **kwargs),
               S(g.f(lo=lo, hi=hi), rhs(g), desc="0-d with 0-d", **kwargs),
               S(g.t(g.f(3, 4, lo=lo, hi=hi)), g.step(rhs(g, 3, 4)), desc="transposed with strided", **kwargs)]
        if edge:
            out.append(S(edge_values(), edge_values().flip(0), desc="edge values", lowp=False, **kwargs))
        if ints:
            out += [S(g.i(3, 4, lo=int_lo, hi=int_hi), irhs(g, 3, 4), desc="int32", **kwargs),
                    S(g.i(3, 4, lo=int_lo, hi=int_hi, dtype=torch.int64), irhs(g, 1, 4, dtype=torch.int64),
                      desc="int64 broadcast", **kwargs),
                    S(g.i(3, 4, lo=int_lo, hi=int_hi), rhs(g), desc="int32 with float32 0-d (promotes)", **kwargs),
                    S(g.f(3, 4, lo=lo, hi=hi), irhs(g, 3, 4, dtype=torch.int64), desc="float32 with int64",
                      **kwargs)]
        if bools:
            out.append(S(g.b(3, 4), g.b(3, 4), desc="bool", **kwargs))
        return out
    return samples


def scalar_rhs(values, *, lo=-3.0, hi=3.0, ints=True, bools=False, kwargs=None):
    """Samples of a Tensor-Scalar op: each Python scalar in ``values`` against float, int and 0-d tensors."""
    kwargs = kwargs or {}

    def samples(g):
        out = []
        for v in values:
            out += [S(g.f(3, 4, lo=lo, hi=hi), v, desc=f"float32, {v!r}", **kwargs),
                    S(g.f(lo=lo, hi=hi), v, desc=f"0-d, {v!r}", **kwargs)]
            if ints:
                out.append(S(g.i(3, 4), v, desc=f"int32, {v!r}", lowp=False, **kwargs))
        out.append(S(g.t(g.f(3, 4, lo=lo, hi=hi)), values[0], desc="transposed", **kwargs))
        out.append(S(edge_values(), values[0], desc="edge values", lowp=False, **kwargs))
        if bools:
            out.append(S(g.b(3, 4), True, desc="bool, True", **kwargs))
        return out
    return samples


def _alpha(g):
    return [S(g.f(3, 4), g.f(3, 4), alpha=2.5, desc="alpha=2.5"), S(g.i(3, 4), g.i(3, 4), alpha=3, desc="int alpha=3")]


_ARITH = "float32 arithmetic is correctly rounded on both sides"
_ALPHA = "correctly rounded; with alpha, a + alpha * b may round once (fused) or twice"
entry(aten.add.Tensor, lambda g: binary(bools=True)(g) + _alpha(g), tol=F32_ULPS, why=_ALPHA)
entry(aten.sub.Tensor, lambda g: binary()(g) + _alpha(g), tol=F32_ULPS, why=_ALPHA)
entry(aten.mul.Tensor, binary(bools=True), tol=EXACT, why=_ARITH)
entry(aten.add.Scalar, lambda g: scalar_rhs([2.5, -3])(g) + [S(g.f(3, 4), 2.0, alpha=-1.5, desc="alpha=-1.5")],
      tol=F32_ULPS, why=_ALPHA)
entry(aten.sub.Scalar, lambda g: scalar_rhs([2.5, -3])(g) + [S(g.i(3, 4), 2, alpha=3, desc="int alpha=3")],
      tol=F32_ULPS, why=_ALPHA)
entry(aten.mul.Scalar, scalar_rhs([2.5, -3]), tol=EXACT, why=_ARITH)


entry(aten.div.Tensor, binary(nonzero_rhs=True, int_lo=-9, int_hi=10), tol=F32_ULPS,
      why="float32 division is correctly rounded; int inputs divide in float32")
entry(aten.div.Scalar, scalar_rhs([2.5, -4]), tol=F32_ULPS, why="float32 division is correctly rounded")


def _div_mode(scalar: bool):
    def samples(g):
        out = []
        for mode in ("trunc", "floor"):
            b = (lambda *s, **k: -2.5) if scalar else (lambda *s, **k: _nz(g.f(*s, lo=-4, hi=4)))
            bi = (lambda *s, **k: 3) if scalar else (lambda *s, dtype=torch.int32: _nz(g.i(*s, lo=-4, hi=5, dtype=dtype)))
            out += [S(g.f(3, 4, lo=-10, hi=10), b(3, 4), rounding_mode=mode, desc=f"float32 {mode}"),
                    S(g.f(3, 1, lo=-10, hi=10), b(1, 4), rounding_mode=mode, desc=f"broadcast {mode}"),
                    S(g.i(3, 4, lo=-20, hi=20), bi(3, 4), rounding_mode=mode, desc=f"int32 {mode} (negative)"),
                    S(g.i(3, 4, lo=-20, hi=20, dtype=torch.int64), bi(3, 4, dtype=torch.int64),
                      rounding_mode=mode, desc=f"int64 {mode}"),
                    S(torch.tensor([7.5, -7.5, 1.0, -1.0, 0.0, 5.0]), b(6) if scalar else
                      torch.tensor([2.0, 2.0, 0.0, 0.0, 0.0, -0.5]), rounding_mode=mode,
                      desc=f"{mode}, division by zero and exact halves", lowp=False)]
        out.append(S(g.f(3, 4), b(3, 4), rounding_mode=None, desc="rounding_mode=None"))
        return out
    return samples


def _nz(x):
    return torch.where(x == 0, torch.ones_like(x), x) if not x.is_floating_point() else \
        torch.where(x.abs() < 0.25, torch.full_like(x, 0.75), x)


entry(aten.div.Tensor_mode, _div_mode(False), tol=F32_ULPS, why="floor/trunc of a correctly rounded quotient")
entry(aten.div.Scalar_mode, _div_mode(True), tol=F32_ULPS, why="floor/trunc of a correctly rounded quotient")

entry(aten.maximum.default, binary(bools=True), tol=EXACT, why="selects one input (NaN propagates)")
entry(aten.minimum.default, binary(bools=True), tol=EXACT, why="selects one input (NaN propagates)")
entry(aten.atan2.default, binary(), tol=F32_ULPS, why=_LIBM)


def _atan2_out(graph_module):
    """Turns the captured ``atan2(a, b)`` into ``atan2.out(a, b, out=empty)``."""
    from ._rewrite import replace_with_out_variant
    replace_with_out_variant(graph_module, aten.atan2.default, aten.atan2.out)


entry(aten.atan2.out, binary(ints=False), tol=F32_ULPS, why=_LIBM,
      call=lambda a, b: torch.atan2(a, b, out=torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=a.dtype)),
      rewrite=_atan2_out,
      note="torch.export functionalises out= calls, so the harness puts atan2.out into the captured graph")

_MOD = "fmod/remainder of float32 are exact; int remainders are exact"
entry(aten.fmod.Tensor, binary(nonzero_rhs=True, edge=False), tol=F32_ULPS, why=_MOD)
entry(aten.fmod.Scalar, scalar_rhs([2.5, -3], lo=-10, hi=10), tol=F32_ULPS, why=_MOD)
entry(aten.remainder.Tensor, binary(nonzero_rhs=True, edge=False), tol=F32_ULPS, why=_MOD)
entry(aten.remainder.Scalar, scalar_rhs([2.5, -3], lo=-10, hi=10), tol=F32_ULPS, why=_MOD)


def _bitwise(scalar: bool):
    def samples(g):
        if scalar:
            return [S(g.i(3, 4, lo=-100, hi=100), 0x35, desc="int32, 0x35"),
                    S(g.i(3, 4, dtype=torch.int64), -6, desc="int64, -6"),
                    S(g.i(lo=0, hi=255, dtype=torch.uint8), 7, desc="0-d uint8"),
                    S(g.b(3, 4), True, desc="bool, True")]
        return [S(g.i(3, 4, lo=-100, hi=100), g.i(3, 4, lo=-100, hi=100), desc="int32"),
                S(g.i(3, 1, dtype=torch.int64), g.i(1, 4, dtype=torch.int64), desc="int64 broadcast"),
                S(g.i(3, 4), g.i(dtype=torch.int64), desc="int32 with int64 0-d"),
                S(g.b(3, 4), g.b(3, 4), desc="bool"),
                S(g.t(g.i(3, 4, dtype=torch.int32)), g.i(3, 4), desc="transposed")]
    return samples


for _name in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    entry(getattr(aten, _name).Tensor, _bitwise(False), tol=EXACT, why="integer op")
    entry(getattr(aten, _name).Scalar, _bitwise(True), tol=EXACT, why="integer op")


def _logical(g):
    return [S(g.b(3, 4), g.b(3, 4), desc="bool"), S(g.f(3, 4).round(), g.i(1, 4), desc="float with int (nonzero)"),
            S(edge_values(), edge_values().flip(1), desc="edge values (nan is true)"),
            S(g.b(), g.b(3, 4), desc="0-d with 3x4")]


for _name in ("logical_and", "logical_or", "logical_xor"):
    entry(getattr(aten, _name).default, _logical, tol=EXACT, why="bool output")


def _compare_samples(scalar: bool):
    def samples(g):
        if scalar:
            return [S(g.f(3, 4).round(), 1.0, desc="float32, 1.0"), S(g.i(3, 4), 2, desc="int32, 2"),
                    S(g.i(3, 4), 1.5, desc="int32, 1.5 (compares in float)"), S(edge_values(), 0.5, desc="edge values"),
                    S(g.f(), -1.0, desc="0-d"), S(g.b(3, 4), True, desc="bool, True")]
        a = g.f(3, 4).round()
        return [S(a, torch.where(g.b(3, 4), a, g.f(3, 4).round()), desc="float32 (equal values)"),
                S(g.i(3, 1), g.i(1, 4), desc="int32 broadcast"), S(g.i(3, 4), g.f(3, 4).round(), desc="int32 with float32"),
                S(edge_values(), edge_values().flip(0), desc="edge values"), S(g.f(3, 4), g.f(), desc="with 0-d"),
                S(g.b(3, 4), g.b(3, 4), desc="bool"), S(g.t(g.f(3, 4).round()), g.f(3, 4).round(), desc="transposed")]
    return samples


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    entry(getattr(aten, _name).Tensor, _compare_samples(False), tol=EXACT, why="bool output")
    entry(getattr(aten, _name).Scalar, _compare_samples(True), tol=EXACT, why="bool output")


def _pow_tt(g):
    return [S(g.f(3, 4, lo=0.1, hi=3), g.f(3, 4, lo=-2, hi=3), desc="float32"),
            S(g.f(3, 1, lo=0.1, hi=3), g.f(1, 4, lo=-2, hi=2), desc="broadcast"),
            S(g.f(3, 4, lo=-3, hi=3), g.f(3, 4, lo=-3, hi=3).round(), desc="negative base, integral exponents"),
            S(g.i(3, 4, lo=-4, hi=5), g.i(3, 4, lo=0, hi=4), desc="int32"),
            S(g.f(3, 4, lo=0.5, hi=2), g.i(3, 4, lo=-3, hi=4), desc="float32 ** int32"),
            S(edge_values(), torch.tensor([0.0, 1.0, 2.0, -1.0]).repeat(3).reshape(3, 4), desc="edge values",
              lowp=False),
            S(g.f(lo=0.5, hi=2), g.f(3, 4), desc="0-d base")]


entry(aten.pow.Tensor_Tensor, _pow_tt, tol=F32_ULPS, why=_LIBM)


def _pow_ts(g):
    out = [S(g.f(3, 4, lo=-3, hi=3), e, desc=f"float32 ** {e!r}") for e in (2, 3, 0.5, -1, -2.5, 0)]
    out += [S(g.i(3, 4, lo=-4, hi=5), 3, desc="int32 ** 3"), S(g.i(3, 4, lo=-4, hi=5), 0.5, desc="int32 ** 0.5"),
            S(edge_values(), 2, desc="edge values ** 2", lowp=False), S(g.f(), 2.0, desc="0-d")]
    return out


entry(aten.pow.Tensor_Scalar, _pow_ts, tol=F32_ULPS, why=_LIBM)
entry(aten.pow.Scalar, lambda g: [S(2.0, g.f(3, 4), desc="2.0 ** float32"), S(2, g.i(3, 4, lo=0, hi=8), desc="2 ** int32"),
                                  S(0.5, edge_values(), desc="0.5 ** edge values", lowp=False),
                                  S(-2.0, g.f(3, 4).round(), desc="-2.0 ** integral floats")],
      tol=F32_ULPS, why=_LIBM)


def _where(g):
    return [S(g.b(3, 4), g.f(3, 4), g.f(3, 4), desc="float32"),
            S(g.b(3, 1), g.f(1, 4), g.f(3, 4), desc="broadcast"),
            S(g.b(3, 4), g.i(3, 4), g.f(3, 4), desc="int32 and float32 (promotes)"),
            S(g.b(3, 4), g.f(), g.f(3, 4), desc="0-d branch"),
            S(g.b(3, 4), g.i(3, 4, dtype=torch.int64), g.i(3, 4, dtype=torch.int64), desc="int64"),
            S(g.b(3, 4), g.b(3, 4), g.b(3, 4), desc="bool"),
            S(g.t(g.b(3, 4)), edge_values(), g.f(3, 4), desc="transposed condition, edge values", lowp=False)]


entry(aten.where.self, _where, tol=EXACT, why="selects one input")


def _clamp(g):
    return [S(g.f(3, 4), -1.0, 1.0, desc="float32 [-1, 1]"), S(g.f(3, 4), None, 0.5, desc="max only"),
            S(g.f(3, 4), -0.5, desc="min only"), S(g.i(3, 4), -2, 3, desc="int32"),
            S(g.i(3, 4), 0.5, 2.5, desc="int32 with float bounds (promotes)"),
            S(edge_values(), -1e38, 1e38, desc="edge values", lowp=False),
            S(g.f(3, 4), 1.0, -1.0, desc="min > max (max wins)"), S(g.f(), -0.1, 0.1, desc="0-d"),
            S(g.t(g.f(3, 4)), -1, 1, desc="transposed")]


entry(aten.clamp.default, _clamp, tol=EXACT, why="selects an input or a bound")


def _clamp_t(g):
    return [S(g.f(3, 4), g.f(3, 4, lo=-3, hi=0), g.f(3, 4, lo=0, hi=3), desc="float32"),
            S(g.f(3, 4), g.f(1, 4, lo=-2, hi=0), None, desc="broadcast min only"),
            S(g.f(3, 4), None, g.f(3, 1, lo=0, hi=2), desc="broadcast max only"),
            S(g.i(3, 4), g.i(3, 4, lo=-3, hi=0), g.i(3, 4, lo=0, hi=3), desc="int32"),
            S(edge_values(), g.f(3, 4, lo=-3, hi=0), g.f(3, 4, lo=0, hi=3), desc="edge values", lowp=False),
            S(g.i(3, 4), g.f(), g.f(lo=3, hi=5), desc="int32 with 0-d float bounds")]


entry(aten.clamp.Tensor, _clamp_t, tol=EXACT, why="selects an input or a bound")


def _act(extra_kwargs):
    def samples(g):
        out = [S(g.f(3, 4, lo=-4, hi=4), desc="float32 3x4"), S(g.f(), desc="0-d"),
               S(g.t(g.f(2, 4, 3, lo=-4, hi=4)), desc="transposed"), S(edge_values(), desc="edge values", lowp=False)]
        out += [S(g.f(3, 4, lo=-4, hi=4), desc=f"{k}={v!r}", **{k: v}) for k, v in extra_kwargs]
        return out
    return samples


entry(aten.hardtanh.default, lambda g: _act([])(g) + [S(g.f(3, 4), -0.5, 2.0, desc="[-0.5, 2]")],
      tol=EXACT, why="selects an input or a bound")
entry(aten.leaky_relu.default, lambda g: _act([])(g) + [S(g.f(3, 4), 0.2, desc="slope 0.2")],
      tol=F32_ULPS, why="one float32 multiply")
entry(aten.elu.default, lambda g: _act([])(g) + [S(g.f(3, 4), 0.5, 2.0, 1.5, desc="alpha, scale, input_scale")],
      tol=F32_ULPS, why=_LIBM)
entry(aten.gelu.default, _act([("approximate", "tanh"), ("approximate", "none")]), tol=F32_ULPS, why=_LIBM)
