"""Quantized edge models: size, latency and error of each recipe against float, and against
litert-torch's own dynamic int8 recipe, on the same models.

    python -m benchmarks.litert_quant [--models resnet18,llama] [--runs 20] [-o RESULTS-quant.md]

Ours: float, fp16, dynamic_int8 and int8 (calibrated on 8 random samples), converted in this
process. litert-torch 0.10: ``litert_torch.convert(model, args, quant_config=
quant_recipes.full_dynamic_recipe())`` (int8 per-channel weights, dynamic-range activations,
applied by ai-edge-quantizer), converted in its own venv (``.venv-bench-litert-torch/``, made by
``litert_vs_litert_torch.py``). Every file is then run by the same LiteRT Interpreter (XNNPACK)
in this process, interleaved, and compared with torch eager on the model's sample inputs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from benchmarks.litert_vs_litert_torch import REPO, ensure_bench_venv, latency, outputs_and_reference

# model -> zoo factory kwargs: the CNNs at phone resolution; a ~21M-parameter Llama-style decoder
MODELS = {
    "resnet18": ("resnet18", {"size": 224}),
    "mobilenet_v2": ("mobilenet_v2", {"size": 224}),
    "bert": ("bert_encoder", {}),
    "llama": ("llama", {"seq": 32, "vocab": 8192, "dim": 512, "layers": 4, "heads": 8, "kv_heads": 4,
                        "hidden": 1536, "max_seq": 128}),
}
RECIPES = ("float", "fp16", "dynamic_int8", "int8")

_CHILD = r"""
import importlib.util, json, sys, time
factory, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
spec = importlib.util.spec_from_file_location("zoo", sys.argv[4])
zoo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zoo)
import litert_torch
from litert_torch.generative.quantize import quant_recipes
model, args = getattr(zoo, factory)(**kwargs)
t0 = time.perf_counter()
try:
    litert_torch.convert(model.eval(), args, quant_config=quant_recipes.full_dynamic_recipe()).export(out)
except Exception as e:
    print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}))
    sys.exit(0)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0}))
