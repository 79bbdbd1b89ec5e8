"""Hot ops through capture, fusion and dispatch: which nodes get Pallas kernels on tpu, and that
both the cpu program and the tpu lowering (kernels in interpret mode) agree with torch eager."""
import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import torchtpu_export as tte
import zoo
from torchtpu_export.capture import capture
from torchtpu_export.converters import stablehlo
from torchtpu_export.converters.stablehlo import pallas
from torchtpu_export.numerics import compare
from torchtpu_export.safetensors_io import to_numpy

aten = torch.ops.aten
FRIENDLY = dict(seq=256, dim=256, heads=2, layers=1, max_seq=256)  # head_dim 128
LLAMA = dict(FRIENDLY, kv_heads=1, head_dim=128)


def _eager(model, args):
    with torch.no_grad():
        return [r.numpy() for r in pytree.tree_leaves(model(*args))]


def _tpu_entries(prog):
    return [k for k in prog.kernels() if k["platform"] == "tpu"]


def _tpu_lowering_on_cpu(model, args, kernels="auto"):
    """Runs the tpu program's lowering on this CPU, its Pallas kernels in interpret mode."""
    cap = capture(model, args, keep=stablehlo.KEEP_WHOLE)
    stablehlo.fuse_hot_ops(cap)
    ctx = stablehlo.LoweringContext("tpu", kernels=kernels)
    fn = stablehlo.to_jax_function(cap, ctx)
    weights = {k: to_numpy(v) for k, v in cap.weights.items()}
    with pallas.interpret_mode(), jax.enable_x64(True):
        out = jax.jit(fn)(weights, *[a.numpy() for a in cap.flatten_inputs(args)])
    return [np.asarray(o) for o in out], ctx.kernel_log


@pytest.mark.parametrize("name,config,kernels", [
    # causal self-attention at 128-multiple lengths: JAX's splash kernel
    ("gpt", FRIENDLY, {"splash_attention": 1, "layer_norm": 3}),
    ("llama", LLAMA, {"splash_attention": 1, "rms_norm": 3}),
])
def test_kernel_friendly_model_uses_kernels_and_cpu_agrees(name, config, kernels):
    model, args = zoo.ZOO[name](**config)
    prog = tte.export(model, args, kernels="pallas")  # "auto" keeps them only where they pay (test below)
    entries = _tpu_entries(prog)
    used = {}
    for e in entries:
        assert e.get("kernel"), e
        used[e["kernel"].split(".")[1]] = used.get(e["kernel"].split(".")[1], 0) + 1
    assert used == kernels
    assert prog.stablehlo_text("tpu").count("tpu_custom_call") == sum(kernels.values())
    assert "tpu_custom_call" not in prog.stablehlo_text("cpu")
    agreement = compare(pytree.tree_leaves(prog(*args)), _eager(model, args), rtol=1e-5)
    assert agreement.ok, agreement
    if name == "llama":  # repeat_interleave of k/v folded into the kernel's GQA index map
        attn = next(e for e in entries if e["kernel"] == "pallas.splash_attention")
        assert "gqa 2:1" in attn["detail"]
        assert "aten.expand.default" not in prog.manifest["programs"]["main"]["op_histogram"]


def _llama_decode():
    model, _ = zoo.llama(**LLAMA)
    k, v = model.empty_cache()
    g = torch.Generator().manual_seed(3)
    return zoo.Decode(model), (torch.tensor([[5]]), torch.tensor([7]), torch.randn(k.shape, generator=g),
                               torch.randn(v.shape, generator=g))


@pytest.mark.parametrize("case", ["llama_causal_gqa", "llama_decode_mask", "bert_mha_mask"])
def test_tpu_lowering_agrees_in_interpret_mode(case):
    if case == "llama_causal_gqa":
        model, args = zoo.llama(**LLAMA)
    elif case == "llama_decode_mask":
        model, args = _llama_decode()
    else:
        model, args = zoo.bert_encoder(seq=256, dim=256, heads=2, layers=1, max_seq=256)
    out, log = _tpu_lowering_on_cpu(model, args)
    attn = [e for e in log if e["op"] == "aten.scaled_dot_product_attention.default"]
    kernel = "pallas.splash_attention" if case == "llama_causal_gqa" else "pallas.flash_attention"
    assert attn and all(e.get("kernel") == kernel for e in attn), log
    agreement = compare(out, _eager(model, args), rtol=1e-5)
    assert agreement.ok, agreement


class _MaskedGQA(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.2)


