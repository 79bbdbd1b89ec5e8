"""Edge I/O options: io_dtypes="web" (LiteRT.js types at the boundary) and channels_last_io (NHWC images)."""
import numpy as np
import pytest
import torch

import torchtpu_export as tte
import zoo
from torchtpu_export.targets.litert.target import describe as describe_tflite
from torchtpu_export.numerics import compare


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 8)

    def forward(self, ids, mask):
        h = self.emb(ids) * mask.unsqueeze(-1).float()
        return h.sum(1), ids.max(dim=1).values, mask.any(dim=1)


def _file_io(edge, tmp_path):
    path = tmp_path / "m.tflite"
    edge.export(path)
    d = describe_tflite(str(path))["programs"]["serving_default"]
    return [i["dtype"] for i in d["inputs"]], [o["dtype"] for o in d["outputs"]]


def test_web_io_dtypes_are_litertjs_types_and_values_roundtrip(tmp_path):
    ids = torch.randint(0, 1000, (2, 5))
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    model = Masked()
    edge = tte.convert(model, (ids, mask), io_dtypes="web")
    ins, outs = _file_io(edge, tmp_path)
    assert set(ins) | set(outs) <= {"float32", "int32", "uint8"}, (ins, outs)
    got = edge(ids, mask)
    want = model(ids, mask)
    assert got[1].dtype == np.int64 and got[2].dtype == np.bool_  # torch's dtypes come back
    assert compare(list(got), [w.detach().numpy() for w in want]).ok
    # default: bool stays bool at the boundary
    ins, _ = _file_io(tte.convert(model, (ids, mask)), tmp_path)
    assert ins == ["int32", "bool"]


def test_web_io_refuses_token_ids_that_do_not_fit_int32():
    class Ids(torch.nn.Module):
        def forward(self, ids):
            return ids * 2
    edge = tte.convert(Ids(), (torch.tensor([1, 2]),), io_dtypes="web")
    with pytest.raises(tte.InputError, match="do not fit in int32"):
        edge(torch.tensor([1, 2**40]))


def test_channels_last_io_has_no_boundary_transpose_and_matches_eager(tmp_path):
    model, (x,) = zoo.mobilenet_v2(size=64)
    nchw = tte.convert(model, (x,))
    nhwc = tte.convert(model, (x,), channels_last_io=True)
    assert describe_tflite_transposes(nchw, tmp_path) == 1 and describe_tflite_transposes(nhwc, tmp_path) == 0
    assert nhwc.inputs()[0].shape == (1, 64, 64, 3)
    with torch.no_grad():
        want = model(x).numpy()
    assert compare([nhwc(x.permute(0, 2, 3, 1).numpy())], [want]).ok


def test_channels_last_outputs_are_nhwc_too():
    model, (x, t) = zoo.unet()
    edge = tte.convert(model, (x, t), channels_last_io=True)
    with torch.no_grad():
        want = model(x, t).permute(0, 2, 3, 1).numpy()
    assert compare([edge(x.permute(0, 2, 3, 1).numpy(), t)], [want]).ok


def test_channels_last_needs_an_image_and_cli_flags(tmp_path):
    with pytest.raises(tte.InputError, match="4-D floating input"):
        tte.convert(torch.nn.Linear(3, 3), (torch.randn(2, 3),), channels_last_io=True)
    from conftest import run_cli
    r = run_cli("examples/zoo.py:small_cnn", "--target", "litert", "--channels-last", "--check",
                "-o", tmp_path / "m.tflite")
    assert r.returncode == 0, r.stderr
    assert "check: OK" in r.stdout
    r = run_cli("examples/zoo.py:small_cnn", "--target", "tpu", "--io-dtypes", "web", "-o", tmp_path / "m.tpu")
    assert r.returncode == 2 and "--io-dtypes applies to --target litert" in r.stderr
    r = run_cli("examples/zoo.py:small_cnn", "--target", "litert", "--kernels", "xla", "-o", tmp_path / "m.tflite")
    assert r.returncode == 2 and "--kernels applies to --target tpu" in r.stderr


def describe_tflite_transposes(edge, tmp_path):
    path = tmp_path / "t.tflite"
    edge.export(path)
    return describe_tflite(str(path))["programs"]["serving_default"]["op_histogram"].get("TRANSPOSE", 0)
