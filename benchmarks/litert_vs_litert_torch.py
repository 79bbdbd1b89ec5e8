"""torchtpu-export's edge target against litert-torch 0.10, side by side, in one run.

    python -m benchmarks.litert_vs_litert_torch [--models resnet18,mobilenet_v2] [--runs 30] [-o RESULTS.md]

litert-torch brings its own pinned dependencies, so it lives in a venv of its own
(``.venv-bench-litert-torch/``, created here on first use). Each conversion runs in a
fresh process (conversion time of the convert call, peak RSS of the process); then
both files are run by the same LiteRT Interpreter in this process (XNNPACK, 1 thread
and all cores, median of repeated runs, the two files interleaved), and both are
checked against torch eager.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_VENV = os.path.join(REPO, ".venv-bench-litert-torch")
LITERT_TORCH = "litert-torch==0.10.0"
# what its export_hf (benchmarks/llm.py) also needs: transformers, and LiteRT-LM's packer it bundles with.
# transformers pinned: from 5.25 it requires `kernels`, whose hub decorators make export_hf's tracing fail
# ("apply_rotary_pos_emb is not decorated with @use_kernel_forward_from_hub")
BENCH_EXTRAS = ["transformers==5.24.0", "litert-lm-builder==0.18.1"]
# model -> zoo factory kwargs (the sizes a phone would see for the CNNs)
MODELS = {
    "resnet18": {"size": 224}, "mobilenet_v2": {"size": 224}, "unet": {}, "gpt": {}, "llama": {}, "dlrm": {},
}

# Runs in a fresh process: builds the zoo model, converts it, writes the file, reports time and peak RSS.
_CHILD = r"""
import importlib.util, json, resource, sys, time
tool, name, kwargs, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
spec = importlib.util.spec_from_file_location("zoo", sys.argv[5])
zoo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zoo)
import torch
model, args = zoo.ZOO[name](**kwargs)
if tool == "ours":
    import torchtpu_export as tte
    def convert(m, a, path):
        tte.convert(m, a).export(path)
else:
    import litert_torch
    def convert(m, a, path):
        litert_torch.convert(m.eval(), a).export(path)
# cold: the first conversion in the process (imports and one-time setup of torch.export and the tool);
# warm: the same model again, what every further conversion costs
times = []
for _ in range(2):
    t0 = time.perf_counter()
    try:
        convert(model, args, out)
    except Exception as e:
        print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}))
        sys.exit(0)
    times.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({"cold": times[0], "seconds": times[1],
                              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def ensure_bench_venv() -> str:
    py = os.path.join(BENCH_VENV, "bin", "python")
    if not os.path.exists(os.path.join(BENCH_VENV, ".installed")):
        print(f"creating {BENCH_VENV} with {LITERT_TORCH} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", BENCH_VENV], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", LITERT_TORCH,
                        *BENCH_EXTRAS], check=True)
        open(os.path.join(BENCH_VENV, ".installed"), "w").close()
    return py


