"""Sharded TPU programs: tensor-parallel over 8 host devices agrees with the unsharded program."""
import os
import subprocess
import sys
import textwrap

import pytest

import torchtpu_export as tte
import zoo

SCRIPT = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np, torch, torchtpu_export as tte
    import zoo
    from torchtpu_export.numerics import compare
    assert len(jax.devices()) == 8
    out_dir = sys.argv[1]
    m, args = zoo.llama(dim=128, heads=8, kv_heads=2, hidden=256)
    plain = tte.export(m, args, platforms=("cpu",))
    sharded = tte.export(m, args, platforms=("tpu", "cpu"), mesh=(("data", 1), ("model", 8)),
                         sharding="tensor_parallel")
    path = os.path.join(out_dir, "llama_tp.tpu")
    sharded.save(path)
    prog = tte.load(path)
    agreement = compare([prog(*args)], [plain(*args)], rtol=1e-5)
    runner = prog.runner()
    shardings = {n: str(w.sharding.spec) for n, w in runner.weights.items()}
    print(json.dumps({"ok": agreement.ok, "agreement": str(agreement), "shardings": shardings,
                      "n_devices": len(runner.weights["layers.0.attn.q.weight"].sharding.device_set)}))
""")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def test_sharded_program_agrees_with_unsharded_on_8_devices(sharded_run):
    _, result = sharded_run
    assert result["ok"], result["agreement"]
    assert result["n_devices"] == 8
    # column-parallel q (output features split), row-parallel o (input features split)
    assert result["shardings"]["layers.0.attn.q.weight"] == "P('model', None)"
    assert result["shardings"]["layers.0.attn.o.weight"] == "P(None, 'model')"
    assert result["shardings"]["layers.0.attn_norm.weight"] == "P(None,)"


def test_manifest_and_inspect_show_mesh_and_shardings(sharded_run):
    out, _ = sharded_run
    from conftest import run_cli
    proc = run_cli("inspect", out / "llama_tp.tpu")
    assert proc.returncode == 0, proc.stderr
    assert "mesh: data=1, model=8 (8 devices)" in proc.stdout
    assert "sharding tensor_parallel: 11 column-parallel, 4 row-parallel" in proc.stdout
    assert "shard layers.0.down.weight: [-, model]" in proc.stdout
    prog = tte.load(out / "llama_tp.tpu")
    assert prog.manifest["mesh"]["axes"] == [["data", 1], ["model", 8]]
    assert 'sdy.mesh @mesh = <["data"=1, "model"=8]>' in prog.stablehlo_text("tpu")


def test_running_sharded_program_without_devices_says_how(sharded_run):
    out, _ = sharded_run
    from conftest import run_cli
    proc = run_cli("run", out / "llama_tp.tpu", "--inputs", "1x16:int64:0:500")
    assert proc.returncode == 5
    assert "sharded over 8 devices" in proc.stderr and "xla_force_host_platform_device_count=8" in proc.stderr


def test_sharding_needs_mesh_and_valid_mode():
    m, args = zoo.small_cnn()
    with pytest.raises(tte.InputError, match="needs a mesh"):
        tte.export(m, args, sharding="tensor_parallel")
    with pytest.raises(tte.InputError, match="sharding must be one of"):
        tte.export(m, args, mesh=(("model", 2),), sharding="pipeline")


def test_sharded_program_falls_back_from_pallas_visibly():
    """Kernels run per shard where the split allows (norms: whole rows on every device); attention whose
    KV heads do not divide over the model axis falls back to XLA and says why."""
    m, args = zoo.llama(dim=256, heads=2, kv_heads=1, head_dim=128, seq=256, max_seq=256, layers=1)
    prog = tte.export(m, args, platforms=("tpu",), mesh=(("data", 1), ("model", 2)))
    entries = prog.kernels()
    attention = [e for e in entries if "attention" in e["op"]]
    assert attention and all("kernel" not in e for e in attention)
    assert all("sharded: 2 query and 1 KV heads do not divide over the model axis (2 devices)" in e["reason"]
               for e in attention)
    norms = [e for e in entries if "norm" in e["op"]]
    kept = prog.manifest["programs"]["main"]["kernel_cost"]["kept"]  # kernels="auto": where they pay
    assert norms and all(e.get("kernel") == "pallas.rms_norm" and "per shard" in e["detail"] if kept == "pallas"
                         else "with XLA alone" in e["reason"] for e in norms), entries
    with pytest.raises(tte.UnsupportedOpError, match="sharded"):
        tte.export(m, args, platforms=("tpu",), mesh=(("model", 2),), kernels="pallas")


KERNEL_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import numpy as np, jax, torch, zoo
    import torchtpu_export.converters.stablehlo as stablehlo
    from torchtpu_export.converters.stablehlo import pallas, sharding as plans
    from torchtpu_export.capture import capture
    from torchtpu_export.safetensors_io import to_numpy
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    axes = {"data": 1, "model": 2}
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "model"))
    for case in ("prefill", "decode"):
        model, args = zoo.llama(dim=512, heads=4, kv_heads=2, head_dim=128, seq=256, max_seq=256, layers=1)
        if case == "decode":  # one token against a cache: the flash kernel with a mask
            k, v = (torch.randn_like(t) for t in model.empty_cache(1))
            model, args = zoo.Decode(model), (args[0][:, :1], torch.tensor([100]), k, v)
        cap = capture(model, args, keep=stablehlo.KEEP_WHOLE)
        stablehlo.fuse_hot_ops(cap)
        ctx = stablehlo.LoweringContext("tpu", mesh_axes=axes)
        fn = stablehlo.to_jax_function(cap, ctx)
        plan = plans.plan(cap, axes, "tensor_parallel")
        wsh = {k: NamedSharding(mesh, P(*s)) for k, s in plan["weights"].items()}
        ish = [NamedSharding(mesh, P(*s)) for s in plan["inputs"]]
        weights = {k: to_numpy(w) for k, w in cap.weights.items()}
        with pallas.interpret_mode(), jax.enable_x64(True), jax.set_mesh(mesh):
            out = jax.jit(fn, in_shardings=(wsh, *ish))(weights, *[a.numpy() for a in cap.flatten_inputs(args)])
        with torch.no_grad():
            ref = model(*args)
        ref = (ref[0] if isinstance(ref, tuple) else ref).numpy()
        kernels = sorted(e["kernel"] for e in ctx.kernel_log if e.get("kernel"))
        err = float(np.abs(np.asarray(out[0]) - ref).max() / np.abs(ref).max())
        print(case, kernels, err)
        assert err < 1e-5, (case, err)
        assert any("attention" in k for k in kernels), kernels
    print("ok")
""")


