"""The TPU compiler accepts what the tpu target emits: libtpu compiles ahead of time for v5e and v6e
topologies on this CPU machine (``jax.experimental.topologies``), no TPU needed.

Compiled here: every Pallas kernel variant the dispatcher can emit (flash attention with causal,
boolean and additive masks, GQA/MQA, float32 and bfloat16, each head_dim, padded and decode
shapes; JAX's splash attention; the norms; the int8 matmul), the tpu program of every zoo model,
multi-signature programs, dynamic programs at their bounds, and sharded programs on 4 and 8 chips.
A program the compiler rejects fails its test with the compiler's message.
"""
import functools
import hashlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.export import Dim

import torchtpu_export as tte
import zoo
from torchtpu_export.targets.tpu import aot as tpu_compile
from torchtpu_export.converters.stablehlo import pallas
from torchtpu_export.converters.stablehlo.pallas.attention import flash_attention, plan_attention
from torchtpu_export.converters.stablehlo.pallas.int8_matmul import int8_matmul, plan_int8_matmul
from torchtpu_export.converters.stablehlo.pallas.norm import layer_norm, plan_norm, rms_norm
from torchtpu_export.converters.stablehlo.pallas.splash import plan_splash, splash_attention
from torchtpu_export.errors import ArtifactError, ConversionError, InputError

TOPOLOGIES = ("v5e:2x2", "v6e:2x2")

if tpu_compile.libtpu_version() is None:
    pytest.fail("libtpu is not installed: `make test` installs the tpu extra (pip install -e '.[tpu]')",
                pytrace=False)


def compiler_verdict(call, avals, topology):
    """None if the TPU compiler accepts call(*avals) on one chip of ``topology``, else its message."""
    with jax.enable_x64(True):  # as the tpu target lowers programs: torch's 64-bit semantics
        return pallas._compile_alone(call, tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in avals),
                                     topology, tpu_compile)


S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16


def _attention_cases():
    # (b, h, hkv, q_len, kv_len, head_dim): exact, GQA multi-block, MQA padded, head_dim 32/96/256, decode
    shapes = [(1, 4, 4, 128, 128, 64), (1, 4, 2, 384, 384, 128), (1, 2, 1, 250, 250, 64), (1, 2, 2, 100, 300, 32),
              (1, 4, 4, 128, 128, 96), (1, 2, 2, 256, 512, 256), (2, 8, 2, 1, 1024, 128), (1, 8, 1, 4, 640, 128)]
    cases = []
    for dtype in (F32, BF16):
        for b, h, hkv, lq, s, d in shapes:
            for mode in ("none", "causal", "bool", "float"):
                mask = {"bool": ((b, 1, lq, s), jnp.bool_), "float": ((1, h, lq, s), dtype)}.get(mode)
                plan = plan_attention((b, h, lq, d), (b, hkv, s, d), (b, hkv, s, d), dtype,
                                      mask and mask[0], force=True)
                avals = [S((b, h, lq, d), dtype), S((b, hkv, s, d), dtype), S((b, hkv, s, d), dtype)]
                avals += [S(*mask)] if mask else []
                call = functools.partial(lambda q, k, v, m=None, **kw: flash_attention(q, k, v, m, **kw),
                                         causal=mode == "causal", plan=plan)
                cases.append(pytest.param(call, avals, id=f"flash-{jnp.dtype(dtype).name}-{b}x{h}x{hkv}-{lq}x{s}"
                                                          f"-d{d}-{mode}"))
        for b, h, hkv, lq, s, d, causal in [(2, 4, 2, 256, 256, 128, True), (1, 4, 1, 128, 384, 64, False),
                                            (1, 2, 2, 512, 512, 256, True)]:
            plan = plan_splash((b, h, lq, d), (b, hkv, s, d), (b, hkv, s, d), dtype, has_mask=False)
            call = functools.partial(splash_attention, causal=causal, scale=None, plan=plan)
            cases.append(pytest.param(call, [S((b, h, lq, d), dtype), S((b, hkv, s, d), dtype), S((b, hkv, s, d), dtype)],
                                      id=f"splash-{jnp.dtype(dtype).name}-{b}x{h}x{hkv}-{lq}x{s}-d{d}-"
                                         f"{'causal' if causal else 'none'}"))
    return cases


