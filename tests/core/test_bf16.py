"""bfloat16 and float16 end to end: a program's outputs go back in as its inputs (API, saved files,
the CLI's .npy/.npz), whatever the array type (ml_dtypes numpy, torch, JAX), with no detour
through another dtype; and the bf16 numerics that follow torch's CPU kernels."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtpu_export as tte


class Recurrent(torch.nn.Module):
    """A cell whose state goes out and comes back in, as a decoder's cache does."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.rec = torch.nn.Linear(16, 16)

    def forward(self, x, h):
        h = torch.tanh(self.inp(x) + self.rec(h))
        return h, h.sum(-1)


def _model(dtype):
    torch.manual_seed(0)
    return Recurrent().to(dtype).eval(), (torch.randn(2, 8, dtype=dtype), torch.zeros(2, 16, dtype=dtype))


def _eager_loop(model, x, h, steps):
    with torch.no_grad():
        for _ in range(steps):
            h, s = model(x, h)
    return h, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outputs_feed_back_as_inputs_through_the_api_and_a_saved_file(dtype, tmp_path):
    model, (x, h0) = _model(dtype)
    prog = tte.export(model, (x, h0), target="tpu", platforms=("cpu",))
    path = tmp_path / "cell.tpu"
    prog.save(path)
    want = np.dtype(ml_dtypes.bfloat16) if dtype == torch.bfloat16 else np.dtype(np.float16)
    ref_h, ref_s = _eager_loop(model, x, h0, 4)
    for runnable in (prog, tte.load(path)):
        h = h0
        for _ in range(4):  # torch in, numpy out, numpy back in
            h, s = runnable(x, h)
            assert h.dtype == want and s.dtype == want
        # bit-for-bit the eager loop, up to the rounding of the last ulp
        np.testing.assert_allclose(h.astype(np.float32), ref_h.float().numpy(), atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(s.astype(np.float32), ref_s.float().numpy(), atol=1e-1, rtol=2e-2)
        # JAX arrays and torch tensors of the same values give the same outputs
        xn = runnable(x, h)[0]
        xj = runnable(jnp.asarray(x.float().numpy()).astype(want), jnp.asarray(h))[0]
        xt = runnable(x, torch.from_numpy(h.view(np.int16)).view(dtype) if dtype == torch.bfloat16
                      else torch.from_numpy(h))[0]
        assert xj.dtype == want and xt.dtype == want
        np.testing.assert_array_equal(xj.view(np.uint16), xn.view(np.uint16))
        np.testing.assert_array_equal(xt.view(np.uint16), xn.view(np.uint16))


def test_float32_values_go_into_a_bf16_program_in_one_cast():
    """float32 (and float64) arrays are cast once to the program's bf16; bf16 arrays go into a float32
    program exactly (bf16 -> f32 loses nothing)."""
    model, (x, h) = _model(torch.bfloat16)
    prog = tte.export(model, (x, h), target="tpu", platforms=("cpu",))
    a = prog(x.float().numpy(), h.float().numpy().astype(np.float64))[0]
    b = prog(x, h)[0]
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    f32, (xf, hf) = _model(torch.float32)
    p32 = tte.export(f32, (xf, hf), target="tpu", platforms=("cpu",))
    xb = xf.numpy().astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(p32(xb, hf)[0], p32(xb.astype(np.float32), hf)[0])
    with pytest.raises(tte.InputError, match="expected int"):
        class Embed(torch.nn.Module):
            def forward(self, i):
                return i * 2
        pi = tte.export(Embed(), (torch.arange(4, dtype=torch.int32),), target="tpu", platforms=("cpu",))
        pi(np.zeros(4, ml_dtypes.bfloat16))


def test_the_edge_targets_take_bf16_arrays():
    """LiteRT computes a bf16 model in float32 (its kernels have no bf16): bf16 arrays go in, float32
    comes out, and that goes back in as well."""
    model, (x, h) = _model(torch.bfloat16)
    prog = tte.convert(model, (x, h))
    out = prog(x, h)[0]
    assert out.dtype == np.float32
    again = prog(x, out.astype(ml_dtypes.bfloat16))[0]
    assert again.shape == out.shape and np.isfinite(again).all()
    # ONNX Runtime's CPU provider has few bf16 kernels: a float32 model takes bf16 arrays (exactly)
    f32, (xf, hf) = _model(torch.float32)
    onnx = tte.export(f32, (xf, hf), target="onnx")
    xb = xf.numpy().astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(onnx(xb, hf)[0], onnx(xb.astype(np.float32), hf)[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cli_run_takes_its_own_bf16_outputs_back(cli, tmp_path, dtype):
    model, (x, h) = _model(getattr(torch, dtype))
    path = tmp_path / "cell.tpu"
    tte.export(model, (x, h), target="tpu", platforms=("cpu",)).save(path)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    xs, hs = tmp_path / "x.npy", tmp_path / "h.npy"
    np.save(xs, x.float().numpy().astype(np_dtype))
    np.save(hs, np.zeros((2, 16), np_dtype))
    out = tmp_path / "out1.npz"
    r = cli("run", path, "--inputs", xs, hs, "-o", out)
    assert r.returncode == 0, r.stderr
    with np.load(out) as z:
        h1 = z[z.files[0]]
    assert h1.dtype.itemsize == 2  # bf16 is stored as numpy's V2, read back as bfloat16
    # the saved state goes back in: .npy for x, the .npz member for h, and an .npz of both
    np.save(hs, h1.view(np_dtype))
    out2 = tmp_path / "out2.npz"
    r = cli("run", path, "--inputs", xs, hs, "-o", out2)
    assert r.returncode == 0, r.stderr
    both = tmp_path / "both.npz"
    np.savez(both, x=x.float().numpy().astype(np_dtype), h=h1.view(np_dtype))
    out3 = tmp_path / "out3.npz"
    r = cli("run", path, "--inputs", both, "-o", out3)
    assert r.returncode == 0, r.stderr
    with np.load(out2) as a, np.load(out3) as b:
        np.testing.assert_array_equal(a[a.files[0]].view(np.uint16), b[b.files[0]].view(np.uint16))
    ref_h, _ = _eager_loop(model, x, h, 2)
    np.testing.assert_allclose(_load_first(out2).view(np_dtype).astype(np.float32), ref_h.float().numpy(),
                               atol=2e-2, rtol=2e-2)
    # and random inputs of the artifact's own bf16 shapes
    r = cli("run", path)
    assert r.returncode == 0, r.stderr


def _load_first(path):
    with np.load(path) as z:
        return z[z.files[0]]


# ---- bf16 numerics as torch's CPU kernels compute them -------------------------------------------

def _tpu_cpu(module, *args):
    prog = tte.export(module, args, target="tpu", platforms=("cpu",))
    out = prog(*args)
    return out if isinstance(out, tuple) else (out,)


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_addbmm_rounds_each_batch_as_torch_does():
    """torch's CPU addbmm is a chain of addmm: the bf16 result is rounded after every batch."""
    torch.manual_seed(0)
    bias, b1, b2 = torch.randn(3, 5).bfloat16(), torch.randn(10, 3, 4).bfloat16() * 3, torch.randn(10, 4, 5).bfloat16() * 3
    for kw in ({}, {"beta": 0.5, "alpha": 2.0}, {"beta": 0}):
        fn = _Fn(lambda a, b, c, kw=kw: torch.addbmm(a, b, c, **kw))
        (out,) = _tpu_cpu(fn, bias, b1, b2)
        ref = fn(bias, b1, b2)
        np.testing.assert_array_equal(out.view(np.uint16), ref.view(torch.int16).numpy().view(np.uint16))


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_bf16_matches_torch_bit_for_bit(mode):
    torch.manual_seed(0)
    for pad in ("zeros", "border", "reflection"):
        for align in (False, True):
            x, g = torch.randn(2, 3, 6, 7).bfloat16(), (torch.rand(2, 5, 4, 2) * 2.4 - 1.2).bfloat16()
            fn = _Fn(lambda a, b, m=mode, p=pad, al=align: F.grid_sample(a, b, mode=m, padding_mode=p, align_corners=al))
            (out,) = _tpu_cpu(fn, x, g)
            ref = fn(x, g).view(torch.int16).numpy().view(np.uint16)
            np.testing.assert_array_equal(out.view(np.uint16), ref, err_msg=f"{mode} {pad} align_corners={align}")
            if mode != "bicubic":  # torch has no 3-D bicubic
                x3, g3 = torch.randn(1, 2, 4, 5, 6).bfloat16(), (torch.rand(1, 3, 4, 2, 3) * 2.4 - 1.2).bfloat16()
                (out,) = _tpu_cpu(fn, x3, g3)
                np.testing.assert_array_equal(out.view(np.uint16), fn(x3, g3).view(torch.int16).numpy().view(np.uint16))


def test_bf16_ops_that_had_no_rule():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5).bfloat16()
    renorm = _Fn(lambda a: torch.renorm(a, 2, 0, 1.0))
    np.testing.assert_allclose(_tpu_cpu(renorm, x)[0].astype(np.float32), renorm(x).float().numpy(), atol=2e-2)
    # computed in float32 and rounded once (torch's own bf16 CPU kernel returns garbage here: values of
    # 1e30 or NaN for 4x4 matrices of norm ~1, so float32 torch is the reference)
    a = (torch.randn(2, 4, 4) * 0.5).bfloat16()
    expm = _Fn(torch.linalg.matrix_exp)
    np.testing.assert_allclose(_tpu_cpu(expm, a)[0].astype(np.float32), expm(a.float()).numpy(), atol=2e-2, rtol=2e-2)


def test_sort_ties_are_any_order_torch_could_give():
    """torch's CPU sort is not stable past 16 elements: among equal bf16 values its index order is
    unspecified, so the comparison accepts any indices that pick the same values; a stable sort
    (stable=True) is ours exactly."""
    from torchtpu_export.optable import S, ties_in_any_order
    torch.manual_seed(0)
    x = (torch.randn(3, 40) * 2).round().bfloat16()  # many ties
    vals, idx = torch.sort(x, dim=-1)
    ours = _tpu_cpu(_Fn(lambda a: torch.sort(a, dim=-1)), x)
    assert not np.array_equal(ours[1], idx.numpy())  # torch's own order is not the stable one
    verdict = ties_in_any_order((1,), 1)(list(ours), [vals, idx.numpy()], S(x, -1, desc="ties"))
    assert verdict.ok, verdict
    wrong = ours[1].copy()
    wrong[:, [0, -1]] = wrong[:, [-1, 0]]
    assert not ties_in_any_order((1,), 1)([ours[0], wrong], [vals, idx.numpy()], S(x, -1, desc="ties")).ok
    stable = _tpu_cpu(_Fn(lambda a: torch.sort(a, dim=-1, stable=True)), x)
    np.testing.assert_array_equal(stable[1], torch.sort(x, dim=-1, stable=True).indices.numpy())


def test_opinfo_in_bfloat16_from_the_cli(cli):
    """`coverage --source opinfo --dtype bfloat16` runs OpInfo's bf16 samples on the xla column."""
    r = cli("coverage", "--source", "opinfo", "--dtype", "bfloat16", "--ops", "renorm", "--format", "json")
    assert r.returncode == 0, r.stderr
    import json
    report = json.loads(r.stdout)
    assert report["dtype"] == "bfloat16" and report["runtimes"] == ["xla"]
    assert report["ops"][0]["cells"]["xla"]["status"] == "pass"
    r = cli("coverage", "--dtype", "bfloat16", "--ops", "aten.add.Tensor")
    assert r.returncode == 2 and "--dtype applies to --source opinfo" in r.stderr
