"""Decoders too large for this machine, exported with abstract weights and compiled by libtpu.

    python -m benchmarks.abstract_llm -o benchmarks/RESULTS-abstract-llm.md
    python -m benchmarks.abstract_llm --configs llama3-8b --cases v6e:1x1 --cache 1024

Each case runs in a process of its own (its peak RSS is the export's): the config is built under
``tte.abstract_weights()`` (nothing allocated), ``export_llm(..., target="tpu", quant_config="bf16")``
traces it with shapes only, and the decode step is compiled for the topology. Reported: parameters, the
bf16 weight bytes the program expects, export seconds, peak RSS, and the compiler's per-chip HBM, fit
and roofline. A case is ``TOPOLOGY`` (one program on one chip), ``TOPOLOGY@model=N`` (tensor parallel
over N chips of it; a mixture-of-experts model's experts split over the same chips) or
``TOPOLOGY@expert=N`` (experts split over N chips, the rest of the model replicated).
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # Llama 3's published shapes (GQA, RoPE theta 500000, untied embeddings)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # Qwen3-30B-A3B's published shapes: 48 layers, each a mixture of 128 experts, 8 routed per token
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
}
DEFAULT_CASES = {"llama3-8b": ["v6e:1x1", "v5e:2x4@model=8"],
                 "llama3-70b": ["v6e:2x4@model=8", "v6e:4x4@data=2,model=8", "v5e:4x8@data=2,model=16"],
                 "qwen3-30b-a3b": ["v6e:1x1", "v5e:2x4@expert=8", "v5e:2x4@model=8", "v6e:2x2@expert=4",
                                   "v6e:2x4@expert=8"]}


def one(name: str, case: str, cache: int, batch: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    import torchtpu_export as tte
    from torchtpu_export import llm
    topology, _, shard = case.partition("@")  # v5e:4x8@data=2,model=16
    mesh = {k: int(v) for k, v in (part.split("=") for part in shard.split(","))} if shard else None
    t = time.perf_counter()
    shape = dict(CONFIGS[name])
    config = AutoConfig.for_model(shape.pop("model_type", "llama"), **shape, bos_token_id=1, eos_token_id=2)
    with tte.abstract_weights():
        model = AutoModelForCausalLM.from_config(config).eval()
    params = sum(p.numel() for p in model.parameters())
    options = dict(mesh=(("data", mesh.pop("data", 1)), *mesh.items())) if mesh else {}
    prog = tte.export_llm(model, None, target="tpu", prefill_lengths=(128,), cache_length=cache, batch_size=batch,
                          quant_config="bf16", platforms=("tpu",), **options)
    export_s = time.perf_counter() - t
    sig = llm.DECODE_BATCH if batch > 1 else llm.DECODE
    t = time.perf_counter()
    st = prog.compiled_stats(topology, signature_name=sig)
    compile_s = time.perf_counter() - t
    weights = sum(w.nbytes for w in prog.artifact.weights.values())
    from torchtpu_export.targets.tpu import aot as tpu_compile
    chips, hosts = tpu_compile.slice_size(topology)
    return dict(chips=chips, hosts=hosts, collectives=st.get("collectives", {}), name=name, case=case, params=params, weights=weights, batch=batch, cache=cache,
                export_s=export_s, compile_s=compile_s,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                hbm=st["hbm_bytes"]["total"], aliased=st["hbm_bytes"].get("aliased", 0),
                capacity=st["hbm_capacity_bytes"], fits=st["fits"], seconds=st["roofline"]["seconds"],
                bound=st["roofline"]["bound"])


def table(rows: list[dict], args) -> str:
    gib = 2 ** 30
    lines = [f"# Decoders exported with abstract weights ({datetime.date.today()}, {os.cpu_count()} cores, "
             f"{platform.processor() or platform.machine()})", "",
             f"`python -m benchmarks.abstract_llm --configs {args.configs} --cache {args.cache} --batch {args.batch}`",
             "", "bf16 weights and KV cache; the decode step compiled by libtpu ahead of time. HBM is per chip; step "
             "time is the compiler's roofline (a lower bound), not a measurement.", "",
             "| config | parameters | case | chips / hosts | weights (bf16) | export | compile | peak RSS | "
             "HBM per chip / capacity | fits | collectives per chip per step | decode step (roofline) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | | {r['case']} | | | | | | {r['error']} | | | |")
            continue
        comms = ", ".join(f"{k} {v['ops']}x {v['bytes'] / 2**20:.2f} MiB" for k, v in sorted(r["collectives"].items()))
        lines.append(f"| {r['name']} | {r['params'] / 1e9:.2f}B | {r['case']}, batch {r['batch']}, cache {r['cache']} | "
                     f"{r['chips']} / {r['hosts']} | {r['weights'] / gib:.1f} GiB | {r['export_s']:.0f} s | "
                     f"{r['compile_s']:.0f} s | {r['peak_rss'] / gib:.2f} GiB | {r['hbm'] / gib:.2f} / "
                     f"{r['capacity'] / gib:.0f} GiB | {'yes' if r['fits'] else 'NO'} | {comms or 'none'} | "
                     f"{r['seconds'] * 1e3:.2f} ms ({r['bound']}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from benchmarks import publish
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="llama3-8b")
    p.add_argument("--cases", default=None, help="comma-separated cases for every config (default: per config)")
    p.add_argument("--cache", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # name|case: run in this process, print JSON
    p.add_argument("-o", "--output", default=None)
    args = p.parse_args()
    if args.one:
        name, case = args.one.split("|")
        print("RESULT " + json.dumps(one(name, case, args.cache, args.batch)), flush=True)
        return 0
    rows = []
    for name in args.configs.split(","):
        for case in (args.cases.split(",") if args.cases else DEFAULT_CASES[name]):
            proc = subprocess.run([sys.executable, "-m", "benchmarks.abstract_llm", "--one", f"{name}|{case}",
                                   "--cache", str(args.cache), "--batch", str(args.batch)],
                                  capture_output=True, text=True, cwd=REPO)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not found:
                err = (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]
                rows.append(dict(name=name, case=case, error=err))
            else:
                rows.append(json.loads(found[-1][len("RESULT "):]))
            print(rows[-1], flush=True)
    text = table(rows, args)
    return publish(text, args.output)


if __name__ == "__main__":
    sys.exit(main())
