"""Conversion time and peak memory against weight bytes (100 MB, 1 GB, 3 GB of weights).

    python -m benchmarks.scale                          # tpu, litert and litert-torch, 0.1/1/3 GB
    python -m benchmarks.scale --sizes 0.1,1 --targets tpu -o benchmarks/RESULTS-scale.md

Each point runs in a fresh process: convert a tiny model (so imports and one-time setup are not
timed), build a model of N bytes of float32 weights (embedding tables plus an MLP head, like a
recommender), convert it, write the artifact, and report wall time and
the process's peak RSS, minus the RSS after building the model (the model itself holds the
weights once). The target: time and memory grow linearly with the weights, memory within
1.5x the weight bytes plus a fixed overhead.

``litert-torch`` (the peer tool) runs in the venv benchmarks/litert_vs_litert_torch.py makes for it.
A point whose process passes ``--max-rss-gb`` is stopped and reported as such (the machine is shared).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(gbytes: float):
    import torch

    class Tables(torch.nn.Module):
        def __init__(self, rows_per_table: int, tables: int, dim: int = 128):
            super().__init__()
            self.tables = torch.nn.ModuleList(torch.nn.Embedding(rows_per_table, dim) for _ in range(tables))
            self.head = torch.nn.Linear(dim * tables, 16)

        def forward(self, idx):
            return self.head(torch.cat([t(idx[:, i]) for i, t in enumerate(self.tables)], dim=-1))

    tables = max(1, int(round(gbytes * 4)))  # tables of about 256 MB each
    rows = int(gbytes * 2**30 / (tables * 128 * 4))
    with torch.no_grad():
        model = Tables(rows, tables).eval()
    idx = torch.randint(0, rows, (4, tables))
    return model, (idx,)


def worker(target: str, gbytes: float) -> dict:
    if target == "litert-torch":
        import litert_torch

        def convert(model, args, out):
            litert_torch.convert(model, args).export(out)
    else:
        import torchtpu_export as tte

        def convert(model, args, out):
            options = {"platforms": ("tpu", "cpu")} if target == "tpu" else {}
            tte.export(model, args, target=target, **options).save(out)
    out = os.path.join(tempfile.mkdtemp(), "model" + (".tpu" if target == "tpu" else ".tflite"))
    # a tiny conversion first: imports and one-time setup (torch.export's included) are not timed
    convert(*build(0.001), out)
    model, args = build(gbytes)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base = _rss_mb()
    t = time.perf_counter()
    convert(model, args, out)
    seconds = time.perf_counter() - t
    peak = _rss_mb()
    size = os.path.getsize(out)
    os.unlink(out)
    return {"target": target, "weight_mb": weight_bytes / 2**20, "seconds": seconds, "peak_rss_mb": peak,
            "growth_mb": peak - base, "file_mb": size / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--sizes", default="0.1,1,3", help="weight sizes in GB")
    p.add_argument("--targets", default="tpu,litert,litert-torch")
    p.add_argument("--max-rss-gb", type=float, default=16.0, help="stop a point whose process passes this RSS")
    p.add_argument("-o", "--output")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], float(args.worker[1]))))
        return 0
    rows = []
    load_start = os.getloadavg()[0]
    for target in args.targets.split(","):
        python = sys.executable
        if target == "litert-torch":
            from benchmarks.litert_vs_litert_torch import ensure_bench_venv
            python = ensure_bench_venv()
        for size in args.sizes.split(","):
            rows.append(_point(python, target, size, args.max_rss_gb))
            print(json.dumps(rows[-1]), file=sys.stderr)
    lines = [f"Conversion at scale, {datetime.date.today()}, {platform.machine()} Linux, {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GB RAM; 1-minute load average "
             f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
             f"(`python -m benchmarks.scale --sizes {args.sizes} --targets {args.targets}`)", "",
             "| target | weights (MB) | convert + write (s) | MB/s | peak RSS (MB) | RSS growth over the model (MB) "
             "| growth / weights | file (MB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['target']} | {r['weight_mb']:.0f} | error: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['target']} | {r['weight_mb']:.0f} | {r['seconds']:.1f} | {r['weight_mb'] / r['seconds']:.0f} "
                     f"| {r['peak_rss_mb']:.0f} | {r['growth_mb']:.0f} | {r['growth_mb'] / r['weight_mb']:.2f} "
                     f"| {r['file_mb']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table + "\n")
    return 0


def _point(python: str, target: str, size: str, max_rss_gb: float) -> dict:
    # one measurement in a fresh process (this module's worker, in the tool's python, from the repository
    # root), stopped if its RSS passes max_rss_gb
    proc = subprocess.Popen([python, "-m", "benchmarks.scale", "--worker", target, size], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3"))
    stopped = None
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 2**20
        except (OSError, StopIteration):
            rss = 0.0
        if rss > max_rss_gb:
            stopped = f"stopped at {rss:.1f} GB RSS (--max-rss-gb {max_rss_gb:g})"
            proc.kill()
        time.sleep(0.2)
    out, err = proc.communicate()
    if stopped or proc.returncode:
        reason = stopped or (f"killed by signal {-proc.returncode}" if proc.returncode < 0 else
                             (err.strip().splitlines() or ["?"])[-1][:160])
        return {"target": target, "weight_mb": float(size) * 1024, "error": reason.replace("|", "/")}
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
