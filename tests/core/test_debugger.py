"""The numerics debugger finds a deliberately broken lowering and names its op and source line."""
import pytest
import torch

import torchtpu_export as tte
import zoo


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.sigmoid(self.a(x))  # the line the debugger must point at
        return self.b(torch.tanh(h) + h)


@pytest.fixture
def broken_sigmoid_tpu(monkeypatch):
    from torchtpu_export.converters.stablehlo import registry
    rules = dict(registry.LOWERINGS[torch.ops.aten.sigmoid.default])
    rules[None] = lambda ctx, x: 1 / (1 + __import__("jax").numpy.exp(-1.01 * x))  # slightly wrong
    monkeypatch.setitem(registry.LOWERINGS, torch.ops.aten.sigmoid.default, rules)


def test_correct_model_has_no_divergence():
    torch.manual_seed(0)
    report = tte.debug(MLP(), (torch.randn(4, 8),), target="tpu")
    assert report.ok and report.first_divergence is None, str(report)


def test_finds_broken_lowering_tpu(broken_sigmoid_tpu):
    torch.manual_seed(0)
    report = tte.debug(MLP(), (torch.randn(4, 8),), target="tpu")
    assert not report.final.ok
    d = report.first_divergence
    assert d is not None and d.op == "aten.sigmoid.default", str(report)
    assert "test_debugger.py" in d.source and "torch.sigmoid(self.a(x))" in d.source
    assert "aten.sigmoid.default" in str(report)


def test_bisection_agrees_with_exposed_intermediates(broken_sigmoid_tpu):
    from torchtpu_export import api, debugger
    torch.manual_seed(0)
    (cap,) = api.captures([("main", MLP(), (torch.randn(4, 8),), None, None)], "tpu", False).values()
    eager = debugger._eager_values(cap)
    found = debugger._bisect(cap, debugger._taps(cap), eager, "tpu", 1e-5, {})
    assert found.op == "aten.sigmoid.default"


def test_cli_debug_exit_codes(tmp_path):
    from conftest import run_cli
    ok = run_cli("debug", "examples/zoo.py:small_cnn", "--target", "tpu")
    assert ok.returncode == 0, ok.stderr
    assert "no intermediate diverges" in ok.stdout
