"""Special functions written once for both targets, on an array namespace ``xp`` (``jax.numpy`` on
tpu, ``torch`` in litert composites): the two share every name used here.

They follow torch's kernels (aten/src/ATen/native/Math.h, after Cephes): the same coefficients
(:mod:`converters.cephes`), branches and special cases, so results match torch's rather than
another approximation's.
"""
from __future__ import annotations

import math

from . import cephes

_SQRT_2_OVER_PI = 0.797884560802865355879892119868763737
_TWO_OVER_PI = 0.636619772367581343075535053490057448
_PI_4 = 0.785398163397448309615660845819875721
_3PI_4 = 2.356194490192344928846982537459627163


def poly(coefs, z, xp):
    """Horner's rule, highest coefficient first."""
    out = xp.zeros_like(z)
    for c in coefs:
        out = out * z + c
    return out


def _asymptotic(c, x, z, phase, first: bool, xp):
    """The large-x form of j0/j1/y0/y1: (P cos|sin(x - phase) -/+ 5/x Q sin|cos(...)) sqrt(2/(pi x))."""
    p = poly(c["PP"], z, xp) / poly(c["PQ"], z, xp)
    q = poly(c["QP"], z, xp) / poly(c["QQ"], z, xp)
    if first:
        v = p * xp.cos(x - phase) - 5 / x * q * xp.sin(x - phase)
    else:
        v = p * xp.sin(x - phase) + 5 / x * q * xp.cos(x - phase)
    return v * _SQRT_2_OVER_PI / xp.sqrt(x)


def bessel_j0(x, xp):
    x = xp.abs(x)
    xx = x * x
    small = (xx - 5.78318596294678452118) * (xx - 30.4712623436620863991) * poly(cephes.BESSEL_J0["RP"], xx, xp) \
        / poly(cephes.BESSEL_J0["RQ"], xx, xp)
    small = xp.where(x < 1e-5, 1 - xx / 4, small)
    safe = xp.where(x <= 5, xp.full_like(x, 5.0), x)
    big = _asymptotic(cephes.BESSEL_J0, safe, 25 / (safe * safe), _PI_4, True, xp)
    return xp.where(x <= 5, small, big)


def bessel_j1(x, xp):
    sign = xp.where(x < 0, -xp.ones_like(x), xp.ones_like(x))
    x = xp.abs(x)
    xx = x * x
    small = poly(cephes.BESSEL_J1["RP"], xx, xp) / poly(cephes.BESSEL_J1["RQ"], xx, xp) * x \
        * (xx - 14.6819706421238932572) * (xx - 49.2184563216946036703)
    safe = xp.where(x <= 5, xp.full_like(x, 5.0), x)
    big = _asymptotic(cephes.BESSEL_J1, safe, 5 / safe * (5 / safe), _3PI_4, True, xp)
    return sign * xp.where(x <= 5, small, big)


def _domain(x, small, xp):
    # y0, y1, k0, k1: -inf (y) or +inf (k) at 0 is the caller's; nan below 0
    return xp.where(x < 0, xp.full_like(x, math.nan), small)


def bessel_y0(x, xp):
    xx = x * x
    safe_small = xp.where(x > 0, x, xp.ones_like(x))
    small = poly(cephes.BESSEL_Y0["YP"], xx, xp) / poly(cephes.BESSEL_Y0["YQ"], xx, xp) \
        + _TWO_OVER_PI * xp.log(safe_small) * bessel_j0(x, xp)
    small = xp.where(x == 0, xp.full_like(x, -math.inf), _domain(x, small, xp))
    safe = xp.where(x <= 5, xp.full_like(x, 5.0), x)
    big = _asymptotic(cephes.BESSEL_Y0, safe, 25 / (safe * safe), _PI_4, False, xp)
    return xp.where(x <= 5, small, big)


