"""LLM bundles for LiteRT-LM: ours against litert-torch 0.10's ``export_hf``, side by side, in one run.

    python -m benchmarks.llm [--configs tiny-llama,tiny-qwen3,llama-1b] [--steps 64] [-o RESULTS-llm.md]

For each model (built from a config with seeded random weights, saved as a Hugging Face folder with a
tokenizer made locally):
- conversion: each tool converts the folder to a ``.litertlm`` in a fresh process (seconds, peak RSS,
  against the weights' bytes); litert-torch runs from its own venv (``.venv-bench-litert-torch``, as
  ``litert_vs_litert_torch.py`` makes it) with a shim for the TensorFlow schema module it imports;
- speed: LiteRT-LM's own benchmark (``litert_lm.Benchmark``, CPU backend, the same threads) on both
  bundles, interleaved, best of rounds: prefill and decode tokens per second;
- quality of each quantization recipe against the float model (torch eager): the float model's greedy
  continuation of fixed prompts is fed to the bundle's program (teacher forcing, ``llm.HostLoop``), and
  we report top-1 agreement of the next-token predictions and the mean KL divergence of the float
  distribution from the bundle's, over ``--steps`` positions per prompt.
Recipes: float; ours ``dynamic_int8`` vs litert-torch's ``dynamic_wi8_afp32``; ours ``int4_blockwise``
(block 32) vs ``dynamic_wi4b32_afp32``; and litert-torch's channelwise ``dynamic_wi4_afp32``.
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

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CONFIGS = {  # name -> (how the folder is made, prefill length, cache length, tokens decoded when timing)
    "tiny-llama": ("llama", 128, 512, 320),
    "tiny-qwen3": ("qwen3", 128, 512, 320),
    "llama-1b": ("llama-1b", 128, 1024, 32),
}
# (label, our quant_config, litert-torch's recipe); None: the tool has no such recipe
RECIPES = [
    ("float", None, "none"),
    ("int8 (dynamic)", "dynamic_int8", "dynamic_wi8_afp32"),
    ("int4 blockwise 32", "int4_blockwise", "dynamic_wi4b32_afp32"),
    ("int4 channelwise", None, "dynamic_wi4_afp32"),
]
PROMPTS = ["the quick brown fox jumps over the lazy dog and",
           "on device models run on phones and in browsers, tokens are made locally from"]
THREADS = 2

# Peak RSS is the child's own: ru_maxrss (and VmHWM) carry over the memory of the process that forked
# it (this benchmark, holding a float model), so the child resets its high-water mark first (clear_refs 5).
_PEAK = r"""
def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
def _peak_gb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
_reset_peak()
"""

_OURS = _PEAK + r"""
import json, sys, time
import torchtpu_export as tte
folder, out, prefill, cache, quant = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
t0 = time.perf_counter()
tte.export_llm(folder, prefill_lengths=(prefill,), cache_length=cache, quant_config=quant).save(out)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_gb": _peak_gb()}))
"""

_THEIRS = _PEAK + r"""
import importlib.machinery, json, os, shutil, sys, time, types
try:
    import tensorflow  # noqa: F401
except ImportError:  # litert-torch's exporter imports TF's schema module; LiteRT ships the same file
    import ai_edge_litert.schema_py_generated as schema
    for name in ("tensorflow", "tensorflow.lite", "tensorflow.lite.python"):
        mod = types.ModuleType(name)
        mod.__spec__, mod.__path__ = importlib.machinery.ModuleSpec(name, None, is_package=True), []
        sys.modules.setdefault(name, mod)
    sys.modules["tensorflow.lite.python.schema_py_generated"] = schema
    sys.modules["tensorflow.lite.python"].schema_py_generated = schema
