"""The documentation site's build hooks (``hooks:`` in mkdocs.yml) and the CLI reference they render (a repository
tool, not installed code).

    python -m tools.docs_site       # prints the CLI reference: what docs/reference/cli.md gets at its marker

- The CLI reference is rendered from ``torchtpu_export.cli``'s argparse parsers when the site is built, so it
  says what ``torchtpu-export --help`` says, never a copy kept by hand.
- The generated coverage reports quote error messages in their tables; a message's ``[x](y)`` is text there, not a
  link, and is escaped so that the strict build does not take it for one.
- The benchmark results (``benchmarks/RESULTS-*.md``) become pages of the site under ``benchmarks/results/``;
  docs pages link them by their place in the repository (``../../benchmarks/RESULTS-tpu.md``, right on GitHub),
  and those links are pointed at the site's pages.
"""
from __future__ import annotations

import argparse
import glob
import os
import posixpath
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_MARKER = "<!-- cli-reference -->"
CLI_PAGE = "reference/cli.md"
RESULTS_PAGES = "benchmarks/results"
GENERATED_REPORTS = ("coverage.md", "coverage_opinfo.md", "coverage_opinfo_bf16.md")
LINK = re.compile(r"\]\(([^)\s#]+\.md)(#[^)\s]*)?\)")


def parsers() -> list[argparse.ArgumentParser]:
    """The converter's parser, then each subcommand's, built as ``cli.main`` builds them."""
    from torchtpu_export import cli
    return cli.parsers()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _render(p: argparse.ArgumentParser) -> str:
    formatter = p._get_formatter()
    rows = []
    for action in p._actions:
        if action.help == argparse.SUPPRESS:
            continue
        invocation = formatter._format_action_invocation(action)
        text = (action.help or "") % {**vars(action), "prog": p.prog} if action.help and "%(" in action.help \
            else action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and action.nargs != 0 \
                and "default" not in text:
            text += f" (default: {action.default})"
        rows.append(f"| `{_cell(invocation)}` | {_cell(text)} |")
    usage = p.format_usage().removeprefix("usage: ").strip()
    return "\n".join([f"## `{p.prog}`", "", _cell(p.description or ""), "", "```text", usage, "```", "",
                      "| argument | what it does |", "|---|---|", *rows, ""])


def cli_reference() -> str:
    """Every command of ``torchtpu-export`` with its usage and arguments, as markdown."""
    from torchtpu_export import cli
    parts = [_render(p) for p in parsers()]
    parts.append("## Exit codes\n\n```text\n" + cli.EXIT_CODES_HELP.strip() + "\n```\n")
    return "\n".join(parts)


def _results() -> list[str]:
    return sorted(glob.glob(os.path.join(REPO, "benchmarks", "RESULTS-*.md")))


def on_files(files, config):
    from mkdocs.structure.files import File, InclusionLevel
    for path in _results():
        uri = f"{RESULTS_PAGES}/{os.path.basename(path)}"
        files.append(File.generated(config, uri, abs_src_path=path, inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def _site_link(page_uri: str, target: str) -> str | None:
    """The site's link for ``target`` (as written on the page ``page_uri``) when it names a benchmark results file
    of the repository; None for every other link."""
    in_repo = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_uri), target))
    if not re.fullmatch(r"benchmarks/RESULTS-[\w.-]+\.md", in_repo):
        return None
    return posixpath.relpath(f"{RESULTS_PAGES}/{posixpath.basename(in_repo)}", posixpath.dirname(page_uri) or ".")


def _quoted_text(line: str) -> str:
    """A table row whose ``](`` outside code spans is escaped (``]\\(``): quoted text, not a link."""
    if not line.startswith("|"):
        return line
    parts = line.split("`")
    return "`".join(part.replace("](", "]\\(") if i % 2 == 0 else part for i, part in enumerate(parts))


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if uri in GENERATED_REPORTS:
        return "\n".join(_quoted_text(line) for line in markdown.split("\n"))
    if uri == CLI_PAGE:
        if CLI_MARKER not in markdown:
            raise ValueError(f"{CLI_PAGE} has no {CLI_MARKER} marker for the generated CLI reference")
        markdown = markdown.replace(CLI_MARKER, cli_reference())

    def relink(m):
        site = _site_link(uri, m.group(1))
        return m.group(0) if site is None else f"]({site}{m.group(2) or ''})"
    return markdown if uri.startswith(RESULTS_PAGES) else LINK.sub(relink, markdown)


if __name__ == "__main__":
    sys.stdout.write(cli_reference())