def convert_in_child(python: str, tool: str, name: str, out: str, kwargs: dict | None = None) -> dict:
    zoo_path = os.path.join(REPO, "examples", "zoo.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3")
    kwargs = MODELS[name] if kwargs is None else kwargs
    r = subprocess.run([python, "-c", _CHILD, tool, name, json.dumps(kwargs), out, zoo_path],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
    return {"error": " | ".join(tail)[:400]}


def _feed(interp, args) -> dict:
    runner = interp.get_signature_runner()
    details = runner.get_input_details()
    names = sorted(details, key=lambda n: details[n]["index"])
    return runner, {n: np.asarray(a).astype(details[n]["dtype"]) for n, a in zip(names, args)}


def latency(paths: dict, args, threads: int, runs: int, rounds: int = 5) -> dict:
    """Per file, the lowest of ``rounds`` medians of ``runs`` timings (ms): both files run by the same
    Interpreter class in this process, interleaved, so load from other processes hits both alike."""
    from ai_edge_litert.interpreter import Interpreter
    loaded = {}
    for key, path in paths.items():
        interp = Interpreter(model_path=path, num_threads=threads)
        runner, feed = _feed(interp, args)
        for _ in range(3):
            runner(**feed)
        loaded[key] = (runner, feed)
    best = {k: float("inf") for k in loaded}
    keys = list(loaded)
    for _ in range(rounds):
        times = {k: [] for k in loaded}
        for i in range(runs):
            for key in keys if i % 2 == 0 else keys[::-1]:  # alternate who runs first
                runner, feed = loaded[key]
                t0 = time.perf_counter()
                runner(**feed)
                times[key].append((time.perf_counter() - t0) * 1000)
        best = {k: min(best[k], statistics.median(v)) for k, v in times.items()}
    return best


def outputs_and_reference(path: str, model, args) -> tuple[list, list]:
    """The .tflite's outputs (in output_N order) and torch eager's on ``args``."""
    import torch
    import torch.utils._pytree as pytree
    from ai_edge_litert.interpreter import Interpreter
    runner, feed = _feed(Interpreter(model_path=path), [a.numpy() for a in args])
    out = runner(**feed)
    with torch.no_grad():
        ref = [r.numpy() for r in pytree.tree_leaves(model(*args))]
    got = [out[k] for k in sorted(out, key=lambda k: int(k.split("_")[-1]) if k.split("_")[-1].isdigit() else 0)]
    return got, ref


def max_error(path: str, model, args) -> float:
    got, ref = outputs_and_reference(path, model, args)
    scale = max(float(np.abs(r).max()) for r in ref) or 1.0
    return max(float(np.abs(g.astype(np.float64) - r).max()) for g, r in zip(got, ref)) / scale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--runs", type=int, default=20, help="timed runs per round (5 rounds)")
    p.add_argument("-o", "--output", default=os.path.join(REPO, "benchmarks", "RESULTS-litert.md"))
    args = p.parse_args(argv)
    bench_py = ensure_bench_venv()
    load_start = os.getloadavg()[0]
    from examples import zoo
    from torchtpu_export.targets.litert.target import describe as describe_tflite
    threads_all = os.cpu_count() or 1
    rows = []
    tmp = tempfile.mkdtemp(prefix="litert-bench-")
    for name in args.models.split(","):
        files = {"ours": os.path.join(tmp, f"{name}.ours.tflite"), "litert_torch": os.path.join(tmp, f"{name}.lt.tflite")}
        conv = {"ours": convert_in_child(sys.executable, "ours", name, files["ours"]),
                "litert_torch": convert_in_child(bench_py, "litert_torch", name, files["litert_torch"])}
        row = {"model": name, "convert": conv}
        if all("error" not in c for c in conv.values()):
            model, margs = zoo.ZOO[name](**MODELS[name])
            model.eval()
            desc = {k: describe_tflite(f) for k, f in files.items()}
            row["size"] = {k: d["size"] for k, d in desc.items()}
            row["transposes"] = {k: d["transposes"] for k, d in desc.items()}
            row["ops"] = {k: sum(d["programs"]["serving_default"]["op_histogram"].values()) for k, d in desc.items()}
            row["error"] = {k: max_error(f, model, margs) for k, f in files.items()}
            inputs = [a.numpy() for a in margs]
            row["ms_1"] = latency(files, inputs, 1, args.runs)
            row["ms_all"] = latency(files, inputs, threads_all, args.runs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    theirs = subprocess.run([bench_py, "-c", "import torch, litert_torch; print(torch.__version__)"],
                            capture_output=True, text=True).stdout.strip().splitlines()
    text = report(rows, threads_all, args.runs, load_start, os.getloadavg()[0], theirs[-1] if theirs else "?")
    print(text)
    with open(args.output, "w") as f:
        f.write(text)
    return 0


def _short(result: dict) -> str:
    if "error" not in result:
        return "ok"
    return result["error"].replace("|", "/")[:160]


def _f(v, fmt):
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def report(rows, threads_all, runs, load_start=None, load_end=None, their_torch="?") -> str:
    import ai_edge_litert
    import torch
    lines = [
        "# Edge target vs litert-torch 0.10",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} Linux, {os.cpu_count()} cores "
        f"({platform.processor() or 'cpu'}); Python {platform.python_version()}, torch {torch.__version__} "
        f"(ours), litert-torch 0.10.0 with torch {their_torch} in its own venv, ai-edge-litert "
        f"{getattr(ai_edge_litert, '__version__', '2.3.0')} for both runs. Command: "
        "`make bench` (`python -m benchmarks.litert_vs_litert_torch`). The machine is shared: 1-minute load "
        f"average {_f(load_start, '.1f')} at the start, {_f(load_end, '.1f')} at the end.",
        "",
        "Conversion: convert + write the file, in a fresh process per tool and model, twice: *warm* is the "
        "second call (what each further conversion costs), *cold* the first (it adds the imports and one-time "
        "setup of torch.export and of the tool); peak RSS of that process. "
        f"Latency: LiteRT Interpreter with XNNPACK, the lowest of 5 medians of {runs} runs (after 3 warm-ups), "
        "both files in one process, interleaved (alternating which goes first). Error: max |tflite - torch eager| over the output's max |value|.",
        "",
        "| model | warm convert s (ours / litert-torch, speed-up) | cold convert s | peak RSS MB | size bytes (ratio) "
        f"| TRANSPOSE | ops | ms 1 thread (ratio) | ms {threads_all} threads (ratio) | rel. error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["convert"]
        if "error" in c["ours"] or "error" in c["litert_torch"]:
            lines.append(f"| {r['model']} | failed: ours {_short(c['ours'])}; litert-torch {_short(c['litert_torch'])} "
                         "||||||||| ")
            continue
        o, t = c["ours"], c["litert_torch"]
        s = r["size"]
        lines.append(
            f"| {r['model']} | {o['seconds']:.2f} / {t['seconds']:.2f} ({t['seconds'] / o['seconds']:.1f}x) "
            f"| {o['cold']:.1f} / {t['cold']:.1f} | {o['peak_rss_mb']:.0f} / {t['peak_rss_mb']:.0f} "
            f"| {s['ours']:,} / {s['litert_torch']:,} ({s['ours'] / s['litert_torch']:.4f}) "
            f"| {r['transposes']['ours']} / {r['transposes']['litert_torch']} "
            f"| {r['ops']['ours']} / {r['ops']['litert_torch']} "
            f"| {r['ms_1']['ours']:.2f} / {r['ms_1']['litert_torch']:.2f} "
            f"({r['ms_1']['ours'] / r['ms_1']['litert_torch']:.2f}) "
            f"| {r['ms_all']['ours']:.2f} / {r['ms_all']['litert_torch']:.2f} "
            f"({r['ms_all']['ours'] / r['ms_all']['litert_torch']:.2f}) "
            f"| {_f(r['error']['ours'], '.1e')} / {_f(r['error']['litert_torch'], '.1e')} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
