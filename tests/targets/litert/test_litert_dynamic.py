"""Dynamic shapes on LiteRT: one .tflite serves every size in the exported range, bounds included,
on both LiteRT APIs (the Interpreter and CompiledModel)."""
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
from ai_edge_litert import schema_py_generated as fb
from torch.export import Dim

import torchtpu_export as tte
import zoo
from torchtpu_export.numerics import compare

RUNTIMES = ("interpreter", "compiled_model")


def _agree(model, edge, args, signature=None):
    with torch.no_grad():
        ref = pytree.tree_leaves(model(*args))
    for runtime in RUNTIMES:
        agreement = compare(edge.run_flat(list(args), signature, runtime=runtime), ref, rtol=1e-4)
        assert agreement.ok, f"{runtime} {[tuple(a.shape) for a in args]}: {agreement}"


def _signature_of(edge, name):
    # (shape, shape_signature) of a signature input, as the flatbuffer stores them
    model = fb.Model.GetRootAs(edge.model_content(), 0)
    sig = model.SignatureDefs(0)
    sub = model.Subgraphs(sig.SubgraphIndex())
    for i in range(sig.InputsLength()):
        if sig.Inputs(i).Name().decode() == name:
            t = sub.Tensors(sig.Inputs(i).TensorIndex())
            return t.ShapeAsNumpy().tolist(), t.ShapeSignatureAsNumpy().tolist()
    raise KeyError(name)


def test_cnn_dynamic_batch(tmp_path):
    model, args = zoo.resnet18(batch=2, size=32)
    edge = tte.convert(model, args, dynamic_shapes=({0: Dim("batch", min=1, max=16)},))
    edge.export(tmp_path / "m.tflite")
    edge = tte.load(tmp_path / "m.tflite")
    (spec,) = edge.inputs()
    assert isinstance(spec.shape[0], str) and spec.shape[1:] == (3, 32, 32)
    assert list(edge.dim_ranges().values()) == [(1, 16)]
    assert _signature_of(edge, "args_0") == ([2, 3, 32, 32], [-1, 3, 32, 32])
    for n in (1, 5, 16, 2):
        _agree(model, edge, (torch.randn(n, 3, 32, 32),))
    for runtime in RUNTIMES:
        with pytest.raises(tte.InputError, match=r"outside the exported range \[1, 16\]"):
            edge.run_flat([torch.randn(17, 3, 32, 32)], runtime=runtime)
    with pytest.raises(tte.InputError, match="expected shape"):
        edge(torch.randn(2, 3, 16, 32))  # a static dim stays static


@pytest.mark.parametrize("factory", [zoo.llama, zoo.gpt])
def test_decoder_dynamic_batch_and_sequence(factory):
    model, args = factory(batch=2, seq=8)
    edge = tte.convert(model, args, dynamic_shapes=({0: Dim("b", min=1, max=4), 1: Dim("s", min=2, max=64)},))
    assert all(isinstance(d, str) for d in edge.inputs()[0].shape)
    assert sorted(edge.dim_ranges().values()) == [(1, 4), (2, 64)]
    assert _signature_of(edge, "args_0")[1] == [-1, -1]
    for b, s in ((1, 2), (3, 17), (4, 64), (2, 63)):
        _agree(model, edge, (torch.randint(0, 512, (b, s)),))
    with pytest.raises(tte.InputError, match="outside the exported range"):
        edge(torch.randint(0, 512, (1, 65)))


def test_dynamic_prefill_and_static_decode_in_one_file_generate_like_eager():
    # prefill pads a prompt of any length to the cache length; decode is one static step
    model, args = zoo.llama(batch=1, seq=8)
    prefill = zoo.Prefill(model)
    k, v = model.empty_cache(1)
    edge = (tte.signature("prefill", prefill, args, dynamic_shapes=({1: Dim("s", min=2, max=model.max_seq)},))
            .signature("decode", zoo.Decode(model), (torch.tensor([[5]]), torch.tensor([8]), k, v)).convert())
    for s in (2, 33, model.max_seq):
        _agree(prefill, edge, (torch.randint(0, 512, (1, s)),), "prefill")
    prompt = torch.randint(0, 512, (1, 11))
    ours = zoo.generate(lambda t: edge(t, signature_name="prefill"),
                        lambda *a: edge(*a, signature_name="decode"), prompt, steps=6, max_seq=model.max_seq)
    with torch.no_grad():
        assert ours == zoo.generate(model.prefill, model.decode, prompt, steps=6, max_seq=model.max_seq)