"""


def litert_torch_dynamic(python: str, name: str, out: str) -> dict:
    factory, kwargs = MODELS[name]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run([python, "-c", _CHILD, factory, json.dumps(kwargs), out,
                        os.path.join(REPO, "examples", "zoo.py")],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[:300]}


def random_like(args, seed: int) -> tuple:
    import torch
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(a.shape, generator=g) if a.is_floating_point()
                 else torch.randint(0, int(a.max()) + 1, a.shape, generator=g, dtype=a.dtype) for a in args)


def ours(model, args, recipe: str, out: str) -> dict:
    import torchtpu_export as tte
    qc = None if recipe == "float" else recipe
    if recipe == "int8":
        qc = {"recipe": "int8", "calibration": [random_like(args, s) for s in range(8)]}
    t0 = time.perf_counter()
    edge = tte.convert(model, args, quant_config=qc)
    seconds = time.perf_counter() - t0
    edge.export(out)
    return {"seconds": seconds}


def error(path: str, model, args) -> dict:
    from torchtpu_export.quant import measure
    got, ref = outputs_and_reference(path, model, args)
    r = measure("", ref[:1], got[:1], 1, 1)
    return {"cosine": r.cosine, "top1": r.top1_agreement, "rel": r.max_rel_err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--runs", type=int, default=20, help="timed runs per round (5 rounds)")
    p.add_argument("-o", "--output", default=os.path.join(REPO, "benchmarks", "RESULTS-quant.md"))
    args = p.parse_args(argv)
    bench_py = ensure_bench_venv()
    load_start = os.getloadavg()[0]
    from examples import zoo
    threads_all = os.cpu_count() or 1
    tmp = tempfile.mkdtemp(prefix="quant-bench-")
    rows = []
    for name in args.models.split(","):
        factory, kwargs = MODELS[name]
        model, margs = getattr(zoo, factory)(**kwargs)
        model.eval()
        files = {r: os.path.join(tmp, f"{name}.{r}.tflite") for r in RECIPES}
        files["litert_torch"] = os.path.join(tmp, f"{name}.litert_torch.tflite")
        conv = {r: ours(model, margs, r, files[r]) for r in RECIPES}
        conv["litert_torch"] = litert_torch_dynamic(bench_py, name, files["litert_torch"])
        ok = {k: f for k, f in files.items() if "error" not in conv[k]}
        row = {"model": name, "convert": conv, "size": {k: os.path.getsize(f) for k, f in ok.items()},
               "error": {k: error(f, model, margs) for k, f in ok.items()}}
        inputs = [a.numpy() for a in margs]
        row["ms_1"] = latency(ok, inputs, 1, args.runs)
        row["ms_all"] = latency(ok, inputs, threads_all, args.runs)
        rows.append(row)
        print(json.dumps(row), flush=True)
    text = report(rows, threads_all, args.runs, load_start, os.getloadavg()[0])
    print(text)
    with open(args.output, "w") as f:
        f.write(text)
    return 0


def report(rows, threads_all: int, runs: int, load_start: float, load_end: float) -> str:
    import ai_edge_litert
    import torch
    cols = list(RECIPES) + ["litert_torch"]
    lines = [
        "# Quantized edge models: recipes against float and against litert-torch's dynamic int8",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.machine()} Linux, {os.cpu_count()} cores "
        f"({platform.processor() or 'cpu'}); Python {platform.python_version()}, torch {torch.__version__}, "
        f"ai-edge-litert {getattr(ai_edge_litert, '__version__', '2.3.0')}; litert-torch 0.10.0 in its own venv. "
        "Command: `make bench` (`python -m benchmarks.litert_quant`). The machine is shared: 1-minute load "
        f"average {load_start:.1f} at the start, {load_end:.1f} at the end.",
        "",
        "Columns: ours as float, fp16, dynamic_int8, int8 (8 random calibration samples); *litert-torch* is "
        "`litert_torch.convert(..., quant_config=quant_recipes.full_dynamic_recipe())`. Latency: LiteRT "
        f"Interpreter with XNNPACK, the lowest of 5 medians of {runs} runs, all files of a model in one process, "
        "interleaved. Error: against torch eager on the model's sample inputs (first output): cosine, and top-1 "
        "agreement of the last axis for logits. *speed-up* is float's latency over the recipe's.",
        "",
        "Reading it: the zoo models have seeded random weights, so their logits are close together and "
        "top-1 agreement is a harsh measure (cosine is the steadier one). MobileNetV2's time is mostly "
        "depthwise convolutions, which stay float in `dynamic_int8` (int8 weights dequantized at load: "
        "LiteRT's hybrid depthwise kernel is slower than float on XNNPACK), so its speed-up is small. On this "
        "shared 2-core machine, timings of sub-millisecond models with 2 threads are mostly scheduling noise.",
        "",
    ]
    for r in rows:
        lines += [f"## {r['model']}", "",
                  "| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

        def cell(k, fmt):
            return fmt(k) if k in r["size"] else "failed"
        lines.append("| size bytes | " + " | ".join(cell(k, lambda k: f"{r['size'][k]:,}") for k in cols) + " |")
        lines.append("| vs float | " + " | ".join(
            cell(k, lambda k: f"{r['size']['float'] / r['size'][k]:.2f}x smaller") for k in cols) + " |")
        for key, label in (("ms_1", "ms, 1 thread"), ("ms_all", f"ms, {threads_all} threads")):
            lines.append(f"| {label} | " + " | ".join(cell(k, lambda k: f"{r[key][k]:.2f}") for k in cols) + " |")
            lines.append("| speed-up | " + " | ".join(
                cell(k, lambda k: f"{r[key]['float'] / r[key][k]:.2f}x") for k in cols) + " |")
        lines.append("| cosine | " + " | ".join(
            cell(k, lambda k: f"{r['error'][k]['cosine']:.5f}") for k in cols) + " |")
        lines.append("| top-1 | " + " | ".join(cell(k, lambda k: "-" if r["error"][k]["top1"] is None
                                                     else f"{r['error'][k]['top1']:.1%}") for k in cols) + " |")
        lines.append("| convert s | " + " | ".join(
            f"{r['convert'][k]['seconds']:.1f}" if "error" not in r["convert"][k]
            else r["convert"][k]["error"].replace("|", "/")[:120] for k in cols) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