def _norm_and_matmul_cases():
    cases = []
    for dtype in (F32, BF16):
        for shape, nd in [((128, 512), 1), ((3, 7, 256), 1), ((5000, 128), 1), ((4, 96), 1), ((8, 4, 64), 2)]:
            plan = plan_norm(shape, nd, dtype, force=True)
            w = shape[len(shape) - nd:]
            name = f"{jnp.dtype(dtype).name}-{'x'.join(map(str, shape))}-nd{nd}"
            cases.append(pytest.param(functools.partial(lambda x, w, plan, nd: rms_norm(x, w, 1e-6, normalized_ndim=nd,
                                                                                      plan=plan), plan=plan, nd=nd),
                                      [S(shape, dtype), S(w, dtype)], id=f"rms_norm-{name}"))
            cases.append(pytest.param(functools.partial(lambda x, w, b, plan, nd: layer_norm(
                x, w, b, 1e-5, normalized_ndim=nd, plan=plan), plan=plan, nd=nd),
                [S(shape, dtype), S(w, dtype), S(w, dtype)], id=f"layer_norm-{name}"))
        for m, n, k in [(8, 256, 512), (100, 384, 128), (1, 4096, 1024), (33, 200, 100)]:
            plan = plan_int8_matmul((m, k), (n, k), dtype, jnp.int8, force=True)
            cases.append(pytest.param(functools.partial(int8_matmul, plan=plan),
                                      [S((m, k), dtype), S((n, k), jnp.int8), S((n,), dtype)],
                                      id=f"int8_matmul-{jnp.dtype(dtype).name}-{m}x{n}x{k}"))
    return cases


@pytest.mark.parametrize("call,avals", _attention_cases() + _norm_and_matmul_cases())
def test_every_kernel_variant_compiles_for_v5e_and_v6e(call, avals):
    for topology in TOPOLOGIES:
        verdict = compiler_verdict(call, avals, topology)
        assert verdict is None, f"the TPU compiler ({topology}) rejects the kernel:\n{verdict}"


def test_kernels_traced_in_64_bit_mode_are_what_mosaic_rejects():
    """Why every kernel is traced with 64-bit mode off: the same kernel without it (an i64 index
    map) is rejected by the real compiler, so the dispatcher's check has something to catch."""
    plan = plan_attention((1, 2, 128, 128), (1, 2, 128, 128), (1, 2, 128, 128), F32)
    unwrapped = functools.partial(flash_attention.__wrapped__, causal=True, plan=plan)
    verdict = compiler_verdict(unwrapped, [S((1, 2, 128, 128), F32)] * 3, "v5e:2x2")
    assert verdict and "Mosaic" in verdict


def test_dispatch_falls_back_to_xla_when_the_compiler_rejects_a_kernel(monkeypatch):
    """A kernel the compiler rejects at export time is not emitted: XLA lowers the node and the
    manifest records the compiler's reason; kernels='pallas' raises with it instead."""
    from torchtpu_export.converters.stablehlo import ops_hot
    real = ops_hot.flash_attention

    def in_64_bit(*args, **kwargs):  # the kernel as it was before it was traced in 32-bit mode
        return real.__wrapped__(*args, **kwargs)

    pallas._VERDICTS.clear()
    monkeypatch.setattr(ops_hot, "flash_attention", in_64_bit)
    model, args = zoo.bert_encoder(seq=128, dim=256, heads=2, layers=1, max_seq=128)  # masked: flash, not splash
    prog = tte.export(model, args, platforms=("tpu",))
    attn = [k for k in prog.kernels() if k["op"] == "aten.scaled_dot_product_attention.default"]
    assert attn and all("kernel" not in k for k in attn), attn
    assert all("the TPU compiler rejects it" in k["reason"] and "Mosaic" in k["reason"] for k in attn), attn
    # the layer norms' kernels only, where they pay (kernels="auto" compares the program with XLA alone)
    kept = prog.manifest["programs"]["main"]["kernel_cost"]["kept"]
    assert prog.stablehlo_text("tpu").count("tpu_custom_call") == (3 if kept == "pallas" else 0)
    with pytest.raises(tte.UnsupportedOpError, match="the TPU compiler rejects it"):
        tte.export(model, args, platforms=("tpu",), kernels="pallas")
    pallas._VERDICTS.clear()


# ---- whole programs -------------------------------------------------------------------------

def assert_compiles(prog, topologies=TOPOLOGIES):
    """Compiles every program of a TpuProgram for each topology; fails with the compiler's message."""
    out = {}
    for topology in topologies:
        try:
            out[topology] = tpu_compile.compile_artifact(prog.artifact, topology, store=False)
        except tpu_compile.CompileError as e:
            pytest.fail(str(e), pytrace=False)
    return out


