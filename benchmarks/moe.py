"""Mixture-of-experts bundles in LiteRT-LM: a small MoE against a dense model of the same active parameters,
and the two forms of the expert matmul the litert target can write, in one run.

    python -m benchmarks.moe [--rounds 3] [-o benchmarks/RESULTS-moe.md]

Models (seeded random weights, the local tokenizer, float32): a Qwen3-MoE decoder (8 layers, hidden 512,
16 experts of 512, 2 routed per token) and a dense Qwen3 of the same shape whose MLP is as wide as the two
routed experts together (1024): the same parameters per token. Each is exported with
``tte.export_llm(..., target="litertlm")`` (one 128-token prefill, cache 512) and timed by LiteRT-LM's own
benchmark (``litert_lm.Benchmark``, CPU backend, 2 threads; best of interleaved rounds). The MoE is exported
three times: the expert matmul as the converter chooses by row count (``auto``: a gather of each row's expert
weights for decode, every row through every expert for prefill), and with each form forced; then both models
once per weight recipe (``dynamic_int8``, ``int4_blockwise``: the experts int8 under both).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=1024)
MODELS = {  # name -> (model_type, config beyond SHAPE)
    "moe 16x512 top-2": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                                           intermediate_size=1024, norm_topk_prob=True)),
    "dense 1024": ("qwen3", dict(intermediate_size=1024)),
}
PREFILL, CACHE, DECODE = 128, 512, 256
RECIPES = ("dynamic_int8", "int4_blockwise")  # each model once more per recipe (the converter's own form)


def build(kind: str, extra: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from examples import hf_llms
    tok = hf_llms.tokenizer()
    config = AutoConfig.for_model(kind, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **SHAPE, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model, tok, sum(p.numel() for p in model.parameters())


def main(argv=None) -> int:
    from benchmarks import publish
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "tte-bench-moe"))
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args(argv)
    import torchtpu_export as tte
    from benchmarks.llm import speed
    from torchtpu_export.converters.litert import ops_composite
    os.makedirs(args.work, exist_ok=True)
    paths, params = {}, {}
    for name, (kind, extra) in MODELS.items():
        model, tok, params[name] = build(kind, extra)
        moe = kind.endswith("moe")
        for form, recipe in [(f, None) for f in (("auto", "gather", "all") if moe else ("auto",))] + \
                [("auto", r) for r in RECIPES]:
            ops_composite.GROUPED_MM_FORM = form
            key = name + (f" ({form})" if moe and not recipe else "") + (f", {recipe}" if recipe else "")
            out = os.path.join(args.work, key.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
                               + ".litertlm")
            tte.export_llm(model, tok, target="litertlm", prefill_lengths=(PREFILL,), cache_length=CACHE,
                           quant_config=recipe, check=False).save(out)
            paths[key] = out
            print(f"exported {key}: {os.path.getsize(out) / 2**20:.1f} MB", flush=True)
    ops_composite.GROUPED_MM_FORM = "auto"
    tps = speed(paths, PREFILL, DECODE, args.rounds)
    dense = {key: tps.get(key) for key in paths if key.startswith("dense")}
    lines = [f"# Mixture-of-experts in LiteRT-LM ({datetime.date.today()}, {platform.machine()} "
             f"{os.cpu_count()} cores)", "", f"`python -m benchmarks.moe --rounds {args.rounds}`: LiteRT-LM's "
             f"benchmark, CPU backend, 2 threads, a {PREFILL}-token prefill and {DECODE} decoded tokens, best of "
             f"{args.rounds} interleaved rounds; float32.", "",
             "| bundle | parameters (all / per token) | MB | prefill tok/s | decode tok/s | decode vs dense (same recipe) |",
             "|---|---|---:|---:|---:|---:|"]
    for key, path in paths.items():
        name = key.split(" (")[0].split(",")[0]
        kind, extra = MODELS[name]
        same = dense.get("dense 1024" + (key[key.index(","):] if "," in key else ""))
        active = params[name] if not kind.endswith("moe") else \
            params[name] - SHAPE["num_hidden_layers"] * 3 * SHAPE["hidden_size"] * extra["moe_intermediate_size"] \
            * (extra["num_experts"] - extra["num_experts_per_tok"])
        got = tps.get(key)
        if got is None:
            lines.append(f"| {key} | | | LiteRT-LM fails | | |")
            continue
        ratio = f"{got[1] / same[1]:.2f}x" if same else ""
        lines.append(f"| {key} | {params[name] / 1e6:.1f}M / {active / 1e6:.1f}M | "
                     f"{os.path.getsize(path) / 2**20:.0f} | {got[0]:.0f} | {got[1]:.0f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    return publish(text, args.output)


if __name__ == "__main__":
    sys.exit(main())
