"""TPU export: conversion time, peak memory, and cpu-program latency vs torch eager; torchax side by side.

    python -m benchmarks.tpu_export                 # all models, ours and torchax, table to stdout
    python -m benchmarks.tpu_export --models resnet18 --repeats 3 -o benchmarks/RESULTS-tpu.md

Every measurement runs in a fresh process (cold start, like a user's first export). torchax runs
from its own venv (.venv-bench-torchax, created on first use: torch 2.13.0, torchax 0.0.13, the same
jax) with benchmarks/torchax_shim.py for the named-dimension overloads torch 2.13 removed.
Our export is measured with the default platforms ("tpu", "cpu": two programs) and with "tpu" only,
which is what torchax produces (one program).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TORCHAX_VENV = os.path.join(REPO, ".venv-bench-torchax")
MODELS = ["resnet18", "gpt", "llama", "dlrm", "unet"]
XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(tool: str, model_name: str, platforms: str) -> dict:
    import torch

    from examples import zoo
    from examples.common import median_ms  # warm-ups, then the median of timed calls
    model, args = zoo.ZOO[model_name]()
    base_rss = _rss_mb()
    result = {"tool": tool, "model": model_name, "platforms": platforms}
    if tool == "ours":
        import torchtpu_export as tte
        if "cpu" in platforms:
            # one thread each (XLA's through XLA_FLAGS, set by run_worker): on a shared 2-core machine
            # torch's spinning OpenMP threads make multi-threaded eager times 10-20x worse under load
            torch.set_num_threads(1)
            with torch.no_grad():
                result["eager_ms"] = median_ms(lambda: model(*args), runs=15, warmup=2)
            base_rss = _rss_mb()
        t = time.perf_counter()
        prog = tte.export(model, args, target="tpu", platforms=tuple(platforms.split(",")))
        result["export_s"] = time.perf_counter() - t
        result["peak_rss_mb"] = _rss_mb()
        result["rss_growth_mb"] = result["peak_rss_mb"] - base_rss
        if "cpu" in platforms:
            runner = prog.runner()
            flat = [a.numpy() for a in args]
            result["xla_cpu_ms"] = median_ms(lambda: runner.run(flat), runs=15, warmup=2)
    else:
        from benchmarks import torchax_shim  # noqa: F401
        from torchax import export as tx_export
        import jax
        t = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(model, args)
        weights, exported = tx_export.exported_program_to_stablehlo(ep)
        exported.mlir_module_serialized  # noqa: B018  (the serialized module, as a user would save)
        result["export_s"] = time.perf_counter() - t
        result["peak_rss_mb"] = _rss_mb()
        result["rss_growth_mb"] = result["peak_rss_mb"] - base_rss
        result["platforms"] = ",".join(exported.platforms)
        result["jax"] = jax.__version__
    return result


def _ensure_torchax_venv() -> str:
    python = os.path.join(TORCHAX_VENV, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", TORCHAX_VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "torch==2.13.0", "torchax==0.0.13", "jax==0.10.2",
                        "jaxlib==0.10.2", "numpy<2.5", "ml_dtypes"], check=True)
    return python


def run_worker(python: str, tool: str, model: str, platforms: str) -> dict:
    proc = subprocess.run([python, "-m", "benchmarks.tpu_export", "--worker", tool, model, platforms], cwd=REPO,
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore", XLA_FLAGS=XLA_ONE_THREAD), timeout=1800)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        # the exception's own line, not JAX's note about filtered frames
        tail = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)][-1:] or lines[-1:] or ["?"]
        return {"tool": tool, "model": model, "platforms": platforms, "error": tail[0][:160]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=3, metavar=("TOOL", "MODEL", "PLATFORMS"), help=argparse.SUPPRESS)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement (median)")
    p.add_argument("--no-torchax", action="store_true")
    p.add_argument("-o", "--output", help="also write the markdown table here")
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    ours_py = sys.executable
    tx_py = None if args.no_torchax else _ensure_torchax_venv()
    rows = []
    for model in args.models.split(","):
        runs = {}
        for key, python, tool, plats in [("ours", ours_py, "ours", "tpu,cpu"), ("ours_tpu", ours_py, "ours", "tpu"),
                                         ("torchax", tx_py, "torchax", "-")]:
            if python is None:
                continue
            results = [run_worker(python, tool, model, plats) for _ in range(args.repeats)]
            ok = [r for r in results if "error" not in r]
            if not ok:
                runs[key] = results[0]
                continue
            med = {k: statistics.median(r[k] for r in ok) for k in ok[0] if isinstance(ok[0][k], float)}
            runs[key] = {**ok[0], **med}
            print(f"{model:10s} {key:9s} {json.dumps({k: round(v, 2) for k, v in med.items()})}", file=sys.stderr)
        rows.append((model, runs))
    table = format_table(rows, args.repeats)
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table + "\n")
    return 0


def _f(run: dict | None, key: str, fmt: str) -> str:
    if not run:
        return "-"
    if "error" in run:
        return "error"
    return format(run[key], fmt) if key in run else "-"


def format_table(rows, repeats) -> str:
    import torch
    head = (f"TPU export, {datetime.date.today()}, {platform.machine()} {os.cpu_count()} cores, "
            f"torch {torch.__version__.split('+')[0]}, median of {repeats} fresh processes; 1-minute load average "
            f"{os.getloadavg()[0]:.1f} at the end (`python -m benchmarks.tpu_export`). Export: capture, lowering "
            "and jax.export serialisation, the first in a fresh process (it includes torch.export's and JAX's "
            "one-time setup). Latency: median of 15 runs after 2 warm-ups, one thread each "
            "(torch.set_num_threads(1); XLA without its Eigen pool), on the sample inputs.\n\n"
            "| model | export tpu+cpu (s) | export tpu only (s) | torchax export (s) | peak RSS ours (MB) "
            "| peak RSS torchax (MB) | .tpu cpu program (ms) | torch eager (ms) |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for model, r in rows:
        lines.append(f"| {model} | {_f(r.get('ours'), 'export_s', '.2f')} | {_f(r.get('ours_tpu'), 'export_s', '.2f')} "
                     f"| {_f(r.get('torchax'), 'export_s', '.2f')} | {_f(r.get('ours'), 'peak_rss_mb', '.0f')} "
                     f"| {_f(r.get('torchax'), 'peak_rss_mb', '.0f')} | {_f(r.get('ours'), 'xla_cpu_ms', '.2f')} "
                     f"| {_f(r.get('ours'), 'eager_ms', '.2f')} |")
    errors = [f"- {m} {k}: {v['error']}" for m, r in rows for k, v in r.items() if "error" in v]
    if errors:
        lines += ["", "Errors:"] + errors
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