def test_gqa_bool_mask_with_fully_masked_row_agrees_on_both_lowerings():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((2, 4, 128, 64), (2, 2, 128, 64), (2, 2, 128, 64)))
    mask = torch.rand(2, 1, 128, 128, generator=g) > 0.5
    mask[1, 0, 3] = False  # torch gives 0 for this query row, not nan
    args = (q, k, v, mask)
    ref = _eager(_MaskedGQA(), args)
    prog = tte.export(_MaskedGQA(), args, kernels="pallas")
    assert _tpu_entries(prog)[0]["kernel"] == "pallas.flash_attention"
    assert compare(pytree.tree_leaves(prog(*args)), ref, rtol=1e-5).ok
    out, _ = _tpu_lowering_on_cpu(_MaskedGQA(), args)
    assert compare(out, ref, rtol=1e-5).ok


def test_unfit_shapes_fall_back_visibly_and_agree():
    model, args = zoo.gpt()  # head_dim 32, seq 32: too small for the attention kernel
    prog = tte.export(model, args)
    attn = [e for e in _tpu_entries(prog) if e["op"] == "aten.scaled_dot_product_attention.default"]
    assert attn and not attn[0].get("kernel")
    assert "head_dim 32" in attn[0]["reason"] and "kv_len 32" in attn[0]["reason"]
    assert compare(pytree.tree_leaves(prog(*args)), _eager(model, args), rtol=1e-5).ok
    out, _ = _tpu_lowering_on_cpu(model, args)
    assert compare(out, _eager(model, args), rtol=1e-5).ok


def test_dynamic_shapes_fall_back_and_still_fold():
    model, args = zoo.llama(seq=32)
    prog = tte.export(model, args, dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=64)},))
    entries = _tpu_entries(prog)
    assert entries and all("dynamic shapes" in e["reason"] for e in entries)
    hist = prog.manifest["programs"]["main"]["op_histogram"]
    assert hist["aten.rms_norm.default"] == 5 and "aten.expand.default" not in hist  # folded all the same
    shorter = (args[0][:, :20],)
    assert compare(pytree.tree_leaves(prog(*shorter)), _eager(model, shorter), rtol=1e-5).ok


def test_kernels_pallas_forces_padding_and_refuses_what_cannot_apply():
    model, args = zoo.gpt()
    _, log = _tpu_lowering_on_cpu(model, args, kernels="pallas")
    attn = next(e for e in log if e["op"] == "aten.scaled_dot_product_attention.default")
    assert attn["kernel"] == "pallas.flash_attention" and "head_dim 32->64" in attn["detail"]

    class Half(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    qkv = [torch.randn(1, 2, 128, 64, dtype=torch.float16) for _ in range(3)]
    with pytest.raises(tte.UnsupportedOpError) as e:
        tte.export(Half(), qkv, kernels="pallas")
    msg = e.value.user_message()
    assert "scaled_dot_product_attention" in msg and "float16" in msg and "kernels='auto'" in msg
    prog = tte.export(Half(), qkv, platforms=("tpu",))  # auto: XLA, and says why
    assert "float16" in _tpu_entries(prog)[0]["reason"]


def test_kernels_xla_uses_no_kernel():
    model, args = zoo.llama(**LLAMA)
    prog = tte.export(model, args, kernels="xla", platforms=("tpu",))
    assert "tpu_custom_call" not in prog.stablehlo_text("tpu")
    entries = _tpu_entries(prog)
    assert entries and all(e["reason"] == "kernels='xla'" for e in entries)


def _graph_ops(model, args):
    cap = capture(model, args, keep=stablehlo.KEEP_WHOLE)
    stablehlo.fuse_hot_ops(cap)
    return [n.target for n in cap.graph.nodes if n.op == "call_function"], cap


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(128))

    def forward(self, x):
        a = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.w  # x*x, trailing weight
        b = self.w * (torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * x)  # weight and rsqrt first
        h = x.float()  # HF style: upcast, normalise, cast back, then weight
        c = self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        d = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)  # not over the last dim: no match
        return a, b, c, d, F.rms_norm(x, (128,), self.w)


def test_rms_norm_patterns_fold_into_one_node():
    model, args = _Norms(), (torch.randn(4, 128),)
    ops, cap = _graph_ops(model, args)
    assert ops.count(aten.rms_norm.default) == 4
    assert ops.count(aten.rsqrt.default) == 1  # the pattern over dim 0 is left alone
    weighted = [n for n in cap.graph.nodes if n.target is aten.rms_norm.default and n.args[2] is not None]
    assert len(weighted) == 3  # a, b and F.rms_norm; c's weight follows a cast
    prog = tte.export(model, args)
    assert compare(pytree.tree_leaves(prog(*args)), _eager(model, args), rtol=1e-5).ok


class _TiledKV(torch.nn.Module):
    def forward(self, q, k, v):
        # repeat tiles heads (0,1,0,1), which is not GQA's (0,0,1,1): must not become enable_gqa
        return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), is_causal=True)


