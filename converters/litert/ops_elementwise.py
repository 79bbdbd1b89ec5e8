"""Elementwise ops: arithmetic, math functions, comparisons, logic, activations, where/clamp."""
from __future__ import annotations

import math

import numpy as np
import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

from .ir import Tensor
from .registry import BOOL, BuildContext, builds

aten = torch.ops.aten


def operand(ctx: BuildContext, x, dtype) -> Tensor:
    """A tensor argument cast to ``dtype``, or a number as a constant of ``dtype``."""
    if isinstance(x, Tensor):
        return ctx.cast(x, dtype)
    if isinstance(x, sympy.Basic):
        return ctx.const(x, dtype)  # a dynamic size, computed at run time
    return ctx.const(np.asarray(x).astype(dtype))


def _is_float(dtype) -> bool:
    return np.dtype(dtype).kind == "f"


# ---- arithmetic ----------------------------------------------------------------------------

def _times(ctx, x, alpha, dt):
    """``x * alpha`` (the alpha of add/sub/rsub); x itself when alpha is 1."""
    return x if alpha == 1 else ctx.op("MUL", [x, ctx.const(np.asarray(alpha, dt))], shape=x.shape, dtype=dt)


@builds(aten.add.Tensor, aten.add.Scalar)
def add(ctx, a, b, alpha=1):
    dt = ctx.promoted_dtype()
    a, b = operand(ctx, a, dt), operand(ctx, b, dt)
    if dt == BOOL:
        return ctx.op("LOGICAL_OR", [a, b], dtype=BOOL)
    return ctx.op("ADD", [a, _times(ctx, b, alpha, dt)], dtype=dt)


@builds(aten.sub.Tensor, aten.sub.Scalar)
def sub(ctx, a, b, alpha=1):
    dt = ctx.promoted_dtype()
    a, b = operand(ctx, a, dt), operand(ctx, b, dt)
    return ctx.op("SUB", [a, _times(ctx, b, alpha, dt)], dtype=dt)


@builds(aten.rsub.Scalar, aten.rsub.Tensor)
def rsub(ctx, a, b, alpha=1):
    dt = ctx.promoted_dtype()
    a, b = operand(ctx, a, dt), operand(ctx, b, dt)
    return ctx.op("SUB", [b, _times(ctx, a, alpha, dt)], dtype=dt)


@builds(aten.mul.Tensor, aten.mul.Scalar)
def mul(ctx, a, b):
    dt = ctx.promoted_dtype()
    if dt == BOOL:
        return ctx.op("LOGICAL_AND", [operand(ctx, a, dt), operand(ctx, b, dt)])
    return ctx.op("MUL", [operand(ctx, a, dt), operand(ctx, b, dt)], dtype=dt)


@builds(aten.div.Tensor, aten.div.Scalar)
def div(ctx, a, b):
    dt = ctx.promoted_dtype(Kind.INT_TO_FLOAT)
    return ctx.op("DIV", [operand(ctx, a, dt), operand(ctx, b, dt)], dtype=dt)