ZOO_SMALL = {  # the zoo at test sizes; defaults where they are small already
    "resnet18": dict(size=64), "resnet50": {}, "mobilenet_v2": dict(size=96), "small_cnn": {}, "gpt": {},
    "llama": {}, "qwen3": {}, "bert_encoder": {}, "dlrm": {}, "unet": {},
}


@pytest.mark.parametrize("name", sorted(ZOO_SMALL))
def test_zoo_tpu_programs_compile_for_one_v5e_chip_and_one_v6e_chip(name):
    model, args = zoo.ZOO[name](**ZOO_SMALL[name])
    prog = tte.export(model, args, platforms=("tpu",))
    stats = assert_compiles(prog, ("v5e", "v6e"))  # a generation alone: a single chip (v5e:1x1, v6e:1x1)
    for topology, per_program in stats.items():
        s = per_program["main"]
        assert s["fits"] and s["hbm_bytes"]["arguments"] > 0 and s["flops"] > 0, (topology, s)


def test_kernel_friendly_transformers_keep_kernels_and_compile():
    """Exports of transformers at head_dim 128 with kernels="pallas" carry Pallas kernels and compile
    ("auto" keeps them where they pay: test_pallas_dispatch)."""
    for make in (functools.partial(zoo.llama, seq=256, dim=256, heads=2, kv_heads=1, head_dim=128, max_seq=256),
                 functools.partial(zoo.gpt, seq=256, dim=256, heads=2, max_seq=256),
                 functools.partial(zoo.bert_encoder, seq=128, dim=256, heads=2, max_seq=128)):
        model, args = make()
        prog = tte.export(model, args, kernels="pallas")
        kernels = [k for k in prog.kernels() if k["platform"] == "tpu"]
        assert kernels and all(k.get("kernel") for k in kernels), kernels
        assert "tpu_custom_call" in prog.stablehlo_text("tpu")
        assert_compiles(prog)


def test_prefill_and_decode_signatures_compile():
    model, (tokens,) = zoo.llama(seq=128, dim=256, heads=2, kv_heads=1, head_dim=128, max_seq=512)
    k, v = model.empty_cache()
    prog = (tte.signature("prefill", zoo.Prefill(model), (tokens,))
            .signature("decode", zoo.Decode(model), (tokens[:, -1:], torch.tensor([128]), k, v))
            .export(target="tpu"))
    decode = [k for k in prog.kernels() if k["program"] == "decode" and k["platform"] == "tpu"
              and k["op"] == "aten.scaled_dot_product_attention.default"]
    assert decode and all(k.get("kernel") == "pallas.flash_attention" and k["detail"].startswith("decode")
                          for k in decode), decode
    stats = assert_compiles(prog)
    assert set(stats["v5e:2x2"]) == {"prefill", "decode"}


def test_dynamic_programs_compile_at_their_bounds():
    model, (tokens,) = zoo.gpt(batch=2, seq=16)
    batch, seq = Dim("batch", min=1, max=4), Dim("seq", min=2, max=32)
    prog = tte.export(model, (tokens,), dynamic_shapes=({0: batch, 1: seq},), platforms=("tpu",))
    stats = assert_compiles(prog)
    entry = prog.manifest["compiled"]["v5e:2x2"]["main"]
    dims = prog.manifest["programs"]["main"]["dims"]  # torch's symbols, with the Dims' bounds
    assert entry["shapes"] == {name: hi for name, (_, hi) in dims.items()} and sorted(entry["shapes"].values()) == [4, 32]
    assert entry["executable"] is None and "fixed shapes" in entry["executable_reason"]
    assert stats["v6e:2x2"]["main"]["hbm_bytes"]["arguments"] > 0


def test_dynamic_program_without_upper_bound_says_so():
    model, (tokens,) = zoo.gpt(batch=2, seq=16)
    prog = tte.export(model, (tokens,), dynamic_shapes=({0: Dim("batch")},), platforms=("tpu",))
    with pytest.raises(InputError, match="no upper bound"):
        prog.compile("v5e:2x2")


