"""LiteRT quantization: every recipe on a CNN, a transformer encoder and a decoder, and pt2e models.

Bounds (documented in docs/guides/quantization.md): weights shrink about 4x (int8, dynamic_int8) or 2x (fp16); against
float (torch eager) on random inputs that are not the calibration samples, dynamic_int8 keeps the
top-1 of logits on >= 99% of rows and cosine >= 0.999, int8 keeps cosine >= 0.99, fp16 >= 0.9999.
"""
import os

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from ai_edge_litert import schema_py_generated as fb

import pt2e_like
from conftest import REPO
import torchtpu_export as tte
import zoo
from torchtpu_export.converters.litert.quantize import MIN_ELEMENTS
from torchtpu_export.errors import InputError, UnsupportedOpError
from torchtpu_export.quant import measure

MODELS = {
    "cnn": lambda: zoo.mobilenet_v2(size=64, batch=2),
    "encoder": lambda: zoo.bert_encoder(),
    "decoder": lambda: zoo.llama(seq=32),
}
LOGITS = {"cnn", "decoder"}  # models whose (first) output is class or token logits


def random_like(args, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(a.shape, generator=g) if a.is_floating_point()
                 else torch.randint(0, int(a.max()) + 1, a.shape, generator=g, dtype=a.dtype) for a in args)


def error_on_random_inputs(m, edge, args, recipe, seeds=range(100, 104)):
    """The report of ``edge`` against torch eager over several random inputs (none used to calibrate)."""
    ref, got = [], []
    with torch.no_grad():
        for s in seeds:
            x = random_like(args, s)
            ref += [t.numpy() for t in pytree.tree_leaves(m(*x))][:1]
            got += pytree.tree_leaves(edge(*x))[:1]
    return measure(recipe, [np.concatenate([r.reshape(-1, r.shape[-1]) for r in ref])],
                   [np.concatenate([o.reshape(-1, o.shape[-1]) for o in got])], 1, 1)


def tensor_types(content: bytes, code: str) -> list[list[str]]:
    """For each op ``code`` in the model: the types of its inputs (``-`` for an omitted one)."""
    return [[t for t, _ in op] for op in op_inputs(content, code)]


def op_inputs(content: bytes, code: str) -> list[list[tuple[str, int]]]:
    """For each op ``code`` in the model: (type, element count) of its inputs."""
    model = fb.Model.GetRootAs(content, 0)
    names = {v: k for k, v in vars(fb.TensorType).items() if not k.startswith("_")}
    codes = [max(model.OperatorCodes(i).BuiltinCode(), model.OperatorCodes(i).DeprecatedBuiltinCode())
             for i in range(model.OperatorCodesLength())]
    want = getattr(fb.BuiltinOperator, code)
    sub = model.Subgraphs(0)
    out = []
    for j in range(sub.OperatorsLength()):
        op = sub.Operators(j)
        if codes[op.OpcodeIndex()] == want:
            out.append([(names[sub.Tensors(i).Type()], int(np.prod(sub.Tensors(i).ShapeAsNumpy()))) if i >= 0
                        else ("-", 0) for i in op.InputsAsNumpy()])
    return out


def op_version(content: bytes, code: str) -> int:
    model = fb.Model.GetRootAs(content, 0)
    for i in range(model.OperatorCodesLength()):
        oc = model.OperatorCodes(i)
        if max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode()) == getattr(fb.BuiltinOperator, code):
            return oc.Version()
    raise KeyError(code)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    name = request.param
    m, args = MODELS[name]()
    return name, m, args, tte.convert(m, args)


def test_fp16(model):
    name, m, args, float_edge = model
    edge = tte.convert(m, args, quant_config="fp16")
    r = edge.quant_report
    assert 1.9 <= r.shrink <= 2.0, r
    assert len(edge.model_content()) < 0.55 * len(float_edge.model_content())
    assert all(t[0] == "FLOAT16" for t in tensor_types(edge.model_content(), "DEQUANTIZE"))
    assert error_on_random_inputs(m, edge, args, "fp16").cosine >= 0.9999


