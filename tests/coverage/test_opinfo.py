"""The OpInfo source of the coverage matrix (one small OpInfo; the full run is `python -m tools.coverage --opinfo`)."""
import types

import numpy as np
import pytest

pytest.importorskip("expecttest")


def test_opinfo_case_runs_and_mismatch_is_caught():
    from torchtpu_export.coverage import opinfo
    from torchtpu_export.coverage.cells import columns, compare_outputs

    cells = opinfo.run_opinfo("cumsum", ["xla"])
    assert cells["xla"]["status"] == "pass", cells
    entry, samples, batch, kind = opinfo.prepare("cumsum")
    assert kind is None
    outs = [np.asarray(r) for ref in batch.refs for r in ref]
    assert compare_outputs(entry, samples, batch.refs, outs, columns()["xla"]).status == "pass"
    outs[0] = outs[0] + 1.0
    cell = compare_outputs(entry, [types.SimpleNamespace(desc=s.desc) for s in samples], batch.refs, outs,
                           columns()["xla"])
    assert cell.status == "mismatch" and cell.sample == samples[0].desc


@pytest.mark.parametrize("name", ["mm", "nn.functional.pad.reflect", "roll", "index_copy",
                                  "nn.functional.pad.replicate_negative"])
def test_empty_and_edge_samples(name):
    # zero-size results (mm of 0 x 5, reflect-padding 0 x 3 x 3), an empty roll, index_copy of a
    # 0-d tensor, negative replicate padding: OpInfo's edge samples that once failed to build
    from torchtpu_export.coverage import opinfo
    cells = opinfo.run_opinfo(name, ["xla", "litert"])
    assert all(c["status"] == "pass" for c in cells.values()), cells


@pytest.mark.parametrize("name, note", [
    ("bernoulli", "random"), ("nn.functional.dropout", "random"), ("empty_like", "uninitialised"),
    ("linalg.eigh", None), ("fft.rfft", None)])
def test_random_uninitialised_and_sign_free_cases(name, note):
    # random ops by distribution over repeated calls, uninitialised memory by shape, eigenvectors up to sign
    from torchtpu_export.coverage import opinfo
    cells = opinfo.run_opinfo(name, ["xla", "litert"])
    assert all(c["status"] == "pass" for c in cells.values()), cells
    if note:
        assert all(c["note"].startswith(note) for c in cells.values()), cells
