"""The generated sections of the docs are what their tools write from the committed results: the op-coverage
totals (tools/coverage.py, from docs/coverage.json) and the README's supported-models summary
(tools/supported_models.py, from the table in docs/supported_models.md). Neither test reruns the matrix or the
family tests."""
import json
import os

from tools import coverage as coverage_tool
from tools import supported_models

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _between(path: str, begin: str, end: str) -> str:
    text = open(path, encoding="utf-8").read()
    assert begin in text and end in text, f"{path} lacks its markers {begin} ... {end}"
    return text.split(begin + "\n", 1)[1].split(end, 1)[0]


def test_the_op_coverage_page_shows_the_totals_of_the_committed_matrix():
    with open(coverage_tool.DOCS_JSON) as f:
        report = json.load(f)
    page = _between(coverage_tool.TOTALS_PAGE, coverage_tool.BEGIN, coverage_tool.END)
    assert page == coverage_tool.totals_block(report), "rerun the coverage tool (make coverage) or fix the page"


def test_the_readme_summarises_the_supported_models_table():
    table = open(supported_models.DOCS, encoding="utf-8").read()
    readme = _between(supported_models.README, supported_models.BEGIN, supported_models.END)
    assert readme == supported_models.summary(table)
    assert "minimax" in readme and "qwen3" in readme