from litert_torch.generative.export_hf import export as hf_export
folder, out, prefill, cache, recipe = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
work = out + ".dir"
t0 = time.perf_counter()
hf_export.export(folder, work, prefill_lengths=[prefill], cache_length=cache, quantization_recipe=recipe)
seconds = time.perf_counter() - t0
shutil.move(os.path.join(work, "model.litertlm"), out)
shutil.rmtree(work, ignore_errors=True)
print("RESULT " + json.dumps({"seconds": seconds, "peak_rss_gb": _peak_gb()}))
"""


def make_folder(kind: str, path: str) -> str:
    from examples import hf_llms
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if kind == "llama-1b":
        return hf_llms.save_llama_folder(path, hf_llms.LLAMA_1B)
    return hf_llms.save_folder(kind, path)


def weight_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def convert(tool: str, folder: str, out: str, prefill: int, cache: int, recipe, reuse: bool = False) -> dict:
    record = out + ".json"
    if reuse and os.path.exists(record) and os.path.exists(out):
        with open(record) as f:
            return json.load(f)
    res = _convert(tool, folder, out, prefill, cache, recipe)
    with open(record, "w") as f:
        json.dump(res, f)
    return res


def _convert(tool: str, folder: str, out: str, prefill: int, cache: int, recipe) -> dict:
    if tool == "ours":
        cmd = [sys.executable, "-c", _OURS, folder, out, str(prefill), str(cache), json.dumps(recipe)]
    else:
        from benchmarks.litert_vs_litert_torch import ensure_bench_venv
        cmd = [ensure_bench_venv(), "-c", _THEIRS, folder, out, str(prefill), str(cache), recipe]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TF_CPP_MIN_LOG_LEVEL="3")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=7200)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]), size_mb=os.path.getsize(out) / 2**20)
    tail = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()][-3:]
    return {"error": (f"exit {r.returncode}: " + " | ".join(tail))[:300]}


def speed(paths: dict, prefill: int, decode: int, rounds: int) -> dict:
    """Per bundle, LiteRT-LM's best prefill and decode tokens per second over ``rounds`` interleaved runs."""
    import litert_lm
    litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)
    best = {k: [0.0, 0.0] for k in paths}
    for i in range(rounds):
        for key in (list(paths) if i % 2 == 0 else list(paths)[::-1]):
            if best[key] is None:
                continue
            try:
                info = litert_lm.Benchmark(paths[key], backend=litert_lm.Backend.CPU(thread_count=THREADS),
                                           prefill_tokens=prefill, decode_tokens=decode).run()
            except RuntimeError as e:
                print(f"   {key}: LiteRT-LM fails: {e}", flush=True)
                best[key] = None
                continue
            best[key][0] = max(best[key][0], info.last_prefill_tokens_per_second)
            best[key][1] = max(best[key][1], info.last_decode_tokens_per_second)
    return {k: v for k, v in best.items() if v is not None}


def reference(folder: str, steps: int) -> list[tuple[list[int], int, np.ndarray]]:
    """Per prompt: the float model's greedy sequence, where its continuation starts, and its logits there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0].tolist()
            logits = model(torch.tensor([seq])).logits[0, len(ids) - 1:-1].double().numpy()
        out.append((seq, len(ids) - 1, logits))
    return out


def quality(bundle_path: str, refs) -> tuple[float, float]:
    """Top-1 agreement with the float model's next tokens and mean KL(float || bundle), teacher-forced."""
    from torchtpu_export import llm
    from torchtpu_export.targets.litertlm.target import LitertLmBundle
    program = LitertLmBundle.from_file(bundle_path).edge
    agree, kls = [], []
    for seq, start, ref in refs:
        got = llm.next_token_logits(program, seq, start)[:-1].astype(np.float64)
        agree += list(got.argmax(-1) == ref.argmax(-1))
        p, q = _log_softmax(ref), _log_softmax(got)
        kls += list((np.exp(p) * (p - q)).sum(-1))
    return float(np.mean(agree)), float(np.mean(kls))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "tte-bench-llm"))
    ap.add_argument("--reuse", default="", help="comma-separated tools (ours, litert-torch) whose bundles from an "
                                                "earlier run in --work are measured again rather than converted again")
    ap.add_argument("--conversion-only", action="store_true",
                    help="only the float conversion of each tool (seconds, peak RSS): no quality or speed")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    conv_rows, recipe_rows = [], []
    for name in args.configs.split(","):
        kind, prefill, cache, decode_tokens = CONFIGS[name]
        folder = make_folder(kind, os.path.join(args.work, name))
        wbytes = weight_bytes(folder)
        print(f"== {name}: {wbytes / 2**30:.2f} GB of float32 weights", flush=True)
        refs = None if args.conversion_only else reference(folder, args.steps)
        paths = {}
        for label, ours, theirs in RECIPES[:1] if args.conversion_only else RECIPES:
            for tool, recipe in (("ours", ours), ("litert-torch", theirs)):
                if recipe is None and not (tool == "ours" and label == "float"):
                    continue
                out = os.path.join(args.work, f"{name}-{tool}-{label.replace(' ', '_')}.litertlm")
                res = convert(tool, folder, out, prefill, cache, recipe, reuse=tool in args.reuse.split(","))
                print(f"   {tool:13s} {label:18s} {json.dumps(res)}", flush=True)
                row = {"config": name, "tool": tool, "recipe": label, **res}
                if "error" not in res and refs is not None:
                    try:
                        row["agreement"], row["kl"] = quality(out, refs)
                        paths[(tool, label)] = out
                    except Exception as e:  # the file converts but LiteRT cannot run it
                        row["error"] = f"converted, but LiteRT fails to run it: {str(e).splitlines()[0][:160]}"
                        print(f"   {row['error']}", flush=True)
                if label == "float":
                    conv_rows.append(dict(row, weights_gb=wbytes / 2**30))
                recipe_rows.append(row)
        if args.conversion_only:
            continue
        tps = speed({f"{t}|{l}": p for (t, l), p in paths.items()}, prefill, decode_tokens, args.rounds)
        for row in recipe_rows:
            key = f"{row['tool']}|{row['recipe']}"
            if row["config"] == name and key in tps:
                row["prefill_tps"], row["decode_tps"] = tps[key]
                print(f"   {key}: prefill {tps[key][0]:.1f} tok/s, decode {tps[key][1]:.1f} tok/s", flush=True)
    text = report(conv_rows, [] if args.conversion_only else recipe_rows, args)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