def test_kernels_per_shard_agree_with_eager_in_interpret_mode():
    """The tpu lowering of a tensor-parallel GQA decoder, its kernels in shard_map per device (splash for
    the causal prefill, flash with a mask for a decode step), run in Pallas interpret mode over two CPU
    devices: the numbers of torch eager."""
    proc = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


LLM_SCRIPT = textwrap.dedent("""
    import os, sys, json
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np, torch, torchtpu_export as tte
    import hf_llms
    model, tok = hf_llms.build("llama")  # 4 query heads, 2 KV heads
    feed, res = None, {}
    for mesh in (None, (("data", 1), ("model", 2)), (("data", 1), ("model", 4))):
        prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=64, batch_size=2,
                              platforms=("tpu", "cpu"), **({"mesh": mesh} if mesh else {}))
        spec = prog.manifest["programs"]["decode"]
        if feed is None:
            rng = np.random.default_rng(0)
            feed = {i["name"]: rng.standard_normal(i["shape"]).astype(np.float32) for i in spec["inputs"]}
            feed.update(tokens=np.full((1, 1), 7, np.int32), input_pos=np.array([5], np.int32),
                        mask=np.zeros(feed["mask"].shape, np.float32))
        names = [i["name"] for i in spec["inputs"]]
        outs = prog.run_flat([feed[n] for n in names], "decode")
        stats = prog.compiled_stats("v5e:2x2" if mesh else "v5e", signature_name="decode")
        ids = tok("hello world, this is a tiny model")["input_ids"]
        res[str(mesh[1][1]) if mesh else "plain"] = {
            # the serving engine (two slots), its caches split as the plan says
            "generated": prog.generate(ids, 12).ids,
            "outs": [o.tolist() for o in outs], "plan": spec.get("sharding"), "names": names,
            "aliased": stats["hbm_bytes"]["aliased"], "collectives": stats.get("collectives", {}),
            "cache_bytes": sum(int(np.prod(spec["inputs"][i]["shape"])) * 4 for i in spec["donate"])}
    print(json.dumps(res))
""")


