"""Models built from code export for tpu, reload in a fresh process and agree with eager."""
import json
import subprocess
import sys

import pytest
import torch
import torch.utils._pytree as pytree

import torchtpu_export as tte
import zoo
from torchtpu_export.numerics import compare

MODELS = ["resnet18", "mobilenet_v2", "gpt", "llama", "qwen3", "bert_encoder", "dlrm", "unet", "resnet50"]


def _eager(model, args):
    with torch.no_grad():
        return [r.numpy() for r in pytree.tree_leaves(model(*args))]


@pytest.mark.parametrize("name", MODELS)
def test_model_agrees_after_reload(name, tmp_path):
    model, args = zoo.ZOO[name]()
    prog = tte.export(model, args, target="tpu")
    path = tmp_path / f"{name}.tpu"
    prog.save(path)
    ref = _eager(model, args)
    # reload in a fresh process: nothing of this one (caches, registries) helps the artifact run
    inputs = tmp_path / "inputs.pt"
    torch.save([a for a in args], inputs)
    script = (
        "import sys, torch, numpy as np, torchtpu_export as tte\n"
        "import torch.utils._pytree as pytree\n"
        f"args = torch.load({str(inputs)!r})\n"
        f"prog = tte.load({str(path)!r})\n"
        "out = pytree.tree_leaves(prog(*args))\n"
        f"np.savez({str(tmp_path / 'out.npz')!r}, *out)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)
    import numpy as np
    with np.load(tmp_path / "out.npz") as f:
        got = [f[k] for k in sorted(f.files, key=lambda s: int(s.split("_")[1]))]
    agreement = compare(got, ref, rtol=1e-5)
    assert agreement.ok, f"{name}: {agreement}"
    text = prog.stablehlo_text(platform="tpu")
    assert text.startswith("#loc") or "module" in text
    assert "stablehlo." in text


def test_weights_are_arguments_not_constants(tmp_path):
    model, args = zoo.small_cnn()
    prog = tte.export(model, args)
    text = prog.stablehlo_text("cpu")
    # the biggest weight (fc 32x10) must not be inlined as a dense constant
    assert "dense<" not in "".join(l for l in text.splitlines() if "tensor<10x32xf32>" in l and "constant" in l)
    manifest = prog.manifest["programs"]["main"]
    assert set(dict(model.named_parameters())) <= set(manifest["weights"])
    assert any("running_mean" in w for w in manifest["weights"])


def test_int64_semantics_preserved():
    class M(torch.nn.Module):
        def forward(self, x):
            return x * 3_000_000_000 + 1, (x.to(torch.float64) / 3)

    x = torch.tensor([1, 2, 3], dtype=torch.int64)
    prog = tte.export(M(), (x,))
    a, b = prog(x)
    assert a.dtype.name == "int64" and a.tolist() == [3_000_000_001, 6_000_000_001, 9_000_000_001]
    assert b.dtype.name == "float64"


def test_narrow_64bit():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(0), x.float() * 2

    x = torch.tensor([1, 2, 3], dtype=torch.int64)
    prog = tte.export(M(), (x,), narrow_64bit=True)
    assert "i64" not in prog.stablehlo_text("cpu").split("func.func public @main")[1].split("{")[0]
    a, b = prog(x)
    assert a.tolist() == [1, 3, 6]
    assert prog.manifest["programs"]["main"]["narrow_64bit"] is True


def test_pytree_inputs_and_outputs():
    class M(torch.nn.Module):
        def forward(self, inputs, scale=None):
            return {"sum": inputs["a"] + inputs["b"][0], "scaled": inputs["b"][1] * scale}

    a, b0, b1, s = torch.randn(3), torch.randn(3), torch.randn(2), torch.randn(2)
    prog = tte.export(M(), ({"a": a, "b": (b0, b1)},), {"scale": s})
    out = prog({"a": a, "b": (b0, b1)}, scale=s)
    assert set(out) == {"sum", "scaled"}
    assert torch.allclose(torch.from_numpy(out["sum"]), a + b0)
    with pytest.raises(tte.InputError):
        prog(a, b0)


def test_unsupported_op_names_op_and_source_line():
    class M(torch.nn.Module):
        def forward(self, x):
            # nonzero's row count depends on the data: fine as an output, not as another op's input
            return torch.nonzero(x > 0).sum()

    with pytest.raises(tte.UnsupportedOpError) as e:
        tte.export(M(), (torch.randn(4),))
    assert "aten.nonzero.default" in str(e.value)
    assert "test_tpu_models.py" in str(e.value) and "torch.nonzero" in str(e.value)


def test_manifest_records_versions_and_platforms(tmp_path):
    model, args = zoo.small_cnn()
    prog = tte.export(model, args, platforms=("tpu", "cpu"))
    prog.save(tmp_path / "m.tpu")
    import zipfile
    with zipfile.ZipFile(tmp_path / "m.tpu") as zf:
        names = set(zf.namelist())
        manifest = json.loads(zf.read("manifest.json"))
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    assert {"manifest.json", "weights.safetensors", "stablehlo/tpu.mlir", "stablehlo/cpu.mlir"} <= names
    assert manifest["platforms"] == ["tpu", "cpu"]
    assert manifest["versions"]["jax"] and manifest["versions"]["torch"]
    # the weights file is standard safetensors
    from safetensors.numpy import load
    with zipfile.ZipFile(tmp_path / "m.tpu") as zf:
        weights = load(zf.read("weights.safetensors"))
    assert set(weights) == set(manifest["programs"]["main"]["weights"])