def report(conv_rows, recipe_rows, args) -> str:
    when = datetime.date.today().isoformat()
    lines = [f"# LLM bundles: torchtpu-export vs litert-torch 0.10 `export_hf`",
             "", f"{when}, {platform.machine()} {os.cpu_count()} cores, LiteRT-LM {_version('litert-lm-api')} "
             f"CPU backend with {THREADS} threads; `python -m benchmarks.llm {' '.join(sys.argv[1:])}`".rstrip(),
             "", "Speed: `litert_lm.Benchmark` with a 128-token prefill and "
             + ", ".join(f"{CONFIGS[c][3]} decoded tokens for {c}" for c in args.configs.split(",")) +
             f"; the best of {args.rounds} interleaved rounds.",
             "", "## Conversion (float32, one prefill length and decode)", "",
             "| model | tool | seconds | peak RSS GB | weights GB | RSS / weights | bundle MB |", "|---|---|---|---|---|---|---|"]
    for r in conv_rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['tool']} | failed: {r['error']} | | {r['weights_gb']:.2f} | | |")
            continue
        lines.append(f"| {r['config']} | {r['tool']} | {r['seconds']:.1f} | {r['peak_rss_gb']:.2f} | "
                     f"{r['weights_gb']:.2f} | {r['peak_rss_gb'] / r['weights_gb']:.2f} | {r['size_mb']:.1f} |")
    if not recipe_rows:
        return "\n".join(lines) + "\n"
    lines += ["", "## Recipes: size, speed in LiteRT-LM, agreement with the float model", "",
              f"Top-1: next-token agreement with torch eager in float32 over {args.steps} greedy steps on "
              f"{len(PROMPTS)} prompts (teacher-forced); KL: mean KL(float || bundle) of those distributions.",
              "", "| model | tool | recipe | MB | prefill tok/s | decode tok/s | top-1 | KL |",
              "|---|---|---|---|---|---|---|---|"]
    for r in recipe_rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['tool']} | {r['recipe']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['tool']} | {r['recipe']} | {r['size_mb']:.1f} | "
                     f"{r.get('prefill_tps', float('nan')):.1f} | {r.get('decode_tps', float('nan')):.1f} | "
                     f"{r['agreement']:.3f} | {r['kl']:.4f} |")
    lines += ["", "## Ours / litert-torch (same model and recipe; above 1 is ours faster)", "",
              "| model | recipe | prefill | decode |", "|---|---|---|---|"]
    index = {(r["config"], r["tool"], r["recipe"]): r for r in recipe_rows if "prefill_tps" in r}
    for (config, tool, recipe), r in index.items():
        other = index.get((config, "litert-torch", recipe))
        if tool == "ours" and other:
            lines.append(f"| {config} | {recipe} | {r['prefill_tps'] / other['prefill_tps']:.2f}x | "
                         f"{r['decode_tps'] / other['decode_tps']:.2f}x |")
    return "\n".join(lines) + "\n"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