@pytest.mark.parametrize("mesh,topologies", [
    ((("data", 1), ("model", 4)), ("v5e:2x2", "v6e:2x2")),
    ((("data", 2), ("model", 4)), ("v5e:2x4", "v6e:2x4")),
    ((("data", 4), ("model", 8)), ("v5e:4x8",)),  # 32 chips on 8 hosts: one program for the whole slice
])
def test_sharded_programs_compile_with_their_shardings(mesh, topologies):
    model, args = zoo.llama(batch=2, dim=256, heads=8, kv_heads=4, hidden=512)
    prog = tte.export(model, args, mesh=mesh, sharding="tensor_parallel", platforms=("tpu",))
    stats = assert_compiles(prog, topologies)
    devices = mesh[0][1] * mesh[1][1]
    for topology in topologies:
        assert prog.manifest["compiled"][topology]["main"]["devices"] == devices
    # tensor-parallel: each chip holds a share of the weights, not all of them
    full = sum(w.nbytes for w in prog.artifact.weights.values())
    assert stats[topologies[0]]["main"]["hbm_bytes"]["arguments"] < full * 0.6
    # the compiler's collectives: the row-parallel linears' all-reduces, per chip per run
    comms = stats[topologies[0]]["main"]["collectives"]
    assert comms["all-reduce"]["ops"] >= 2 and comms["all-reduce"]["bytes"] > 0


def test_sharded_program_on_too_few_chips_says_how_many():
    model, args = zoo.llama(batch=2, dim=256, heads=8, kv_heads=4, hidden=512)
    prog = tte.export(model, args, mesh=(("data", 2), ("model", 4)), platforms=("tpu",))
    with pytest.raises(InputError, match="needs 8 chips; TPU topology v5e:2x2 has 4"):
        prog.compile("v5e:2x2")


# ---- executables in the artifact, and what the compiler says -------------------------------

@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    model, args = zoo.llama(seq=128, dim=256, heads=2, kv_heads=1, head_dim=128, max_seq=128)
    prog = tte.export(model, args, precompile=("v5e:2x2",))
    path = tmp_path_factory.mktemp("exe") / "llama.tpu"
    prog.save(path)
    return model, args, prog, path


def test_precompile_stores_an_executable_with_versions_and_digest(precompiled):
    _, _, prog, path = precompiled
    loaded = tte.load(path)
    entry = loaded.manifest["compiled"]["v5e:2x2"]["main"]
    assert entry["libtpu"] == tpu_compile.libtpu_version() and entry["jax"] == jax.__version__
    assert entry["device_kind"] == "TPU v5 lite" and entry["devices"] == 1
    data = loaded.artifact.executables["v5e:2x2"]["main"]
    assert hashlib.sha256(data).hexdigest() == entry["executable"]["sha256"] and len(data) > 10_000
    s = entry["stats"]
    assert s["hbm_bytes"]["total"] == sum(s["hbm_bytes"][k] for k in ("arguments", "outputs", "temporaries", "code")) \
        - s["hbm_bytes"]["aliased"]
    # the Pallas kernels declare their cost: the compiler's FLOPs include the attention
    assert s["flops"] > 4 * 2 * 128 * 128 * 128
    roof = s["roofline"]
    assert roof["seconds"] == pytest.approx(max(s["flops"] / 197e12, s["bytes_accessed"] / 819e9))


