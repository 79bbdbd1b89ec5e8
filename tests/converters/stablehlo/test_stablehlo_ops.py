"""Lowerings that need more than the op table's per-op check: data-dependent output lengths."""
import numpy as np
import pytest
import torch

import torchtpu_export as tte


class Selects(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0), x[x > 0.5], x.amax()


def test_data_dependent_outputs_are_trimmed_after_reload(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    prog = tte.export(Selects(), (x,), target="tpu", platforms=("cpu",))
    assert [s.shape for s in prog.outputs()] == [("u0", 2), ("u1",), ()]
    prog.save(tmp_path / "m.tpu")
    loaded = tte.load(tmp_path / "m.tpu")
    # the row counts differ from the sample's: all, none, some
    for t in (torch.ones(3, 4), -torch.ones(3, 4), torch.randn(3, 4, generator=g)):
        got = loaded(t)
        want = Selects()(t)
        assert len(got) == 3
        for o, w in zip(got, want):
            np.testing.assert_array_equal(o, w.numpy())


def test_data_dependent_value_read_inside_the_program_is_unsupported():
    class Counts(torch.nn.Module):
        def forward(self, x):
            return x[x > 0].sum()
    with pytest.raises(tte.UnsupportedOpError) as e:
        tte.export(Counts(), (torch.randn(5),), target="tpu", platforms=("cpu",))
    assert "aten.sum" in e.value.op and "row count depends on the input's values" in str(e.value)


def test_nonzero_static_has_a_fixed_shape():
    class Static(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero_static(x, size=6, fill_value=-1)
    x = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    prog = tte.export(Static(), (x,), target="tpu", platforms=("cpu",))
    np.testing.assert_array_equal(prog(x), Static()(x).numpy())
