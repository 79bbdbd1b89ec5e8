"""Special functions: Bessel, incomplete gamma, zeta, erfcx, ndtri and the orthogonal polynomials.

The polynomial rules follow torch's kernels (aten/src/ATen/native/Math.h) step for step: the same
special cases and the same three-term recurrences, run for ``n`` steps per element.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind

import torch

from .. import cephes, special_math
from .ops_elementwise import binary, opmath, unary
from .registry import lowers

aten = torch.ops.aten
special = jax.scipy.special

for _op, _fn in [
    (aten.i0.default, special.i0), (aten.special_i0e.default, special.i0e),
    (aten.special_i1.default, special.i1), (aten.special_i1e.default, special.i1e),
    (aten.special_modified_bessel_i0.default, special.i0), (aten.special_modified_bessel_i1.default, special.i1),
    (aten.special_erfcx.default, special.erfcx), (aten.special_ndtri.default, special.ndtri),
]:
    unary(_op, _fn, Kind.INT_TO_FLOAT)

binary([aten.igamma.default], special.gammainc, Kind.INT_TO_FLOAT)
binary([aten.igammac.default], special.gammaincc, Kind.INT_TO_FLOAT)
binary([aten.special_zeta.default, aten.special_zeta.other_scalar, aten.special_zeta.self_scalar],
       special.zeta, Kind.INT_TO_FLOAT)


def _recurrence(n_steps, p, q, step):
    """Runs ``r = step(k, p, q); p, q = q, r`` for k = 1..n_steps (per element) and returns q."""
    n_steps = jnp.broadcast_to(n_steps, q.shape)
    bound = jnp.max(n_steps, initial=0)

    def body(state):
        k, p, q = state
        r = step(k.astype(q.dtype), p, q)
        live = k <= n_steps
        return k + 1, jnp.where(live, q, p), jnp.where(live, r, q)

    _, _, q = lax.while_loop(lambda s: s[0] <= bound, body, (jnp.ones((), n_steps.dtype), p, q))
    return q


def _polynomial(ops, fn):
    @lowers(*ops)
    def rule(ctx, x, n):
        dt = opmath(ctx.promoted_dtype())
        x, n = jnp.asarray(x, dt), jnp.asarray(n)
        # torch's kernels take n as an integer (truncating a floating n)
        n = (jnp.trunc(n) if jnp.issubdtype(n.dtype, jnp.inexact) else n).astype(jnp.int32)
        x, n = jnp.broadcast_arrays(x, n)
        return fn(x, n)
    return rule


def _chebyshev_t(x, n):
    one = jnp.ones_like(x)
    rec = _recurrence(n - 1, one, x, lambda k, p, q: (x + x) * q - p)
    out = jnp.where(n == 0, one, jnp.where(n == 1, x, rec))
    out = jnp.where((n > 6) & (jnp.abs(x) < 1), jnp.cos(n * jnp.arccos(x)), out)
    out = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | (n % 2 == 0), one, -one), out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _chebyshev_u(x, n):
    one = jnp.ones_like(x)
    rec = _recurrence(n - 1, one, x + x, lambda k, p, q: (x + x) * q - p)
    out = jnp.where(n == 0, one, jnp.where(n == 1, x + x, rec))
    theta = jnp.arccos(x)
    n1 = (n + 1).astype(x.dtype)
    big = jnp.where(jnp.sin(theta) != 0, jnp.sin(n1 * theta) / jnp.sin(theta), n1 * jnp.cos(n1 * theta) / x)
    out = jnp.where((n > 8) & (jnp.abs(x) < 1), big, out)
    out = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | (n % 2 == 0), n1, -n1), out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _hermite_h(x, n):
    one = jnp.ones_like(x)
    # torch steps k = 2, 4, ..., 2n - 2: H_{j+1} = 2x H_j - 2j H_{j-1}
    rec = _recurrence(n - 1, one, x + x, lambda k, p, q: (x + x) * q - (k + k) * p)
    out = jnp.where(n == 0, one, jnp.where(n == 1, x + x, rec))
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _hermite_he(x, n):
    one = jnp.ones_like(x)
    rec = _recurrence(n - 1, one, x, lambda k, p, q: x * q - k * p)
    out = jnp.where(n == 0, one, jnp.where(n == 1, x, rec))
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _laguerre_l(x, n):
    one = jnp.ones_like(x)
    rec = _recurrence(n - 1, one, one - x, lambda k, p, q: (((k + k) + (one - x)) * q - k * p) / (k + 1))
    out = jnp.where(n == 0, one, jnp.where(n == 1, one - x, rec))
    out = jnp.where(x == 0, one, out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _odd_even(n, odd, even):
    return jnp.where(n % 2 == 0, even, odd)


def _chebyshev_v(x, n):
    one = jnp.ones_like(x)
    n21 = (n + n + 1).astype(x.dtype)
    rec = _recurrence(n - 1, one, x + x - 1, lambda k, p, q: (x + x) * q - p)
    out = jnp.where(n == 0, one, jnp.where(n == 1, x + x - 1, rec))
    t = jnp.arccos(x)
    big = jnp.where(jnp.sin(t / 2) != 1, jnp.cos((n + 0.5) * t) / jnp.cos(t / 2), _odd_even(n, -n21, n21))
    out = jnp.where((n > 8) & (jnp.abs(x) < 1), big, out)
    out = jnp.where(jnp.abs(x) == 1, jnp.where(x > 0, one, _odd_even(n, -n21, n21)), out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _chebyshev_w(x, n):
    one = jnp.ones_like(x)
    n21 = (n + n + 1).astype(x.dtype)
    rec = _recurrence(n - 1, one, x + x + 1, lambda k, p, q: (x + x) * q - p)
    out = jnp.where(n == 0, one, jnp.where(n == 1, x + x + 1, rec))
    t = jnp.arccos(x)
    at_one = jnp.where(x > 0, n21, _odd_even(n, -one, one))
    big = jnp.where(jnp.cos(t / 2) != 1, jnp.sin((n + 0.5) * t) / jnp.sin(t / 2), at_one)
    out = jnp.where((n > 8) & (jnp.abs(x) < 1), big, out)
    out = jnp.where(jnp.abs(x) == 1, at_one, out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _legendre_p(x, n):
    one = jnp.ones_like(x)
    rec = _recurrence(n - 1, one, x, lambda k, p, q: ((k + k + 1) * x * q - k * p) / (k + 1))
    out = jnp.where(n == 0, one, jnp.where(n == 1, x, rec))
    out = jnp.where(jnp.abs(x) == 1, jnp.where((x > 0) | (n % 2 == 0), one, -one), out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _shifted(kind):
    """torch's shifted Chebyshev polynomials: T*, U*, V*, W* of y = 2x - 1, with their own special cases."""
    def fn(x, n):
        one = jnp.ones_like(x)
        y = x + x - 1
        n1, n21 = (n + 1).astype(x.dtype), (n + n + 1).astype(x.dtype)
        first = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
        rec = _recurrence(n - 1, one, first, lambda k, p, q: (y + y) * q - p)
        out = jnp.where(n == 0, one, jnp.where(n == 1, first, rec))
        t = jnp.arccos(y)
        if kind == "t":
            big, threshold = jnp.cos(n * t), 6
            at_one, at_zero = one, _odd_even(n, -one, one)
        elif kind == "u":
            big = jnp.where(jnp.sin(t) != 0, jnp.sin(n1 * t) / jnp.sin(t), n1 * jnp.cos(n1 * t) / y)
            threshold, at_one, at_zero = 6, n1, _odd_even(n, -n1, n1)
        elif kind == "v":
            at_one, at_zero = one, _odd_even(n, -n21, n21)
            big = jnp.where(jnp.sin(t / 2) != 1, jnp.cos((n + 0.5) * t) / jnp.cos(t / 2), at_zero)
            threshold = 6
        else:
            at_one, at_zero = n21, _odd_even(n, -one, one)
            big = jnp.where(jnp.cos(t / 2) != 1, jnp.sin((n + 0.5) * t) / jnp.sin(t / 2), at_zero)
            threshold = 4
        out = jnp.where((n > threshold) & (jnp.abs(y) < 1), big, out)
        out = jnp.where(x == 0, at_zero, out)
        out = jnp.where(x == 1, at_one, out)
        return jnp.where(n < 0, jnp.zeros_like(x), out)
    return fn


