"""The edge target's pieces: API and CLI, errors, the layout pass, the writer, and a sample of builders."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import torchtpu_export as tte
import zoo
from torchtpu_export.converters.litert.ir import Graph, Op, Tensor
from torchtpu_export.converters.litert.layout import reshape_keeps_order
from torchtpu_export.converters.litert.writer import serialize
from torchtpu_export import EdgeModel
from torchtpu_export.numerics import compare


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _check(module, args, rtol=1e-5):
    module.eval()
    edge = tte.convert(module, args)
    with torch.no_grad():
        ref = [r.numpy() for r in pytree.tree_leaves(module(*args))]
    agreement = compare(pytree.tree_leaves(edge(*args)), ref, rtol=rtol)
    assert agreement.ok, agreement
    return edge


R = torch.randn
# Builders the zoo models do not reach; the op coverage matrix runs every core op.
CASES = {
    "conv_transpose_output_padding": (torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
                                      (R(1, 3, 5, 5),)),
    "grouped_conv1d": (torch.nn.Conv1d(4, 6, 3, groups=2, padding=1), (R(1, 4, 8),)),
    "avg_pool_ceil_exclude_pad": (Fn(lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)),
                                  (R(1, 3, 10, 10),)),
    "bilinear_align_corners": (Fn(lambda x: F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=True)),
                               (R(1, 2, 3, 3),)),
    "nearest_non_integer": (Fn(lambda x: F.interpolate(x, size=(5, 7))), (R(1, 2, 3, 3),)),
    "embedding_bag_mean": (torch.nn.EmbeddingBag(10, 3, mode="mean"),
                           (torch.tensor([1, 4, 2, 9, 0, 3]), torch.tensor([0, 2, 2]))),
    "scatter_add": (Fn(lambda x, i, s: x.scatter_add(0, i, s)),
                    (R(3, 5), torch.tensor([[0, 1, 2, 0, 1], [2, 2, 0, 1, 0]]), R(2, 5))),
    "index_put_accumulate": (Fn(lambda x, i, v: x.index_put((i,), v, accumulate=True)),
                             (R(5, 3), torch.tensor([0, 3, 0]), R(3, 3))),
    # repeated positions: the last write wins, as in torch's CPU kernels (not their sum)
    "index_put_repeated": (Fn(lambda x, i, v: x.index_put((i,), v)), (R(5, 3), torch.tensor([0, 3, 0, 0]), R(4, 3))),
    "max_unpool_repeated": (Fn(lambda x, i: F.max_unpool2d(x, i, 2, output_size=(4, 4))),
                            (R(1, 2, 2, 2), torch.tensor([[[[0, 0], [5, 5]], [[15, 3], [15, 3]]]]))),
    "avg_pool3d_ceil_divisor": (Fn(lambda x: F.avg_pool3d(x, (2, 3, 4), (1, 2, 2), (0, 1, 2), ceil_mode=True,
                                                        divisor_override=2)), (R(1, 2, 5, 5, 5),)),
    "addmv_addbmm": (Fn(lambda b, m, v, b1, b2: (torch.addmv(b, m, v, beta=0.5, alpha=2.0),
                                                 torch.addbmm(m, b1, b2, alpha=0.5))),
                     (R(4), R(4, 3), R(3), R(2, 4, 5), R(2, 5, 3))),
    "round_decimals": (Fn(lambda x: (torch.round(x, decimals=2), torch.round(x * 1e3, decimals=-2))), (R(3, 4),)),
    "sort_topk": (Fn(lambda x: (torch.sort(x, 1, descending=True).values, torch.topk(x, 2, 0).indices)), (R(3, 5),)),
    "trunc_division_ints": (Fn(lambda a, b: torch.div(a, b, rounding_mode="trunc")),
                            (torch.tensor([[-7, 7, -3, 5]]), torch.tensor([[2, -2, 2, 3]]))),
    "erf_asinh_atanh": (Fn(lambda x: torch.erf(x) + torch.asinh(3 * x) + torch.atanh(x.clamp(-0.9, 0.9))), (R(4, 5),)),
    "group_norm_3d": (torch.nn.GroupNorm(2, 4), (R(2, 4, 6),)),
    "bitwise_int32_extremes": (Fn(lambda a, b: (a & b, a | b, a ^ b)),
                               (torch.tensor([0, -1, 5, 2**31 - 1, -2**31, 123456789], dtype=torch.int32),
                                torch.tensor([3, -1, 12, -2**31, 2**31 - 1, -98765], dtype=torch.int32))),
    "max_pool_indices": (Fn(lambda x: torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1])),
                         (R(1, 2, 7, 6),)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_builder_agrees_with_eager(name):
    module, args = CASES[name]
    _check(module if isinstance(module, torch.nn.Module) else Fn(module), args)


def test_int64_inputs_and_outputs_keep_torch_dtypes():
    edge = _check(Fn(lambda t: (t * 3 + 1, t.float().mean())), (torch.tensor([[1, 2, 3]]),))
    assert edge.inputs()[0].dtype == "int64"
    out = edge(torch.tensor([[4, 5, 6]]))
    assert out[0].dtype == np.int64 and out[0].tolist() == [[13, 16, 19]]


def test_unsupported_op_names_the_op_and_the_source_line():
    with pytest.raises(tte.UnsupportedOpError) as info:
        tte.convert(Fn(lambda x: torch.nonzero(x > 0).float().sum() + x.sum()), (R(3, 4),))
    err = info.value
    assert err.op == "aten.nonzero.default" and err.target == "litert"
    assert "test_litert_converter.py" in (err.source or "")
    assert "data" in str(err)


def test_export_with_target_litert_is_convert(tmp_path):
    model, args = zoo.small_cnn()
    edge = tte.export(model, args, target="litert")
    assert isinstance(edge, EdgeModel)
    assert edge.model_content() == edge.tflite_model() == tte.convert(model, args).model_content()
    with pytest.raises(tte.OutputError):
        edge.export(tmp_path / "missing" / "m.tflite")
    assert not (tmp_path / "missing").exists()
    with pytest.raises(tte.InputError):
        edge(R(1, 3, 8, 8))  # wrong shape: one clear error, no LiteRT crash
    with pytest.raises(tte.InputError):
        tte.convert(model, args, quant_config={"int8": True})


def test_cli_converts_checks_and_inspects(cli, tmp_path):
    out = tmp_path / "cnn.tflite"
    r = cli("examples/zoo.py:small_cnn", "--target", "litert", "-o", out, "--check")
    assert r.returncode == 0, r.stderr
    assert "check: OK" in r.stdout
    r = cli("inspect", out)
    assert r.returncode == 0, r.stderr
    assert "signature serving_default" in r.stdout and "CONV_2D 2" in r.stdout and "TRANSPOSE ops: 1" in r.stdout
    r = cli("run", out)
    assert r.returncode == 0, r.stderr
    assert "output_0: float32[1, 10]" in r.stdout


def _add_graph():
    g = Graph("serving_default")
    x = Tensor("x", (1, 4), np.float32)
    y = Tensor("output_0", (1, 4), np.float32)
    w = Tensor("w", (4,), np.float32, np.arange(4, dtype=np.float32))
    g.inputs, g.input_names = [x], ["x"]
    g.ops = [Op("ADD", [x, w], [y], {"fusedActivationFunction": 1})]
    g.outputs, g.output_names = [y], ["output_0"]
    return g


def test_buffers_after_the_flatbuffer_load_and_run(tmp_path):
    # the layout used past 2 GB, forced here on a tiny model
    content = serialize([_add_graph()], external_threshold=0)
    assert content[4:8] == b"TFL3"
    path = tmp_path / "ext.tflite"
    path.write_bytes(content)
    for edge in (EdgeModel(content), tte.load(path)):
        for runtime in ("interpreter", "compiled_model"):
            out = edge.run_flat([np.array([[-5, 1, 2, 3]], np.float32)], runtime=runtime)
            assert out[0].tolist() == [[0, 2, 4, 6]]


def test_foreign_tflite_runs_positionally():
    edge = EdgeModel(serialize([_add_graph()]))  # no torchtpu_export metadata
    assert [s.name for s in edge.inputs()] == ["x"]
    assert edge(np.ones((1, 4), np.float32)).tolist() == [[1, 2, 3, 4]]


def test_reshape_layout_compatibility():
    nhwc4, nlc3 = (0, 2, 3, 1), (0, 2, 1)
    assert reshape_keeps_order((1, 64, 1, 1), nhwc4, (1, 64), (0, 1))  # only size-1 dims move
    assert reshape_keeps_order((1, 64, 8, 8), nhwc4, (1, 64, 64), nlc3)  # (N, H, W, C) -> (N, HW, C)
    assert not reshape_keeps_order((1, 64, 8, 8), nhwc4, (1, 64, 64), (0, 1, 2))
    assert not reshape_keeps_order((1, 4, 16, 64), nhwc4, (1, 64, 8, 8), nhwc4)


def test_damaged_files_are_refused(tmp_path):
    model, args = zoo.small_cnn()
    content = tte.convert(model, args).model_content()
    flipped = bytearray(content)
    flipped[len(content) // 2] ^= 0x40  # inside the weights
    for name, data in (("truncated", content[: len(content) // 3]), ("flipped", bytes(flipped))):
        path = tmp_path / f"{name}.tflite"
        path.write_bytes(data)
        with pytest.raises(tte.ArtifactError):
            tte.load(path)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample_modes(mode, padding_mode, align_corners):
    g = torch.Generator().manual_seed(0)
    x, grid = torch.randn(2, 3, 5, 7, generator=g), torch.rand(2, 4, 6, 2, generator=g) * 2.6 - 1.3  # some outside
    _check(Fn(lambda x, grid: F.grid_sample(x, grid, mode=mode, padding_mode=padding_mode,
                                            align_corners=align_corners)), (x, grid))
