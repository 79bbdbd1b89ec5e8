"""The ONNX target: export through torch.onnx, save atomically, load and run on ONNX Runtime."""
import os

import numpy as np
import pytest
import torch

import torchtpu_export as tte
import zoo
from torchtpu_export.errors import InputError, UnsupportedOpError


class Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, extra):
        return {"y": torch.relu(self.fc(x)) * extra["scale"], "spectrum": torch.fft.rfft(x)}


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, generator=g), {"scale": torch.tensor(1.5)}


def test_export_call_save_load(tmp_path):
    model, (x, extra) = Structured().eval(), _args()
    prog = tte.export(model, (x, extra), target="onnx")
    assert [s.name for s in prog.inputs()] == ["x", "extra_scale"]
    assert [s.dtype for s in prog.outputs()] == ["float32", "complex64"]
    with torch.no_grad():
        ref = model(x, extra)
    got = prog(x, extra)
    assert set(got) == {"y", "spectrum"}
    np.testing.assert_allclose(got["y"], ref["y"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["spectrum"], ref["spectrum"].numpy(), rtol=1e-5, atol=1e-5)

    path = tmp_path / "m.onnx"
    prog.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temp file left behind
    loaded = tte.load(path)
    np.testing.assert_array_equal(loaded(x.numpy(), {"scale": np.float32(1.5)})["y"], got["y"])
    flat = loaded.run_flat([x.numpy(), np.asarray(1.5, np.float32)])
    np.testing.assert_array_equal(flat[0], got["y"])


def test_zoo_model_agrees_with_eager():
    model, args = zoo.small_cnn()
    prog = tte.export(model, args, target="onnx")
    with torch.no_grad():
        ref = model(*args)
    np.testing.assert_allclose(prog(*args), ref.numpy(), rtol=1e-4, atol=1e-5)


def test_foreign_onnx_file_runs_with_flat_inputs(tmp_path):
    import onnx
    from onnx import TensorProto, helper
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])])
    path = tmp_path / "add.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    prog = tte.load(path)
    assert [s.name for s in prog.inputs()] == ["a", "b"]
    np.testing.assert_array_equal(prog(np.ones(2, np.float32), np.full(2, 2, np.float32)), [3, 3])


def test_unsupported_op_is_reported_by_name():
    class Pdist(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.pdist(x)
    with pytest.raises(UnsupportedOpError) as e:
        tte.export(Pdist(), (torch.randn(4, 3),), target="onnx")
    assert e.value.op == "aten._pdist_forward.default" and e.value.target == "onnx"


def test_bad_options_and_signatures():
    model, args = zoo.small_cnn()
    with pytest.raises(TypeError, match="unknown option"):
        tte.export(model, args, target="onnx", colour="blue")
    prog = tte.export(model, args, target="onnx")
    with pytest.raises(InputError, match="one program"):
        prog.inputs("decode")


def test_cli_convert_and_run(cli, tmp_path):
    out = tmp_path / "cnn.onnx"
    r = cli("examples/zoo.py:small_cnn", "--target", "onnx", "-o", out, "--check")
    assert r.returncode == 0, r.stderr
    assert os.path.getsize(out) > 0 and "check: OK" in r.stdout
    r = cli("run", out)
    assert r.returncode == 0, r.stderr
    assert "output_0: float32" in r.stdout