_polynomial([aten.special_chebyshev_polynomial_t.default, aten.special_chebyshev_polynomial_t.x_scalar,
             aten.special_chebyshev_polynomial_t.n_scalar], _chebyshev_t)
_polynomial([aten.special_chebyshev_polynomial_u.default, aten.special_chebyshev_polynomial_u.x_scalar,
             aten.special_chebyshev_polynomial_u.n_scalar], _chebyshev_u)
_polynomial([aten.special_chebyshev_polynomial_v.default, aten.special_chebyshev_polynomial_v.x_scalar,
             aten.special_chebyshev_polynomial_v.n_scalar], _chebyshev_v)
_polynomial([aten.special_chebyshev_polynomial_w.default, aten.special_chebyshev_polynomial_w.x_scalar,
             aten.special_chebyshev_polynomial_w.n_scalar], _chebyshev_w)
_polynomial([aten.special_legendre_polynomial_p.default, aten.special_legendre_polynomial_p.x_scalar,
             aten.special_legendre_polynomial_p.n_scalar], _legendre_p)
_polynomial([aten.special_shifted_chebyshev_polynomial_t.default, aten.special_shifted_chebyshev_polynomial_t.x_scalar,
             aten.special_shifted_chebyshev_polynomial_t.n_scalar], _shifted("t"))