def test_compile_cli_stores_executables_and_inspect_shows_stats(precompiled, tmp_path, cli):
    _, _, _, path = precompiled
    out = tmp_path / "both.tpu"
    r = cli("compile", path, "--topology", "v5e:2x2,v6e:2x2", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "v6e:2x2 main: HBM" in r.stdout and "executable stored" in r.stdout
    r = cli("inspect", out)
    assert r.returncode == 0, r.stderr
    assert "compiled [v5e:2x2, TPU v5 lite" in r.stdout and "compiled [v6e:2x2, TPU v6 lite" in r.stdout
    assert "executables/v6e_2x2/main.bin" in r.stdout and "roofline" in r.stdout
    r = cli("inspect", path, "--topology", "v6e:2x2", "--json")
    assert r.returncode == 0, r.stderr
    assert '"v6e:2x2"' in r.stdout and '"flops"' in r.stdout
    r = cli("compile", path, "--topology", "v9:2x2")
    assert r.returncode == 2 and "unknown TPU topology" in r.stderr


def test_topologies_as_users_name_them():
    canon = tpu_compile.canonical_topology
    assert canon("v5e") == "v5e:1x1" and canon("v6e") == "v6e:1x1" and canon("v5p") == "v5p:2x2x1"
    assert canon("V5E:1x1") == "v5e:1x1" and canon("v5e:4x8") == "v5e:4x8" and canon("v5p:4x4x4") == "v5p:4x4x4"
    assert canon("v5litepod-1") == "v5e:1x1" and canon("v5litepod-32") == "v5e:4x8" and canon("v6e-8") == "v6e:2x4"
    assert canon("v5p-128") == "v5p:4x4x4" and canon("v4-8") == "v4:2x2x1"
    assert tpu_compile.host_bounds("v5e:1x1") == (1, 1, 1) and tpu_compile.host_bounds("v6e:2x4") == (2, 4, 1)
    assert tpu_compile.host_bounds("v5e:4x8") is None
    for bad, says in (("v9", "unknown TPU topology"), ("v5e:2x2x2", "2 dimensions"), ("v5litepod-3", "sizes 1, 4"),
                      ("v5p-7", "sizes 8, 16"), ("tpu", "unknown TPU topology")):
        with pytest.raises(InputError, match=says) as info:
            canon(bad)
        assert "GEN:LAYOUT" in info.value.hint and "v5litepod-32" in info.value.hint  # the forms, with examples
    # one chip, a host, and multi-host slices, as libtpu describes them
    assert tpu_compile.slice_size("v5e") == (1, 1) and tpu_compile.slice_size("v6e-8") == (8, 1)
    assert tpu_compile.slice_size("v5litepod-32") == (32, 8) and tpu_compile.slice_size("v5p:4x4x4") == (64, 16)


def test_compile_and_inspect_print_the_slice(tmp_path, cli):
    model, args = zoo.small_cnn()
    path = tmp_path / "cnn.tpu"
    tte.export(model, args, platforms=("tpu",)).save(path)
    r = cli("compile", path, "--topology", "v5e,v6e-8", "-o", tmp_path / "c.tpu")
    assert r.returncode == 0, r.stderr
    assert "v5e:1x1: 1 chip on 1 host" in r.stdout and "v6e:2x4: 8 chips on 1 host" in r.stdout
    assert "v5e:1x1 main: HBM" in r.stdout
    r = cli("inspect", path, "--topology", "v5litepod-32")
    assert r.returncode == 0, r.stderr
    assert "topology v5e:4x8: 32 chips on 8 hosts" in r.stdout
    r = cli("compile", path, "--topology", "v5e:9")
    assert r.returncode == 2 and "accelerator type" in r.stderr and "v5litepod-32" in r.stderr


def test_compiled_stats_per_generation(precompiled):
    _, _, prog, _ = precompiled
    v5e, v6e = prog.compiled_stats("v5e:2x2"), prog.compiled_stats("v6e:2x2")
    assert v5e["generation"] == "v5e" and v6e["generation"] == "v6e"
    assert v5e["hbm_capacity_bytes"] == 16 * 10 ** 9 and v6e["hbm_capacity_bytes"] == 32 * 10 ** 9
    assert v6e["roofline"]["seconds"] < v5e["roofline"]["seconds"]  # more bandwidth and FLOP/s per chip


def test_stored_executable_is_chosen_by_chip_versions_and_digest(precompiled):
    prog = tte.load(precompiled[3])  # as saved: one executable, for v5e

    class Chip:
        platform = "tpu"

        def __init__(self, kind):
            self.device_kind = kind

    art = prog.artifact
    found, why = tpu_compile.stored_executable(art, "main", [Chip("TPU v5 lite")], True)
    assert found and found[0] == "v5e:2x2" and why is None
    found, why = tpu_compile.stored_executable(art, "main", [Chip("TPU v6 lite")], True)
    assert found is None and "is for TPU v5 lite, these chips are TPU v6 lite" in why
    entry = art.manifest["compiled"]["v5e:2x2"]["main"]
    good = art.executables["v5e:2x2"]["main"]
    try:
        art.executables["v5e:2x2"]["main"] = good[:-1] + bytes([good[-1] ^ 1])
        found, why = tpu_compile.stored_executable(art, "main", [Chip("TPU v5 lite")], True)
        assert found is None and "does not match its recorded sha256" in why
        art.executables["v5e:2x2"]["main"] = good
        entry["libtpu"] = "0.0.1"
        found, why = tpu_compile.stored_executable(art, "main", [Chip("TPU v5 lite")], True)
        assert found is None and "compiled by libtpu 0.0.1" in why
    finally:
        art.executables["v5e:2x2"]["main"] = good
        entry["libtpu"] = tpu_compile.libtpu_version()


def test_loading_an_executable_runs_it_and_refuses_foreign_classes(tmp_path):
    """The loader on a CPU executable (the TPU host path is the same code with TPU devices): it
    runs, and a container naming anything outside jax's executable classes is refused unrun."""
    model, args = zoo.small_cnn()
    prog = tte.export(model, args, platforms=("cpu",))
    runner = prog.runner()
    with jax.enable_x64(True):
        compiled = jax.jit(runner.exported.call).trace(
            *jax.tree_util.tree_unflatten(runner.exported.in_tree, list(runner.exported.in_avals))[0]).lower().compile()
    loaded = tpu_compile.load_executable(tpu_compile.serialize(compiled), runner.exported, uses_x64=True,
                                         devices=jax.devices()[:1])
    with jax.enable_x64(True):
        out = loaded(runner.weights, *[a.numpy() for a in args])
    np.testing.assert_allclose(np.asarray(out[0]), model(*args).detach().numpy(), rtol=1e-5, atol=1e-6)

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(ArtifactError, match="refusing"):
        tpu_compile.load_executable(pickle.dumps(Evil()), runner.exported, uses_x64=True, devices=jax.devices()[:1])
    assert not marker.exists()


def test_a_host_whose_chips_match_no_executable_compiles_and_says_why_once(precompiled, caplog):
    """Here the "chips" are this CPU: the tpu runner finds no executable for them, warns once per
    artifact with the reason, and would compile the StableHLO instead."""
    _, _, _, path = precompiled
    prog = tte.load(path, trust_stored_executables=True)
    with caplog.at_level("WARNING", logger="torchtpu_export"):
        runner = prog.runner(platform="tpu")
        again = tte.load(path, trust_stored_executables=True)
        again.runner(platform="tpu")
        prog._runners.clear()
        prog.runner(platform="tpu")
    assert runner.executable is None
    warnings = [r.getMessage() for r in caplog.records if "no stored executable" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once per loaded artifact
    assert "these devices are cpu, not TPU chips" in warnings[0]


def test_precompile_needs_the_tpu_platform_and_a_known_topology():
    model, args = zoo.small_cnn()
    with pytest.raises(InputError, match="needs the tpu platform"):
        tte.export(model, args, platforms=("cpu",), precompile=("v5e:2x2",))
    with pytest.raises(InputError, match="unknown TPU topology"):
        tte.export(model, args, precompile=("v5x",))


class _Spectrum(torch.nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x).abs()


def test_float64_the_tpu_compiler_lacks_says_to_narrow():
    """float64 compiles on TPUs (emulated) except FFT and LU: the error says how to compute in float32."""
    x = torch.randn(4, 64, dtype=torch.float64)
    prog = tte.export(_Spectrum(), (x,), platforms=("tpu",))
    with pytest.raises(ConversionError, match="Unexpected operand type for FFT") as e:
        prog.compile("v5e:2x2")
    assert "narrow_64bit=True" in e.value.hint
    assert_compiles(tte.export(_Spectrum(), (x,), platforms=("tpu",), narrow_64bit=True), ("v5e:2x2",))


@pytest.mark.parametrize("model_axis,topology", [(4, "v5e:2x2"), (8, "v6e:2x4")])
def test_tensor_parallel_programs_run_their_kernels_per_shard(model_axis, topology):
    """The attention and norm kernels of a tensor-parallel program, in shard_map over the model axis
    (attention by head, norms on whole rows), compiled by libtpu for 4 and 8 chips."""
    model, args = zoo.llama(dim=1024, heads=8, kv_heads=8, head_dim=128, seq=256, max_seq=256, layers=1)
    prog = tte.export(model, args, mesh=(("data", 1), ("model", model_axis)), platforms=("tpu",), kernels="pallas")
    used = [e for e in prog.kernels() if e.get("kernel")]
    assert {e["kernel"] for e in used} == {"pallas.splash_attention", "pallas.rms_norm"}, prog.kernels()
    attention = next(e for e in used if "attention" in e["kernel"])
    assert f"{8 // model_axis} of 8 heads on each of {model_axis} devices" in attention["detail"]
    assert prog.stablehlo_text("tpu").count("tpu_custom_call") == len(used)
    stats = assert_compiles(prog, (topology,))
    assert stats[topology]["main"]["hbm_bytes"]["total"] > 0