def bessel_y1(x, xp):
    xx = x * x
    safe_small = xp.where(x > 0, x, xp.ones_like(x))
    small = x * (poly(cephes.BESSEL_Y1["YP"], xx, xp) / poly(cephes.BESSEL_Y1["YQ"], xx, xp)) \
        + _TWO_OVER_PI * (bessel_j1(x, xp) * xp.log(safe_small) - 1 / safe_small)
    small = xp.where(x == 0, xp.full_like(x, -math.inf), _domain(x, small, xp))
    safe = xp.where(x <= 5, xp.full_like(x, 5.0), x)
    big = _asymptotic(cephes.BESSEL_Y1, safe, 5 / safe * (5 / safe), _3PI_4, False, xp)
    return xp.where(x <= 5, small, big)


def _chbevl(coefs, y, xp):
    """Cephes' Chebyshev series: (b0, b2) of the Clenshaw recurrence; the value is (b0 - b2) / 2."""
    p = q = xp.zeros_like(y)
    b = xp.full_like(y, coefs[0])
    for c in coefs[1:]:
        p, q = q, b
        b = y * q - p + c
    return b, p


def bessel_k(order: int, scaled: bool, x, i_n, xp):
    """K0 / K1 (``scaled``: times e^x); ``i_n`` is I0 or I1 of the same namespace."""
    c = cephes.MODIFIED_BESSEL_K0 if order == 0 else cephes.MODIFIED_BESSEL_K1
    safe_small = xp.where(x > 0, x, xp.ones_like(x))
    a, p = _chbevl(c["A"], x * x - 2, xp)
    if order == 0:
        small = 0.5 * (a - p) - xp.log(0.5 * safe_small) * i_n(x)
    else:
        small = xp.log(0.5 * safe_small) * i_n(x) + 0.5 * (a - p) / safe_small
    if scaled:
        small = small * xp.exp(x)
    safe = xp.where(x <= 2, xp.full_like(x, 2.0), x)
    b, p = _chbevl(c["B"], 8 / safe - 2, xp)
    big = 0.5 * (b - p) / xp.sqrt(safe)
    if not scaled:
        big = xp.exp(-safe) * big
    out = xp.where(x <= 2, small, big)
    return xp.where(x == 0, xp.full_like(x, math.inf), _domain(x, out, xp))


def spherical_bessel_j0(x, xp):
    x2 = x * x
    series = 1 + x2 * (-1 / 6 + x2 * (1 / 120 + x2 * (-1 / 5040 + x2 * (1 / 362880 + x2 * (
        -1 / 39916800 + x2 * (1 / 6227020800))))))
    safe = xp.where(x == 0, xp.ones_like(x), x)
    out = xp.where(xp.abs(x) < 0.5, series, xp.sin(safe) / safe)
    return xp.where(xp.isinf(x), xp.zeros_like(x), out)


def trigamma(x, xp):
    """torch's trigamma: reflection below 1/2, six recurrence steps, then the asymptotic series."""
    neg = x < 0.5
    reflect = -(math.pi * math.pi) / (xp.sin(math.pi * x) * xp.sin(math.pi * x))
    x = xp.where(neg, 1 - x, x)
    result = xp.zeros_like(x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / x
    return xp.where(neg, -(reflect + result), result)


def bessel_i_scaled(order: int, x, xp, terms: int = 60):
    """e^-|x| I0(x) or e^-|x| I1(x): the power series below |x| = 30 (``terms`` terms reach float
    precision there), the Hankel expansion above."""
    a = xp.abs(x)
    small_a = xp.where(a < 30, a, xp.zeros_like(a))
    q = small_a * small_a / 4
    term = xp.ones_like(a) if order == 0 else small_a / 2
    total = term
    for k in range(1, terms):
        term = term * q / (k * (k + order))
        total = total + term
    small = total * xp.exp(-small_a)
    big_a = xp.where(a < 30, xp.full_like(a, 30.0), a)
    mu = 4.0 * order * order
    series, coef = xp.ones_like(a), 1.0
    for k in range(1, 8):
        coef *= -(mu - (2 * k - 1) ** 2) / (k * 8)
        series = series + coef / big_a ** k
    big = series / xp.sqrt(2 * math.pi * big_a)
    out = xp.where(a < 30, small, big)
    if order == 1:
        out = xp.where(x < 0, -out, out)
    return out
