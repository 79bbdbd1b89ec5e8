"""How many hot nodes of each zoo model get a Pallas kernel in the tpu program.

Kernels run only on TPU and interpret-mode timings mean nothing, so this
reports coverage instead of speed: per model, the hot nodes (attention,
RMSNorm/LayerNorm, int8 matmul) and how many were lowered to a kernel, with
the reasons for the rest. Models run at kernel-friendly shapes (sequence 256,
head_dim 128) and at the zoo's small default shapes, where most fall back.

    python -m benchmarks.pallas_kernels [--kernels auto|pallas|xla] [--json FILE]   # from the repository root
"""
from __future__ import annotations

import argparse
import collections
import json
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

import torchtpu_export as tte  # noqa: E402
from examples import zoo  # noqa: E402

FRIENDLY = dict(seq=256, dim=256, heads=2, layers=2, max_seq=256)
LLAMA = dict(FRIENDLY, kv_heads=1, head_dim=128)


def _llama_part(part):
    def factory():
        model, args = zoo.llama(**LLAMA)
        if part == "prefill":
            return zoo.Prefill(model), args
        k, v = model.empty_cache()
        return zoo.Decode(model), (torch.tensor([[1]]), torch.tensor([9]), k, v)
    return factory


CASES = {
    "gpt (seq 256, head_dim 128)": lambda: zoo.gpt(**FRIENDLY),
    "llama (seq 256, head_dim 128, GQA 2:1)": lambda: zoo.llama(**LLAMA),
    "llama prefill": _llama_part("prefill"),
    "llama decode (kv cache 256)": _llama_part("decode"),
    "qwen3 (seq 256, head_dim 128)": lambda: zoo.qwen3(**LLAMA),
    "bert_encoder (seq 256, head_dim 128)": lambda: zoo.bert_encoder(seq=256, dim=256, heads=2, max_seq=256),
    "gpt (zoo default)": zoo.gpt,
    "llama (zoo default)": zoo.llama,
    "bert_encoder (zoo default)": zoo.bert_encoder,
    "unet (zoo default)": zoo.unet,
}


def measure(name, factory, kernels):
    model, args = factory()
    start = time.perf_counter()
    prog = tte.export(model, args, platforms=("tpu",), kernels=kernels)
    seconds = time.perf_counter() - start
    entries = prog.kernels()
    used = collections.Counter(e["kernel"] for e in entries if e.get("kernel"))
    reasons = collections.Counter(f"{e['op'].split('.')[1]}: {_short(e['reason'])}" for e in entries
                                  if not e.get("kernel"))
    cost = [c for c in (spec.get("kernel_cost") for spec in prog.manifest["programs"].values()) if c]
    return {"model": name, "hot_nodes": len(entries), "with_kernel": sum(used.values()), "kernels": dict(used),
            "kernel_cost": cost,
            "fallbacks": dict(reasons), "tpu_custom_calls": prog.stablehlo_text("tpu").count("tpu_custom_call"),
            "export_seconds": round(seconds, 2)}


def _short(reason: str) -> str:
    # the byte counts of a dropped kernel are in the cost column
    return "kernels cost more than XLA" if reason.startswith("kernels='auto'") else reason


def _cost(costs: list) -> str:
    """``kernels="auto"``'s comparison: the program's bytes accessed with kernels and with XLA alone, and
    which it kept."""
    out = []
    for c in costs:
        if c.get("not_compared"):
            out.append(f"not compared ({c['not_compared']})")
            continue
        t = next(iter(c["pallas"]))
        out.append(f"{c['pallas'][t] / 1e6:.1f} vs {c['xla'][t] / 1e6:.1f} MB ({t}): {c['kept']}")
    return "; ".join(out) or "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="auto", choices=["auto", "pallas", "xla"])
    ap.add_argument("--json", help="also write the rows as JSON")
    opts = ap.parse_args(argv)
    rows = []
    for name, factory in CASES.items():
        try:
            rows.append(measure(name, factory, opts.kernels))
        except tte.TteError as e:  # e.g. kernels=pallas on shapes no kernel takes
            rows.append({"model": name, "error": e.user_message().splitlines()[0]})
    print(f"kernels={opts.kernels}, platform tpu (jax {__import__('jax').__version__})\n")
    print("| model | hot nodes | with Pallas kernel | kernels | fallbacks | program with kernels vs XLA, kept |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | - | - | - | error: {r['error']} | - |")
            continue
        kernels = ", ".join(f"{k.split('.')[1]} {n}" for k, n in sorted(r["kernels"].items())) or "-"
        falls = "; ".join(f"{n}x {why}" for why, n in r["fallbacks"].items()) or "-"
        print(f"| {r['model']} | {r['hot_nodes']} | {r['with_kernel']} | {kernels} | {falls} | "
              f"{_cost(r['kernel_cost'])} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
