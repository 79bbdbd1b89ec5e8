"""Dynamic shapes: one artifact serves every size in the exported range, bounds included."""
import pytest
import torch
import torch.utils._pytree as pytree
from torch.export import Dim

import torchtpu_export as tte
import zoo
from torchtpu_export.numerics import compare


def _agree(model, prog, args):
    with torch.no_grad():
        ref = pytree.tree_leaves(model(*args))
    agreement = compare(pytree.tree_leaves(prog(*args)), ref, rtol=1e-5)
    assert agreement.ok, f"{[tuple(a.shape) for a in args]}: {agreement}"


def test_cnn_dynamic_batch(tmp_path):
    model, args = zoo.resnet18(batch=2, size=32)
    batch = Dim("batch", min=1, max=16)
    prog = tte.export(model, args, dynamic_shapes=({0: batch},))
    prog.save(tmp_path / "m.tpu")
    prog = tte.load(tmp_path / "m.tpu")
    (spec,) = prog.inputs()
    assert isinstance(spec.shape[0], str) and spec.shape[1:] == (3, 32, 32)
    assert list(prog.manifest["programs"]["main"]["dims"].values()) == [[1, 16]]
    for n in (1, 5, 16):
        _agree(model, prog, (torch.randn(n, 3, 32, 32),))
    with pytest.raises(tte.InputError, match=r"outside the exported range \[1, 16\]"):
        prog(torch.randn(17, 3, 32, 32))


def test_decoder_dynamic_batch_and_sequence():
    model, args = zoo.llama(batch=2, seq=8)
    prog = tte.export(model, args, dynamic_shapes=({0: Dim("b", min=1, max=4), 1: Dim("s", min=2, max=64)},))
    assert all(isinstance(d, str) for d in prog.inputs()[0].shape)
    assert sorted(map(tuple, prog.manifest["programs"]["main"]["dims"].values())) == [(1, 4), (2, 64)]
    for b, s in ((1, 2), (3, 17), (4, 64)):
        _agree(model, prog, (torch.randint(0, 512, (b, s)),))


def test_encoder_shared_dims_across_inputs():
    model, args = zoo.bert_encoder(batch=2, seq=16)
    b, s = Dim("b", min=1, max=8), Dim("s", min=2, max=32)
    prog = tte.export(model, args, dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}))
    _agree(model, prog, (torch.randint(0, 1000, (3, 9)), torch.ones(3, 9, dtype=torch.int64)))
    with pytest.raises(tte.InputError, match="must agree"):
        prog(torch.randint(0, 1000, (3, 9)), torch.ones(3, 10, dtype=torch.int64))


def test_sample_of_size_one_in_a_dynamic_dim_is_explained():
    model, args = zoo.small_cnn(batch=1)
    with pytest.raises(tte.CaptureError) as e:
        tte.export(model, args, dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    assert "size >= 2" in e.value.user_message()
