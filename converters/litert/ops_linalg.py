"""Dense linear algebra on small static matrices, unrolled into TFLite arithmetic (composites).

TFLite has no factorisation ops, so each is written as the textbook algorithm with its loops over
the matrix size unrolled at trace time; data-dependent choices (pivot rows, rotation angles) are
tensors, applied with masks, gathers and matmuls. They follow LAPACK's conventions where torch
exposes them (1-based pivots, Householder reflectors with ``beta = -sign(alpha) * norm``), so
packed results match torch's. Eigen- and singular vectors come from cyclic Jacobi rotations
(round-robin order, a fixed number of sweeps that converges in float32 for these sizes); like
LAPACK's, each vector is defined up to its sign. Cost grows as n^3 per sweep in ops, so these suit
the small matrices of geometry and control code, not large solvers.
"""
from __future__ import annotations

import numpy as np
import torch

from torchtpu_export.errors import UnsupportedOpError

from .composite import composite
from .registry import not_supported

aten = torch.ops.aten


def _eye(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.eye(n, dtype=like.dtype).expand(like.shape[:-2] + (n, n))


def _set_col(a, j: int, col):
    mask = torch.arange(a.shape[-1]) == j
    return torch.where(mask, col.unsqueeze(-1), a)


def _set_row(a, i: int, row):
    mask = (torch.arange(a.shape[-2]) == i).unsqueeze(-1)
    return torch.where(mask, row.unsqueeze(-2), a)


def _safe(x):
    return torch.where(x == 0, torch.ones_like(x), x)


# ---- LU with partial pivoting (getrf) -----------------------------------------------------------

def _lu(a):
    """(LU packed, 1-based int32 pivots, row order) of ``a`` (..., m, n), LAPACK's getrf."""
    m, n = a.shape[-2], a.shape[-1]
    rows, cols = torch.arange(m), torch.arange(n)
    order = rows.expand(a.shape[:-1]).contiguous()
    pivots = []
    for k in range(min(m, n)):
        col = a[..., :, k]
        # the first row at or below k with the largest magnitude
        p = torch.argmax(torch.where(rows >= k, col.abs(), torch.full_like(col, -1.0)), -1, keepdim=True)
        swap = torch.where(rows == k, p, torch.where(rows == p, torch.full_like(p, k), rows))
        a = torch.gather(a, -2, swap.unsqueeze(-1).expand(a.shape))
        order = torch.gather(order, -1, swap)
        pivots.append(p + 1)
        pivot = a[..., k, k].unsqueeze(-1)
        below = rows > k
        l = torch.where(below, a[..., :, k] / _safe(pivot), torch.zeros_like(col))   # a zero pivot: no scaling
        right = torch.where(cols > k, a[..., k, :], torch.zeros_like(a[..., k, :]))
        a = a - l.unsqueeze(-1) * right.unsqueeze(-2)
        a = _set_col(a, k, torch.where(below, l, a[..., :, k]))
    piv = torch.cat(pivots, -1).to(torch.int32) if pivots else torch.zeros(a.shape[:-2] + (0,), dtype=torch.int32)
    return a, piv, order


def _unpack(lu, m: int, n: int):
    k = min(m, n)
    l = torch.tril(lu[..., :, :k], -1) + torch.eye(m, k, dtype=lu.dtype)
    u = torch.triu(lu[..., :k, :])
    return l, u


def _perm_matrix(order, dtype):
    # P with A = P L U: column i of P is e_{order[i]}
    m = order.shape[-1]
    return (torch.arange(m).reshape(m, 1) == order.unsqueeze(-2)).to(dtype)


def _order_from_pivots(pivots, m: int):
    order = torch.arange(m).expand(pivots.shape[:-1] + (m,)).contiguous()
    rows = torch.arange(m)
    for k in range(pivots.shape[-1]):
        p = (pivots[..., k:k + 1] - 1).to(torch.int64)
        swap = torch.where(rows == k, p, torch.where(rows == p, torch.full_like(p, k), rows))
        order = torch.gather(order, -1, swap)
    return order


def _permute_rows(b, order):
    return torch.gather(b, -2, order.unsqueeze(-1).expand(order.shape + (b.shape[-1],)))


def _trisolve(a, b, *, lower: bool, unit: bool = False):
    """X with a X = b, ``a`` triangular (..., n, n), ``b`` (..., n, k)."""
    n = a.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(batch + a.shape[-2:])
    b = b.expand(batch + b.shape[-2:])
    x = torch.zeros_like(b)
    for i in (range(n) if lower else reversed(range(n))):
        r = b[..., i, :] - (a[..., i, :].unsqueeze(-1) * x).sum(-2)
        if not unit:
            r = r / a[..., i, i].unsqueeze(-1)
        x = _set_row(x, i, r)
    return x


def _lu_solve(lu, order, b, adjoint: bool = False):
    n = lu.shape[-1]
    if not adjoint:   # A = P L U: L U x = P^T b
        y = _trisolve(lu, _permute_rows(b, order.expand(b.shape[:-2] + (n,)) if b.dim() > 2 else order),
                      lower=True, unit=True)
        return _trisolve(lu, y, lower=False)
    # A^T = U^T L^T P^T: U^T z = b, L^T w = z, x = P w
    z = _trisolve(lu.mT, b, lower=True)
    w = _trisolve(lu.mT, z, lower=False, unit=True)
    inverse = torch.argsort(order, -1)
    return _permute_rows(w, inverse.expand(w.shape[:-2] + (n,)) if w.dim() > 2 else inverse)


def _swaps(pivots):
    k = pivots.shape[-1]
    return (pivots.to(torch.int64) - 1 != torch.arange(k)).sum(-1)


@composite(aten.linalg_lu_factor_ex.default)
def lu_factor_ex(a, *, pivot=True, check_errors=False):
    if not pivot:
        raise UnsupportedOpError("aten.linalg_lu_factor_ex.default", target="litert",
                                 reason="LU without pivoting is not lowered (torch has it on CUDA only)")
    lu, piv, _ = _lu(a)
    return lu, piv, torch.zeros(a.shape[:-2], dtype=torch.int32)


@composite(aten.linalg_lu.default)
def linalg_lu(a, *, pivot=True):
    lu, _, order = _lu(a)
    l, u = _unpack(lu, a.shape[-2], a.shape[-1])
    return _perm_matrix(order, a.dtype), l, u


@composite(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2], lu.shape[-1]
    l, u = _unpack(lu, m, n)
    p = _perm_matrix(_order_from_pivots(pivots, m), lu.dtype)
    return p, l, u


@composite(aten.linalg_lu_solve.default)
def lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    n = lu.shape[-1]
    order = _order_from_pivots(pivots, n)
    if left:
        return _lu_solve(lu, order, b, adjoint)
    # X A = B  <=>  A^T X^T = B^T
    return _lu_solve(lu, order, b.mT, not adjoint).mT


def _vector_rhs(a, b) -> bool:
    return b.dim() == 1 or (b.dim() == a.dim() - 1 and b.shape == a.shape[:-1])


@composite(aten._linalg_solve_ex.default)
def solve_ex(a, b, *, left=True, check_errors=False):
    vector = _vector_rhs(a, b)
    rhs = b.unsqueeze(-1) if vector else b
    if not left:
        rhs = rhs.mT
    lu, piv, order = _lu(a if left else a.mT)
    x = _lu_solve(lu, order, rhs)
    if not left:
        x = x.mT
    if vector:
        x = x.squeeze(-1)
    return x, lu, piv, torch.zeros(a.shape[:-2], dtype=torch.int32)


@composite(aten.linalg_inv_ex.default)
def inv_ex(a, *, check_errors=False):
    lu, _, order = _lu(a)
    return _lu_solve(lu, order, _eye(a.shape[-1], a)), torch.zeros(a.shape[:-2], dtype=torch.int32)


@composite(aten._linalg_det.default)
def det(a):
    lu, piv, _ = _lu(a)
    d = torch.diagonal(lu, 0, -2, -1).prod(-1)
    sign = 1.0 - 2.0 * torch.remainder(_swaps(piv), 2).to(a.dtype)
    return d * sign, lu, piv


@composite(aten._linalg_slogdet.default)
def slogdet(a):
    lu, piv, _ = _lu(a)
    diag = torch.diagonal(lu, 0, -2, -1)
    sign = (1.0 - 2.0 * torch.remainder(_swaps(piv), 2).to(a.dtype)) * torch.sign(diag).prod(-1)
    return sign, torch.log(diag.abs()).sum(-1), lu, piv


@composite(aten.linalg_solve_triangular.default)
def solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    if left:
        return _trisolve(a, b, lower=not upper, unit=unitriangular)
    return _trisolve(a.mT, b.mT, lower=upper, unit=unitriangular).mT


@composite(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    coeff = a.mT if transpose else a
    lower = (not upper) != transpose
    return _trisolve(coeff, b, lower=lower, unit=unitriangular), a.clone()


# ---- Cholesky ---------------------------------------------------------------------------------

def _cholesky(a):
    n = a.shape[-1]
    rows = torch.arange(n)
    l = torch.zeros_like(a)
    for j in range(n):
        c = a[..., :, j] - (l * l[..., j:j + 1, :]).sum(-1)
        d = torch.sqrt(c[..., j:j + 1])
        col = torch.where(rows > j, c / d, torch.where(rows == j, d, torch.zeros_like(c)))
        l = _set_col(l, j, col)
    return l


@composite(aten.linalg_cholesky_ex.default)
def cholesky_ex(a, *, upper=False, check_errors=False):
    l = _cholesky(a)
    return (l.mT if upper else l), torch.zeros(a.shape[:-2], dtype=torch.int32)


@composite(aten.cholesky.default)
def cholesky(a, upper=False):
    l = _cholesky(a)
    return l.mT if upper else l


def _cholesky_solve(l, b, upper: bool):
    if upper:   # A = U^T U
        return _trisolve(l, _trisolve(l.mT, b, lower=True), lower=False)
    return _trisolve(l.mT, _trisolve(l, b, lower=True), lower=False)


@composite(aten.cholesky_solve.default)
def cholesky_solve(b, l, upper=False):
    return _cholesky_solve(l, b, upper)


@composite(aten.cholesky_inverse.default)
def cholesky_inverse(l, upper=False):
    return _cholesky_solve(l, _eye(l.shape[-1], l), upper)


# ---- Householder QR (geqrf, orgqr, ormqr) -------------------------------------------------------

def _reflector(a, j: int):
    """LAPACK's larfg on column j of ``a`` below row j: (v with v[j] = 1, tau, beta)."""
    m = a.shape[-2]
    rows = torch.arange(m)
    x = a[..., :, j]
    alpha = x[..., j:j + 1]
    tail = torch.where(rows > j, x, torch.zeros_like(x))
    xnorm = torch.linalg.vector_norm(tail, dim=-1, keepdim=True)
    norm = torch.sqrt(alpha * alpha + xnorm * xnorm)
    beta = -torch.copysign(norm, alpha)
    trivial = xnorm == 0
    tau = torch.where(trivial, torch.zeros_like(alpha), (beta - alpha) / _safe(beta))
    scale = torch.where(trivial, torch.zeros_like(alpha), 1.0 / _safe(alpha - beta))
    v = torch.where(rows == j, torch.ones_like(x), tail * scale)
    return v, tau, torch.where(trivial, alpha, beta)


def _apply_reflector(c, v, tau, *, left: bool = True):
    """(I - tau v v^T) c (left) or c (I - tau v v^T)."""
    if left:
        w = (v.unsqueeze(-1) * c).sum(-2, keepdim=True)          # v^T c
        return c - tau.unsqueeze(-1) * v.unsqueeze(-1) * w
    w = (c * v.unsqueeze(-2)).sum(-1, keepdim=True)               # c v
    return c - tau.unsqueeze(-1) * w * v.unsqueeze(-2)


def _geqrf(a):
    m, n = a.shape[-2], a.shape[-1]
    rows, cols = torch.arange(m), torch.arange(n)
    taus = []
    for j in range(min(m, n)):
        v, tau, beta = _reflector(a, j)
        updated = _apply_reflector(a, v, tau)
        a = torch.where(cols > j, updated, a)
        a = _set_col(a, j, torch.where(rows == j, beta.expand(v.shape), torch.where(rows > j, v, a[..., :, j])))
        taus.append(tau)
    tau = torch.cat(taus, -1) if taus else a.new_zeros(a.shape[:-2] + (0,))
    return a, tau


def _reflectors(a, tau):
    """The Householder vectors stored below the diagonal of ``a``, one per tau."""
    rows = torch.arange(a.shape[-2])
    out = []
    for j in range(tau.shape[-1]):
        x = a[..., :, j]
        v = torch.where(rows == j, torch.ones_like(x), torch.where(rows > j, x, torch.zeros_like(x)))
        out.append((v, tau[..., j:j + 1]))
    return out


def _q(a, tau, ncols: int):
    m = a.shape[-2]
    q = torch.eye(m, ncols, dtype=a.dtype).expand(a.shape[:-2] + (m, ncols))
    for v, t in reversed(_reflectors(a, tau)):
        q = _apply_reflector(q, v, t)
    return q


@composite(aten.geqrf.default)
def geqrf(a):
    return _geqrf(a)


@composite(aten.linalg_qr.default)
def linalg_qr(a, mode="reduced"):
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    packed, tau = _geqrf(a)
    if mode == "r":
        return a.new_zeros((0,)), torch.triu(packed[..., :k, :])
    if mode == "complete":
        return _q(packed, tau, m), torch.triu(packed)
    return _q(packed, tau, k), torch.triu(packed[..., :k, :])


@composite(aten.linalg_householder_product.default)
def householder_product(a, tau):
    return _q(a, tau, a.shape[-1])


@composite(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    refl = _reflectors(a, tau)
    # Q = H_0 H_1 ... H_{k-1}; each H is symmetric
    forward = left == transpose
    for v, t in (refl if forward else reversed(refl)):
        c = _apply_reflector(c, v, t, left=left)
    return c


# ---- symmetric eigenproblem and SVD: cyclic Jacobi -------------------------------------------------

def _rounds(n: int):
    """Round-robin pairings of 0..n-1: each round's pairs are disjoint, every pair meets once a sweep."""
    m = n + n % 2
    players = list(range(m))
    out = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        out.append([(min(p, q), max(p, q)) for p, q in pairs if p < n and q < n])
        players = [players[0], players[-1]] + players[1:-1]
    return out


def _sweeps(n: int) -> int:
    return 8 + n // 8


def _rotation(g, pairs, n: int):
    """The Jacobi rotation J of disjoint ``pairs`` that zeroes g[p, q] in J^T g J (g symmetric)."""
    flat = g.reshape(g.shape[:-2] + (n * n,))
    pp = torch.tensor([p * n + p for p, _ in pairs])
    qq = torch.tensor([q * n + q for _, q in pairs])
    pq = torch.tensor([p * n + q for p, q in pairs])
    app, aqq, apq = flat.index_select(-1, pp), flat.index_select(-1, qq), flat.index_select(-1, pq)
    theta = (aqq - app) / (2.0 * _safe(apq))
    sign = torch.where(theta >= 0, torch.ones_like(theta), -torch.ones_like(theta))
    t = sign / (theta.abs() + torch.sqrt(theta * theta + 1.0))
    t = torch.where(apq == 0, torch.zeros_like(t), t)
    c = 1.0 / torch.sqrt(t * t + 1.0)
    s = t * c
    basis = np.zeros((2 * len(pairs), n * n), np.float32)
    for k, (p, q) in enumerate(pairs):
        basis[k, p * n + p] = basis[k, q * n + q] = 1.0
        basis[len(pairs) + k, p * n + q] = 1.0
        basis[len(pairs) + k, q * n + p] = -1.0
    coef = torch.cat([c - 1.0, s], -1)
    j = torch.matmul(coef, torch.from_numpy(basis).to(g.dtype)).reshape(g.shape[:-2] + (n, n))
    return j + torch.eye(n, dtype=g.dtype)


def _eigh(a, vectors: bool = True):
    n = a.shape[-1]
    v = _eye(n, a)
    for _ in range(_sweeps(n)):
        for pairs in _rounds(n):
            j = _rotation(a, pairs, n)
            a = torch.matmul(torch.matmul(j.mT, a), j)
            if vectors:
                v = torch.matmul(v, j)
    w, order = torch.sort(torch.diagonal(a, 0, -2, -1), -1)
    if vectors:
        v = torch.gather(v, -1, order.unsqueeze(-2).expand(v.shape))
    return w, v


def _symmetric(a, uplo: str):
    if uplo.upper() == "L":
        low = torch.tril(a)
        return low + torch.tril(a, -1).mT
    up = torch.triu(a)
    return up + torch.triu(a, 1).mT


@composite(aten._linalg_eigh.default)
def linalg_eigh(a, UPLO="L", compute_v=True):
    w, v = _eigh(_symmetric(a, UPLO), compute_v)
    return w, (v if compute_v else a.new_zeros((0,)))


def _svd(a, compute_uv: bool = True):
    """Reduced SVD by one-sided Jacobi: (U (m, k), S (k) descending, V (n, k))."""
    m, n = a.shape[-2], a.shape[-1]
    if m < n:
        u, s, v = _svd(a.mT, compute_uv)
        return v, s, u
    u, v = a, _eye(n, a)
    for _ in range(_sweeps(n)):
        for pairs in _rounds(n):
            j = _rotation(torch.matmul(u.mT, u), pairs, n)
            u = torch.matmul(u, j)
            v = torch.matmul(v, j)
    s = torch.linalg.vector_norm(u, dim=-2)
    s, order = torch.sort(s, -1, descending=True)
    if not compute_uv:
        return None, s, None
    u = torch.gather(u, -1, order.unsqueeze(-2).expand(u.shape))
    v = torch.gather(v, -1, order.unsqueeze(-2).expand(v.shape))
    u = torch.where(s.unsqueeze(-2) == 0, torch.zeros_like(u), u / _safe(s).unsqueeze(-2))
    return u, s, v


@composite(aten._linalg_svd.default)
def linalg_svd(a, full_matrices=False, compute_uv=True, driver=None):
    m, n = a.shape[-2], a.shape[-1]
    if compute_uv and full_matrices and m != n and a.numel():
        raise UnsupportedOpError("aten._linalg_svd.default", target="litert",
                                 reason="full_matrices=True of a non-square matrix is not lowered; "
                                        "use full_matrices=False")
    u, s, v = _svd(a, compute_uv)
    if not compute_uv:
        return a.new_zeros((0,)), s, a.new_zeros((0,))
    return u, s, v.mT


@composite(aten.linalg_pinv.atol_rtol_tensor, aten.linalg_pinv.atol_rtol_float)
def linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    m, n = a.shape[-2], a.shape[-1]
    if hermitian:
        w, v = _eigh(_symmetric(a, "L"))
        mag = w.abs()
    else:
        u, s, v = _svd(a)
        mag = s
    biggest = mag.amax(-1, keepdim=True) if mag.shape[-1] else mag.new_zeros(mag.shape[:-1] + (1,))
    if rtol is None:
        rtol = 0.0 if atol is not None else float(torch.finfo(a.dtype).eps) * max(m, n)
    atol = 0.0 if atol is None else atol
    atol = atol.unsqueeze(-1) if isinstance(atol, torch.Tensor) and atol.dim() else atol
    rtol = rtol.unsqueeze(-1) if isinstance(rtol, torch.Tensor) and rtol.dim() else rtol
    cutoff = torch.maximum(torch.as_tensor(atol, dtype=a.dtype) + torch.zeros_like(biggest), rtol * biggest)
    keep = mag > cutoff
    if hermitian:
        inv = torch.where(keep, 1.0 / _safe(w), torch.zeros_like(w))
        return torch.matmul(v * inv.unsqueeze(-2), v.mT)
    inv = torch.where(keep, 1.0 / _safe(s), torch.zeros_like(s))
    return torch.matmul(v * inv.unsqueeze(-2), u.mT)


@composite(aten.linalg_matrix_exp.default)
def matrix_exp(a):
    # scaling and squaring: a / 2^s has a 1-norm at most 1/2, a degree-12 Taylor polynomial, s squarings
    n = a.shape[-1]
    norm = a.abs().sum(-2).amax(-1)
    s = torch.clamp(torch.ceil(torch.log2(_safe(norm) * 2.0)), min=0.0, max=40.0)
    s = torch.where(norm == 0, torch.zeros_like(s), s)
    x = a / torch.pow(2.0, s).unsqueeze(-1).unsqueeze(-1)
    eye = _eye(n, a)
    term, out = eye, eye
    for k in range(1, 13):
        term = torch.matmul(term, x) / k
        out = out + term
    for i in range(40):
        out = torch.where((s > i).unsqueeze(-1).unsqueeze(-1), torch.matmul(out, out), out)
    return out


not_supported("the general (non-symmetric) eigenproblem has complex results that TFLite kernels cannot "
              "compute with (TFLite's complex64 has no ADD)", aten.linalg_eig.default)
not_supported("no TFLite lowering (Bunch-Kaufman pivoting); solve with linalg.solve or cholesky",
              aten.linalg_ldl_factor_ex.default, aten.linalg_ldl_solve.default)

