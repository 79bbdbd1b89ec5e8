"""The coverage matrix, cell by cell, against the committed verdicts in coverage_expected.json.

Every op of the table runs on every runtime, like ``torchtpu-export coverage``. A cell whose
status differs from the committed one fails, whether it regressed or newly passes, and so does a
mismatch whose error grew past its recorded bound: run ``make coverage`` (or
``python -m tools.coverage --ops OP`` for one op) to regenerate the files when a change is intended.
"""
import json
import os

import pytest

from conftest import REPO
from torchtpu_export import coverage, optable

EXPECTED_FILE = os.path.join(REPO, "tests", "coverage_expected.json")
DOCS_JSON = os.path.join(REPO, "docs", "coverage.json")

with open(EXPECTED_FILE) as f:
    EXPECTED = json.load(f)


def _diff(op, cells):
    return coverage.differences(EXPECTED["cells"].get(op, {}), cells, EXPECTED["runtimes"])


def test_expected_file_matches_the_table():
    assert set(EXPECTED["cells"]) == set(optable.op_names()), "run `make coverage` after changing the op table"
    assert EXPECTED["runtimes"] == list(coverage.RUNTIMES)


@pytest.mark.parametrize("op", optable.op_names())
def test_cells(op):
    if op in EXPECTED.get("isolate", []):
        # its worker crashed or hung when the file was made: run it where a crash cannot take pytest down
        results = coverage.run_isolated([("torchtpu_export.coverage.harness:run_op_json", (op, [rt]))
                                         for rt in EXPECTED["runtimes"]], jobs=1)
        cells = {rt: coverage.Cell.from_json(r.get(rt, r)) for rt, r in zip(EXPECTED["runtimes"], results)}
    else:
        cells = coverage.run_op(op, EXPECTED["runtimes"], locate=False)
    bad = _diff(op, cells)
    assert not bad, f"{op} changed; if intended, run `make coverage`:\n  " + "\n  ".join(bad)


def test_a_crashing_task_becomes_an_error_and_the_run_goes_on():
    results = coverage.run_isolated([("os:abort", ()), ("math:sqrt", (4.0,)), ("time:sleep", (30,))],
                                    jobs=2, timeout=5)
    assert results[0]["status"] == "error" and "crashed" in results[0]["reason"]
    assert results[1] == 2.0
    assert results[2]["status"] == "error" and "timed out" in results[2]["reason"]


def test_cli_json_report(cli, tmp_path):
    out = tmp_path / "cov.json"
    r = cli("coverage", "--ops", "aten.add.Tensor", "--targets", "xla,onnx", "--format", "json", "-o", out)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["runtimes"] == ["xla", "onnx"] and report["torch"]
    (row,) = report["ops"]
    assert row["op"] == "aten.add.Tensor" and row["core"] is True
    assert row["cells"]["xla"]["status"] == "pass" and isinstance(row["cells"]["xla"]["max_abs_err"], float)
    assert set(row["cells"]["onnx"]) >= {"status", "max_abs_err", "reason"}


def test_cli_markdown_and_bad_flags(cli, tmp_path):
    r = cli("coverage", "--ops", "aten.relu.default", "--targets", "xla", "--format", "md")
    assert r.returncode == 0, r.stderr
    assert "| `aten.relu.default` | yes | pass |" in r.stdout
    r = cli("coverage", "--ops", "no_such_op")
    assert r.returncode == 2 and "no op of the table matches" in r.stderr
    r = cli("coverage", "--targets", "tpu,gpu")
    assert r.returncode == 2 and "unknown runtime 'gpu'" in r.stderr


def test_docs_are_generated_from_the_same_report():
    docs = os.path.join(REPO, "docs", "coverage.md")
    with open(DOCS_JSON) as f:
        report = json.load(f)
    with open(docs) as f:
        assert f.read() == coverage.to_markdown(report)
    assert coverage.expected(report)["cells"] == EXPECTED["cells"]


def test_a_mismatch_that_grows_fails_and_a_status_change_shows_the_old_reason():
    want = {"litert": {"status": "mismatch", "reason": "output 0", "max_rel_err": 0.001},
            "onnx": {"status": "unsupported", "reason": "no ONNX function"}, "xla": "pass"}
    same = {"litert": coverage.Cell("mismatch", 1.0, 0.0015), "onnx": coverage.Cell("unsupported", reason="x"),
            "xla": coverage.Cell("pass")}
    assert coverage.differences(want, same, ["xla", "litert", "onnx"]) == []
    worse = dict(same, litert=coverage.Cell("mismatch", 1.0, 0.01))
    (msg,) = coverage.differences(want, worse, ["xla", "litert", "onnx"])
    assert "grew" in msg and "0.01" in msg
    fixed = dict(same, onnx=coverage.Cell("pass"))
    (msg,) = coverage.differences(want, fixed, ["xla", "litert", "onnx"])
    assert "onnx: pass (expected unsupported)" in msg and "no ONNX function" in msg


def test_litert_column_follows_the_converter_contract(monkeypatch):
    """The litert column against a stand-in built through api.build: a model with run_flat(list of
    arrays); ops it cannot express raise UnsupportedOpError; int64 results may come back as int32."""
    from torchtpu_export import api
    from torchtpu_export.errors import UnsupportedOpError

    class Edge:
        def __init__(self, prog):
            self.prog = prog

        def run_flat(self, inputs, signature_name=None):
            return [o.astype("int32") if o.dtype == "int64" else o for o in self.prog.run_flat(inputs)]

    real = api.build

    def build(target, captured, **options):
        if target != "litert":
            return real(target, captured, **options)
        (name, cap), = captured.items()
        assert name == "serving_default"
        if "aten.sin.default" in cap.op_histogram():
            raise UnsupportedOpError("aten.sin.default", target="litert", reason="no SIN builtin in this test")
        return Edge(real("tpu", {"main": cap}, platforms=("cpu",)))

    monkeypatch.setattr(api, "build", build)
    sin = coverage.run_cell("aten.sin.default", "litert")
    assert sin.status == "unsupported" and sin.reason == "no SIN builtin in this test"
    argmax = coverage.run_cell("aten.argmax.default", "litert")
    assert argmax.status == "pass", argmax
    # no half-precision samples on litert
    litert = coverage.columns()["litert"]
    assert argmax.samples == len(coverage.column_samples(optable.get("aten.argmax.default"), litert))
    assert all(not s.desc.endswith("16]") for s in coverage.column_samples(optable.get("aten.sin.default"), litert))
