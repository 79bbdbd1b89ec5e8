"""Every shell and Python example on the getting-started pages (docs/getting-started/) runs, in order, as a user
runs it from the repository's root: in a folder of the test's own that links examples/, with ``torchtpu-export``
and ``python`` this environment's. The README's quickstarts are those pages' examples word for word, so they run
too. The models are the tiny ones of examples/ (nothing is downloaded)."""
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = os.path.join(REPO, "docs", "getting-started")
FENCE = re.compile(r"^```(sh|python)\n(.*?)^```$", re.M | re.S)
SERVE_PORT = "8080"  # the port the serving page's examples use; replaced by a free one here


def examples(text: str) -> list[tuple[str, str]]:
    """The page's ``sh`` and ``python`` fenced blocks, (language, code), in order."""
    return FENCE.findall(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(blocks, folder) -> str:
    """One bash script running the blocks in order: shell blocks as written, Python blocks as files run by
    ``python``; commands left in the background (a server) are stopped when it ends."""
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for i, (language, code) in enumerate(blocks):
        if language == "sh":
            lines.append(code)
        else:
            with open(os.path.join(folder, f"example_{i}.py"), "w") as f:
                f.write(code)
            lines.append(f"python example_{i}.py")
    return "\n".join(lines) + "\n"


def _environment(folder) -> dict:
    bin_dir = os.path.join(folder, ".bin")
    os.makedirs(bin_dir)
    for name, command in (("torchtpu-export", f'"{sys.executable}" -m torchtpu_export'), ("python", f'"{sys.executable}"')):
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\nexec {command} "$@"\n')
        os.chmod(path, 0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a user's shell: examples/ is not on the path
    return dict(env, PATH=bin_dir + os.pathsep + env.get("PATH", ""), PYTHONWARNINGS="ignore")


@pytest.mark.parametrize("page", sorted(f for f in os.listdir(PAGES) if f.endswith(".md")))
def test_every_example_of_the_getting_started_page_runs(page, tmp_path):
    text = open(os.path.join(PAGES, page), encoding="utf-8").read().replace(SERVE_PORT, str(_free_port()))
    blocks = examples(text)
    assert blocks, f"{page} has no example"
    other = re.findall(r"^```(?!sh$|python$|text$|$)(.*)$", text, re.M)
    assert not other, f"{page} has blocks this test would not run ({other}): write them as sh or python"
    os.symlink(os.path.join(REPO, "examples"), tmp_path / "examples")
    script = tmp_path / "examples.sh"
    script.write_text(_script(blocks, tmp_path))
    proc = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=_environment(tmp_path), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=420)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the script's process group: anything it left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{page}'s examples failed ({proc.returncode}):\n{out[-6000:]}"


def test_the_readme_quickstarts_are_the_getting_started_examples():
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = readme.split("\n## Quickstarts\n", 1)[1].split("\n## ", 1)[0]
    seen = []
    for quickstart in section.split("\n### ")[1:]:
        title = quickstart.splitlines()[0]
        pages = re.findall(r"\]\(docs/getting-started/([\w-]+\.md)\)", quickstart)
        assert len(pages) == 1, f"the quickstart '{title}' links no getting-started page, or several"
        page = open(os.path.join(PAGES, pages[0]), encoding="utf-8").read()
        assert examples(quickstart) == examples(page), f"the quickstart '{title}' differs from {pages[0]}'s examples"
        seen.append(pages[0])
    assert sorted(seen) == sorted(f for f in os.listdir(PAGES) if f.endswith(".md"))
