"""make bench: every benchmark, one after another, each writing its table to benchmarks/RESULTS-*.md.

    python -m benchmarks.run                 # all (from the repository root)
    python -m benchmarks.run tpu litert      # some (names below)

Benchmarks measure; they never fail a build on a number. Run them on a quiet machine: the 2-thread
latencies and conversion times move with whatever else the cores are doing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

BENCHMARKS = {
    # name: (module under benchmarks/, arguments) -- each writes benchmarks/RESULTS-<name>.md
    "tpu": ("tpu_export", ["-o", "RESULTS-tpu.md"]),
    "litert": ("litert_vs_litert_torch", ["-o", "RESULTS-litert.md"]),
    "quant": ("litert_quant", ["-o", "RESULTS-quant.md"]),
    "scale": ("scale", ["-o", "RESULTS-scale.md"]),
    "pallas": ("pallas_kernels", []),
    "tpu-compile": ("tpu_compile", ["-o", "RESULTS-tpu-compile.md"]),
    "web": ("web", []),
    "edge-readers": ("edge_readers", []),
    "opinfo-peers": ("opinfo_peers", ["-o", "RESULTS-opinfo-peers.md"]),
    "llm": ("llm", ["--rounds", "3", "-o", "RESULTS-llm.md"]),
    "serving": ("serving", ["--start", "-o", "RESULTS-serving.md"]),
    "structured": ("structured", ["-o", "RESULTS-structured.md"]),
    "abstract-llm": ("abstract_llm", ["--configs", "llama3-8b,llama3-70b", "-o", "RESULTS-abstract-llm.md"]),
    "abstract-moe": ("abstract_llm", ["--configs", "qwen3-30b-a3b", "-o", "RESULTS-abstract-moe.md"]),
    "moe": ("moe", ["--rounds", "3", "-o", "RESULTS-moe.md"]),
    "families": ("families", ["-o", "RESULTS-families.md"]),
    "serving-tpu": ("serving", ["--concurrency", "", "--topologies", "v5e,v6e", "-o", "RESULTS-serving-tpu.md"]),
    "decode-cost": ("plain_decode", ["-o", "RESULTS-decode-cost.md"]),
    "capacity": ("serving", ["--concurrency", "", "--prefix", "0", "--capacity", "v5e", "-o", "RESULTS-capacity.md"]),
    "mixed": ("serving", ["--concurrency", "", "--prefix", "0", "--mixed", "v5e", "-o", "RESULTS-mixed.md"]),
}


def main(names) -> int:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names or BENCHMARKS:
        module, args = BENCHMARKS[name]
        args = [os.path.join(HERE, a) if a.startswith("RESULTS-") else a for a in args]
        print(f"== {name}: python -m benchmarks.{module} {' '.join(args)}", flush=True)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=REPO)
        print(f"== {name}: exit {proc.returncode} after {time.perf_counter() - t:.0f} s", flush=True)
        if proc.returncode:
            failed.append(name)
    if failed:
        print(f"benchmarks that did not complete: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