_polynomial([aten.special_shifted_chebyshev_polynomial_u.default, aten.special_shifted_chebyshev_polynomial_u.x_scalar,
             aten.special_shifted_chebyshev_polynomial_u.n_scalar], _shifted("u"))
_polynomial([aten.special_shifted_chebyshev_polynomial_v.default, aten.special_shifted_chebyshev_polynomial_v.x_scalar,
             aten.special_shifted_chebyshev_polynomial_v.n_scalar], _shifted("v"))
_polynomial([aten.special_shifted_chebyshev_polynomial_w.default, aten.special_shifted_chebyshev_polynomial_w.x_scalar,
             aten.special_shifted_chebyshev_polynomial_w.n_scalar], _shifted("w"))
_polynomial([aten.special_hermite_polynomial_h.default, aten.special_hermite_polynomial_h.x_scalar,
             aten.special_hermite_polynomial_h.n_scalar], _hermite_h)
_polynomial([aten.special_hermite_polynomial_he.default, aten.special_hermite_polynomial_he.x_scalar,
             aten.special_hermite_polynomial_he.n_scalar], _hermite_he)
_polynomial([aten.special_laguerre_polynomial_l.default, aten.special_laguerre_polynomial_l.x_scalar,
             aten.special_laguerre_polynomial_l.n_scalar], _laguerre_l)


# ---- Bessel functions of the first and second kind, K0/K1: torch's Cephes kernels ---------------
# (written once for both targets in converters/special_math.py)

def _poly(coefs, z):
    return special_math.poly(coefs, z, jnp)


for _op, _fn in [(aten.special_bessel_j0.default, special_math.bessel_j0),
                 (aten.special_bessel_j1.default, special_math.bessel_j1),
                 (aten.special_bessel_y0.default, special_math.bessel_y0),
                 (aten.special_bessel_y1.default, special_math.bessel_y1),
                 (aten.special_spherical_bessel_j0.default, special_math.spherical_bessel_j0)]:
    unary(_op, lambda x, fn=_fn: fn(x, jnp), Kind.INT_TO_FLOAT)

for _op, _order, _scaled in [(aten.special_modified_bessel_k0.default, 0, False),
                             (aten.special_modified_bessel_k1.default, 1, False),
                             (aten.special_scaled_modified_bessel_k0.default, 0, True),
                             (aten.special_scaled_modified_bessel_k1.default, 1, True)]:
    unary(_op, lambda x, o=_order, sc=_scaled: special_math.bessel_k(o, sc, x, special.i0 if o == 0 else special.i1, jnp),
          Kind.INT_TO_FLOAT)


@lowers(aten.polygamma.default)
def polygamma(ctx, n, x):
    x = ctx.cast(x, opmath(ctx.out_dtype()))
    if n == 0:
        return special.digamma(x)
    if n == 1:
        return _trigamma(x)
    # torch: (-1)^(n+1) n! zeta(n+1, x)
    sign = 1.0 if n % 2 else -1.0
    return sign * jnp.exp(special.gammaln(jnp.asarray(n + 1.0, x.dtype))) * _cephes_zeta(jnp.asarray(n + 1.0, x.dtype), x)