def test_unet_dynamic_batch_and_image_size():
    # convolutions, group norms, attention over the pixels and 2x upsampling at every image size;
    # the size is a derived dim (4 * side), which the model reads back from the input's shape
    model, args = zoo.unet(batch=2, size=32)
    b, side = Dim("b", min=1, max=4), Dim("side", min=2, max=16)
    edge = tte.convert(model, args, dynamic_shapes=({0: b, 2: 4 * side, 3: 4 * side}, {0: b}))
    for n, size in ((1, 8), (3, 36), (4, 64)):
        _agree(model, edge, (torch.randn(n, 3, size, size), torch.randint(0, 1000, (n,))))
    with pytest.raises(tte.InputError, match=r"outside the exported range \[8, 64\]"):
        edge(torch.randn(1, 3, 68, 68), torch.randint(0, 1000, (1,)))


def test_encoder_shared_dims_across_inputs():
    model, args = zoo.bert_encoder(batch=2, seq=16)
    b, s = Dim("b", min=1, max=8), Dim("s", min=2, max=32)
    edge = tte.convert(model, args, dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}))
    tokens, mask = edge.inputs()
    assert tokens.shape == mask.shape
    for n, t in ((1, 2), (3, 9), (8, 32)):
        m = torch.ones(n, t, dtype=torch.int64)
        m[-1, t // 2:] = 0
        _agree(model, edge, (torch.randint(0, 1000, (n, t)), m))
    with pytest.raises(tte.InputError, match="must agree"):
        edge(torch.randint(0, 1000, (3, 9)), torch.ones(3, 10, dtype=torch.int64))


class _Gather(torch.nn.Module):
    def forward(self, x):
        return torch.gather(x, 1, torch.zeros_like(x, dtype=torch.int64)) * 2


class _AdaptivePool(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(x, (2, 2))


@pytest.mark.parametrize("module, shape, dims, op", [
    (_Gather(), (2, 8), {1: Dim("n", min=2, max=64)}, "aten.gather.default"),
    (_AdaptivePool(), (2, 3, 8, 8), {2: Dim("h", min=2, max=64)}, "aten.adaptive_avg_pool2d.default"),
])
def test_an_op_that_cannot_be_dynamic_says_which_where_and_why(module, shape, dims, op):
    with pytest.raises(tte.UnsupportedOpError) as info:
        tte.convert(module, (torch.randn(*shape),), dynamic_shapes=(dims,))
    err = info.value
    assert err.op == op and err.target == "litert"
    assert "test_litert_dynamic.py" in (err.source or "")
    assert "cannot have a dynamic size" in str(err) and "conversion" in str(err)


def test_dynamic_ops_on_sizes_match_eager():
    # sizes used as values (arange, full, division by a dynamic count), dynamic slicing and padding
    class Sizes(torch.nn.Module):
        def forward(self, x):
            n = x.shape[1]
            pos = torch.arange(n, dtype=torch.float32) / n
            ones = torch.ones(x.shape[0], n)
            y = x[:, 1:] - x[:, :-1]
            y = torch.nn.functional.pad(y, (0, 1))
            z = torch.nn.functional.pad(x[None], (2, 1), mode="replicate")[0, :, 1:-2] + torch.roll(x, -2, 1)
            return x * pos + ones + y + z + x.var(dim=1, keepdim=True) + x[:, -3:].sum(1, keepdim=True)

    model = Sizes()
    edge = tte.convert(model, (torch.randn(2, 8),), dynamic_shapes=({0: Dim("b", min=1, max=8),
                                                                     1: Dim("n", min=4, max=100)},))
    for b, n in ((1, 4), (5, 37), (8, 100)):
        _agree(model, edge, (torch.randn(b, n),))
    assert np.asarray(edge(torch.randn(3, 11))).shape == (3, 11)