@builds(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(ctx, a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return div(ctx, a, b)
    dt = ctx.promoted_dtype()
    a, b = operand(ctx, a, dt), operand(ctx, b, dt)
    if rounding_mode == "floor":
        if _is_float(dt):
            q = ctx.op("DIV", [a, b], dtype=dt)
            return ctx.op("FLOOR", [q], dtype=dt)
        return ctx.op("FLOOR_DIV", [a, b], dtype=dt)
    if _is_float(dt):
        return trunc_tensor(ctx, ctx.op("DIV", [a, b], dtype=dt))
    return _int_trunc_div(ctx, a, b, ctx.out_shape())


def trunc_tensor(ctx, x: Tensor) -> Tensor:
    """Rounds toward zero: floor for positives, ceil for negatives."""
    neg = ctx.op("LESS", [x, ctx.const(np.zeros((), x.dtype))], shape=x.shape, dtype=BOOL)
    return ctx.op("SELECT_V2", [neg, ctx.op("CEIL", [x], shape=x.shape, dtype=x.dtype),
                                ctx.op("FLOOR", [x], shape=x.shape, dtype=x.dtype)], shape=x.shape, dtype=x.dtype)


@builds(aten.remainder.Tensor, aten.remainder.Scalar)
def remainder(ctx, a, b):
    dt = ctx.promoted_dtype()
    return ctx.op("FLOOR_MOD", [operand(ctx, a, dt), operand(ctx, b, dt)], dtype=dt)


@builds(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(ctx, a, b):
    # fmod(a, b) = sign(a) * fmod(|a|, |b|), and FLOOR_MOD of non-negatives is exactly that fmod
    dt = ctx.promoted_dtype()
    a, b = operand(ctx, a, dt), operand(ctx, b, dt)
    shape = ctx.out_shape()
    m = ctx.op("FLOOR_MOD", [ctx.op("ABS", [a], shape=a.shape, dtype=dt), ctx.op("ABS", [b], shape=b.shape, dtype=dt)],
               shape=shape, dtype=dt)
    return ctx.op("MUL", [m, ctx.op("SIGN", [a], shape=a.shape, dtype=dt)], dtype=dt)


def _int_trunc_div(ctx, a, b, shape):
    # integer division toward zero: floor division, plus one where the signs differ and it is inexact
    dt = a.dtype
    q = ctx.op("FLOOR_DIV", [a, b], shape=shape, dtype=dt)
    r = ctx.op("FLOOR_MOD", [a, b], shape=shape, dtype=dt)
    nonzero = ctx.op("NOT_EQUAL", [r, ctx.const(np.zeros((), dt))], shape=shape, dtype=BOOL)
    neg = ctx.op("LESS", [ctx.op("MUL", [a, b], shape=shape, dtype=dt), ctx.const(np.zeros((), dt))],
                 shape=shape, dtype=BOOL)
    return ctx.op("ADD", [q, ctx.cast(ctx.op("LOGICAL_AND", [nonzero, neg], shape=shape, dtype=BOOL), dt)],
                  shape=shape, dtype=dt)


@builds(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow_(ctx, a, b):
    dt = ctx.promoted_dtype()
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, Tensor):
        a = operand(ctx, a, dt)
        if b == 1:
            return a
        if b == 2:
            return ctx.op("MUL", [a, a], dtype=dt)
        if b == 0.5 and _is_float(dt):
            return ctx.op("SQRT", [a], dtype=dt)
        if b == -0.5 and _is_float(dt):
            return ctx.op("RSQRT", [a], dtype=dt)
        if b == -1 and _is_float(dt):
            return ctx.op("DIV", [ctx.const(np.ones((), dt)), a], dtype=dt)
        if b == 3:
            return ctx.op("MUL", [ctx.op("MUL", [a, a], shape=a.shape, dtype=dt), a], dtype=dt)
    return ctx.op("POW", [operand(ctx, a, dt), operand(ctx, b, dt)], dtype=dt)


def _nan_propagating(code):
    def rule(ctx, a, b):
        dt = ctx.promoted_dtype()
        a, b = operand(ctx, a, dt), operand(ctx, b, dt)
        if dt == BOOL:
            return ctx.op("LOGICAL_OR" if code == "MAXIMUM" else "LOGICAL_AND", [a, b], dtype=BOOL)
        y = ctx.op(code, [a, b], dtype=dt)
        if dt.kind != "f":
            return y
        # TFLite's MAXIMUM/MINIMUM return the other operand where one is NaN; torch returns NaN
        nan = ctx.op("LOGICAL_OR", [ctx.op("NOT_EQUAL", [a, a], shape=a.shape, dtype=BOOL),
                                    ctx.op("NOT_EQUAL", [b, b], shape=b.shape, dtype=BOOL)], shape=y.shape, dtype=BOOL)
        return ctx.op("SELECT_V2", [nan, ctx.const(np.asarray(np.nan, dt)), y], dtype=dt)
    return rule


builds(aten.maximum.default)(_nan_propagating("MAXIMUM"))
builds(aten.minimum.default)(_nan_propagating("MINIMUM"))


@builds(aten.atan2.default, aten.atan2.out)
def atan2(ctx, a, b, **_):
    dt = ctx.promoted_dtype(Kind.INT_TO_FLOAT)
    shape = ctx.out_shape()
    # ATAN2 does not broadcast
    a, b = (_expand_to(ctx, operand(ctx, t, dt), shape) for t in (a, b))
    return ctx.op("ATAN2", [a, b], dtype=dt)


def _expand_to(ctx, t: Tensor, shape) -> Tensor:
    if t.shape == tuple(shape):
        return t
    if t.rank < len(shape):
        t = ctx.reshape(t, (1,) * (len(shape) - t.rank) + t.shape)
    return ctx.broadcast_to(t, shape)


# ---- unary math ----------------------------------------------------------------------------

def _unary(op, code, kind=Kind.DEFAULT):
    @builds(op)
    def rule(ctx, x):
        return ctx.op(code, [operand(ctx, x, ctx.promoted_dtype(kind))])
    rule.__name__ = str(op).split(".")[1]
    return rule


def exp(ctx, x):
    """EXP with NaN kept: LiteRT's CPU kernel (XNNPACK's) gives 0 for NaN, the one unary op that does."""
    e = ctx.op("EXP", [x], shape=x.shape)
    nan = ctx.op("NOT_EQUAL", [x, x], shape=x.shape, dtype=BOOL)
    return ctx.op("SELECT_V2", [nan, x, e], shape=x.shape)


@builds(aten.exp.default)
def exp_rule(ctx, x):
    return exp(ctx, operand(ctx, x, ctx.promoted_dtype(Kind.INT_TO_FLOAT)))


for _op, _code in [(aten.log.default, "LOG"), (aten.sqrt.default, "SQRT"),
                   (aten.rsqrt.default, "RSQRT"), (aten.sin.default, "SIN"), (aten.cos.default, "COS"),
                   (aten.sigmoid.default, "LOGISTIC"), (aten.tanh.default, "TANH")]:
    _unary(_op, _code, Kind.INT_TO_FLOAT)
for _op, _code in [(aten.abs.default, "ABS"), (aten.neg.default, "NEG")]:
    _unary(_op, _code)


@builds(aten.sign.default)
def sign(ctx, x):
    if x.dtype == BOOL:
        return x
    y = ctx.op("SIGN", [x])
    if x.dtype.kind != "f":
        return y
    # torch.sign(nan) is 0
    return ctx.op("SELECT_V2", [ctx.op("NOT_EQUAL", [x, x], shape=x.shape, dtype=BOOL),
                                ctx.const(np.zeros((), x.dtype)), y])


def _keep_ints(code):
    def rule(ctx, x):
        if x.dtype.kind != "f":
            return x  # ceil/floor/round/trunc of an integer is itself
        return ctx.op(code, [x]) if code != "TRUNC" else trunc_tensor(ctx, x)
    return rule


builds(aten.ceil.default)(_keep_ints("CEIL"))
builds(aten.floor.default)(_keep_ints("FLOOR"))
builds(aten.trunc.default)(_keep_ints("TRUNC"))


@builds(aten.round.default)
def round_(ctx, x):
    # ROUND rounds half to even, like torch.round
    return x if x.dtype.kind != "f" else ctx.op("ROUND", [x])


@builds(aten.round.decimals)
def round_decimals(ctx, x, *, decimals=0):
    # torch: round(x * 10**d) / 10**d, or round(x / 10**-d) * 10**-d for negative d, half to even
    if x.dtype.kind != "f":
        return x
    if decimals == 0:
        return ctx.op("ROUND", [x])
    p = _c(ctx, 10.0 ** abs(decimals), x)
    scale, unscale = ("MUL", "DIV") if decimals > 0 else ("DIV", "MUL")
    return ctx.op(unscale, [ctx.op("ROUND", [ctx.op(scale, [x, p])]), p])


def _float_unary(ctx, x) -> Tensor:
    return operand(ctx, x, ctx.promoted_dtype(Kind.INT_TO_FLOAT))


def _c(ctx, v, x):
    return ctx.const(np.asarray(v, x.dtype))


@builds(aten.reciprocal.default)
def reciprocal(ctx, x):
    x = _float_unary(ctx, x)
    return ctx.op("DIV", [_c(ctx, 1.0, x), x])


def _scaled_log(scale):
    def rule(ctx, x):
        x = _float_unary(ctx, x)
        return ctx.op("MUL", [ctx.op("LOG", [x], shape=x.shape), _c(ctx, scale, x)])
    return rule


builds(aten.log2.default)(_scaled_log(1 / math.log(2)))
builds(aten.log10.default)(_scaled_log(1 / math.log(10)))


def _exp_pair(ctx, x):
    e = exp(ctx, x)
    return e, ctx.op("DIV", [_c(ctx, 1.0, x), e], shape=x.shape)


@builds(aten.sinh.default)
def sinh(ctx, x):
    x = _float_unary(ctx, x)
    e, inv = _exp_pair(ctx, x)
    return ctx.op("MUL", [ctx.op("SUB", [e, inv], shape=x.shape), _c(ctx, 0.5, x)])


@builds(aten.cosh.default)
def cosh(ctx, x):
    x = _float_unary(ctx, x)
    e, inv = _exp_pair(ctx, x)
    return ctx.op("MUL", [ctx.op("ADD", [e, inv], shape=x.shape), _c(ctx, 0.5, x)])


def _one_minus_sq_root(ctx, x):
    sq = ctx.op("MUL", [x, x], shape=x.shape)
    return ctx.op("SQRT", [ctx.op("SUB", [_c(ctx, 1.0, x), sq], shape=x.shape)], shape=x.shape)


@builds(aten.atan.default)
def atan(ctx, x):
    x = _float_unary(ctx, x)
    return ctx.op("ATAN2", [x, _expand_to(ctx, ctx.const(np.ones((), x.dtype)), x.shape)])


@builds(aten.asin.default)
def asin(ctx, x):
    x = _float_unary(ctx, x)
    return ctx.op("ATAN2", [x, _one_minus_sq_root(ctx, x)])


@builds(aten.acos.default)
def acos(ctx, x):
    x = _float_unary(ctx, x)
    return ctx.op("ATAN2", [_one_minus_sq_root(ctx, x), x])


@builds(aten.asinh.default)
def asinh(ctx, x):
    # sign(x) * log(|x| + sqrt(x^2 + 1)): exact for negative x too
    x = _float_unary(ctx, x)
    a = ctx.op("ABS", [x], shape=x.shape)
    r = ctx.op("SQRT", [ctx.op("ADD", [ctx.op("MUL", [x, x], shape=x.shape), _c(ctx, 1.0, x)], shape=x.shape)],
               shape=x.shape)
    lg = ctx.op("LOG", [ctx.op("ADD", [a, r], shape=x.shape)], shape=x.shape)
    return ctx.op("MUL", [lg, ctx.op("SIGN", [x], shape=x.shape)])


@builds(aten.acosh.default)
def acosh(ctx, x):
    # log(x + sqrt(x - 1) * sqrt(x + 1)): NaN below 1 like torch, and no overflow in x * x
    x = _float_unary(ctx, x)
    lo = ctx.op("SQRT", [ctx.op("SUB", [x, _c(ctx, 1.0, x)], shape=x.shape)], shape=x.shape)
    hi = ctx.op("SQRT", [ctx.op("ADD", [x, _c(ctx, 1.0, x)], shape=x.shape)], shape=x.shape)
    return ctx.op("LOG", [ctx.op("ADD", [x, ctx.op("MUL", [lo, hi], shape=x.shape)], shape=x.shape)])


@builds(aten.atanh.default)
def atanh(ctx, x):
    x = _float_unary(ctx, x)
    num = ctx.op("ADD", [_c(ctx, 1.0, x), x], shape=x.shape)
    den = ctx.op("SUB", [_c(ctx, 1.0, x), x], shape=x.shape)
    lg = ctx.op("LOG", [ctx.op("DIV", [num, den], shape=x.shape)], shape=x.shape)
    return ctx.op("MUL", [lg, _c(ctx, 0.5, x)])


# erf(x) by Abramowitz & Stegun 7.1.26 refined (max abs error 1.2e-7, float32's own resolution).
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@builds(aten.erf.default)
def erf(ctx, x):
    x = _float_unary(ctx, x)
    s = x.shape

    def c(v):
        return _c(ctx, v, x)
    a = ctx.op("ABS", [x], shape=s)
    t = ctx.op("DIV", [c(1.0), ctx.op("ADD", [c(1.0), ctx.op("MUL", [a, c(_ERF_P)], shape=s)], shape=s)], shape=s)
    poly = c(_ERF_A[4])
    for coef in reversed(_ERF_A[:4]):
        poly = ctx.op("ADD", [ctx.op("MUL", [poly, t], shape=s), c(coef)], shape=s)
    poly = ctx.op("MUL", [poly, t], shape=s)
    e = ctx.op("EXP", [ctx.op("NEG", [ctx.op("MUL", [a, a], shape=s)], shape=s)], shape=s)
    y = ctx.op("SUB", [c(1.0), ctx.op("MUL", [poly, e], shape=s)], shape=s)
    return ctx.op("MUL", [y, ctx.op("SIGN", [x], shape=s)])


@builds(aten.isnan.default)
def isnan(ctx, x):
    if x.dtype.kind != "f":
        return ctx.const(np.zeros(x.shape, bool))
    return ctx.op("NOT_EQUAL", [x, x])


@builds(aten.isinf.default)
def isinf(ctx, x):
    if x.dtype.kind != "f":
        return ctx.const(np.zeros(x.shape, bool))
    return ctx.op("EQUAL", [ctx.op("ABS", [x], shape=x.shape, dtype=x.dtype), ctx.const(np.asarray(np.inf, x.dtype))])


# ---- comparisons and logic -----------------------------------------------------------------

def _compare(ops, code):
    @builds(*ops)
    def rule(ctx, a, b):
        dt = ctx.promoted_dtype()
        if dt == BOOL and code not in ("EQUAL", "NOT_EQUAL"):
            dt = np.dtype(np.int32)  # LESS and friends have no bool kernel
        return ctx.op(code, [operand(ctx, a, dt), operand(ctx, b, dt)], dtype=BOOL)
    return rule


_compare([aten.eq.Tensor, aten.eq.Scalar], "EQUAL")
_compare([aten.ne.Tensor, aten.ne.Scalar], "NOT_EQUAL")
_compare([aten.lt.Tensor, aten.lt.Scalar], "LESS")
_compare([aten.le.Tensor, aten.le.Scalar], "LESS_EQUAL")
_compare([aten.gt.Tensor, aten.gt.Scalar], "GREATER")
_compare([aten.ge.Tensor, aten.ge.Scalar], "GREATER_EQUAL")


def _as_bool(ctx, x) -> Tensor:
    if isinstance(x, Tensor) and x.dtype == BOOL:
        return x
    if not isinstance(x, Tensor):
        return ctx.const(np.asarray(bool(x)))
    return ctx.op("NOT_EQUAL", [x, ctx.const(np.zeros((), x.dtype))], shape=x.shape, dtype=BOOL)


@builds(aten.logical_and.default)
def logical_and(ctx, a, b):
    return ctx.op("LOGICAL_AND", [_as_bool(ctx, a), _as_bool(ctx, b)], dtype=BOOL)


@builds(aten.logical_or.default)
def logical_or(ctx, a, b):
    return ctx.op("LOGICAL_OR", [_as_bool(ctx, a), _as_bool(ctx, b)], dtype=BOOL)


@builds(aten.logical_xor.default)
def logical_xor(ctx, a, b):
    return ctx.op("NOT_EQUAL", [_as_bool(ctx, a), _as_bool(ctx, b)], dtype=BOOL)


@builds(aten.logical_not.default)
def logical_not(ctx, a):
    return ctx.op("LOGICAL_NOT", [_as_bool(ctx, a)], dtype=BOOL)


def _bitwise(op_t, op_s, bool_code, int_rule):
    @builds(op_t, op_s)
    def rule(ctx, a, b):
        dt = ctx.promoted_dtype()
        a, b = operand(ctx, a, dt), operand(ctx, b, dt)
        if dt == BOOL:
            return ctx.op(bool_code, [a, b], dtype=BOOL)
        return int_rule(ctx, a, b, ctx.out_shape())
    return rule


def _and16(ctx, x, y, shape):
    # x + y == (x ^ y) + 2 (x & y) for integers; exact here, as 16-bit halves cannot overflow
    s = ctx.op("SUB", [ctx.op("ADD", [x, y], shape=shape), ctx.op("BITWISE_XOR", [x, y], shape=shape)], shape=shape)
    return ctx.op("RIGHT_SHIFT", [s, ctx.const(np.ones((), x.dtype))], shape=shape)


def _halves(ctx, x):
    hi = ctx.op("RIGHT_SHIFT", [x, ctx.const(np.asarray(16, x.dtype))], shape=x.shape)
    lo = ctx.op("SUB", [x, ctx.op("MUL", [hi, ctx.const(np.asarray(1 << 16, x.dtype))], shape=x.shape)],
                shape=x.shape)
    return hi, lo


def bitwise_and_int(ctx, a, b, shape):
    """a & b from XOR and arithmetic (TFLite has no integer AND), one 16-bit half at a time."""
    (ha, la), (hb, lb) = _halves(ctx, a), _halves(ctx, b)
    hi = _and16(ctx, ha, hb, shape)
    lo = _and16(ctx, la, lb, shape)
    return ctx.op("ADD", [ctx.op("MUL", [hi, ctx.const(np.asarray(1 << 16, a.dtype))], shape=shape), lo],
                  shape=shape, dtype=a.dtype)


def bitwise_or_int(ctx, a, b, shape):
    # a | b == (a ^ b) + (a & b)
    return ctx.op("ADD", [ctx.op("BITWISE_XOR", [a, b], shape=shape), bitwise_and_int(ctx, a, b, shape)],
                  shape=shape, dtype=a.dtype)


def bitwise_xor_int(ctx, a, b, shape):
    return ctx.op("BITWISE_XOR", [a, b], shape=shape, dtype=a.dtype)


_bitwise(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, "LOGICAL_AND", bitwise_and_int)
_bitwise(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, "LOGICAL_OR", bitwise_or_int)
_bitwise(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, "NOT_EQUAL", bitwise_xor_int)


@builds(aten.bitwise_not.default)
def bitwise_not(ctx, x):
    if x.dtype == BOOL:
        return ctx.op("LOGICAL_NOT", [x])
    # two's complement: ~x == -x - 1
    return ctx.op("SUB", [ctx.op("NEG", [x], shape=x.shape), ctx.const(np.ones((), x.dtype))])


@builds(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(ctx, cond, a, b):
    dt = ctx.out_dtype()
    return ctx.op("SELECT_V2", [_as_bool(ctx, cond), operand(ctx, a, dt), operand(ctx, b, dt)])


# ---- activations ---------------------------------------------------------------------------

@builds(aten.relu.default)
def relu(ctx, x):
    if x.dtype.kind != "f":
        return ctx.op("MAXIMUM", [x, ctx.const(np.zeros((), x.dtype))])
    return ctx.op("RELU", [x])


def clamp_tensor(ctx, x: Tensor, lo, hi) -> Tensor:
    """``x`` clamped to [lo, hi] (numbers or None), with TFLite's RELU ops where they fit."""
    if x.dtype.kind == "f":
        if lo == 0 and hi == 6:
            return ctx.op("RELU6", [x], shape=x.shape)
        if lo == -1 and hi == 1:
            return ctx.op("RELU_N1_TO_1", [x], shape=x.shape)
        if lo == 0 and hi is None:
            return ctx.op("RELU", [x], shape=x.shape)
    if lo is not None:
        x = ctx.op("MAXIMUM", [x, ctx.const(np.asarray(lo).astype(x.dtype))], shape=x.shape, dtype=x.dtype)
    if hi is not None:
        x = ctx.op("MINIMUM", [x, ctx.const(np.asarray(hi).astype(x.dtype))], shape=x.shape, dtype=x.dtype)
    return x


@builds(aten.hardtanh.default)
def hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    return clamp_tensor(ctx, x, min_val, max_val)


@builds(aten.relu6.default)
def relu6(ctx, x):
    return clamp_tensor(ctx, x, 0, 6)


@builds(aten.clamp.default)
def clamp(ctx, x, min=None, max=None):
    x = operand(ctx, x, ctx.out_dtype())
    if min is None and max is None:
        return x
    return clamp_tensor(ctx, x, min, max)


@builds(aten.clamp.Tensor)
def clamp_t(ctx, x, min=None, max=None):
    dt = ctx.out_dtype()
    x = operand(ctx, x, dt)
    if min is not None:
        x = ctx.op("MAXIMUM", [x, operand(ctx, min, dt)])
    if max is not None:
        x = ctx.op("MINIMUM", [x, operand(ctx, max, dt)])
    return x


@builds(aten.gelu.default)
def gelu(ctx, x, *, approximate="none"):
    return ctx.op("GELU", [x], approximate=approximate == "tanh")


@builds(aten.silu.default)
def silu(ctx, x):
    return ctx.op("MUL", [x, ctx.op("LOGISTIC", [x], shape=x.shape)])


@builds(aten.hardswish.default)
def hardswish(ctx, x):
    return ctx.op("HARD_SWISH", [x])


@builds(aten.hardsigmoid.default)
def hardsigmoid(ctx, x):
    r = ctx.op("RELU6", [ctx.op("ADD", [x, _c(ctx, 3.0, x)], shape=x.shape)], shape=x.shape)
    return ctx.op("MUL", [r, _c(ctx, 1 / 6, x)])


@builds(aten.leaky_relu.default)
def leaky_relu(ctx, x, negative_slope=0.01):
    return ctx.op("LEAKY_RELU", [x], alpha=float(negative_slope))


@builds(aten.elu.default)
def elu(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    if alpha == 1 and scale == 1 and input_scale == 1:
        return ctx.op("ELU", [x])
    s = x.shape
    xi = x if input_scale == 1 else ctx.op("MUL", [x, _c(ctx, input_scale, x)], shape=s)
    neg = ctx.op("MUL", [ctx.op("SUB", [ctx.op("EXP", [xi], shape=s), _c(ctx, 1.0, x)], shape=s),
                         _c(ctx, alpha * scale, x)], shape=s)
    pos = x if scale == 1 else ctx.op("MUL", [x, _c(ctx, scale, x)], shape=s)
    cond = ctx.op("GREATER", [x, _c(ctx, 0.0, x)], shape=s, dtype=BOOL)
    return ctx.op("SELECT_V2", [cond, pos, neg])


@builds(aten.square.default)
def square(ctx, x):
    x = operand(ctx, x, ctx.out_dtype())
    return ctx.op("MUL", [x, x])