def test_dynamic_int8(model):
    name, m, args, float_edge = model
    edge = tte.convert(m, args, quant_config="dynamic_int8")
    r = edge.quant_report
    assert 3.5 <= r.shrink <= 4.0, r
    content = edge.model_content()
    assert len(content) < 0.3 * len(float_edge.model_content())
    # hybrid kernels: float activations, int8 weights
    fcs = tensor_types(content, "FULLY_CONNECTED")
    assert fcs and all(t[:2] == ["FLOAT32", "INT8"] for t in fcs), fcs
    assert op_version(content, "FULLY_CONNECTED") == 12  # hybrid with per-channel scales
    if name == "cnn":  # every conv with enough weights to matter
        convs = [(x[0], w[0]) for x, w, *_ in op_inputs(content, "CONV_2D") if w[1] >= MIN_ELEMENTS]
        assert len(convs) > 20 and all(c == ("FLOAT32", "INT8") for c in convs), convs
        # depthwise weights are int8 too, dequantized at load (the hybrid depthwise kernel is slow)
        big_dw = [w for _, w, *_ in op_inputs(content, "DEPTHWISE_CONV_2D") if w[1] >= MIN_ELEMENTS]
        assert big_dw and len(tensor_types(content, "DEQUANTIZE")) == len(big_dw)
        assert all(t == ["INT8"] for t in tensor_types(content, "DEQUANTIZE"))
        assert op_version(content, "DEQUANTIZE") == 5  # per-channel
    else:
        assert tensor_types(content, "EMBEDDING_LOOKUP")[0][1] == "INT8"
    err = error_on_random_inputs(m, edge, args, "dynamic_int8")
    assert err.cosine >= 0.999, err
    if name in LOGITS:
        assert err.top1_agreement >= 0.99, err
    # the CompiledModel API runs the same file to the same numbers
    x = [t.numpy() for t in random_like(args, 7)]
    a = edge.run_flat(x)
    b = edge.run_flat(x, runtime="compiled_model")
    np.testing.assert_allclose(a[0], b[0], rtol=1e-3, atol=1e-3 * np.abs(a[0]).max())


def test_int8(model):
    name, m, args, float_edge = model
    calibration = [random_like(args, s) for s in range(8)]
    edge = tte.convert(m, args, quant_config={"recipe": "int8", "calibration": calibration})
    r = edge.quant_report
    assert 3.5 <= r.shrink <= 4.0, r
    content = edge.model_content()
    for code in ("FULLY_CONNECTED",) + (("CONV_2D", "DEPTHWISE_CONV_2D") if name == "cnn" else ("BATCH_MATMUL",)):
        ops = tensor_types(content, code)
        assert ops and all(t[0] == "INT8" for t in ops), (code, ops)
    for t in tensor_types(content, "FULLY_CONNECTED"):
        assert t[1] == "INT8" and t[2:] in ([], ["INT32"], ["-"])  # bias int32 at input scale x weight scale
    # float inputs and outputs by default; the layout pass worked as on the float graph
    assert [s.dtype for s in edge.inputs()] == [s.dtype for s in float_edge.inputs()]
    assert content.count(b"TRANSPOSE") == float_edge.model_content().count(b"TRANSPOSE")
    err = error_on_random_inputs(m, edge, args, "int8")
    assert err.cosine >= 0.99, err
    x = [t.numpy() for t in random_like(args, 7)]
    np.testing.assert_allclose(edge.run_flat(x)[0], edge.run_flat(x, runtime="compiled_model")[0],
                               atol=1e-6 * np.abs(edge.run_flat(x)[0]).max())
    if name == "cnn":  # fully integer between the input QUANTIZE and the output DEQUANTIZE
        assert len(tensor_types(content, "QUANTIZE")) == 1 and len(tensor_types(content, "DEQUANTIZE")) == 1


