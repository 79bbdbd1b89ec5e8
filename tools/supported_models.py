"""Regenerates the supported-models table from the LLM family tests' results (a repository tool).

    python -m tools.supported_models            # runs the family tests, writes the table to
                                                # docs/supported_models.md and its summary to the README
                                                # (between the README's markers)

Each family test below is run by pytest (``--junitxml``); a family's cell for a target says what passed
(or "fails" / "refused"), so the table is what the tests found on this checkout, not a claim.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from torchtpu_export.fileio import write_bytes_atomic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs", "supported_models.md")
BEGIN, END = "<!-- supported-models:begin -->", "<!-- supported-models:end -->"

# test (file::name) -> (targets, what it checks); the parameter is the family
CHECKS = {
    "tests/targets/litertlm/test_llm_bundles.py::test_bundle_runs_in_litert_lm_and_equals_transformers":
        (("litertlm",), "CLI export; LiteRT-LM's greedy text = transformers', 64 tokens (raw, chat, long prompt)"),
    "tests/targets/tpu/test_llm_tpu.py::test_every_dense_family_gives_transformers_tokens_over_64_steps":
        (("tpu",), "CLI export; greedy tokens = transformers', 64 tokens"),
    "tests/llm/test_moe_decoders.py::test_moe_gives_transformers_tokens_on_both_targets":
        (("tpu", "litertlm"), "CLI export; greedy tokens = transformers', 64 tokens (tpu generate, LiteRT-LM)"),
    "tests/llm/test_attention_variants.py::test_cache_layout_is_the_models_and_both_targets_give_transformers_tokens":
        (("tpu", "litertlm"), "CLI export; the model's own cache layout; greedy tokens = transformers', 64 tokens"),
    "tests/llm/test_attention_variants.py::test_adapted_families_give_transformers_tokens_on_both_targets":
        (("tpu", "litertlm"), "CLI export; greedy tokens = transformers', 64 tokens (tpu generate, LiteRT-LM)"),
    "tests/llm/test_hybrid_decoders.py::test_hybrid_families_carry_their_states_and_give_transformers_tokens":
        (("tpu",), "CLI export; recurrent states carried as program state; greedy tokens = transformers', 64 tokens"),
    "tests/llm/test_hybrid_decoders.py::test_hybrid_bundles_give_transformers_tokens_in_litert_lm":
        (("litertlm",), "CLI export; states kept past LiteRT-LM's padded chunk; "
                        "LiteRT-LM's greedy text = transformers', "
                        "64 tokens, 2 prompts"),
    "tests/llm/test_hybrid_decoders.py::test_layers_that_keep_their_state_elsewhere_are_refused_naming_the_layer":
        (("tpu", "litertlm"), "refused at export, naming the recurrent layer"),
    "tests/targets/tpu/test_sharding.py::test_experts_split_over_chips_give_the_same_tokens_and_gather_no_weights":
        (("tpu",), "expert-parallel over 4 devices: same tokens; compiles for v5e:2x2"),
}
# tests that check a family's chat too (the export's probe conversations in the runtime's renderer against
# transformers' apply_chat_template ids, and a chat's greedy reply), on the targets named
CHAT = {
    "tests/targets/litertlm/test_llm_bundles.py::test_bundle_runs_in_litert_lm_and_equals_transformers":
        "LiteRT-LM's conversation API",
    "tests/targets/tpu/test_llm_tpu.py::test_every_dense_family_gives_transformers_tokens_over_64_steps":
        "run --chat / serve",
}
# tests without a family parameter: the family they cover
FAMILY_OF = {"test_experts_split_over_chips_give_the_same_tokens_and_gather_no_weights": "qwen3_moe"}
KIND = {"test_layers_that_keep_their_state_elsewhere_are_refused_naming_the_layer": "refused"}


def run_tests(xml_path: str) -> None:
    files = sorted({k.split("::")[0] for k in CHECKS})
    names = " or ".join(sorted({k.split("::")[1] for k in CHECKS}))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                    *files, "-k", names, f"--junitxml={xml_path}"], cwd=REPO, check=False)


def results(*xml_paths: str) -> dict:
    """family -> target -> list of (kind, passed, check); a test case in a later file replaces the same one
    in an earlier file."""
    cases = {}
    for xml_path in xml_paths:
        for case in ET.parse(xml_path).getroot().iter("testcase"):
            cases[(case.get("classname"), case.get("name"))] = case
    table: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for case in cases.values():
        name, _, param = case.get("name").partition("[")
        path = case.get("classname").replace(".", "/") + ".py"
        key = f"{path}::{name}"
        if key not in CHECKS:
            continue
        family = FAMILY_OF.get(name) or re.split(r"[-\]]", param)[0]
        passed = case.find("failure") is None and case.find("error") is None and case.find("skipped") is None
        targets, check = CHECKS[key]
        for target in targets:
            table[family][target].append((KIND.get(name, "runs"), passed, check))
        if key in CHAT:
            table[family]["chat"].append(("runs", passed, CHAT[key]))
        elif KIND.get(name) != "refused" and "CLI export" in check:  # its export ran the chat probes (ChatML)
            table[family]["chat probes"].append(("runs", passed, "/".join(targets)))
    return table


def _chat_cell(cells: dict) -> str:
    own, probes = cells.get("chat", []), cells.get("chat probes", [])
    if any(not ok for _, ok, _ in own + probes):
        return "**fails**"
    if own:
        return ("yes: the family's template style; probe chats = transformers' ids, greedy chat reply = "
                "transformers' (" + ", ".join(c for _, _, c in own) + ")")
    if probes:
        return "probes: the export's probe chats (ChatML template) = transformers' ids"
    return "not tested"


def _cell(entries: list) -> str:
    if not entries:
        return "not tested"
    if any(not ok for _, ok, _ in entries):
        return "**fails**: " + "; ".join(c for _, ok, c in entries if not ok)
    if all(kind == "refused" for kind, _, _ in entries):
        return "refused: " + "; ".join(c for _, _, c in entries)
    return "yes: " + "; ".join(c for kind, _, c in entries)


def render(table: dict) -> str:
    lines = [f"Generated by `python -m tools.supported_models` from the family tests ({datetime.date.today()}; "
             "tiny configs of each transformers family, seeded random weights, a local tokenizer).", "",
             "| family | tpu | litertlm | chat |", "|---|---|---|---|"]
    order = sorted(table, key=lambda f: (all(k == "refused" for t in table[f].values() for k, _, _ in t), f))
    for family in order:
        chat = "-" if all(k == "refused" for t in table[family].values() for k, _, _ in t) else \
            _chat_cell(table[family])
        lines.append(f"| {family} | {_cell(table[family].get('tpu', []))} | {_cell(table[family].get('litertlm', []))} "
                     f"| {chat} |")
    return "\n".join(lines) + "\n"


def _row_cells(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| family ")]


def summary(text: str) -> str:
    """The README's summary of a table ``render`` wrote: the families each target runs, those refused, and a link to
    the table (docs/supported_models.md)."""
    rows = _row_cells(text)
    date = re.search(r"\((\d{4}-\d{2}-\d{2});", text).group(1)
    kind = {f: (tpu.split(":")[0], lm.split(":")[0]) for f, tpu, lm, _ in rows}
    both = [f for f, k in kind.items() if k == ("yes", "yes")]
    refused = [f for f, k in kind.items() if k == ("refused", "refused")]
    other = [f"{f} (tpu: {k[0].strip('*')}, litertlm: {k[1].strip('*')})" for f, k in kind.items()
             if f not in both and f not in refused]
    own_chat = [f for f, _, _, chat in rows if chat.startswith("yes")]
    lines = [f"Generated by `python -m tools.supported_models` from the family tests ({date}): of {len(rows)} "
             f"transformers families, {len(both)} export and give transformers' greedy tokens on both targets (tpu "
             f"and litertlm): {', '.join(both)}."]
    if other:
        lines.append(f"Not on both: {', '.join(other)}.")
    if refused:
        lines.append(f"Refused at export, naming the layer: {', '.join(refused)}.")
    lines.append(f"Chat templates in their families' own styles, checked against transformers: {', '.join(own_chat)} "
                 "(the others: the export's probe chats). Per family and target: "
                 "[docs/supported_models.md](docs/supported_models.md).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junitxml", nargs="+", default=None,
                    help="read these results instead of running the tests (a later file's case replaces an earlier's)")
    args = ap.parse_args(argv)
    xml_paths = args.junitxml
    if xml_paths is None:
        xml_paths = [os.path.join(tempfile.mkdtemp(), "families.xml")]
        run_tests(xml_paths[0])
    text = render(results(*xml_paths))
    write_bytes_atomic(DOCS, ("# Supported models\n\n" + text).encode())
    with open(README) as f:
        readme = f.read()
    if BEGIN not in readme or END not in readme:
        print(f"README.md has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = readme.split(BEGIN, 1)
    write_bytes_atomic(README, (head + BEGIN + "\n" + summary(text) + END + rest.split(END, 1)[1]).encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