# Euler-Maclaurin coefficients of Cephes' zeta (torch's Math.h)
_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)


def _cephes_zeta(x, q):
    """torch's Hurwitz zeta (Cephes): unlike jax's, it is defined for negative non-integer q and integer x."""
    x, q = jnp.broadcast_arrays(x, q)
    s = jnp.power(q, -x)

    def body(state):
        i, a, s, b = state
        live = (i < 9) | (a <= 9)
        a1 = a + 1
        b1 = jnp.power(a1, -x)
        return i + 1, jnp.where(live, a1, a), jnp.where(live, s + b1, s), jnp.where(live, b1, b)

    _, a, s, b = lax.while_loop(lambda st: jnp.any((st[0] < 9) | (st[1] <= 9)), body,
                                (jnp.zeros((), jnp.int32), q, s, jnp.zeros_like(s)))
    w = a
    s = s + b * w / (x - 1) - 0.5 * b
    a, k = jnp.ones_like(s), jnp.zeros_like(s)
    for coef in _ZETA_A:
        a = a * (x + k)
        b = b / w
        s = s + a * b / coef
        k = k + 1
        a = a * (x + k)
        b = b / w
        k = k + 1
    s = jnp.where((q <= 0) & (x != jnp.floor(x)), jnp.nan, s)
    s = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, s)
    s = jnp.where(x < 1, jnp.nan, s)
    return jnp.where(x == 1, jnp.inf, s)


def _trigamma(x):
    return special_math.trigamma(x, jnp)


@lowers(aten.ldexp.Tensor)
def ldexp(ctx, x, other):
    # torch: x * 2 ** other, in x's floating type
    dt = opmath(ctx.out_dtype())
    return ctx.cast(x, dt) * jnp.exp2(ctx.cast(other, dt))


def _airy_ai(x):
    """torch's Cephes Ai(x): asymptotic forms beyond |x| = 2.09, the Maclaurin series between."""
    c = cephes.AIRY_AI
    neg = jnp.where(x < -2.09, x, -3.0)
    z = 1 / (-2 * neg * jnp.sqrt(-neg) / 3)
    zz = z * z
    t = -2 * neg * jnp.sqrt(-neg) / 3 + 0.25 * jnp.pi
    left = 5.64189583547756286948e-01 / jnp.sqrt(jnp.sqrt(-neg)) * (
        jnp.sin(t) * (1 + zz * _poly(c["AFN"], zz) / _poly(c["AFD"], zz))
        - jnp.cos(t) * (z * _poly(c["AGN"], zz) / _poly(c["AGD"], zz)))
    pos = jnp.where(x >= 2.09, x, 3.0)
    zeta = 2 * pos * jnp.sqrt(pos) / 3
    right = 5.64189583547756286948e-01 * (_poly(c["AN"], 1 / zeta) / _poly(c["AD"], 1 / zeta)) \
        / (2 * jnp.sqrt(jnp.sqrt(pos)) * jnp.exp(zeta))
    # the series f, g of torch's loop, run until every element's last term is below epsilon
    mid = jnp.where((x >= -2.09) & (x < 2.09), x, 0.0)
    eps = jnp.finfo(x.dtype).eps
    z3 = mid * mid * mid

    def body(s):
        f, g, k, m, n, _ = s
        m = m * z3
        k = k + 1
        m = m / k
        n = n * z3
        k = k + 1
        n = n / k
        m = m / k
        f = f + m
        k = k + 1
        n = n / k
        g = g + n
        return f, g, k, m, n, jnp.abs(m / f)

    one = jnp.ones_like(mid)
    # elements that converged earlier than the slowest keep adding terms, each below epsilon of their sum
    f, g, *_ = lax.while_loop(lambda s: jnp.any(s[5] > eps), body, (one, mid, one, one, mid, one))
    centre = 0.355028053887817239260 * f - 0.258819403792806798405 * g
    out = jnp.where(x < -2.09, left, jnp.where(x >= 2.09, right, centre))
    out = jnp.where(x > 103.892, jnp.zeros_like(x), out)
    return jnp.where(jnp.isinf(x), jnp.nan, out)


unary(aten.special_airy_ai.default, _airy_ai, Kind.INT_TO_FLOAT)
