"""The op table itself: complete, deterministic, and every sample is a valid call in eager torch."""
import pytest
import torch

from torchtpu_export import optable
from torchtpu_export.core_ops import core_aten_ops


def test_every_core_op_has_an_entry():
    names = set(optable.op_names())
    missing = sorted(str(op) for op in core_aten_ops() if str(op) not in names)
    assert not missing, f"core ATen overloads without a table entry: {missing}"
    assert len(core_aten_ops()) == 193


def test_entries_state_their_tolerance_and_reason():
    for name in optable.op_names():
        e = optable.get(name)
        assert e.tol >= 0 and e.why, name
        assert len(e.samples(optable.Gen(name))) >= 1, name


def test_samples_are_deterministic():
    e = optable.get("aten.add.Tensor")
    a, b = e.all_samples(), e.all_samples()
    assert [s.desc for s in a] == [s.desc for s in b]
    for s, t in zip(a, b):
        for x, y in zip(s.tensors(), t.tensors()):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_half_variants_are_derived_from_float32_samples():
    e = optable.get("aten.sin.default")
    descs = [s.desc for s in e.all_samples()]
    assert any(d.endswith("[float16]") for d in descs) and any(d.endswith("[bfloat16]") for d in descs)
    assert not any(s.lowp and s.dtypes() & {torch.float16, torch.bfloat16} for s in e.all_samples())


@pytest.mark.parametrize("name", optable.op_names())
def test_samples_run_in_eager(name):
    from torchtpu_export.coverage.harness import op_module
    e = optable.get(name)
    samples = e.all_samples()
    module = op_module(e, samples)
    with torch.no_grad():
        outs = module(*[t for s in samples for t in s.tensors()])
    assert len(outs) == len(samples)
    assert all(len(o) >= 1 for o in outs), "every sample must produce a tensor to compare"
