"""The documentation site (mkdocs.yml, docs/) and the README: the site builds with ``mkdocs build --strict`` (no
broken link, anchor or reference), its API reference lists every public name, its CLI reference is the parser's,
and the README stays a short page whose links lead somewhere."""
import os
import re
import subprocess
import sys

import pytest
from markdown.extensions.toc import slugify

import torchtpu_export
from tools import docs_site

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
README_MAX_LINES = 250
pytestmark = pytest.mark.xdist_group("docs_site")  # one worker builds the site once for every test here


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built with --strict into a folder of the test's own."""
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


def _page(site, uri: str) -> str:
    with open(os.path.join(site, uri, "index.html"), encoding="utf-8") as f:
        return f.read()


def test_the_site_builds_with_no_warning(site):
    assert os.path.exists(os.path.join(site, "index.html"))


def test_the_api_reference_lists_every_public_name(site):
    ids = set(re.findall(r'id="(torchtpu_export\.[\w.]+)"', _page(site, "reference/api")))
    missing = [name for name in torchtpu_export.__all__ if f"torchtpu_export.{name}" not in ids]
    assert not missing, f"the API reference lacks {missing}"


def test_the_cli_reference_is_the_parsers(site):
    html = _page(site, "reference/cli")
    missing = [f"{p.prog} {flag}" for p in docs_site.parsers() for a in p._actions for flag in a.option_strings
               if flag not in html]
    assert not missing, missing


def test_the_benchmark_results_are_pages_of_the_site(site):
    results = sorted(f for f in os.listdir(os.path.join(REPO, "benchmarks")) if re.fullmatch(r"RESULTS-.*\.md", f))
    assert results and all(os.path.exists(os.path.join(site, "benchmarks", "results", f[:-3], "index.html"))
                           for f in results)
    assert 'href="../results/RESULTS-tpu/"' in _page(site, "benchmarks/tpu")


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    first_block = lines[lines.index("```sh") + 1:lines.index("```")]
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]


def _anchors(path: str) -> set[str]:
    text, fence, out = open(path, encoding="utf-8").read(), False, set()
    for line in text.splitlines():
        fence ^= line.startswith("```")
        if not fence and re.match(r"#{1,6} ", line):
            out.add(slugify(re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip()).replace("`", ""), "-"))
    return out


def test_the_readmes_links_lead_to_files_and_headings():
    text = open(README, encoding="utf-8").read()
    broken = []
    for target, anchor in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text):
        if "://" in target:
            continue
        path = os.path.join(REPO, target)
        if not os.path.exists(path):
            broken.append(target)
        elif anchor and anchor not in _anchors(path):
            broken.append(f"{target}#{anchor}")
    assert not broken, broken


def test_no_page_links_to_the_steering_folder():
    pages = [os.path.join(root, f) for root, _, files in os.walk(os.path.join(REPO, "docs")) for f in files
             if f.endswith(".md")] + [README, os.path.join(REPO, "mkdocs.yml")]
    assert not [p for p in pages if "../shared" in open(p, encoding="utf-8").read()]
