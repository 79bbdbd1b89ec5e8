"""Every Pallas kernel in interpret mode against torch eager, over a small grid of shapes.

The grid covers exact fits, padding (q rows, kv length, head dim, matmul dims,
partial row blocks), GQA/MQA, causal, boolean and additive masks (with fully
masked rows), float32 and bfloat16, head dims 64 and 128; and the shapes each
kernel's plan refuses, with the reason it gives.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

jnp = pytest.importorskip("jax.numpy")
pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

from torchtpu_export.converters.stablehlo.pallas import Unfit  # noqa: E402
from torchtpu_export.converters.stablehlo.pallas.attention import flash_attention, plan_attention  # noqa: E402
from torchtpu_export.converters.stablehlo.pallas.int8_matmul import int8_matmul, plan_int8_matmul  # noqa: E402
from torchtpu_export.converters.stablehlo.pallas.norm import layer_norm, plan_norm, rms_norm  # noqa: E402
from torchtpu_export.converters.stablehlo.pallas.splash import plan_splash, splash_attention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _j(t: torch.Tensor):
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def _close(got, ref: torch.Tensor, dtype):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    ref = ref.float().numpy()
    assert got.shape == ref.shape
    assert np.isfinite(got).all() == np.isfinite(ref).all()
    scale = max(np.abs(ref).max(), 1e-6)
    err = np.abs(got - ref).max() / scale
    assert err <= TOL[dtype], f"relative error {err:.2e}"


def _qkv(b, h, hkv, lq, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in ((b, h, lq, d), (b, hkv, s, d), (b, hkv, s, d)))


# (b, h, hkv, q_len, kv_len, head_dim, dtype, causal, mask, interpret): mask is None, "bool" (b,1,1,s) padding
# mask with one fully masked row set, or "float" (b,h,q,s) additive with -inf entries
ATTENTION_CASES = [
    pytest.param(1, 2, 2, 128, 128, 64, torch.float32, False, None, True, id="mha-exact-d64"),
    pytest.param(1, 4, 2, 384, 384, 128, torch.float32, True, None, True, id="gqa-causal-multiblock-d128"),
    pytest.param(1, 2, 1, 250, 250, 64, torch.bfloat16, True, None, True, id="mqa-causal-padded-bf16"),
    pytest.param(2, 4, 2, 1, 256, 128, torch.float32, False, "bool", True, id="gqa-decode-boolmask"),
    pytest.param(1, 2, 2, 100, 300, 64, torch.bfloat16, False, "float", "tpu", id="mha-floatmask-padded-bf16"),
    pytest.param(1, 2, 1, 136, 128, 32, torch.float32, True, None, True, id="headdim32-padded"),
    # decode-shaped: the q heads of a kv head fold into the rows of one block
    pytest.param(1, 8, 2, 4, 640, 128, torch.float32, True, None, True, id="decode-gqa-causal-4tokens"),
    pytest.param(2, 8, 2, 3, 300, 64, torch.bfloat16, False, "float", True, id="decode-gqa-perhead-floatmask-bf16"),
    pytest.param(1, 4, 1, 1, 1024, 128, torch.float32, False, "bool", True, id="decode-mqa-boolmask"),
    pytest.param(2, 4, 4, 2, 256, 128, torch.float32, False, "float", True, id="decode-mha-floatmask"),
]


@pytest.mark.parametrize("b,h,hkv,lq,s,d,dtype,causal,mask,interpret", ATTENTION_CASES)
def test_flash_attention_matches_torch(b, h, hkv, lq, s, d, dtype, causal, mask, interpret):
    q, k, v = _qkv(b, h, hkv, lq, s, d, dtype)
    m = None
    if mask == "bool":
        m = torch.ones(b, 1, 1, s, dtype=torch.bool)
        m[-1, ..., s // 3:] = False
    elif mask == "float":
        g = torch.Generator().manual_seed(1)
        m = torch.randn(b, h, lq, s, generator=g).to(dtype)
        m[..., ::3] = float("-inf")
        m[0, 0, min(5, lq - 1), :] = float("-inf")  # a row with every key masked: torch gives 0
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=h != hkv)
    plan = plan_attention(q.shape, k.shape, v.shape, _j(q).dtype, None if m is None else m.shape, force=True)
    assert not isinstance(plan, Unfit), plan
    got = flash_attention(_j(q), _j(k), _j(v), None if m is None else _j(m) if m.dtype != torch.bool
                          else jnp.asarray(m.numpy()), causal=causal, plan=plan,
                          interpret=pltpu.InterpretParams() if interpret == "tpu" else True)
    _close(got, ref, dtype)


@pytest.mark.parametrize("b,h,hkv,lq,s,d,dtype,causal,scale", [
    (2, 4, 2, 256, 256, 128, torch.float32, True, None),
    (1, 4, 1, 128, 384, 64, torch.float32, False, 0.3),
    (1, 2, 2, 128, 256, 128, torch.float32, True, None),  # top-left causal with more keys than queries
    (1, 4, 4, 256, 512, 128, torch.bfloat16, True, None),
])
def test_splash_attention_matches_torch(b, h, hkv, lq, s, d, dtype, causal, scale):
    q, k, v = _qkv(b, h, hkv, lq, s, d, dtype)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=h != hkv)
    plan = plan_splash(q.shape, k.shape, v.shape, _j(q).dtype, has_mask=False)
    assert not isinstance(plan, Unfit), plan
    got = splash_attention(_j(q), _j(k), _j(v), causal=causal, scale=scale, plan=plan, interpret=True)
    _close(got, ref, dtype)


@pytest.mark.parametrize("shapes,has_mask,reason", [
    (((1, 2, 128, 128),) * 3, True, "runtime mask"),
    (((1, 2, 100, 64), (1, 2, 128, 64), (1, 2, 128, 64)), False, "not multiples of 128"),
    (((1, 2, 128, 96),) * 3, False, "head_dim 96"),
    (((1, 3, 128, 64), (1, 2, 128, 64), (1, 2, 128, 64)), False, "not a multiple of 2 kv heads"),
])
def test_splash_plan_leaves_what_it_does_not_cover_to_flash(shapes, has_mask, reason):
    plan = plan_splash(*shapes, jnp.float32, has_mask=has_mask)
    assert isinstance(plan, Unfit) and reason in plan.reason


def test_flash_attention_explicit_scale():
    q, k, v = _qkv(1, 2, 2, 128, 256, 128, torch.float32)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    _close(flash_attention(_j(q), _j(k), _j(v), scale=0.3, interpret=True), ref, torch.float32)


def test_attention_plan_blocks_and_padding():
    plan = plan_attention((1, 4, 384, 128), (1, 2, 384, 128), (1, 2, 384, 128), jnp.float32)
    assert (plan.block_q, plan.block_k, plan.padded_q, plan.padded_kv, plan.groups) == (128, 128, 384, 384, 2)
    plan = plan_attention((1, 1, 1, 64), (1, 1, 250, 64), (1, 1, 250, 64), jnp.bfloat16)
    assert (plan.block_q, plan.padded_q, plan.padded_kv) == (16, 16, 256)  # bf16 rows come in 16s
    assert "q_len 1->16" in plan.describe() and "kv_len 250->256" in plan.describe()


@pytest.mark.parametrize("shapes,dtype,reason,forcible", [
    (((1, 2, 64, 64),) * 3, jnp.float16, "dtype float16", False),
    (((1, 2, 64, 512),) * 3, jnp.float32, "head_dim 512", False),
    (((1, 3, 64, 64), (1, 2, 64, 64), (1, 2, 64, 64)), jnp.float32, "not a multiple", False),
    (((2, 64, 64),) * 3, jnp.float32, "4-D", False),
    (((1, 2, 64, 64),) * 3, jnp.float32, "kv_len 64 < 128", True),
    (((1, 2, 200, 64),) * 3, jnp.float32, "kv_len 200 pads to 256", True),
    (((1, 2, 256, 32),) * 3, jnp.float32, "head_dim 32 pads to 64", True),
])
def test_attention_plan_refuses(shapes, dtype, reason, forcible):
    fit = plan_attention(*shapes, dtype)
    assert isinstance(fit, Unfit) and reason in fit.reason and fit.forcible == forcible
    if forcible:  # kernels="pallas" takes them, padded
        assert not isinstance(plan_attention(*shapes, dtype, force=True), Unfit)


@pytest.mark.parametrize("shape,dtype,interpret", [
    ((3, 37, 256), torch.float32, True),
    ((2, 5, 4, 128), torch.bfloat16, "tpu"),
    ((1100, 256), torch.float32, True),  # more rows than one block: a partial last block
    ((4, 64), torch.float32, True),  # lane-sparse: only with force
])
def test_norm_kernels_match_torch(shape, dtype, interpret):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    d = shape[-1]
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    b = (0.1 * torch.randn(d, generator=g)).to(dtype)
    plan = plan_norm(shape, 1, _j(x).dtype, force=True)
    interp = pltpu.InterpretParams() if interpret == "tpu" else True
    ref = F.rms_norm(x.float(), (d,), w.float(), 1e-6)
    _close(rms_norm(_j(x), _j(w), 1e-6, plan=plan, interpret=interp), ref, dtype)
    ref = F.layer_norm(x.float(), (d,), w.float(), b.float(), 1e-5)
    _close(layer_norm(_j(x), _j(w), _j(b), 1e-5, plan=plan, interpret=interp), ref, dtype)
    ref = F.layer_norm(x.float(), (d,), None, None, 1e-5)
    _close(layer_norm(_j(x), None, None, 1e-5, plan=plan, interpret=interp), ref, dtype)


def test_norm_over_two_trailing_dims():
    x = torch.randn(3, 4, 64)
    w = torch.randn(4, 64)
    ref = F.layer_norm(x, (4, 64), w, None, 1e-5)
    _close(layer_norm(_j(x), _j(w), None, 1e-5, normalized_ndim=2, interpret=True), ref, torch.float32)


def test_norm_plan_refuses():
    assert "float16" in plan_norm((4, 128), 1, jnp.float16).reason
    fit = plan_norm((4, 64), 1, jnp.float32)
    assert fit.forcible and "not a multiple of 128" in fit.reason
    fit = plan_norm((4, 1 << 17), 1, jnp.float32, force=True)
    assert isinstance(fit, Unfit) and not fit.forcible and "VMEM" in fit.reason


@pytest.mark.parametrize("m,k,n,dtype,interpret", [
    (5, 384, 640, torch.float32, True),
    (16, 256, 256, torch.bfloat16, "tpu"),
    (3, 200, 100, torch.float32, True),  # K and N padded to 128 (force)
])
def test_int8_matmul_matches_torch(m, k, n, dtype, interpret):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) * 0.02).to(dtype)
    ref = torch.ops.aten._weight_int8pack_mm(x, w, s)
    plan = plan_int8_matmul(x.shape, w.shape, _j(x).dtype, jnp.int8, force=True)
    got = int8_matmul(_j(x), jnp.asarray(w.numpy()), _j(s), plan=plan,
                      interpret=pltpu.InterpretParams() if interpret == "tpu" else True)
    _close(got, ref, dtype)


def test_int8_matmul_plan_refuses():
    assert "int8" in plan_int8_matmul((4, 128), (128, 128), jnp.float32, jnp.int16).reason
    fit = plan_int8_matmul((4, 200), (100, 200), jnp.float32, jnp.int8)
    assert fit.forcible and "multiple of 128" in fit.reason


# (rows B, heads, kv heads, queries per row n, head_dim, page, table width T, dtype, interpret): rows of n queries at
# their own starts (0, the end of the table, between) over scattered pages of a shared pool
PAGED_BLOCKS_CASES = [
    pytest.param(3, 4, 2, 8, 128, 16, 4, torch.bfloat16, True, id="gqa-bf16-steps-of-4-pages"),
    pytest.param(2, 2, 1, 16, 128, 8, 40, torch.float32, "tpu", id="mqa-f32-tpu-interpret-partial-step"),
    pytest.param(2, 8, 2, 200, 128, 16, 16, torch.bfloat16, True, id="gqa-800-rows-in-blocks-of-512"),
]


@pytest.mark.parametrize("b,h,hkv,n,d,page,t,dtype,interpret", PAGED_BLOCKS_CASES)
def test_paged_blocks_attention_matches_torch(b, h, hkv, n, d, page, t, dtype, interpret):
    """Our paged kernel for rows of several queries against ``tte::paged_attention``'s eager definition (the
    pages gathered, causal from each row's start): pages past a row's last query are never read, so they hold
    NaN here."""
    from torchtpu_export.converters.stablehlo.pallas.paged import paged_blocks_attention, plan_paged_blocks
    from torchtpu_export.llm.paged import paged_attention
    g = torch.Generator().manual_seed(0)
    pages = b * t + 1
    k, v = (torch.randn(hkv, pages, page, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(b, h, n, d, generator=g).to(dtype)
    table = (torch.randperm(pages - 1, generator=g) + 1)[:b * t].reshape(b, t).int()
    start = torch.tensor([0, t * page - n, (t * page - n) // 3][:b]).int()
    for row in range(b):  # the pages after a row's last live one
        dead = table[row, (int(start[row]) + n - 1) // page + 1:].long()
        k[:, dead], v[:, dead] = float("nan"), float("nan")
    ref = paged_attention(q, k.nan_to_num(), v.nan_to_num(), table, start, 0.1)
    plan = plan_paged_blocks(q.shape, k.shape, v.shape, table.shape, _j(q).dtype)
    assert not isinstance(plan, Unfit), plan
    got = paged_blocks_attention(_j(q), _j(k), _j(v), _j(table), _j(start), scale=0.1, plan=plan,
                                 interpret=pltpu.InterpretParams() if interpret == "tpu" else True)
    _close(got, ref, dtype)


def test_paged_blocks_plan_refuses():
    from torchtpu_export.converters.stablehlo.pallas.paged import plan_paged_blocks

    def why(n, d, page, dtype):
        return plan_paged_blocks((4, 2, n, d), (1, 9, page, d), (1, 9, page, d), (4, 2), dtype).reason
    assert "one query" in why(1, 128, 16, jnp.bfloat16)
    assert "head_dim 64" in why(8, 64, 16, jnp.float32)
    assert "pages of 8" in why(8, 128, 8, jnp.bfloat16)
    assert "float16" in why(8, 128, 16, jnp.float16)
