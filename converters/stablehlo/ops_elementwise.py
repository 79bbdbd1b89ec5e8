"""Elementwise ops: math, comparisons, logic, bitwise, activations, where/clamp."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

import torch

from .registry import lowers

aten = torch.ops.aten


def opmath(dtype):
    """The dtype torch computes in: float16/bfloat16 math runs in float32 and rounds once at the end."""
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def unary(op, fn, kind=Kind.DEFAULT):
    @lowers(op)
    def rule(ctx, x):
        return fn(ctx.cast(x, opmath(ctx.promoted_dtype(kind))))
    rule.__name__ = op.__name__
    return rule


# Ops whose integer inputs compute (and return) float, like torch.
for _op, _fn in [
    (aten.acos.default, jnp.arccos), (aten.acosh.default, jnp.arccosh), (aten.asin.default, jnp.arcsin),
    (aten.asinh.default, jnp.arcsinh), (aten.atan.default, jnp.arctan), (aten.atanh.default, jnp.arctanh),
    (aten.cos.default, jnp.cos), (aten.cosh.default, jnp.cosh), (aten.erf.default, jax.scipy.special.erf),
    (aten.exp.default, jnp.exp), (aten.expm1.default, jnp.expm1), (aten.log.default, jnp.log),
    (aten.log10.default, jnp.log10), (aten.log1p.default, jnp.log1p), (aten.log2.default, jnp.log2),
    (aten.reciprocal.default, lambda x: 1 / x), (aten.rsqrt.default, lax.rsqrt),
    (aten.sigmoid.default, jax.nn.sigmoid), (aten.sin.default, jnp.sin), (aten.sinh.default, jnp.sinh),
    (aten.sqrt.default, jnp.sqrt), (aten.tan.default, jnp.tan), (aten.tanh.default, jnp.tanh),
]:
    unary(_op, _fn, Kind.INT_TO_FLOAT)

# Ops that keep the input dtype (ints stay ints).
for _op, _fn in [
    (aten.abs.default, jnp.abs), (aten.neg.default, jnp.negative), (aten.bitwise_not.default, jnp.invert),
    # torch's sign(nan) is 0
    (aten.sign.default, lambda x: x if x.dtype == jnp.bool_ else jnp.where(jnp.isnan(x), 0, jnp.sign(x))
     if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.sign(x)),
    (aten.relu.default, lambda x: jnp.maximum(x, jnp.zeros((), x.dtype))),
]:
    unary(_op, _fn)


def _float_or_same(fn):
    # ceil/floor/round/trunc of an integer is the integer itself
    def apply(x):
        return x if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_ else fn(x)
    return apply


for _op, _fn in [(aten.ceil.default, jnp.ceil), (aten.floor.default, jnp.floor),
                 (aten.round.default, jnp.round), (aten.trunc.default, jnp.trunc)]:
    unary(_op, _float_or_same(_fn))


@lowers(aten.isnan.default)
def isnan(ctx, x):
    return jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape, jnp.bool_)


@lowers(aten.isinf.default)
def isinf(ctx, x):
    return jnp.isinf(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape, jnp.bool_)


@lowers(aten.logical_not.default)
def logical_not(ctx, x):
    return jnp.logical_not(x)


def binary(ops, fn, kind=Kind.DEFAULT):
    @lowers(*ops)
    def rule(ctx, a, b, *args, out=None, **kwargs):
        # ``out`` (of out= overloads) only says where torch would write the result
        dt = opmath(ctx.promoted_dtype(kind))
        return fn(ctx.cast(jnp.asarray(a), dt), ctx.cast(jnp.asarray(b), dt), *args, **kwargs)
    return rule


def _with_alpha(fn):
    def apply(a, b, alpha=None):
        return fn(a, b if alpha is None or alpha == 1 else b * jnp.asarray(alpha, b.dtype))
    return apply


binary([aten.add.Tensor, aten.add.Scalar], _with_alpha(jnp.add))
binary([aten.sub.Tensor, aten.sub.Scalar], _with_alpha(jnp.subtract))
binary([aten.mul.Tensor, aten.mul.Scalar], jnp.multiply)
binary([aten.div.Tensor, aten.div.Scalar], jnp.true_divide, Kind.INT_TO_FLOAT)
binary([aten.maximum.default], jnp.maximum)
binary([aten.minimum.default], jnp.minimum)
binary([aten.atan2.default, aten.atan2.out], jnp.arctan2, Kind.INT_TO_FLOAT)
binary([aten.fmod.Tensor, aten.fmod.Scalar], jnp.fmod)
binary([aten.remainder.Tensor, aten.remainder.Scalar], jnp.remainder)
binary([aten.bitwise_and.Tensor, aten.bitwise_and.Scalar], jnp.bitwise_and)
binary([aten.bitwise_or.Tensor, aten.bitwise_or.Scalar], jnp.bitwise_or)
binary([aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar], jnp.bitwise_xor)
binary([aten.logical_and.default], jnp.logical_and)
binary([aten.logical_or.default], jnp.logical_or)
binary([aten.logical_xor.default], jnp.logical_xor)
binary([aten.eq.Tensor, aten.eq.Scalar], jnp.equal)
binary([aten.ne.Tensor, aten.ne.Scalar], jnp.not_equal)
binary([aten.lt.Tensor, aten.lt.Scalar], jnp.less)
binary([aten.le.Tensor, aten.le.Scalar], jnp.less_equal)
binary([aten.gt.Tensor, aten.gt.Scalar], jnp.greater)
binary([aten.ge.Tensor, aten.ge.Scalar], jnp.greater_equal)


def _div_mode(a, b, rounding_mode=None):
    if rounding_mode is None:
        return jnp.true_divide(a, b)
    if rounding_mode == "trunc":
        return lax.div(a, b) if jnp.issubdtype(a.dtype, jnp.integer) else jnp.trunc(a / b)
    if rounding_mode == "floor":
        return jnp.floor_divide(a, b)
    raise ValueError(f"unknown rounding_mode {rounding_mode!r}")


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(ctx, a, b, *, rounding_mode=None):
    kind = Kind.INT_TO_FLOAT if rounding_mode is None else Kind.DEFAULT
    dt = opmath(ctx.promoted_dtype(kind))
    return _div_mode(ctx.cast(jnp.asarray(a), dt), ctx.cast(jnp.asarray(b), dt), rounding_mode)


@lowers(aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)
def pow_(ctx, a, b):
    dt = opmath(ctx.promoted_dtype())
    a, b = jnp.asarray(a), jnp.asarray(b)
    if jnp.issubdtype(dt, jnp.integer) and b.ndim == 0 and not isinstance(ctx.node.args[1], torch.fx.Node):
        return lax.integer_pow(ctx.cast(a, dt), int(ctx.node.args[1]))
    return jnp.power(ctx.cast(a, dt), ctx.cast(b, dt))


@lowers(aten.where.self)
def where(ctx, cond, a, b):
    dt = ctx.out_dtype()
    return jnp.where(cond, ctx.cast(jnp.asarray(a), dt), ctx.cast(jnp.asarray(b), dt))


@lowers(aten.clamp.default, aten.clamp.Tensor)
def clamp(ctx, x, min=None, max=None):
    dt = ctx.out_dtype()
    x = ctx.cast(x, dt)
    if min is not None:
        x = jnp.maximum(x, ctx.cast(jnp.asarray(min), dt))
    if max is not None:
        x = jnp.minimum(x, ctx.cast(jnp.asarray(max), dt))
    return x


@lowers(aten.hardtanh.default)
def hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    return jnp.clip(x, jnp.asarray(min_val, x.dtype), jnp.asarray(max_val, x.dtype))


@lowers(aten.leaky_relu.default)
def leaky_relu(ctx, x, negative_slope=0.01):
    x = x.astype(opmath(x.dtype))
    return jnp.where(x > 0, x, x * jnp.asarray(negative_slope, x.dtype))


@lowers(aten.elu.default)
def elu(ctx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    x = x.astype(opmath(x.dtype))
    neg = jnp.asarray(alpha, x.dtype) * jnp.expm1(x * jnp.asarray(input_scale, x.dtype))
    return jnp.asarray(scale, x.dtype) * jnp.where(x > 0, x, neg)


@lowers(aten.gelu.default)
def gelu(ctx, x, *, approximate="none"):
    x = x.astype(opmath(x.dtype))
    out = jax.nn.gelu(x, approximate=approximate == "tanh")
    # torch's exact gelu gives nan at +inf (its erf form computes inf * 0 there)
    return jnp.where(jnp.isposinf(x), jnp.nan, out) if approximate != "tanh" else out


# ---- non-core ops that torch.export's core decomposition leaves in graphs ------------------

for _op, _fn in [(aten.erfc.default, jax.scipy.special.erfc), (aten.erfinv.default, jax.scipy.special.erfinv),
                 (aten.exp2.default, jnp.exp2), (aten.lgamma.default, jax.scipy.special.gammaln),
                 (aten.digamma.default, jax.scipy.special.digamma)]:
    unary(_op, _fn, Kind.INT_TO_FLOAT)

binary([aten.copysign.Tensor, aten.copysign.Scalar], jnp.copysign, Kind.INT_TO_FLOAT)
# right shifts of signed integers are arithmetic, like torch's
binary([aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar, aten.__lshift__.Tensor,
        aten.__lshift__.Scalar], jnp.left_shift)
binary([aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar, aten.__rshift__.Tensor,
        aten.__rshift__.Scalar], jnp.right_shift)


@lowers(aten.angle.default)
def angle(ctx, x):
    # real inputs: pi for negatives, 0 otherwise (-0.0 included), nan stays nan
    x = ctx.cast(x, opmath(ctx.out_dtype()))
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0).astype(x.dtype))


@lowers(aten.round.decimals)
def round_decimals(ctx, x, *, decimals):
    # torch: round(x * 10^d) / 10^d, or round(x / 10^-d) * 10^-d for negative d
    x = x.astype(opmath(x.dtype))
    scale = jnp.asarray(10.0 ** abs(decimals), x.dtype)
    return jnp.round(x * scale) / scale if decimals >= 0 else jnp.round(x / scale) * scale


binary([aten.fmax.default], jnp.fmax)
binary([aten.fmin.default], jnp.fmin)
binary([aten.hypot.default], jnp.hypot)
binary([aten.nextafter.default], jnp.nextafter)
binary([aten.gcd.default], jnp.gcd)
binary([aten.lcm.default], jnp.lcm)


@lowers(aten.signbit.default)
def signbit(ctx, x):
    if x.dtype == jnp.bool_:
        return jnp.zeros(x.shape, jnp.bool_)
    return jnp.signbit(x) if jnp.issubdtype(x.dtype, jnp.floating) else x < 0


@lowers(aten.frexp.Tensor)
def frexp(ctx, x):
    mantissa, exponent = jnp.frexp(x)
    return mantissa, exponent.astype(jnp.int32)


# ---- complex numbers ---------------------------------------------------------------------------

@lowers(aten.complex.default)
def complex_(ctx, real, imag):
    return lax.complex(*jnp.broadcast_arrays(real, imag))


@lowers(aten.polar.default)
def polar(ctx, r, theta):
    return lax.complex(*jnp.broadcast_arrays(r * jnp.cos(theta), r * jnp.sin(theta)))


@lowers(aten.view_as_complex.default)
def view_as_complex(ctx, x):
    return lax.complex(x[..., 0], x[..., 1])


@lowers(aten.view_as_real.default)
def view_as_real(ctx, x):
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@lowers(aten._conj.default, aten._conj_physical.default, aten.conj_physical.default)
def conj(ctx, x):
    return jnp.conj(x) if jnp.iscomplexobj(x) else x
