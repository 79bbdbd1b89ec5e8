"""Lowerings of linear algebra, sort-based reductions, scans and special functions, against torch eager."""
import numpy as np
import torch

import torchtpu_export as tte


def _check(module, args, rtol=1e-5):
    prog = tte.export(module, args, target="tpu", platforms=("cpu",))
    got = prog(*args)
    want = module(*args)
    assert len(got) == len(want)
    for i, (o, w) in enumerate(zip(got, want)):
        w = w.numpy()
        assert o.shape == w.shape and o.dtype == w.dtype, (i, o.shape, w.shape, o.dtype, w.dtype)
        scale = max(float(np.max(np.abs(w))), 1.0) if w.size else 1.0
        np.testing.assert_allclose(o, w, rtol=0, atol=rtol * scale, err_msg=f"output {i}")


class Linalg(torch.nn.Module):
    def forward(self, a, b):
        spd = a @ a.mT + 4 * torch.eye(a.shape[-1])
        L, info = torch.linalg.cholesky_ex(spd)
        lu, piv, lu_info = torch.linalg.lu_factor_ex(a)
        sign, logabsdet = torch.linalg.slogdet(a)
        return (L, info, torch.cholesky_solve(b, L), torch.linalg.svdvals(a), torch.linalg.eigvalsh(spd),
                lu, piv, lu_info, torch.linalg.lu_solve(lu, piv, b), sign, logabsdet,
                torch.linalg.solve_triangular(L, b, upper=False), torch.linalg.pinv(a), torch.linalg.det(a))


def test_factorizations_and_solves_match_torch():
    g = torch.Generator().manual_seed(0)
    _check(Linalg(), (torch.randn(2, 4, 4, generator=g), torch.randn(2, 4, 3, generator=g)))


def test_cholesky_ex_reports_the_first_failing_minor():
    class Chol(torch.nn.Module):
        def forward(self, a):
            return torch.linalg.cholesky_ex(a).info,
    a = torch.tensor([[4.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # second minor is singular
    prog = tte.export(Chol(), (torch.eye(3),), target="tpu", platforms=("cpu",))
    assert int(prog(a)[0]) == int(torch.linalg.cholesky_ex(a).info) == 2
    assert int(prog(torch.eye(3))[0]) == 0


class Reductions(torch.nn.Module):
    def forward(self, x, i, j):
        med = torch.median(x, dim=1)
        kth = torch.kthvalue(x, 2, dim=0)
        cmax = torch.cummax(x, dim=1)
        mode = torch.mode(i, dim=1)
        return (torch.median(x), med.values, med.indices, torch.nanmedian(x), kth.values, kth.indices,
                cmax.values, cmax.indices, mode.values, mode.indices, torch.gcd(i, j), torch.lcm(i, j),
                torch.logcumsumexp(x, 0), torch.histc(x, bins=5), x.max(), torch.fmax(x, x.flip(0)))


def test_sort_based_reductions_and_scans_match_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 6, generator=g)
    x[1, 2] = x[1, 4]  # a tie for cummax's index rule
    i = torch.randint(-6, 6, (4, 7), generator=g)
    j = torch.randint(-9, 9, (4, 7), generator=g)
    _check(Reductions(), (x, i, j))


class Special(torch.nn.Module):
    def forward(self, x, n):
        return (torch.special.i1e(x), torch.special.erfcx(x), torch.special.ndtri(torch.sigmoid(x)),
                torch.special.chebyshev_polynomial_t(x.tanh(), n), torch.special.hermite_polynomial_h(x, n),
                torch.special.legendre_polynomial_p(x.tanh(), n), torch.polygamma(2, x), torch.special.zeta(x.abs() + 1, 2.0),
                torch.igamma(x.abs() + 0.1, x.abs()), torch.special.bessel_j0(3 * x), torch.special.bessel_y1(x.abs() * 4),
                torch.special.modified_bessel_k0(x.abs()))


def test_special_functions_match_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g) * 2
    n = torch.randint(0, 12, (3, 5), generator=g).float()
    _check(Special(), (x, n))
