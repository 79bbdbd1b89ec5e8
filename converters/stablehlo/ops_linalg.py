"""Linear algebra: factorizations (Cholesky, LU, QR, SVD, eigen), solves, inverses, matrix_exp.

These lower to JAX's LAPACK-backed primitives (``lax.linalg``, ``jnp.linalg``). Where torch returns
a LAPACK-style ``info`` or 1-based ``pivots``, the rule computes them the way torch documents them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import torch

from .registry import lowers

aten = torch.ops.aten


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x)) if jnp.iscomplexobj(x) else _mT(x)


def _broadcast_batch(a, b):
    """Broadcasts the batch dims (all but the last two) of two matrices against each other."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _tri_solve(a, b, *, lower, left=True, transpose=False, unit=False):
    """Solves op(a) x = b (left) or x op(a) = b, op transposing (conjugating complex) a when asked."""
    a, b = _broadcast_batch(a, b)
    if 0 in a.shape or 0 in b.shape:
        return jnp.zeros(b.shape, jnp.result_type(a, b))
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=transpose,
                                       conjugate_a=transpose and jnp.iscomplexobj(a), unit_diagonal=unit)


def _leading_failure(ok_per_minor):
    """torch's ``info``: 1-based index of the first failing entry along the last axis, 0 if none fails."""
    if 0 in ok_per_minor.shape:
        return jnp.zeros(ok_per_minor.shape[:-1], jnp.int32)
    bad = jnp.logical_not(ok_per_minor)
    first = jnp.argmax(bad, axis=-1).astype(jnp.int32) + 1
    return jnp.where(jnp.any(bad, axis=-1), first, 0).astype(jnp.int32)


def _cholesky(ctx, x, upper):
    L = jnp.linalg.cholesky(x, upper=False, symmetrize_input=False) if x.shape[-1] else x
    return _mH(L) if upper else L


@lowers(aten.cholesky.default)
def cholesky(ctx, x, upper=False):
    return _cholesky(ctx, x, upper)


@lowers(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(ctx, x, *, upper=False, check_errors=False):
    L = _cholesky(ctx, x, upper)
    # info = order of the first leading minor that is not positive-definite (Sylvester's criterion)
    n = x.shape[-1]
    minors = [jnp.linalg.det(x[..., :k, :k]).real > 0 for k in range(1, n + 1)]
    ok = jnp.stack(minors, axis=-1) if minors else jnp.ones(x.shape[:-2] + (0,), jnp.bool_)
    return L, _leading_failure(ok)


@lowers(aten.cholesky_inverse.default)
def cholesky_inverse(ctx, L, upper=False):
    eye = jnp.broadcast_to(jnp.eye(L.shape[-1], dtype=L.dtype), L.shape)
    return cholesky_solve(ctx, eye, L, upper)


@lowers(aten.cholesky_solve.default)
def cholesky_solve(ctx, b, L, upper=False):
    # A = L L^H (or U^H U): solve the two triangular systems
    if upper:
        y = _tri_solve(L, b, lower=False, transpose=True)
        return _tri_solve(L, y, lower=False)
    y = _tri_solve(L, b, lower=True)
    return _tri_solve(L, y, lower=True, transpose=True)


@lowers(aten._linalg_svd.default)
def linalg_svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    if not compute_uv:
        s = jnp.linalg.svd(a, compute_uv=False)
        return jnp.zeros(ctx.out_shape(0), a.dtype), s, jnp.zeros(ctx.out_shape(2), a.dtype)
    return tuple(jnp.linalg.svd(a, full_matrices=full_matrices, compute_uv=True))


@lowers(aten._linalg_eigh.default)
def linalg_eigh(ctx, a, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    return (w, v) if compute_v else (w, jnp.zeros(ctx.out_shape(1), a.dtype))


@lowers(aten.linalg_eig.default)
def linalg_eig(ctx, a):
    w, v = jnp.linalg.eig(a)
    return w.astype(ctx.out_dtype(0)), v.astype(ctx.out_dtype(1))


@lowers(aten.linalg_householder_product.default)
def linalg_householder_product(ctx, a, tau):
    return lax.linalg.householder_product(a, tau)


def _lu(a):
    """(LU, 0-based pivots, permutation) of a batch of matrices, as LAPACK's getrf gives them."""
    return lax.linalg.lu(a)


def _lu_info(lu):
    k = min(lu.shape[-2:])
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k]
    return _leading_failure(diag != 0)


@lowers(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    if not pivot:
        raise NotImplementedError("linalg_lu_factor_ex with pivot=False (torch supports it on CUDA only)")
    lu, piv, _ = _lu(a)
    return lu, (piv + 1).astype(jnp.int32), _lu_info(lu)


def _lu_solve(lu, pivots, b, adjoint):
    """Solves A x = b (or A^H x = b) for A given as getrf's LU and 1-based pivots."""
    n = lu.shape[-1]
    perm = lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, n)
    lu, b = _broadcast_batch(lu, b)
    perm = jnp.broadcast_to(perm, lu.shape[:-2] + (n,))
    # A[perm] = L U
    if not adjoint:
        pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        y = _tri_solve(lu, pb, lower=True, unit=True)
        return _tri_solve(lu, y, lower=False)
    # A^H = U^H L^H P: solve U^H y = b, L^H z = y, then x[perm] = z
    y = _tri_solve(lu, b, lower=False, transpose=True)
    z = _tri_solve(lu, y, lower=True, unit=True, transpose=True)
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inv[..., :, None], axis=-2)