class _ExpandKV(torch.nn.Module):
    def forward(self, q, k, v):
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d)
        v = v[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize("module,gqa", [(_TiledKV, False), (_ExpandKV, True)])
def test_repeated_kv_folds_only_when_it_is_gqa(module, gqa):
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 4, 16, 8, generator=g), torch.randn(1, 2, 16, 8, generator=g),
            torch.randn(1, 2, 16, 8, generator=g))
    _, cap = _graph_ops(module(), args)
    sdpa = next(n for n in cap.graph.nodes if n.target is aten.scaled_dot_product_attention.default)
    assert bool(sdpa.kwargs.get("enable_gqa")) == gqa
    prog = tte.export(module(), args)
    assert compare(pytree.tree_leaves(prog(*args)), _eager(module(), args), rtol=1e-5).ok


class _Int8Linear(torch.nn.Module):
    """Weight-only int8 linear layers written the usual way: dequantise, then F.linear."""

    def __init__(self, k=256, n=384, bias=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8))
        self.register_buffer("scale", torch.rand(n, generator=g) * 0.01)
        self.bias = torch.nn.Parameter(torch.randn(n)) if bias else None
        self.register_buffer("w2", torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8))
        self.register_buffer("scale2", torch.rand(k, generator=g) * 0.01)

    def forward(self, x):
        y = F.linear(x, self.w.to(x.dtype) * self.scale[:, None], self.bias)
        return F.linear(y, self.w2.to(x.dtype) * self.scale2.unsqueeze(-1))


def test_int8_weight_only_linear_uses_kernel():
    model, args = _Int8Linear(), (torch.randn(2, 8, 256),)
    ops, _ = _graph_ops(model, args)
    assert ops.count(aten._weight_int8pack_mm.default) == 2
    prog = tte.export(model, args, kernels="pallas")
    assert [e.get("kernel") for e in _tpu_entries(prog)] == ["pallas.int8_matmul"] * 2
    assert compare(pytree.tree_leaves(prog(*args)), _eager(model, args), rtol=1e-5).ok
    out, _ = _tpu_lowering_on_cpu(model, args)
    assert compare(out, _eager(model, args), rtol=1e-5).ok


def test_other_targets_capture_plain_core_aten():
    model, args = zoo.llama()
    ops = {n.target for n in capture(model, args).graph.nodes if n.op == "call_function"}
    assert aten.scaled_dot_product_attention.default not in ops and aten.rms_norm.default not in ops


def test_inspect_lists_kernels_per_node(tmp_path, cli):
    model, args = zoo.llama(**LLAMA)
    path = tmp_path / "llama.tpu"
    tte.export(model, args, kernels="pallas").save(path)
    res = cli("inspect", path)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("kernel [tpu]")]
    assert len(lines) == 4
    assert sum("pallas.splash_attention" in ln and "gqa 2:1" in ln for ln in lines) == 1
    assert sum("(aten.rms_norm.default): pallas.rms_norm" in ln for ln in lines) == 3


def test_auto_keeps_kernels_only_where_the_compiler_says_they_access_no_more(tmp_path, cli):
    """kernels="auto" compiles the program whole with its kernels and with XLA alone (libtpu's cost
    analysis, v5e) and keeps the one that accesses fewer bytes; inspect shows both figures."""
    model, args = zoo.llama(**LLAMA)
    prog = tte.export(model, args)
    cost = prog.manifest["programs"]["main"]["kernel_cost"]
    pallas, xla = cost["pallas"]["v5e:2x2"], cost["xla"]["v5e:2x2"]
    assert pallas > 0 and xla > 0
    entries = _tpu_entries(prog)
    if pallas <= xla:
        assert cost["kept"] == "pallas" and any(e.get("kernel") for e in entries)
    else:
        assert cost["kept"] == "xla" and "tpu_custom_call" not in prog.stablehlo_text("tpu")
        assert all(not e.get("kernel") and "with XLA alone" in e["reason"] for e in entries), entries
    # the program kept is the one measured: compiled again, it accesses what the record says
    assert prog.compiled_stats("v5e:2x2")["bytes_accessed"] == pytest.approx(min(pallas, xla), rel=1e-6)
    assert compare(pytree.tree_leaves(prog(*args)), _eager(model, args), rtol=1e-5).ok
    path = tmp_path / "llama.tpu"
    prog.save(path)
    res = cli("inspect", path)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if "kernels vs XLA" in ln)
    assert f"v5e:2x2 {pallas / 1e6:.1f} vs {xla / 1e6:.1f} MB" in line and f"kept {cost['kept']}" in line
    forced = tte.export(model, args, kernels="pallas")  # forced kernels are never swapped
    assert "kernel_cost" not in forced.manifest["programs"]["main"]
    assert all(e.get("kernel") for e in _tpu_entries(forced))