def test_int8_integer_io(tmp_path):
    m, args = zoo.small_cnn(batch=2)
    calibration = [random_like(args, s) for s in range(4)]
    edge = tte.convert(m, args, quant_config={"recipe": "int8", "calibration": calibration, "integer_io": True})
    edge.export(tmp_path / "m.tflite")
    from ai_edge_litert.interpreter import Interpreter
    runner = Interpreter(model_path=str(tmp_path / "m.tflite")).get_signature_runner()
    (inp,) = runner.get_input_details().values()
    (out,) = runner.get_output_details().values()
    assert inp["dtype"] == np.int8 and out["dtype"] == np.int8
    scale, zero = inp["quantization"]
    assert scale > 0
    # the file takes int8 values; the EdgeModel (fresh from the file too) takes and gives floats like the module
    for e in (edge, tte.load(tmp_path / "m.tflite")):
        got = e(*args)
        assert got.dtype == np.float32
        with torch.no_grad():
            ref = m(*args).numpy()
        assert measure("int8", [ref], [got], 1, 1).cosine >= 0.99
    x = np.clip(np.rint(args[0].numpy() / scale) + zero, -128, 127).astype(np.int8)
    raw = runner(**{next(iter(runner.get_input_details())): x})
    q_scale, q_zero = out["quantization"]
    np.testing.assert_allclose((next(iter(raw.values())).astype(np.float32) - q_zero) * q_scale, edge(*args),
                               atol=1e-6)


def test_pt2e_model_converts_to_int8_ops():
    m, args = zoo.small_cnn(batch=2)
    qm = pt2e_like.quantize(m, args, [random_like(args, s) for s in range(4)])
    assert pt2e_like.count(qm, torch.ops.quantized_decomposed.quantize_per_tensor.default) >= 5
    edge = tte.convert(qm, args)
    content = edge.model_content()
    for code in ("CONV_2D", "FULLY_CONNECTED", "MAX_POOL_2D", "MEAN"):
        ops = tensor_types(content, code)
        assert ops and all(t[0] == "INT8" for t in ops), (code, ops)
    r = edge.quant_report
    assert r.recipe == "pt2e" and r.shrink > 3.5, r
    # the int8 kernels compute what pt2e's float simulation says, up to rounding
    err = error_on_random_inputs(qm, edge, args, "pt2e")
    assert err.cosine >= 0.9999 and err.max_rel_err < 0.02, err
    with pytest.raises(InputError, match="already quantized"):
        tte.convert(qm, args, quant_config="dynamic_int8")