@lowers(aten.linalg_lu_solve.default)
def linalg_lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    if left:
        return _lu_solve(lu, pivots, b, adjoint)
    # X A = B  <=>  A^H X^H = B^H
    return _mH(_lu_solve(lu, pivots, _mH(b), not adjoint))


@lowers(aten.linalg_inv_ex.default)
def linalg_inv_ex(ctx, a, *, check_errors=False):
    lu, piv, _ = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, piv + 1, eye, False), _lu_info(lu)


@lowers(aten._linalg_slogdet.default)
def linalg_slogdet(ctx, a):
    lu, piv, _ = _lu(a)
    n = a.shape[-1]
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(piv != jnp.arange(n, dtype=piv.dtype), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(a.dtype)
    absdiag = jnp.abs(diag)
    logabsdet = jnp.sum(jnp.log(absdiag), axis=-1)
    if jnp.iscomplexobj(a):
        sign = parity * jnp.prod(diag / absdiag.astype(a.dtype), axis=-1)
    else:
        sign = parity * jnp.prod(jnp.sign(diag), axis=-1)
    sign = jnp.where(jnp.any(diag == 0, axis=-1), jnp.zeros_like(sign), sign)
    return sign, logabsdet, lu, (piv + 1).astype(jnp.int32)


@lowers(aten.linalg_qr.default)
def linalg_qr(ctx, a, mode="reduced"):
    if mode == "r":
        return jnp.zeros(ctx.out_shape(0), a.dtype), jnp.linalg.qr(a, mode="r")
    q, r = jnp.linalg.qr(a, mode=mode)
    return q, r


@lowers(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    return _tri_solve(a, b, lower=not upper, left=left, unit=unitriangular)


@lowers(aten.triangular_solve.default)
def triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    x = _tri_solve(a, b, lower=not upper, transpose=transpose, unit=unitriangular)
    return x, jnp.broadcast_to(a, ctx.out_shape(1))


@lowers(aten.linalg_pinv.atol_rtol_tensor)
def linalg_pinv(ctx, a, *, atol=None, rtol=None, hermitian=False):
    m, n = a.shape[-2:]
    real = jnp.finfo(a.dtype).dtype
    if rtol is None:
        # torch: rtol defaults to eps * max(m, n), or to 0 when a positive atol is given
        default = jnp.asarray(jnp.finfo(real).eps * max(m, n), real)
        rtol = default if atol is None else jnp.where(jnp.asarray(atol) > 0, jnp.zeros((), real), default)
    atol = jnp.zeros((), real) if atol is None else jnp.asarray(atol, real)
    rtol = jnp.asarray(rtol, real)
    if 0 in a.shape:
        return jnp.zeros(ctx.out_shape(), a.dtype)
    if hermitian:
        w, v = jnp.linalg.eigh(a, symmetrize_input=False)
        s = jnp.abs(w)
        tol = jnp.maximum(atol[..., None], rtol[..., None] * jnp.max(s, axis=-1, keepdims=True))
        w_inv = jnp.where(s > tol, 1 / w, 0).astype(a.dtype)
        return (v * w_inv[..., None, :]) @ _mH(v)
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    smax = jnp.max(s, axis=-1, keepdims=True)
    tol = jnp.maximum(atol[..., None], rtol[..., None] * smax)
    s_inv = jnp.where(s > tol, 1 / s, 0).astype(a.dtype)
    return (_mH(vh) * s_inv[..., None, :]) @ _mH(u)


@lowers(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(ctx, a):
    if a.shape[-1] == 0:
        return a
    flat = a.reshape((-1,) + a.shape[-2:])
    if flat.dtype in (jnp.bfloat16, jnp.float16):  # JAX's expm takes float32/64: computed there, rounded once
        return jax.vmap(jax.scipy.linalg.expm)(flat.astype(jnp.float32)).astype(a.dtype).reshape(a.shape)
    return jax.vmap(jax.scipy.linalg.expm)(flat).reshape(a.shape)


@lowers(aten._linalg_det.default)
def linalg_det(ctx, a):
    lu, piv, _ = _lu(a)
    n = a.shape[-1]
    swaps = jnp.sum(piv != jnp.arange(n, dtype=piv.dtype), axis=-1)
    parity = jnp.where(swaps % 2 == 1, -1, 1).astype(a.dtype)
    det = parity * jnp.prod(jnp.diagonal(lu, axis1=-2, axis2=-1), axis=-1)
    return det, lu, (piv + 1).astype(jnp.int32)


def _unpack(lu, perm, m, n):
    """P, L, U of A = P L U from getrf's packed LU and the row permutation (A[perm] = L U)."""
    k = min(m, n)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    U = jnp.triu(lu[..., :k, :])
    # P[perm[i], i] = 1
    P = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2)
    return P, L, U


@lowers(aten.linalg_lu.default)
def linalg_lu(ctx, a, *, pivot=True):
    if not pivot:
        raise NotImplementedError("linalg_lu with pivot=False (torch supports it on CUDA only)")
    m, n = a.shape[-2:]
    lu, _, perm = _lu(a)
    return _unpack(lu, perm, m, n)


@lowers(aten.lu_unpack.default)
def lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    perm = lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)
    P, L, U = _unpack(lu, perm, m, n)
    if not unpack_data:
        L, U = jnp.zeros(ctx.out_shape(1), lu.dtype), jnp.zeros(ctx.out_shape(2), lu.dtype)
    if not unpack_pivots:
        P = jnp.zeros(ctx.out_shape(0), lu.dtype)
    return P, L, U


@lowers(aten._linalg_solve_ex.default)
def linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    lu, piv, _ = _lu(a)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    bm = b[..., None] if vector else b
    if left:
        x = _lu_solve(lu, piv + 1, bm, False)
    else:
        x = _mH(_lu_solve(lu, piv + 1, _mH(bm), True))
    x = x[..., 0] if vector else x
    return x, lu, (piv + 1).astype(jnp.int32), _lu_info(lu)


@lowers(aten.geqrf.default)
def geqrf(ctx, a):
    # jax has the geqrf primitive (LAPACK's, like torch's) but does not re-export it in jax.lax.linalg
    from jax._src.lax.linalg import geqrf as _geqrf
    return _geqrf(a)


@lowers(aten.ormqr.default)
def ormqr(ctx, a, tau, c, left=True, transpose=False):
    # the full m x m Q of geqrf's reflectors: zero-padded columns and taus are identity reflectors
    m, k = a.shape[-2], tau.shape[-1]
    a = a[..., :, :k]
    a = jnp.concatenate([a, jnp.zeros(a.shape[:-1] + (m - k,), a.dtype)], axis=-1)
    tau = jnp.concatenate([tau, jnp.zeros(tau.shape[:-1] + (m - k,), tau.dtype)], axis=-1)
    q = lax.linalg.householder_product(a, tau)
    if transpose:
        q = _mH(q)
    return q @ c if left else c @ q