def test_tensor_parallel_llm_keeps_each_chips_kv_heads(tmp_path):
    """export_llm with a model axis splits each KV cache by head, as attention is: the cache input and its
    updated output keep the same split (donated in place, half the cache per chip), the compiled decode step
    all-gathers nothing, its numbers equal the unsharded program's, and the serving engine generates the same
    tokens from it over the two devices. With more chips than KV heads each head's features are split."""
    import json
    proc = subprocess.run([sys.executable, "-c", LLM_SCRIPT], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, sharded, by_features = res["plain"], res["2"], res["4"]
    plan = sharded["plan"]
    for name, spec in zip(sharded["names"], plan["inputs"]):
        assert spec == ([None, "model", None, None] if name.startswith("kv_cache_") else [None] * len(spec)), name
    assert plan["outputs"][0] == [None, None, None]  # logits, replicated
    assert all(s == [None, "model", None, None] for s in plan["outputs"][1:])
    import numpy as np
    for a, b in zip(sharded["outs"], plain["outs"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert sharded["generated"] == plain["generated"] and len(plain["generated"]) == 12
    # 4 chips, 2 KV heads: each head's features split instead (head_dim), numbers and tokens unchanged
    assert all(s == [None, None, None, "model"] for n, s in zip(by_features["names"], by_features["plan"]["inputs"])
               if n.startswith("kv_cache_"))
    for a, b in zip(by_features["outs"], plain["outs"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert by_features["generated"] == plain["generated"]
    # libtpu, v5e: each chip aliases its half of the cache; only the row-parallel all-reduces remain
    assert plain["aliased"] >= plain["cache_bytes"] and sharded["aliased"] >= plain["cache_bytes"] // 2
    assert sharded["aliased"] < plain["aliased"]
    assert "all-gather" not in sharded["collectives"] and "all-reduce" in sharded["collectives"]


def test_input_shardings_are_checked():
    m, args = zoo.small_cnn()
    with pytest.raises(tte.InputError, match="needs a mesh"):
        tte.export(m, args, input_shardings={"args_0": [None, None, None, None]})
    with pytest.raises(tte.InputError, match="no program takes"):
        tte.export(m, args, platforms=("tpu",), mesh=(("model", 2),), input_shardings={"nope": [None]})
    name = tte.export(m, args, platforms=("tpu",)).manifest["programs"]["main"]["inputs"][0]["name"]
    with pytest.raises(tte.InputError, match="4 dims"):
        tte.export(m, args, platforms=("tpu",), mesh=(("model", 2),), input_shardings={name: [None]})
    with pytest.raises(tte.InputError, match="does not divide"):
        tte.export(m, args, platforms=("tpu",), mesh=(("model", 2),), input_shardings={name: [None, "model", None, None]})
    with pytest.raises(tte.InputError, match="names axis 'data'"):
        tte.export(m, args, platforms=("tpu",), mesh=(("model", 2),), input_shardings={name: ["data", None, None, None]})


MOE_SCRIPT = textwrap.dedent("""
    import os, sys, json, tempfile
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import torch, torchtpu_export as tte
    import hf_llms
    model, tok = hf_llms.moe("qwen3_moe")  # 2 layers of 4 experts, 2 routed per token
    ids = tok("hello world, this is a tiny model")["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    res = {"want": want[0, len(ids):].tolist()}
    for name, mesh in (("plain", None), ("model", (("data", 1), ("model", 4))), ("expert", (("expert", 4),))):
        prog = tte.export_llm(model, tok, target="tpu", prefill_lengths=(8,), cache_length=64, batch_size=2,
                              platforms=("tpu", "cpu"), check=False, **({"mesh": mesh} if mesh else {}))
        path = os.path.join(tempfile.mkdtemp(), name + ".tpu")
        prog.save(path)
        prog = tte.load(path)  # the plan goes through the manifest and back
        stats = prog.compiled_stats("v5e:2x2" if mesh else "v5e", signature_name="decode")
        plan = prog.manifest["programs"]["decode"].get("sharding") or {}
        res[name] = {"generated": prog.generate(ids, 12).ids, "collectives": stats.get("collectives", {}),
                     "arguments": stats["hbm_bytes"]["arguments"], "axis": plan.get("expert_axis"),
                     "experts": plan.get("expert_parallel"),
                     "specs": {w: plan["weights"][w] for w in plan.get("expert_parallel") or []}}
    print(json.dumps(res))
""")


def test_experts_split_over_chips_give_the_same_tokens_and_gather_no_weights():
    """Expert parallelism: a mixture-of-experts model's expert weights split by expert over the mesh's
    ``expert`` axis (or, without one, its ``model`` axis), each chip computing its own experts' rows and
    one all-reduce per expert projection; the program served over 4 host devices gives transformers'
    greedy tokens, and the TPU compiler (v5e:2x2) builds it with no all-gather of expert weights."""
    import json
    proc = subprocess.run([sys.executable, "-c", MOE_SCRIPT], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    want = res["want"]
    assert res["plain"]["generated"] == want
    for name in ("model", "expert"):
        r = res[name]
        assert r["generated"] == want, name
        assert r["axis"] == name and len(r["experts"]) == 4  # gate_up and down of 2 layers
        assert all(spec[0] == name and not any(spec[1:]) for spec in r["specs"].values()), r["specs"]
    expert = res["expert"]
    # the rest of the model replicated: only the 2 all-reduces per MoE layer cross chips
    assert set(expert["collectives"]) == {"all-reduce"} and expert["collectives"]["all-reduce"]["ops"] == 4
    assert "all-gather" not in res["model"]["collectives"] or \
        res["model"]["collectives"]["all-gather"]["bytes"] < 4 * 64 * 32 * 4  # never a whole expert's weights