def test_real_pt2e_file_converts_to_int8_ops(tmp_path, cli):
    """A .pt2 made by the real flow (torchao prepare/convert_pt2e, litert-torch's PT2EQuantizer):
    tests/data/make_small_cnn_pt2e.py."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401
    path = os.path.join(REPO, "tests", "data", "small_cnn_pt2e.pt2")
    out = tmp_path / "m.tflite"
    r = cli(path, "--target", "litert", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "quantization pt2e" in r.stdout
    content = out.read_bytes()
    for code in ("CONV_2D", "FULLY_CONNECTED", "MAX_POOL_2D", "MEAN"):
        ops = tensor_types(content, code)
        assert ops and all(t[0] == "INT8" for t in ops), (code, ops)
    ep = torch.export.load(path)
    args = ep.example_inputs[0]
    err = error_on_random_inputs(ep.module(), tte.load(out), args, "pt2e")
    assert err.cosine >= 0.9999 and err.max_rel_err < 0.02, err


def test_pt2e_linear_stack():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)).eval()
    args = (torch.randn(4, 64),)
    qm = pt2e_like.quantize(m, args, [random_like(args, s) for s in range(4)])
    edge = tte.convert(qm, args)
    fcs = tensor_types(edge.model_content(), "FULLY_CONNECTED")
    assert len(fcs) == 2 and all(t == ["INT8", "INT8", "INT32"] for t in fcs), fcs
    assert error_on_random_inputs(qm, edge, args, "pt2e").cosine >= 0.9999


def test_signatures_share_quantized_weights():
    m, (tokens,) = zoo.llama(seq=8)
    single = tte.convert(m, (tokens,), quant_config="dynamic_int8")
    both = tte.signature("a", m, (tokens,)).signature("b", m, (tokens[:, :4],)).convert(quant_config="dynamic_int8")
    # the int8 weights are stored once for both signatures (each subgraph has its own tensors' scales)
    assert both.quantization["weight_bytes"] < 1.05 * single.quantization["weight_bytes"]
    assert len(both.model_content()) < 1.15 * len(single.model_content())
    np.testing.assert_allclose(both(tokens, signature_name="a"), single(tokens), rtol=1e-5, atol=1e-5)


def test_calibration_per_signature():
    m, (tokens,) = zoo.llama(seq=8)
    short = tokens[:, :4]
    cal = {"a": [random_like((tokens,), s) for s in range(2)], "b": [random_like((short,), s) for s in range(2)]}
    edge = tte.signature("a", m, (tokens,)).signature("b", m, (short,)).convert(
        quant_config={"recipe": "int8", "calibration": cal})
    with torch.no_grad():
        ref = m(short).numpy()
    assert measure("int8", [ref], [edge(short, signature_name="b")], 1, 1).cosine >= 0.99


def test_quant_config_errors():
    m, args = zoo.small_cnn()
    with pytest.raises(InputError, match="unknown quantization recipe"):
        tte.convert(m, args, quant_config="int4")
    with pytest.raises(InputError, match="needs calibration"):
        tte.convert(m, args, quant_config="int8")
    with pytest.raises(InputError, match="calibration sample 1"):
        tte.convert(m, args, quant_config={"recipe": "int8", "calibration": [args, (torch.randn(1, 3, 8, 8),)]})
    with pytest.raises(InputError, match="unknown option"):
        tte.convert(m, args, quant_config={"recipe": "dynamic_int8", "calibration": [args]})
    with pytest.raises(InputError, match="skip_passes"):
        tte.convert(m, args, quant_config="fp16", skip_passes=("quantize_weights",))


def test_dynamic_pt2e_is_refused_clearly():
    qd = torch.ops.quantized_decomposed

    class Dyn(torch.nn.Module):
        def forward(self, x):
            scale, zero = qd.choose_qparams.tensor(x, -128, 127, 1e-6, torch.int8)
            q = qd.quantize_per_tensor.tensor(x, scale, zero, -128, 127, torch.int8)
            return qd.dequantize_per_tensor.tensor(q, scale, zero, -128, 127, torch.int8) * 2

    with pytest.raises(UnsupportedOpError, match="dynamic_int8"):
        tte.convert(Dyn(), (torch.randn(2, 8),))


def test_cli_prints_the_report(tmp_path, cli):
    out = tmp_path / "m.tflite"
    r = cli("examples/zoo.py:small_cnn", "--target", "litert", "--quantize", "dynamic_int8", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "quantization dynamic_int8" in r.stdout and "cosine" in r.stdout
    r = cli("inspect", str(out))
    assert "quantized: dynamic_int8" in r.stdout


def test_report_with_keyword_and_constant_inputs():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)

        def forward(self, x, *, bias, scale=1.0):
            return self.fc(x) * scale + bias

    m = M()
    edge = tte.convert(m, (torch.randn(2, 64),), {"bias": torch.randn(64), "scale": 2.0}, quant_config="dynamic_int8")
    assert edge.quant_report.cosine >= 0.999 and edge.quant_report.shrink > 3.5, edge.quant_report


def test_int8_calibrates_0d_and_numpy_inputs():
    # a 0-d input (a scale, a temperature) stays 0-d through calibration and at run time, also as numpy
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 32)

        def forward(self, x, t):
            return self.fc(x) * t

    torch.manual_seed(0)
    m = Scaled().eval()
    x, t = torch.randn(4, 64), torch.tensor(1.5)
    calib = [(torch.randn(4, 64), torch.tensor(v)) for v in (0.5, 1.0, 2.0)]
    edge = tte.convert(m, (x, t), quant_config={"recipe": "int8", "calibration": calib})
    got = edge(x.numpy(), np.asarray(1.5, np.float32))
    assert got.shape == (4, 32)
    assert measure("int8", [m(x, t).detach()], [got], 0, 0).cosine >= 0.99
