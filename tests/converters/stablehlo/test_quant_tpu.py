"""TPU quantization recipes: the weights shrink as promised and outputs stay close to float."""
import numpy as np
import pytest
import torch

import torchtpu_export as tte
import zoo

MODELS = {
    "cnn": lambda: zoo.resnet18(size=32, batch=4),
    "encoder": lambda: zoo.bert_encoder(),
    "decoder": lambda: zoo.llama(seq=32),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return request.param, *MODELS[request.param]()


def test_bf16(model, tmp_path):
    name, m, args = model
    prog = tte.export(m, args, quant_config="bf16")
    report = prog.quant_report
    assert report.shrink == pytest.approx(2.0, rel=0.01), report
    assert report.cosine >= 0.999, report
    out = prog(*args)
    first = out[0] if isinstance(out, tuple) else out
    assert first.dtype == np.float32  # I/O keeps its dtypes
    assert "bf16" in prog.stablehlo_text("tpu")
    assert prog.manifest["programs"]["main"]["quantization"]["recipe"] == "bf16"


def test_int8_weight_only(model, tmp_path):
    name, m, args = model
    prog = tte.export(m, args, quant_config="int8_weight_only")
    report = prog.quant_report
    spec = prog.manifest["programs"]["main"]["quantization"]["weights"]
    assert spec, "no weight was quantized"
    weights = prog.artifact.weights
    params = dict(m.named_parameters())
    for wname, info in spec.items():
        assert weights[wname].dtype == np.int8
        assert weights[info["scale"]].shape == (params[wname].shape[info["axis"]],)
        # int8 values are about 4x smaller than the float32 weights they replace
        assert params[wname].numel() * 4 / weights[wname].nbytes == 4
    assert report.cosine >= 0.999, report
    if report.top1_agreement is not None and name == "decoder":
        assert report.top1_agreement >= 0.99, report
    # the dequantisation is in the program, next to the matmul: int8 operands are converted in it
    assert "xi8" in prog.stablehlo_text("tpu")
    prog.save(tmp_path / "q.tpu")
    float_size = sum(p.numel() * 4 for p in m.parameters())
    assert (tmp_path / "q.tpu").stat().st_size < float_size


def test_cnn_int8_shrinks_about_4x():
    m, args = zoo.resnet18(size=32)
    report = tte.export(m, args, quant_config="int8_weight_only").quant_report
    assert 3.8 < report.shrink <= 4.0, report


def test_unknown_recipe_is_refused():
    m, args = zoo.small_cnn()
    with pytest.raises(tte.InputError, match="unknown quantization recipe 'int4'"):
        tte.export(m, args, quant_config="int4")
    with pytest.raises(tte.InputError, match="for the tpu target"):
        tte.export(m, args, quant_config="dynamic_int8")


def test_cli_quantize_prints_report(tmp_path):
    from conftest import run_cli
    proc = run_cli("examples/zoo.py:small_cnn", "--target", "tpu", "-o", tmp_path / "m.tpu",
                   "--quantize", "int8_weight_only", "--check", "--tolerance", "0.05")
    assert proc.returncode == 0, proc.stderr
    assert "quantization int8_weight_only" in proc.stdout and "smaller" in proc.stdout


def test_int8_recipe_uses_pallas_int8_matmul_on_tpu():
    # kernel-friendly shapes: K and N multiples of 128
    m, args = zoo.llama(dim=256, hidden=512, heads=2, kv_heads=1, head_dim=128, seq=128, max_seq=128, layers=1)
    prog = tte.export(m, args, quant_config="int8_weight_only", kernels="pallas")
    kernels = [k for k in prog.kernels() if k["op"] in ("aten.linear.default", "aten.addmm.default",
                                                        "aten.mm.default")]
    assert kernels and all(k.get("kernel") == "pallas.int8_matmul" for k in kernels), kernels
    assert prog.quant_report.cosine >= 0.999
